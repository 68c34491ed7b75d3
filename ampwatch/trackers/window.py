"""The AMP figures of a logging window, for frameworks that log on their own cadence (HF Trainer,
Lightning): fed by the live mirror on the writer thread, taken by the framework's logging call.

:class:`LogWindow` is a tracker object for ``attach(mirror=...)`` (it has SummaryWriter's
``add_scalar``), so nothing new runs on the training thread per step: at each of the framework's
own log calls, :meth:`LogWindow.take` hands over a few numbers under a lock. It sees the steps
the writer thread has committed, so a window's figures lag training by at most ``flush_every_s``;
every committed step is counted in exactly one window.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Optional

from . import series

LAST_STEP = series.PREFIX + "step"                      # the last step the figures include
SKIPPED_STEPS = series.PREFIX + "skipped_steps"         # skipped optimizer steps in the window
NONFINITE_LOSS_STEPS = series.PREFIX + "nonfinite_loss_steps"  # steps whose loss was NaN/inf


class LogWindow:
    """Per window: the last step's loss, loss scale, grad norm and lr, the lowest fp16 headroom,
    and the counts of skipped steps and of steps with a non-finite loss."""

    _LAST = (series.LOSS, series.SCALE, series.GRAD_NORM, series.LR)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fresh: dict[str, float] = {}
        self._step: Optional[int] = None

    # -- the writer thread's side (SummaryWriter-like, see trackers.tensorboard) -----------------
    def add_scalar(self, tag: str, value: float, step: int, walltime: Optional[float] = None) -> None:
        with self._lock:
            f = self._fresh
            if tag in self._LAST:
                f[tag] = value
                if tag == series.LOSS and not math.isfinite(value):
                    f[NONFINITE_LOSS_STEPS] = f.get(NONFINITE_LOSS_STEPS, 0.0) + 1
            elif tag == series.SKIPPED:
                f[SKIPPED_STEPS] = f.get(SKIPPED_STEPS, 0.0) + value
                self._step = step if self._step is None else max(self._step, step)
            elif tag == series.HEADROOM:
                f[tag] = min(f.get(tag, math.inf), value)

    def add_text(self, tag: str, text: str, step: int) -> None:
        pass  # findings stay in the run file and the doctor; framework logs hold numbers

    def flush(self) -> None:
        pass

    # -- the framework's side ---------------------------------------------------------------------
    def take(self) -> dict[str, float]:
        """The figures of the steps committed since the last call ({} when none). Does not sync."""
        with self._lock:
            fresh, step = self._fresh, self._step
            self._fresh, self._step = {}, None
        if step is None:
            return {}
        fresh.setdefault(NONFINITE_LOSS_STEPS, 0.0)
        fresh[LAST_STEP] = float(step)
        return fresh
