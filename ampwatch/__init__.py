"""ampwatch: a flight recorder, dashboard and doctor for PyTorch mixed-precision training.

>>> watch = ampwatch.attach(model, optimizer, scaler, path="runs/exp1.sqlite")
>>> ...  # the training loop, unchanged
>>> watch.close()
>>> run = ampwatch.load("runs/exp1.sqlite")
"""
from __future__ import annotations

from ._version import __version__

from typing import Any, Optional

from .errors import RunError


def attach(model: Any, optimizer: Any, scaler: Any = None, *, path: Optional[str] = None,
           name: Optional[str] = None, config: Optional[dict] = None, **options: Any) -> "Watch":
    """Start recording a training run into one SQLite file; returns a :class:`Watch`.

    :param model: the ``nn.Module`` being trained (hooked for NaN/Inf localization).
    :param optimizer: its optimizer (wrapped optimizers such as Accelerate's are unwrapped).
    :param scaler: the ``GradScaler``, or an object that holds one (timm's ``NativeScaler``: its
        ``._scaler`` is hooked), or None for bf16/fp32 (then ``watch.log(loss=loss)``).
    :param path: run file; default ``runs/<name or timestamp>.sqlite`` (numbered if it exists).
        An explicit path that exists is refused (:class:`RunError`) unless ``overwrite=True``
        (a folder always is);
        ``watch.path`` is where the run went. ``{rank}`` is filled in; several ranks sharing one
        path get ``.rank<N>`` files.
    :param name: run name (default: the file's stem).
    :param config: a JSON-able dict stored with the run (hyper-parameters).
    :param options: ``layer_every``, ``localize``, ``flush_every_s``, ``strict``, ``overwrite``,
        ``first_step`` (a run resumed from a checkpoint: the step it starts at), … (see docs/api.md).

    A wrong option value raises :class:`ampwatch.errors.OptionError` (a ValueError); an argument of
    the wrong type (model, optimizer, scaler, path, name, config) raises
    :class:`ampwatch.errors.ArgumentTypeError` (an OptionError and a TypeError); a path that names
    a folder raises :class:`ampwatch.errors.RunPathIsFolderError` (a RunError). One line each.

    Cost: a few device ops and one device-to-host transfer per optimizer step (non-blocking on
    CUDA); disk writes happen on a background thread.
    """
    from .record.watch import Watch
    from .record.options import check_arguments, held_scaler
    check_arguments(model, optimizer, scaler, name, config)
    open_mirror = None
    if options.get("mirror") is not None:  # trackers are a face over the recorder: wired in here
        from .trackers.live import open_mirror
    return Watch(model, optimizer, held_scaler(scaler), path=path, name=name, config=config,
                 open_mirror=open_mirror, **options)


def load(path: Any) -> "Run":
    """Open a run file read-only; raises :class:`RunError` with one clear line if it cannot."""
    from .store.reader import Run
    return Run(path)


def diagnose(run: Any) -> list:
    """Findings (id, severity, title, steps, evidence, advice) for a :class:`Run` or a path."""
    import os
    from .doctor import diagnose as _diagnose
    from .userpath import short_repr
    # hasattr on the type: on a Run, hasattr(run, "steps") would read the whole steps table.
    is_path = isinstance(run, (str, bytes, os.PathLike))
    if not is_path and hasattr(type(run), "steps"):
        return _diagnose(run)
    if not is_path:
        raise RunError(f"ampwatch.diagnose needs a Run (from ampwatch.load) or a run file path, got "
                       f"{type(run).__name__} {short_repr(run)}")
    return _diagnose(load(run))


def load_group(folder_or_glob: Any, job: Optional[str] = None) -> "RunGroup":
    """The ranks of one distributed job (a folder of rank files, a glob, or one file) as a
    :class:`RunGroup`: ``steps`` (per rank), ``global_steps`` (across ranks), ``first_nonfinite()``,
    ``missing`` and ``unreadable`` ranks. Several jobs in the folder: pick one with ``job=``
    (a :class:`RunError` lists them). See :func:`ampwatch.jobs.group.load_group`.
    """
    from .jobs.group import load_group as _load_group
    return _load_group(folder_or_glob, job)


def load_batch(run: Any, step: int, micro_batch: Optional[int] = None, call: bool = False) -> Any:
    """The model's inputs saved from ``step`` of a run (a :class:`Run` or a path) as CPU tensors by
    name (``args[0]``, ``kwargs['input_ids']``): saved for the first steps whose loss or outputs
    went NaN/Inf, and for the step a run crashed in (option ``save_batches``). ``micro_batch``
    None: the first one saved. To reproduce the step, feed them to the model restored from a
    checkpoint of the step before. ``call=True``: ``(args, kwargs)`` rebuilt from the names, for
    ``model(*args, **kwargs)`` (a :class:`RunError` when an argument that was not a tensor, and so
    not saved, leaves a gap). Raises :class:`RunError` (one line, listing the steps saved) when the
    step has none."""
    import torch
    if not hasattr(type(run), "batch_bytes"):
        run = load(run)
    out = {}
    for name, dtype, shape, data in run.batch_bytes(step, micro_batch):
        if data is None:  # listed, over the budget: not saved
            continue
        kind = getattr(torch, dtype, None)
        if not isinstance(kind, torch.dtype):
            raise RunError(f"{dtype!r} of {name} (step {step}) is not a dtype of this torch {torch.__version__}: "
                           f"upgrade torch to read it")
        flat = torch.frombuffer(bytearray(data), dtype=kind) if data else torch.empty(0, dtype=kind)
        out[name] = flat.reshape(shape)
    if call:
        from .store.reader import call_from_names
        return call_from_names(out, f"step {step} of {run.path.name}")
    return out


def __getattr__(name: str) -> Any:
    # Lazy: `import ampwatch` stays light (no pandas) for the training box.
    if name == "Watch":
        from .record.watch import Watch
        return Watch
    if name == "Run":
        from .store.reader import Run
        return Run
    if name == "RunGroup":
        from .jobs.group import RunGroup
        return RunGroup
    if name == "Finding":
        from .doctor import Finding
        return Finding
    raise AttributeError(f"module 'ampwatch' has no attribute {name!r}")


__all__ = ["attach", "load", "load_batch", "load_group", "diagnose", "Watch", "Run", "RunGroup", "RunError", "Finding",
           "__version__"]
