"""Rules about the training signal: loss spikes, gradient-norm explosions, divergence."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import numpy as np
import pandas as pd

from .finding import Finding, counted, num, times
from ..store.reader import clip_threshold
from .facts import Facts
from .origins import describe_origins, origin_advice, overwrite_advice, overwritten_around


# Loss spikes / grad-norm explosions: a point must stand out three ways against the previous 50
# steps: a robust z-score (median and MAD, so earlier outliers don't widen the band), a ratio to the
# median (so a low-noise plateau does not turn a 20% wiggle into a "spike"), and a ratio to the
# window's maximum (so the steady several-fold growth of the gradient norm early in training is not
# an "explosion"). Largest values on our healthy MLP/CNN/transformer runs and healthy samples: loss
# 3.0x the median, 1.3x the max, z 3.9; grad norm 6.1x the median, 1.6x the max, z 7.5 (a CNN under
# Adam leaving its plateau). Faults measured 80-7000x. tests/test_doctor.py checks no healthy step
# gets half-way on all three.
OUTLIER_WINDOW = 50
OUTLIER_MIN_HISTORY = 20
LOSS_SPIKE = dict(z=8.0, ratio=2.0, over_max=2.0)
GRAD_SPIKE = dict(z=8.0, ratio=20.0, over_max=3.0)
FOLLOW_STEPS = 5  # "did a skip or NaN follow": within this many steps after the outlier

# Rising loss: the last window's median >= 1.5x the best window median, still rising, and having
# given back at least half of what the run had learned. Windows are 10% of the run (>= 10 steps).
RISE_RATIO, RISE_GIVEBACK = 1.5, 0.5
RISE_MIN_STEPS = 50


def outliers(steps: pd.Series, values: pd.Series, z: float, ratio: float, over_max: float) -> list[tuple]:
    """(step, value, median, ratio, values before it in the window) of robust upward outliers against
    the previous OUTLIER_WINDOW.

    The spread is the trailing median of each point's absolute deviation from its own trailing
    median: a rolling-window MAD that pandas computes in C (a per-window MAD would be a Python loop).
    """
    v = pd.Series(values.to_numpy(dtype=float))
    med = v.rolling(OUTLIER_WINDOW, min_periods=OUTLIER_MIN_HISTORY).median().shift(1)
    # the deviations exist only from step OUTLIER_MIN_HISTORY on (where the median does): asking for
    # OUTLIER_MIN_HISTORY of them as well left every outlier before step 40 unseen (a loss 6x its
    # median at step 30: no finding); half as many is the spread of 10 deviations
    mad = (v - med).abs().rolling(OUTLIER_WINDOW, min_periods=OUTLIER_MIN_HISTORY // 2).median().shift(1) * 1.4826
    spread = np.maximum(mad.to_numpy(), 1e-12)
    m = med.to_numpy()
    zscore = (v.to_numpy() - m) / spread
    peak = v.rolling(OUTLIER_WINDOW, min_periods=OUTLIER_MIN_HISTORY).max().shift(1).to_numpy()
    x = v.to_numpy()
    # Ratios only mean something for positive series (a loss can be negative): then z alone, doubled.
    guard = np.where(m > 0, (x >= ratio * m) & (x >= over_max * peak), zscore >= 2 * z)
    hits = np.flatnonzero((zscore >= z) & guard & np.isfinite(m))
    s = steps.to_numpy()
    return [(int(s[i]), float(v[i]), float(m[i]), float(v[i] / m[i]) if m[i] > 0 else math.inf,
             min(int(i), OUTLIER_WINDOW)) for i in hits]


def _episodes(hits: list[tuple]) -> list[list[tuple]]:
    groups: list[list[tuple]] = []
    for h in hits:
        if groups and h[0] - groups[-1][-1][0] <= FOLLOW_STEPS:
            groups[-1].append(h)
        else:
            groups.append([h])
    return groups


def _aftermath(facts: Facts, step: int) -> str:
    s = facts.steps
    after = s[(s["step"] >= step) & (s["step"] <= step + FOLLOW_STEPS)]
    notes = []
    skipped = after.loc[after["skipped"], "step"]
    if len(skipped):
        notes.append(f"skipped step {int(skipped.iloc[0]):,}")
    bad = after.loc[~np.isfinite(after["loss"].astype(float)) & facts.has_loss, "step"]
    if len(bad):
        notes.append(f"non-finite loss at step {int(bad.iloc[0]):,}")
    return "followed by " + " and ".join(notes) if notes else "no skip or NaN followed"


def _outlier_finding(facts: Facts, id: str, label: str, hits: list[tuple], advice: str) -> list[Finding]:
    if not hits:
        return []
    episodes = _episodes(hits)
    peaks = [max(g, key=lambda h: h[3]) for g in episodes]
    worst = max(peaks, key=lambda h: h[3])
    parts = [f"step {p[0]:,}: {num(p[1])} vs median {num(p[2])} of the previous {p[4]} "
             f"({times(p[3])}), {_aftermath(facts, p[0])}" for p in peaks[:5]]
    more = f"; and {len(peaks) - 5} more" if len(peaks) > 5 else ""
    how_often = "once" if len(peaks) == 1 else counted(len(peaks), "time")
    title = (f"{label} {'spiked' if id == 'loss-spike' else 'exploded'} {how_often}: up to "
             f"{times(worst[3])} the recent median (step {worst[0]:,})")
    evidence = "; ".join(parts) + more + _layers_that_grew(facts, worst[0])
    # the first spike's weights: one moved beyond what training moves it is the cause, not the batches
    jumped = overwritten_around(facts, hits[0][0])
    if jumped:
        extra, fix = overwrite_advice(facts, jumped, hits[0][0])
        evidence, advice = evidence + extra, fix + "."
        facts.claims[id] = (jumped[0], "overwritten")  # a gradient explosion it also explains follows the loss spike
    return [facts.finding(id, "warning", title, hits[0][0], hits[-1][0], evidence, advice,
                          jump=facts.jump(worst[0], worst[0]))]


# a parameter named as grown at a spike: its gradient norm this many times its recent median
LAYER_GROWTH = 3.0


def _layers_that_grew(facts: Facts, step: int, limit: int = 3) -> str:
    """"; at step 412 the gradient grew most in h.3.mlp.fc.weight: 12.3, 48x its median ..." from the
    layer rows a spike step gets (record/spikes.py); "" where it has none."""
    grown = [g for g in facts.layer_grad_growth(step) if g[1] >= LAYER_GROWTH * g[2]]
    if not grown:
        return ""
    parts = [f"{name} {num(norm)}, {times(norm / median)} its median over the recorded steps before"
             + (f", {share:.0%} of the step's squared norm" if share == share else "")
             for name, norm, median, share in grown[:limit]]
    more = f" (and {counted(len(grown) - limit, 'other parameter')} grew {LAYER_GROWTH:g}x or more)" \
        if len(grown) > limit else ""
    return f"; at step {step:,} the gradient grew most in " + "; ".join(parts) + more


# Past this many steps the rolling medians of the loss, of the gradient norm and of the rising-loss
# window (each ~0.4-1 s on 1,000,000 steps, in pandas' C loop, which lets go of the GIL) are worked
# out together on two threads the first time a rule asks.
TOGETHER_STEPS = 50_000


def _loss_points(facts: Facts) -> pd.DataFrame:
    s = facts.steps[facts.steps["step"] <= facts.healthy_end]
    return s[np.isfinite(s["loss"].astype(float))]


def _grad_points(facts: Facts) -> pd.DataFrame:
    """The steps whose gradient norm the outlier test reads: healthy, applied, finite (kept: the
    explosion rule reads them again for its median)."""
    if "grad points" not in facts.memo:
        s = facts.steps[(facts.steps["step"] <= facts.healthy_end) & ~facts.steps["skipped"]]
        facts.memo["grad points"] = s[np.isfinite(s["grad_norm"].astype(float))]
    return facts.memo["grad points"]


def _series(facts: Facts, name: str) -> Any:
    """One of the answers below, all worked out at once on a long run (``facts.memo``)."""
    work: dict[str, Callable[[], Any]] = {
        "loss outliers": lambda: _outliers_of(_loss_points(facts), "loss", LOSS_SPIKE),
        "grad outliers": lambda: _outliers_of(_grad_points(facts), "grad_norm", GRAD_SPIKE),
        "rising loss": lambda: _rising_loss(facts)}
    if name not in facts.memo and len(facts.steps) > TOGETHER_STEPS:
        # divergence reads a NaN tail where there is one, not the rising loss
        skip = {"rising loss"} - {name} if facts.nan_tail_start is not None else set()
        with ThreadPoolExecutor(2) as pool:
            done = {key: pool.submit(fn) for key, fn in work.items() if key not in facts.memo and key not in skip}
            facts.memo.update({key: future.result() for key, future in done.items()})
    if name not in facts.memo:
        facts.memo[name] = work[name]()
    return facts.memo[name]


def _outliers_of(points: pd.DataFrame, column: str, thresholds: dict) -> list[tuple]:
    return outliers(points["step"], points[column], **thresholds)


def loss_spike(facts: Facts) -> list[Finding]:
    """Warning: loss values far above the median of the previous steps (median/MAD)."""
    hits = _series(facts, "loss outliers")
    clip = clip_threshold(facts.info)
    advice = ("Look at the batches of these steps (corrupt or outlier samples, a data-loader bug); "
              "a lower learning rate or a longer warm-up helps"
              + (f"; gradients are clipped at max_norm={clip}, which bounds the damage." if clip else
                 "; clip gradients (scaler.unscale_(opt); clip_grad_norm_(params, 1.0)) to bound the damage."
                 if facts.scaling else
                 "; clip gradients (clip_grad_norm_(params, 1.0) before optimizer.step()) to bound the damage."))
    return _outlier_finding(facts, "loss-spike", "Loss", hits, advice)


def grad_norm_explosion(facts: Facts) -> list[Finding]:
    """Warning: gradient norms (unscaled, before clipping) far above their recent median."""
    s = _grad_points(facts)
    hits = _series(facts, "grad outliers")
    median = float(s["grad_norm"].median()) if len(s) else float("nan")
    clip = clip_threshold(facts.info)
    how = "Clip gradients after unscaling: scaler.unscale_(optimizer); " if facts.scaling else \
        "Clip gradients before optimizer.step(): "  # no GradScaler: nothing to unscale
    advice = (f"{how}"
              f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={2 * median:.2g}) (2x the run's "
              f"median norm {median:.3g})" + (f"; the clip at max_norm={clip:g} already bounds the update"
                                              if clip else "")
              + "; if it recurs, lower the learning rate or check the batches at these steps.")
    return _outlier_finding(facts, "grad-norm-explosion", "Gradient norm", hits, advice)


def _rising_loss(facts: Facts) -> Optional[tuple[int, str]]:
    s = facts.steps[np.isfinite(facts.steps["loss"].astype(float))]
    if len(s) < RISE_MIN_STEPS:
        return None
    w = max(10, len(s) // 10)
    med = s["loss"].astype(float).rolling(w).median().to_numpy()
    first, best_i = med[w - 1], int(np.nanargmin(med))
    best, last, prev = med[best_i], med[-1], med[-1 - w] if len(med) > w else np.nan
    if not (best > 0 and last >= RISE_RATIO * best and last > prev):
        return None
    if first > best and (last - best) < RISE_GIVEBACK * (first - best):
        return None
    onset = int(s["step"].iloc[best_i])
    return onset, (f"median loss over {w} steps fell from {num(first)} to {num(best)} (at step {onset:,}) "
                   f"and rose to {num(last)} at the end ({last / best:.3g}x its best)")


def divergence(facts: Facts) -> list[Finding]:
    """Error: loss NaN/inf on the last steps, or steadily rising at the end."""
    end = facts.last_step
    if facts.nan_tail_start is not None:
        onset = facts.nan_tail_start
        tail = facts.steps[facts.steps["step"] >= onset]
        good = facts.steps[(facts.steps["step"] < onset) & np.isfinite(facts.steps["loss"].astype(float))]
        kinds = "NaN" if tail["loss"].isna().all() else "non-finite"
        evidence = f"loss is {kinds} on every step from {onset:,} to the end ({len(tail):,} steps)"
        if len(good):
            evidence += f"; last finite loss {num(float(good['loss'].iloc[-1]))} at step {int(good['step'].iloc[-1]):,}"
        if facts.scaling:
            sc = tail["loss_scale"].astype(float)
            evidence += (f"; the scaler skipped {int(tail['skipped'].sum()):,} of them, scale "
                         f"{num(sc.iloc[0])} -> {num(sc.iloc[-1])}")
        origins = facts.origins(tail["step"]).sort_values("first", kind="stable")  # the earliest is the cause
        restart = f"restart from a checkpoint before step {onset:,}. "
        if len(origins):
            extra, fix = origin_advice(facts, origins["module"].iloc[0], origins["phase"].iloc[0], onset)
            evidence += f"; born in {describe_origins(origins)}{extra}"
            restart = "" if extra else restart  # the overwritten weight's advice names the checkpoint
        else:
            fix = "Find the first non-finite value (localize=True records where it is born)"
        return [facts.finding(
            "divergence", "error", f"Training diverged at step {onset:,}: the loss is {kinds} to the end",
            onset, end, evidence, f"The run does not recover by itself: {restart}{fix}.",
            jump=facts.jump(onset, onset, pad=20))]
    rising = _series(facts, "rising loss")
    if rising is None:
        return []
    onset, evidence = rising
    return [facts.finding(
        "divergence", "error", f"Training is diverging: the loss has been rising since step {onset:,}",
        onset, end, evidence,
        "Lower the learning rate (halve it), check the learning-rate schedule at that step and "
        "clip gradients (max_norm=1.0); resume from a checkpoint before it.")]
