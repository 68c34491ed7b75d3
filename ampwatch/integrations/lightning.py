"""PyTorch Lightning: ``L.Trainer(..., callbacks=[AmpwatchCallback("runs/x.sqlite")])`` records the run.

The callback finds everything itself: the LightningModule, ``trainer.optimizers[0]`` and the
precision plugin's GradScaler (``precision="16-mixed"``; none for bf16/32, then rows come from the
optimizer hooks). Lightning divides each micro-batch loss by ``accumulate_grad_batches`` before
``backward``; the recorded loss undoes that, so a row holds the mean of ``training_step``'s losses.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ..record import torch_access
from . import attach_options, check_options, format_error, note_amp_dtype, plain, require, run_path

pl = require("lightning.pytorch", "lightning")

log = logging.getLogger("ampwatch")
_AUTOCAST = {"16-mixed": "float16", "bf16-mixed": "bfloat16"}  # precisions that autocast
_TRAINER_SETTINGS = ("precision", "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm",
                     "max_epochs", "max_steps")


def training_config(trainer: Any, module: Any) -> dict[str, Any]:
    """The run config: the Trainer settings that shape mixed precision, and the module's hparams."""
    config = {name: plain(getattr(trainer, name, None)) for name in _TRAINER_SETTINGS}
    hparams = getattr(module, "hparams", None)
    if hparams:
        config["hparams"] = dict(hparams)
    return config


class AmpwatchCallback(pl.Callback):
    """Record every ``fit`` into its own run file.

    >>> L.Trainer(precision="16-mixed", callbacks=[AmpwatchCallback("runs/lit.sqlite")]).fit(model, data)

    :param path: the run file (as for :func:`ampwatch.attach`); a second ``fit`` gets a numbered
        sibling (``lit-2.sqlite``), never overwriting. A file already at ``path`` is refused
        (``overwrite=True`` replaces it); ``callback.watch.path`` is where a run went.
    :param options: ``attach``'s: ``name``, ``config`` (merged over the Trainer settings kept in the
        run's config), ``layer_every``, ``localize``, ``flush_every_s``, ``strict``, ``rank``.

    Cost: that of ``attach``, plus a few device ops per step for the loss; no sync.
    """

    def __init__(self, path: Optional[str] = None, **options: Any) -> None:
        self.path = path
        self._first_path: Any = None  # where the first run went; later runs are its numbered siblings
        self.options = check_options(options, "lightning")
        self.watch: Any = None
        self._losses: list[torch.Tensor] = []
        self._accumulation = 1
        self._window: Any = None  # the AMP figures for the trainer's loggers (trackers.window)
        self._logged_at = -1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        import ampwatch
        self._close("crashed", "a previous fit ended without on_train_end")
        if not trainer.optimizers:
            log.warning("AmpwatchCallback: the Trainer has no optimizer; nothing to record")
            return
        if len(trainer.optimizers) > 1:
            log.warning("AmpwatchCallback records the first of %d optimizers", len(trainer.optimizers))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        # Manual optimization passes the user's loss to backward as is.
        self._accumulation = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        self._losses = []
        path = run_path(self.path, self._first_path)
        # on_train_start comes after a checkpoint given as fit(ckpt_path=...) is restored
        options = attach_options(self.options, "lightning", training_config(trainer, pl_module),
                                 trainer.global_step)
        if trainer.loggers and "mirror" not in options:
            from ..trackers.window import LogWindow
            self._window = options["mirror"] = LogWindow()
            self._logged_at = -1
        self.watch = ampwatch.attach(pl_module, trainer.optimizers[0], scaler, path=path, **options)
        self._first_path = self._first_path or self.watch.path
        note_amp_dtype(self.watch, _AUTOCAST.get(str(trainer.precision)))

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self.watch is not None:
            self._losses.append(loss.detach())  # scaled by the plugin under 16-mixed: undone per step

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        watch = self.watch
        if watch is None or getattr(optimizer, "_optimizer", optimizer) is not watch.optimizer:
            return
        if self._losses:  # before scaler.step()/optimizer.step(), inside which the watch ends the step
            loss = torch.stack(self._losses).float().mean() * self._accumulation
            if torch_access.scaler_enabled(watch.scaler):
                scale = torch_access.scale_tensor(watch.scaler)  # update() has not run: the window's scale
                if scale is not None:
                    loss = loss / scale
            watch.log(loss=loss)
        self._losses = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """On Lightning's own logging cadence (``log_every_n_steps``), the AMP figures of the steps
        committed since the last time go to every logger of the trainer, at ``global_step``."""
        window, step = self._window, trainer.global_step
        # an accumulation window ends several batches at one global_step: log once per step
        if window is None or step % max(1, trainer.log_every_n_steps) or step == self._logged_at:
            return
        self._logged_at = step
        figures = window.take()
        if figures:
            for logger in trainer.loggers:
                logger.log_metrics(figures, step=trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close("finished")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close("crashed", format_error(exception))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close("finished")  # normally closed already; never leave a run open past fit

    def _close(self, status: str, error: Optional[str] = None) -> None:
        watch, self.watch, self._window = self.watch, None, None
        if watch is not None:
            watch.close(status=status, error=error)


__all__ = ["AmpwatchCallback", "training_config"]
