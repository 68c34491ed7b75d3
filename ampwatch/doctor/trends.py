"""Early warnings: trends that reach a limit if they hold, said before the NaN.

* ``activation-trend``: a leaf module's recorded fp16 maximum (``modules.amax`` on the recorded
  steps) grows steadily, geometrically, toward 65,504.
* ``scale-falling``: after warm-up the loss scale backs off more often than it grows and has lost
  a good part of its value: the scaler is losing, and the scale heads for 1 (then collapse).
"""
from __future__ import annotations

import math

import numpy as np

from .facts import Facts
from .finding import FP16_MAX, Finding, num, span
from .numerics import leaf_modules

# A trend is a fit of log(max |output|) against the step over a module's last TREND_ROWS recorded
# healthy rows. It warns only when all of these hold, so that the slow drift of a healthy run (a few
# percent per recorded step, up and down) never does:
# * it is steady: R² >= TREND_R2 and at least TREND_UP of the steps between rows go up;
# * it is large: the maximum grew >= TREND_GROWTH x over those rows (healthy 40-step runs of the
#   accuracy tests and the sample runs grow < 1.5x, see tests/test_doctor_trends.py);
# * it is near: at that rate 65,504 is reached within TREND_HORIZON x the rows' span of steps after
#   the last one (a limit 1000 spans away is not a warning, it is a curve), and the last maximum is
#   within 2**8 of it (>= 256): early training grows small outputs fast (the diverged and
#   lightning samples' attention projections go 0.12 -> 2.3 in 140 steps, 1.02x per step), which
#   says nothing about fp16's range.
TREND_ROWS = 8
TREND_STEPS_READ = 4 * TREND_ROWS
TREND_MIN_ROWS = 5
TREND_R2 = 0.9
TREND_UP = 0.8
TREND_GROWTH = 4.0
TREND_HORIZON = 4.0
TREND_NEAR = FP16_MAX / 2 ** 8

# Scale falling: after warm-up, SCALE_MIN_BACKOFFS+ backoffs outnumbering growths at least 2:1, and
# the scale at the last healthy step SCALE_FALL x or more below its value right after warm-up. A
# healthy fp16 run grows once per growth_interval and backs off about as often (the scaler probing
# its ceiling: scale-probing), so its scale hovers; one that keeps losing heads for 1.
SCALE_MIN_BACKOFFS = 4
SCALE_FALL = 8.0


def _fit(steps: np.ndarray, amax: np.ndarray) -> tuple[float, float, float]:
    """(slope of ln(amax) per step, intercept, R²) of a least-squares line."""
    y = np.log(amax)
    slope, intercept = np.polyfit(steps, y, 1)
    pred = slope * steps + intercept
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else 0.0
    return float(slope), float(intercept), r2


def activation_trend(facts: Facts) -> list[Finding]:
    """Warning: a leaf module's fp16 maximum grows steadily toward 65504 (name, rate, projected step)."""
    if not facts.fp16:
        return []
    # the last TREND_ROWS healthy rows of each module, from a few more recent steps than that: a
    # step where a module's value was zero or non-finite is left out of its fit
    fwd = facts.forward_activations(facts.healthy_end, leaf_modules(facts), recent=TREND_STEPS_READ)
    order = {n: i for i, n in enumerate(facts.tensors["name"])}
    hits = []
    for name, g in fwd.groupby("module", sort=False):
        g = g[np.isfinite(g["amax"].to_numpy(dtype=float)) & (g["amax"] > 0)].tail(TREND_ROWS)
        if len(g) < TREND_MIN_ROWS:
            continue
        steps, amax = g["step"].to_numpy(dtype=float), g["amax"].to_numpy(dtype=float)
        if amax[-1] < TREND_NEAR or amax[-1] / amax[0] < TREND_GROWTH or np.mean(np.diff(amax) > 0) < TREND_UP:
            continue
        slope, intercept, r2 = _fit(steps, amax)
        if slope <= 0 or r2 < TREND_R2:
            continue
        reach = (math.log(FP16_MAX) - intercept) / slope
        if reach - steps[-1] > TREND_HORIZON * (steps[-1] - steps[0]):
            continue
        hits.append((order.get(name, len(order)), name, slope, reach, g))
    if not hits:
        return []
    # Downstream modules inherit an upstream one's growth: name the first, in forward (registration)
    # order, among those growing nearly as fast as the fastest.
    fastest = max(h[2] for h in hits)
    hits.sort(key=lambda h: (h[2] < 0.8 * fastest, h[0]))
    _, name, slope, reach, g = hits[0]
    first, last = int(g["step"].iloc[0]), int(g["step"].iloc[-1])
    per_step = math.exp(slope)
    at = max(int(math.ceil(reach)), last + 1)
    others = ", ".join(h[1] for h in hits[1:4])
    facts.claims["activation-trend"] = (name, "forward")
    return [facts.finding(
        "activation-trend", "warning",
        f"Activations of {name} grow {per_step:.3g}x per step toward fp16's limit: 65,504 at step ~{at:,} "
        f"if the trend holds",
        first, last,
        f"max |output| of {name} {num(float(g['amax'].iloc[0]))} -> {num(float(g['amax'].iloc[-1]))} over "
        f"{len(g)} recorded steps ({span(first, last)}), a steady {per_step:.3g}x per step; at that rate it "
        f"passes 65,504 at step ~{at:,}" + (f"; also growing: {others}" if others else ""),
        f"Find what makes {name}'s output grow (its weights: weight decay, a lower learning rate, clipping; "
        f"or its inputs: a normalization before it), or keep it in fp32 (autocast disabled around it) or use "
        f"bf16 autocast before it overflows.")]


def scale_falling(facts: Facts) -> list[Finding]:
    """Warning: after warm-up the loss scale backs off faster than it grows and keeps falling."""
    if not facts.scaling:
        return []
    s = facts.after_warmup()
    if len(s) < 2:
        return []
    scale = s["loss_scale"].to_numpy(dtype=float)
    steps = s["step"].to_numpy()
    change = scale[1:] / scale[:-1]
    backoffs, growths = int((change < 1).sum()), int((change > 1).sum())
    if backoffs < SCALE_MIN_BACKOFFS or backoffs < 2 * growths or not scale[-1] * SCALE_FALL <= scale[0]:
        return []
    if scale.min() < 1.0:  # below 1 is scale-collapse's
        return []
    first_drop = int(steps[1:][change < 1][0]) - 1
    rate = (math.log2(scale[-1]) - math.log2(scale[0])) / max(int(steps[-1]) - int(steps[0]), 1)
    reach = int(steps[-1]) + math.ceil(math.log2(scale[-1]) / -rate) if rate < 0 and scale[-1] > 1 else None
    return [facts.finding(
        "scale-falling", "warning",
        f"The loss scale keeps falling: {backoffs} backoffs against {growths} growths after warm-up",
        first_drop, int(steps[-1]),
        f"scale {num(scale[0])} -> {num(scale[-1])} between steps {int(steps[0]):,} and {int(steps[-1]):,} "
        f"({backoffs} backoffs, {growths} growths)"
        + (f"; at that rate it reaches 1 at step ~{reach:,}" if reach is not None else ""),
        "The gradients overflow more and more often: find the origin of the skips (recurring-overflow, the "
        "events) and keep that module in fp32, or use bf16 autocast; a growing model may need gradient "
        "clipping or a lower learning rate.")]
