"""Which healthy steps spiked, decided on the writer thread: their per-layer gradient norms are
written too, so a spike says which layer's gradient grew, not only that the total did.

Every step's pack brings one norm per gradient (the global norm is made from them), so writing a
spike step's ``layers`` rows costs the training thread nothing: the writer keeps them instead of
dropping them. The bars are below the doctor's (signals.py: 3x the previous 50 steps' maximum for
the gradient norm, 2x for the loss, among other tests), so that every spike it reports has its rows;
a run that keeps spiking stops getting them after MAX_STEPS.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Optional

WINDOW = 50       # the previous steps a value is compared with (the doctor's OUTLIER_WINDOW)
MIN_HISTORY = 10  # fewer than this: no judgement yet
NORM_OVER_MAX = 3.0
LOSS_OVER_MAX = 2.0
MAX_STEPS = 1000  # per run: ~150k rows for GPT-2 small's 148 parameters


class SpikeWatch:
    """Feed every step's finite gradient norm and loss, in step order; says whether it spiked."""

    def __init__(self) -> None:
        self._norms: deque = deque(maxlen=WINDOW)
        self._losses: deque = deque(maxlen=WINDOW)
        self.steps = 0  # spike steps reported so far

    def spiked(self, grad_norm: Optional[float], loss: Optional[float]) -> bool:
        hit = _over(self._norms, grad_norm, NORM_OVER_MAX) | _over(self._losses, loss, LOSS_OVER_MAX)
        if hit and self.steps < MAX_STEPS:
            self.steps += 1
            return True
        return False


def _over(recent: deque, value: Optional[float], factor: float) -> bool:
    """Whether ``value`` is ``factor`` times the largest of ``recent``; then it joins them."""
    if value is None or not math.isfinite(value):
        return False
    # a spike is above the last value too: one comparison for the usual step, the maximum only then
    hit = (len(recent) >= MIN_HISTORY and value > 0 and value >= factor * recent[-1]
           and value >= factor * max(recent))
    recent.append(value)
    return hit
