"""Rules about the loss scale: collapse, a scale stuck too low (skips: :mod:`.skips`)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .finding import FP16_MAX, Finding, num, span
from .facts import Facts
from .origins import describe_origins, origin_advice, place
from .warmup import SCALE_FREE_PHASES

# Scale collapse: a scale below 1 means the gradients overflow even unscaled. A gradient that
# overflowed only because the scale grew is fixed by one or two halvings (the weights do not change
# on skipped steps), so 8 halvings in a row (scale / 256) means the overflow ignores the scale.
COLLAPSE_STREAK = 8

# Scale stuck low: only when the largest scaled gradient sits >= 2**10 below fp16's limit (ten
# binary orders of magnitude of fp16 range wasted, at the bottom where small gradients lose
# precision; healthy runs sit within 2**1-2**7 of it) for 200+ clean steps at one scale (a short
# run that has not had time to grow is not a finding).
STUCK_HEADROOM = 2.0 ** 10
STUCK_MIN_STEPS = 200


def pow2(x: float) -> str:
    """The largest power of two <= x, as Python: ``2**16``."""
    return f"2**{math.floor(math.log2(x))}" if x > 0 else "1"


def _runs(starts: np.ndarray, member: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first row, length) of each run of ``member`` rows, a run beginning at every ``starts`` row."""
    label = np.cumsum(starts & member)
    return np.flatnonzero(starts & member), np.bincount(label[member])[1:]


def _longest_skip_streak(steps: pd.DataFrame) -> tuple[int, int, int]:
    """(length, first step, last step) of the longest (the first of equals) run of consecutive skipped steps."""
    step, skipped = steps["step"].to_numpy(), steps["skipped"].to_numpy(dtype=bool)
    if not skipped.any():
        return 0, 0, 0
    goes_on = np.zeros(len(step), dtype=bool)
    goes_on[1:] = skipped[:-1] & (step[1:] == step[:-1] + 1)
    first, length = _runs(~goes_on, skipped)
    best = int(np.argmax(length))
    return int(length[best]), int(step[first[best]]), int(step[first[best] + length[best] - 1])


def scale_collapse(facts: Facts) -> list[Finding]:
    """Error: the scale fell below 1, or halved COLLAPSE_STREAK+ times in a row after warm-up."""
    if not facts.scaling:
        return []
    steps = facts.after_warmup()
    if not len(steps):
        return []
    scale = steps["loss_scale"].astype(float)
    streak, s_first, s_last = _longest_skip_streak(steps)
    # Below 1 only counts when skipping took it there (an init_scale < 1 is scale-stuck-low's business).
    fell = steps["skipped"] & (scale < 2.0)
    below = steps.loc[(scale < 1.0) & (steps["step"] > steps.loc[fell, "step"].min()), "step"] if fell.any() \
        else steps["step"].iloc[:0]
    if not len(below) and streak < COLLAPSE_STREAK:
        return []
    first, last = (s_first, s_last) if streak >= COLLAPSE_STREAK else (int(below.iloc[0]), int(below.iloc[0]))
    if len(below):
        first, last = min(first, int(below.iloc[0])), max(last, int(below.iloc[-1]))
    skipped_in = [int(s) for s in steps.loc[steps["skipped"] & steps["step"].between(first, last), "step"]]
    origins = facts.origins(skipped_in)
    evidence = f"scale {num(scale.max())} -> {num(scale.min())}"
    if streak:
        evidence += f"; {streak} consecutive skipped steps ({span(s_first, s_last)})"
    if len(below):
        evidence += f"; below 1 from step {int(below.iloc[0]):,} to {int(below.iloc[-1]):,} ({len(below):,} steps)"
    if len(origins):
        evidence += f"; overflow born in {describe_origins(origins)}"
        extra, fix = origin_advice(facts, origins["module"].iloc[0], origins["phase"].iloc[0], first)
        evidence += extra
        phase = origins["phase"].iloc[0]
        lowest = float(scale[steps["step"].isin(skipped_in)].min()) if skipped_in else float(scale.min())
        if phase in SCALE_FREE_PHASES:
            why = (f"It is born in the {'loss' if phase == 'loss' else 'forward' if phase == 'forward' else 'batch'}, "
                   f"which the loss scale does not "
                   f"touch (the scale multiplies only the gradients), so halving cannot fix it")
        else:
            why = (f"It still overflowed at a scale of {num(lowest)}, so halving has not fixed it" if lowest >= 1 else
                   f"It still overflowed at a scale of {num(lowest)}, below 1: the gradient is out of range (or "
                   f"non-finite) unscaled, so halving cannot fix it")
        advice = f"{why}. {fix}."
    else:
        advice = ("The gradients overflow at any scale: find the layer (localize=True records it) "
                  "and keep it in fp32, or use bf16 autocast.")
    where = f" at {place(origins['module'].iloc[0], origins['phase'].iloc[0])}" if len(origins) else ""
    if len(origins):
        facts.claims["scale-collapse"] = (origins["module"].iloc[0], origins["phase"].iloc[0])
    return [facts.finding("scale-collapse", "error", f"Loss scale collapsed{where}: it keeps halving",
                          first, last, evidence, advice)]


def _clean_spans(steps: pd.DataFrame, min_length: int = 1) -> list[tuple[int, int, float, int]]:
    """Maximal runs of non-skipped rows at one unchanged scale, at least ``min_length`` long, in
    step order: (first step, last step, scale, length)."""
    step, clean = steps["step"].to_numpy(), ~steps["skipped"].to_numpy(dtype=bool)
    scale = steps["loss_scale"].to_numpy(dtype=float)
    if not clean.any():
        return []
    goes_on = np.zeros(len(step), dtype=bool)
    goes_on[1:] = clean[:-1] & (scale[1:] == scale[:-1])  # NaN never equals: each NaN row stands alone
    first, length = _runs(~goes_on, clean)
    keep = length >= min_length
    return [(int(step[a]), int(step[a + n - 1]), float(scale[a]), int(n))
            for a, n in zip(first[keep], length[keep])]


def scale_stuck_low(facts: Facts) -> list[Finding]:
    """Warning: the scale sat >= STUCK_HEADROOM below what the gradients allow for a long span."""
    if not (facts.scaling and facts.fp16):
        return []
    spans = _clean_spans(facts.after_warmup(), STUCK_MIN_STEPS)
    # Any finite value above this (with a margin for rounding) already leaves less headroom than
    # STUCK_HEADROOM: the span is fine, and the exact maximum is not needed.
    enough = FP16_MAX / STUCK_HEADROOM * (1 + 1e-6)
    for first, last, scale, length in sorted(spans, key=lambda s: -s[3]):
        peak = facts.scaled_grad_max(first, last, stop_above=enough)
        if peak is None or peak <= 0 or FP16_MAX / peak < STUCK_HEADROOM:
            continue
        room = FP16_MAX / peak
        gi = facts.info.get("growth_interval")
        target = scale * room / 8  # keep 8x margin below the limit
        grew_never = gi is not None and length > gi
        why = (f"the scaler did not grow in {length:,} clean steps although growth_interval={gi}: growth is "
               f"disabled (growth_factor={facts.info.get('growth_factor')}) or the scale is set by hand"
               if grew_never else
               f"with growth_interval={gi} it would only start growing after {num(gi)} clean steps")
        return [facts.finding(
            "scale-stuck-low", "warning",
            f"Loss scale stuck at {num(scale)}, 2^{math.floor(math.log2(room))}x below what the gradients allow",
            first, last,
            f"{length:,} clean steps at scale {num(scale)}; largest scaled gradient {num(peak)}, "
            f"{room:.3g}x below fp16's 65,504; {why}",
            f"Start at init_scale={pow2(min(target, 2.0 ** 24))} and keep growth_interval at or below "
            f"{min(gi or 2000, 2000):,} so the scaler can find its level; small gradients lose precision "
            f"or flush to zero at this scale.")]
    return []
