"""Hugging Face Trainer: ``Trainer(..., callbacks=[AmpwatchCallback("runs/x.sqlite")])`` records the run.

The callback finds everything itself: the model and ``AcceleratedOptimizer`` from the callback
arguments, the GradScaler from ``trainer.accelerator.scaler`` (on GPU fp16; on the CPU accelerate
has none and rows come from the optimizer hooks), and each step's loss from ``Trainer.training_step``,
summed over the accumulation window exactly as the Trainer sums it for its own ``loss`` log.
"""
from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Optional

import torch

from . import attach_options, check_options, format_error, note_amp_dtype, plain, require, run_path

transformers = require("transformers", "transformers")

log = logging.getLogger("ampwatch")
_MISSING = object()
# The TrainingArguments that decide how mixed precision behaves, stored as the run's config.
_ARGS = ("fp16", "bf16", "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps",
         "max_grad_norm", "weight_decay", "optim", "lr_scheduler_type", "warmup_steps", "num_train_epochs",
         "max_steps", "seed")


def training_config(args: Any) -> dict[str, Any]:
    """The run config taken from ``TrainingArguments``."""
    return {name: plain(getattr(args, name)) for name in _ARGS if hasattr(args, name)}


def _autocast_dtype(accelerator: Any) -> Optional[str]:
    """The dtype accelerate autocasts to (it autocasts only with native AMP: not fp16 on the CPU)."""
    if not getattr(accelerator, "native_amp", False):
        return None
    return {"fp16": "float16", "bf16": "bfloat16"}.get(str(getattr(accelerator, "mixed_precision", "")))


def _find_trainer(callback: "AmpwatchCallback") -> Optional[Any]:
    """The Trainer whose callback handler is calling us. Callbacks are not handed the Trainer, but
    its frame is a few levels up (``callback_handler.on_...`` is called from a Trainer method)."""
    frame = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, transformers.Trainer):
            handler = getattr(owner, "callback_handler", None)
            if any(cb is callback for cb in getattr(handler, "callbacks", ())):
                return owner
        frame = frame.f_back
    return None


def _guard_train(trainer: Any) -> None:
    """Wrap ``trainer.train`` (once per Trainer) so a run that raises is closed as crashed:
    the Trainer has no exception event for callbacks."""
    if getattr(trainer.train, "_ampwatch_guard", False):
        return
    original = trainer.train

    @functools.wraps(original)
    def train(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except BaseException as exc:
            for cb in list(trainer.callback_handler.callbacks):
                if isinstance(cb, AmpwatchCallback):
                    cb.crashed(exc)
            raise

    train._ampwatch_guard = True  # type: ignore[attr-defined]
    trainer.train = train


class AmpwatchCallback(transformers.TrainerCallback):
    """Record every ``Trainer.train()`` call into its own run file.

    >>> Trainer(model, args, train_dataset=ds, callbacks=[AmpwatchCallback("runs/gpt2.sqlite")]).train()

    :param path: the run file (as for :func:`ampwatch.attach`); a second ``train()`` gets a
        numbered sibling (``gpt2-2.sqlite``), never overwriting. A file already at ``path`` is refused
        (``overwrite=True`` replaces it); ``callback.watch.path`` is where a run went.
    :param options: ``attach``'s: ``name``, ``config`` (merged over the TrainingArguments kept in
        the run's config), ``layer_every``, ``localize``, ``flush_every_s``, ``strict``, ``rank``.

    Cost: that of ``attach``, plus one device-side add per micro-batch for the loss; no sync.
    """

    def __init__(self, path: Optional[str] = None, **options: Any) -> None:
        self.path = path
        self._first_path: Any = None  # where the first run went; later runs are its numbered siblings
        self.options = check_options(options, "transformers")
        self.watch: Any = None
        self._trainer: Any = None
        self._wrapper: Any = None
        self._previous: Any = _MISSING
        self._losses: list[torch.Tensor] = []
        self._window: Any = None  # the AMP figures for the Trainer's own logs (trackers.window)
        self._previous_log: Any = _MISSING
        self._log_wrapper: Any = None

    # -- Trainer events -------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _find_trainer(self)
        if trainer is not None:
            _guard_train(trainer)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        import ampwatch
        if self.watch is not None:  # the previous train() never reached on_train_end
            self.crashed(None, "train() ended without on_train_end (it raised, or was restarted)")
        trainer = _find_trainer(self)
        if trainer is None:
            log.warning("AmpwatchCallback could not find its Trainer: the loss is recorded only where a "
                        "GradScaler sees it, and a crash is only noticed at exit")
            scaler = getattr(optimizer, "scaler", None)
        else:
            _guard_train(trainer)
            scaler = getattr(trainer.accelerator, "scaler", None)
        self._losses = []
        path = run_path(self.path, self._first_path)
        # on_train_begin comes after a resumed checkpoint's state is loaded: global_step is its step
        options = attach_options(self.options, "transformers", training_config(args),
                                 getattr(state, "global_step", 0))
        if trainer is not None and "mirror" not in options:
            from ..trackers.window import LogWindow
            self._window = options["mirror"] = LogWindow()
        self.watch = ampwatch.attach(model, optimizer, scaler, path=path, **options)
        self._first_path = self._first_path or self.watch.path
        if trainer is not None:
            self._capture_losses(trainer)
            if self._window is not None:
                self._add_to_logs(trainer)
            note_amp_dtype(self.watch, _autocast_dtype(trainer.accelerator))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # After clipping, before optimizer.step(): the watch closes the step inside that call.
        if self.watch is not None and self._losses:
            self.watch.log(loss=torch.stack(self._losses).sum())
        self._losses = []

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close("finished")

    # -- run lifetime ----------------------------------------------------------------------------
    def crashed(self, exc: Optional[BaseException], message: Optional[str] = None) -> None:
        """Close the open run (if any) as crashed."""
        self._close("crashed", format_error(exc) or message)

    def _close(self, status: str, error: Optional[str] = None) -> None:
        watch, self.watch = self.watch, None
        self._release_trainer()
        if watch is not None:
            watch.close(status=status, error=error)

    def _capture_losses(self, trainer: Any) -> None:
        """Wrap this Trainer's ``training_step``: its return value is what the Trainer adds to the
        loss it logs (already divided for accumulation), so their sum over a window is that loss."""
        original = trainer.training_step
        self._trainer = trainer
        self._previous = trainer.__dict__.get("training_step", _MISSING)

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            try:
                loss = original(*args, **kwargs)
            except BaseException as exc:
                self.crashed(exc)
                raise
            if isinstance(loss, torch.Tensor) and self.watch is not None:
                self._losses.append(loss.detach())
            return loss

        self._wrapper = training_step
        trainer.training_step = training_step

    def _add_to_logs(self, trainer: Any) -> None:
        """Wrap this Trainer's ``log``: every report_to backend, the console and ``log_history``
        get the AMP figures of the window (trackers.window), including a NaN loss that the
        Trainer's ``logging_nan_inf_filter`` replaces in its own ``loss``."""
        original, window = trainer.log, self._window
        self._previous_log = trainer.__dict__.get("log", _MISSING)

        @functools.wraps(original)
        def log_(logs: dict, *args: Any, **kwargs: Any) -> Any:
            if isinstance(logs, dict) and "loss" in logs:  # training logs, not eval or the final summary
                logs.update(window.take())
            return original(logs, *args, **kwargs)

        self._log_wrapper = log_
        trainer.log = log_

    def _release_trainer(self) -> None:
        trainer, self._trainer = self._trainer, None
        self._window = None
        if trainer is None:
            return
        if trainer.__dict__.get("log") is self._log_wrapper and self._log_wrapper is not None:
            if self._previous_log is _MISSING:
                del trainer.log
            else:
                trainer.log = self._previous_log
        self._log_wrapper = None
        if trainer.__dict__.get("training_step") is not self._wrapper:
            return  # someone wrapped it after us: leave theirs in place (ours passes through)
        if self._previous is _MISSING:
            del trainer.training_step
        else:
            trainer.training_step = self._previous


__all__ = ["AmpwatchCallback", "training_config"]
