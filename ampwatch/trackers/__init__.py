"""AMP series and doctor findings in the trackers a team already watches (TensorBoard, MLflow, W&B).

Live, from the run writer's thread (``attach(..., mirror=...)``, :mod:`.live`), and after the fact
(``ampwatch export RUN --to ...``, :mod:`.export`). Every tracker library is imported only when
that tracker is asked for; the extras ``ampwatch[tensorboard]``, ``[mlflow]`` and ``[wandb]``
install them. What appears where: docs/trackers.md.

A sink has four methods: ``scalars(points)``, ``texts(tag, [(step, text)])``, ``flush()`` and
``close()`` (which never ends a run or closes a writer that the user made).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from ..errors import OptionError

TRACKERS = ("tensorboard", "mlflow", "wandb")
_EXTRA = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


class TrackerUnavailable(RuntimeError):
    """A tracker cannot be written to: its package is missing, or it has no active run."""


def mirror_sink(target: Any) -> tuple[Any, str]:
    """The sink for ``attach(mirror=target)`` and how warnings name it. Runs on the training
    thread at attach: MLflow's active run is per thread, so it is looked up here.

    Raises :class:`TrackerUnavailable` when the tracker cannot be used."""
    from .tensorboard import TensorBoardSink, is_writer
    if is_writer(target):
        return TensorBoardSink(target), f"{type(target).__name__} {getattr(target, 'log_dir', '')}".strip()
    if target == "mlflow":
        mlflow = _import("mlflow", "mlflow")
        active = mlflow.active_run()
        if active is None:
            raise TrackerUnavailable("mirror='mlflow' needs an active MLflow run: call mlflow.start_run() "
                                     "before ampwatch.attach")
        from .mlflow import MlflowSink
        return MlflowSink(run_id=active.info.run_id), f"MLflow run {active.info.run_id}"
    if target == "wandb":
        wandb = _import("wandb", "wandb")
        if wandb.run is None:
            raise TrackerUnavailable("mirror='wandb' needs an active W&B run: call wandb.init() before "
                                     "ampwatch.attach")
        from .wandb import WandbSink
        return WandbSink(run=wandb.run), f"W&B run {wandb.run.id}"
    _import("tensorboard", "tensorboard")
    folder = os.fspath(target)
    try:
        return TensorBoardSink(folder), f"TensorBoard {folder!r}"
    except OSError as exc:
        raise TrackerUnavailable(f"cannot write TensorBoard events into {folder!r} "
                                 f"({exc.strerror or exc})") from None


def export_sink(kind: str, *, logdir: Optional[str] = None, name: str = "run",
                config: Optional[dict] = None) -> Any:
    """A sink that starts a tracker run of its own for ``ampwatch export --to kind``."""
    if kind not in TRACKERS:
        raise OptionError(f"unknown tracker {kind!r}; choose from {', '.join(TRACKERS)}")
    if kind == "tensorboard":
        _import("tensorboard", "tensorboard")
        from .tensorboard import TensorBoardSink
        return TensorBoardSink(logdir)
    if kind == "mlflow":
        _import("mlflow", "mlflow")
        from .mlflow import MlflowSink
        return MlflowSink(run_name=name, config=config)
    _import("wandb", "wandb")
    from .wandb import WandbSink
    return WandbSink(name=name, config=config)


def _import(module: str, tracker: str) -> Any:
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackerUnavailable(f"{tracker} is not installed ({exc}): "
                                 f"pip install 'ampwatch[{_EXTRA[tracker]}]'") from None
