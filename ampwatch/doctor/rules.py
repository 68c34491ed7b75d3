"""The doctor's rules: each is a pure function ``Facts -> list[Finding]``.

Grouped by theme: :mod:`.skips` (warm-up, probing, recurring overflow, lone skips: every skipped
step explained), :mod:`.scale` (collapse, stuck scale),
:mod:`.numerics` (underflow, activation headroom, where NaN/Inf was born), :mod:`.signals` (loss
spikes, gradient-norm explosions, divergence) and :mod:`.misuse`. Every threshold is a named
constant next to its rule with the reason it has that value. False alarms are as bad as misses:
tests/test_doctor.py trains healthy MLP, CNN and transformer runs and asserts that none of these
rules fires a warning on them, and trains a faulty run per rule that must fire it.
"""
from __future__ import annotations

from typing import Callable

from .cost import SHARE_NOTE, detail_cost_share
from .finding import Finding, num
from .fp8 import ERR_FACTOR, ERR_MIN, FLUSH_WARN, fp8_cast_loss, fp8_output_error
from .facts import Facts
from .ending import run_crashed, run_interrupted, run_stalled
from .memory import memory_growth
from .misuse import misuse_clip_scaled, misuse_config, misuse_notices
from .numerics import (FP32_MODULE_TYPES, HEADROOM_FACTOR, HEADROOM_MIN_ROWS, UNDERFLOW_EXCESS,
                       UNDERFLOW_MIN_FRAC, UNDERFLOW_SCALED_AMAX, activation_headroom, grad_underflow,
                       nonfinite_origin)
from .origins import WEIGHT_JUMP, origin_advice, weight_jump
from .scale import COLLAPSE_STREAK, STUCK_HEADROOM, STUCK_MIN_STEPS, scale_collapse, scale_stuck_low
from .skips import (PROBE_RATE_WARN, SAME_ORIGIN_MIN, SKIP_MIN_COUNT, SKIP_MIN_STEPS, SKIP_RATE_ERROR,
                    SKIP_RATE_WARN, lone_skips, recurring_overflow, scale_probing, warmup_skips)
from .replayed import step_not_reproduced
from .trends import activation_trend, scale_falling
from .signals import (GRAD_SPIKE, LOSS_SPIKE, OUTLIER_MIN_HISTORY, OUTLIER_WINDOW, outliers, divergence,
                      grad_norm_explosion, loss_spike)

# The order rules run in; causes.group() decides the report order.
RULES: list[Callable[[Facts], list[Finding]]] = [
    run_crashed, run_interrupted, run_stalled, warmup_skips, nonfinite_origin, divergence, scale_collapse, recurring_overflow, scale_probing,
    lone_skips, scale_stuck_low,
    grad_underflow, activation_headroom, activation_trend, scale_falling, loss_spike, grad_norm_explosion,
    misuse_config, misuse_clip_scaled, memory_growth,
    misuse_notices, step_not_reproduced, fp8_cast_loss, fp8_output_error, detail_cost_share,
]

__all__ = ["RULES", "Facts", "num", "origin_advice", "weight_jump", "outliers",
           "SKIP_RATE_WARN", "SKIP_RATE_ERROR", "PROBE_RATE_WARN", "SAME_ORIGIN_MIN", "SKIP_MIN_COUNT", "SKIP_MIN_STEPS", "COLLAPSE_STREAK",
           "STUCK_HEADROOM", "STUCK_MIN_STEPS", "UNDERFLOW_SCALED_AMAX", "UNDERFLOW_EXCESS",
           "UNDERFLOW_MIN_FRAC", "HEADROOM_FACTOR", "HEADROOM_MIN_ROWS", "FP32_MODULE_TYPES",
           "OUTLIER_WINDOW", "OUTLIER_MIN_HISTORY", "LOSS_SPIKE", "GRAD_SPIKE", "WEIGHT_JUMP",
           "FLUSH_WARN", "ERR_FACTOR", "ERR_MIN", "SHARE_NOTE"]
