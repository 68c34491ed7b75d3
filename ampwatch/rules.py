"""The doctor's rules: each is a pure function ``Facts -> list[Finding]`` (issue 5).

Every threshold is a named constant with the reason it has that value. False alarms are as bad as
misses: tests/test_doctor.py trains healthy MLP, CNN and transformer runs and asserts that none of
these rules fires a warning on them, and trains a faulty run per rule that must fire it.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
import pandas as pd

from .doctor import FP16_MAX, Facts, Finding, describe_origins, fix_for_origin, num, pct, place, span

# Recurring overflow: GradScaler's defaults (growth_interval=2000) allow one probing skip per ~2000
# steps (0.05%). 2% is 40x that, and means 2% of the batches are thrown away; below 3 skips there is
# no pattern to speak of, below 50 steps no rate. A quarter of all steps skipped is an error:
# training is visibly slower and something is wrong every few steps.
SKIP_RATE_WARN = 0.02
SKIP_RATE_ERROR = 0.25
SKIP_MIN_COUNT = 3
SKIP_MIN_STEPS = 50

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

# Gradient underflow: a row is "at low scale" when its largest scaled gradient element is below 1:
# fp16 has only 24 binary orders of magnitude below 1 before flushing to zero, and a gradient's
# elements spread over many orders below their maximum. Healthy fp16 runs at a normal scale have
# <1% exactly-zero elements apart from structural zeros (dead ReLU units, unused embedding rows),
# which we subtract: the same parameter's zero fraction at normal scale. 20 percentage points more
# zeros, and at least a quarter of the tensor, is a fifth of the gradient signal gone.
UNDERFLOW_SCALED_AMAX = 1.0
UNDERFLOW_EXCESS = 0.20
UNDERFLOW_MIN_FRAC = 0.25

# Activation headroom: fp16 activations within 4x of 65504 (the "factor of 2-4") on at
# least 3 recorded detail rows in a row (3 x layer_every steps by default): one larger batch or a
# little weight growth away from inf. Healthy runs sit orders of magnitude below (max ~10-1000).
HEADROOM_FACTOR = 4.0
HEADROOM_MIN_ROWS = 3

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

# Clipping still-scaled gradients: a logged norm that is the scale times the true norm (within 2x)
# on most steps; the scale must be large enough (16) that "x scale" cannot be noise.
CLIP_RATIO_BAND = (0.5, 2.0)
CLIP_MIN_SCALE = 16.0
CLIP_MIN_STEPS = 5

# Modules that compute in fp32 under autocast, so their outputs are not fp16 activations.
FP32_MODULE_TYPES = {"LayerNorm", "GroupNorm", "RMSNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
                     "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "Softmax", "LogSoftmax",
                     "Embedding", "EmbeddingBag", "CrossEntropyLoss", "MSELoss", "NLLLoss"}


def pow2(x: float) -> str:
    """The largest power of two <= x, as Python: ``2**16``."""
    return f"2**{math.floor(math.log2(x))}" if x > 0 else "1"


def _finding(facts: Facts, id: str, severity: str, title: str, first: int, last: int,
             evidence: str, advice: str, jump: Optional[tuple[int, int]] = None) -> Finding:
    return Finding(id, severity, title, (int(first), int(last)), evidence, advice,
                   jump or facts.jump(int(first), int(last)))


# -- loss scale ---------------------------------------------------------------------------------------

def warmup_skips(facts: Facts) -> list[Finding]:
    """Info: the usual skipped steps at the start while the scale backs off from init_scale."""
    w = facts.warmup
    if w is None:
        return []
    ev = facts.events
    n_events = int(ev["step"].isin(w.skips).sum()) if len(ev) else 0
    return [_finding(
        facts, "warmup-skips", "info",
        f"Normal warm-up: {len(w.skips)} skipped step(s) while the loss scale backed off, ended at step {w.last:,}",
        w.first, w.last,
        f"{len(w.skips)} skipped of the first {w.last - w.first + 1:,} steps ({', '.join(map(str, w.skips[:12]))}"
        f"{', ...' if len(w.skips) > 12 else ''}); scale {num(w.scale_from)} -> {num(w.scale_to)}; "
        f"{n_events:,} gradient-overflow event(s) in them are expected",
        f"Nothing to fix: GradScaler starts high and halves until the gradients fit. To skip the warm-up, "
        f"start at init_scale={pow2(w.scale_to)}.",
        jump=(w.first, min(facts.last_step, w.last + 5)))]


def _probe_skips(facts: Facts, skips: list[int]) -> int:
    """Gradient-only skips after the scale had grown since the previous backoff: the scaler probing
    upward and finding the ceiling (a forward overflow is never a probe: the scale plays no part)."""
    scale = facts.scale_at()
    ev = facts.events
    forward = set(ev.loc[ev["phase"].isin(["forward", "loss"]), "step"]) if len(ev) else set()
    prev = facts.warmup.last if facts.warmup else None
    n = 0
    for s in skips:
        base_step = prev + 1 if prev is not None else facts.first_step
        if s not in forward and base_step in scale.index and scale[s] > scale[base_step]:
            n += 1
        prev = s
    return n


def recurring_overflow(facts: Facts) -> list[Finding]:
    """Warning/error: skip rate after warm-up above SKIP_RATE_WARN; names the origin modules."""
    if not facts.scaling:
        return []
    steps = facts.after_warmup()
    skips = [int(s) for s in steps.loc[steps["skipped"], "step"]]
    n = len(steps)
    if n < SKIP_MIN_STEPS or len(skips) < SKIP_MIN_COUNT or len(skips) / n < SKIP_RATE_WARN:
        return []
    rate = len(skips) / n
    origins = facts.origins(skips)
    probes = _probe_skips(facts, skips)
    gi = facts.info.get("growth_interval")
    evidence = f"{len(skips):,} of {n:,} steps skipped after warm-up ({pct(len(skips), n)})"
    if len(origins):
        evidence += f"; overflow born in {describe_origins(origins)}"
    if probes:
        evidence += f"; {probes:,} skip(s) right after the scale grew (growth_interval={gi})"
    if len(origins) and origins["phase"].iloc[0] in ("forward", "loss"):
        advice = origin_advice(facts, origins["module"].iloc[0], origins["phase"].iloc[0], skips[0])[1] + \
            " (a forward overflow does not depend on the loss scale, so the scaler cannot help)."
    elif gi is not None and probes >= len(skips) / 2 and gi < 2000:
        advice = (f"Most skips are the scaler probing upward every {gi} clean steps and hitting the "
                  f"ceiling: raise growth_interval to 2000 (the default).")
    elif len(origins):
        advice = origin_advice(facts, origins["module"].iloc[0], origins["phase"].iloc[0], skips[0])[1] + "."
    else:
        advice = "Turn localization on (ampwatch.attach(..., localize=True)) to see which module overflows."
    return [_finding(facts, "recurring-overflow", "error" if rate >= SKIP_RATE_ERROR else "warning",
                     f"{pct(len(skips), n)} of steps skipped after warm-up: the overflow keeps coming back",
                     skips[0], skips[-1], evidence, advice)]


def _longest_skip_streak(steps: pd.DataFrame) -> tuple[int, int, int]:
    """(length, first step, last step) of the longest run of consecutive skipped steps."""
    best = (0, 0, 0)
    run_start, length, prev = None, 0, None
    for step, skipped in zip(steps["step"], steps["skipped"]):
        if skipped and prev is not None and step == prev + 1 and length:
            length += 1
        elif skipped:
            run_start, length = step, 1
        else:
            length = 0
        if length > best[0]:
            best = (length, int(run_start), int(step))
        prev = step
    return best


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
        advice = f"The overflow does not go away at any scale, so halving cannot fix it. {fix}."
    else:
        advice = ("The gradients overflow at any scale: find the layer (localize=True records it) "
                  "and keep it in fp32, or use bf16 autocast.")
    where = f" at {place(origins['module'].iloc[0], origins['phase'].iloc[0])}" if len(origins) else ""
    return [_finding(facts, "scale-collapse", "error", f"Loss scale collapsed{where}: it keeps halving",
                     first, last, evidence, advice)]


def _scaled_grad_max(facts: Facts, first: int, last: int) -> Optional[float]:
    """Largest scaled gradient value seen in [first, last]: param grads x scale, module backward."""
    values = []
    layers = facts.layers
    if len(layers):
        rows = layers[layers["step"].between(first, last)]
        scaled = (rows["grad_amax"] * rows["step"].map(facts.scale_at())).astype(float)
        scaled = scaled[np.isfinite(scaled)]
        if len(scaled):
            values.append(float(scaled.max()))
    mods = facts.modules
    if len(mods):
        back = mods[(mods["phase"] == "backward") & mods["step"].between(first, last)]["amax"].astype(float)
        back = back[np.isfinite(back)]
        if len(back):
            values.append(float(back.max()))
    return max(values) if values else None


def _clean_spans(steps: pd.DataFrame) -> list[tuple[int, int, float, int]]:
    """Maximal runs of non-skipped steps at one unchanged scale: (first, last, scale, length)."""
    spans, cur = [], None
    for step, scale, skipped in zip(steps["step"], steps["loss_scale"].astype(float), steps["skipped"]):
        if skipped or (cur and scale != cur[2]):
            if cur:
                spans.append(cur)
            cur = None
        if not skipped:
            cur = (cur[0], int(step), scale, cur[3] + 1) if cur else (int(step), int(step), scale, 1)
    if cur:
        spans.append(cur)
    return spans


def scale_stuck_low(facts: Facts) -> list[Finding]:
    """Warning: the scale sat >= STUCK_HEADROOM below what the gradients allow for a long span."""
    if not (facts.scaling and facts.fp16):
        return []
    spans = [s for s in _clean_spans(facts.after_warmup()) if s[3] >= STUCK_MIN_STEPS]
    for first, last, scale, length in sorted(spans, key=lambda s: -s[3]):
        peak = _scaled_grad_max(facts, first, last)
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
        return [_finding(
            facts, "scale-stuck-low", "warning",
            f"Loss scale stuck at {num(scale)}, 2^{math.floor(math.log2(room))}x below what the gradients allow",
            first, last,
            f"{length:,} clean steps at scale {num(scale)}; largest scaled gradient {num(peak)}, "
            f"{room:.3g}x below fp16's 65,504; {why}",
            f"Start at init_scale={pow2(min(target, 2.0 ** 24))} and keep growth_interval at or below "
            f"{min(gi or 2000, 2000):,} so the scaler can find its level; small gradients lose precision "
            f"or flush to zero at this scale.")]
    return []


# -- gradients, activations -------------------------------------------------------------------------

def grad_underflow(facts: Facts) -> list[Finding]:
    """Warning: many more exactly-zero gradient elements at low scale than at normal scale."""
    layers = facts.layers
    if not facts.fp16 or not len(layers):
        return []
    trainable = set(facts.tensors.loc[(facts.tensors["kind"] == "param")
                                      & (facts.tensors["trainable"].fillna(1) == 1), "name"])
    rows = layers[layers["name"].isin(trainable) & (layers["step"] <= facts.healthy_end)
                  & np.isfinite(layers["grad_amax"].astype(float)) & layers["grad_zero_frac"].notna()].copy()
    if facts.warmup:
        rows = rows[rows["step"] > facts.warmup.last]
    if not len(rows):
        return []
    scale = rows["step"].map(facts.scale_at()).fillna(1.0) if facts.scaling else 1.0
    rows["scaled"] = rows["grad_amax"].astype(float) * scale
    rows["low"] = rows["scaled"] < UNDERFLOW_SCALED_AMAX
    hits = []
    for name, g in rows.groupby("name", sort=False):
        low, normal = g[g["low"]], g[~g["low"]]
        if not len(low):
            continue
        frac = float(low["grad_zero_frac"].median())
        base = float(normal["grad_zero_frac"].median()) if len(normal) else 0.0
        if frac >= UNDERFLOW_MIN_FRAC and frac - base >= UNDERFLOW_EXCESS:
            hits.append((frac - base, name, frac, base, low, len(normal) > 0))
    if not hits:
        return []
    hits.sort(key=lambda h: -h[0])
    _, name, frac, base, low, has_base = hits[0]
    first, last = int(low["step"].min()), int(low["step"].max())
    others = ", ".join(h[1] for h in hits[1:4])
    scale_txt = num(float(facts.scale_at()[first])) if facts.scaling else "1 (no scaler)"
    return [_finding(
        facts, "grad-underflow", "warning",
        f"Gradients underflow to zero at low loss scale ({len(hits)} parameter(s), worst {name})",
        first, last,
        f"{name}: {frac:.0%} of gradient elements exactly zero at low scale (median over {len(low)} "
        f"recorded steps, scale {scale_txt} at step {first:,}) against "
        + (f"{base:.0%} at normal scale" if has_base else "no step at a normal scale to compare with")
        + (f"; also {others}" if others else ""),
        ("Use a GradScaler (torch.amp.GradScaler) so gradients are scaled into fp16's range."
         if not facts.scaling else
         "Raise the loss scale: init_scale=2**16 and the default growth_interval=2000; if the scale "
         "collapsed first, fix that overflow (see scale-collapse)."))]


def _leaf_modules(facts: Facts) -> set[str]:
    """Modules without children that do not compute in fp32 under autocast."""
    mods = facts.tensors[facts.tensors["kind"] == "module"]
    parents = {n.rsplit(".", 1)[0] for n in mods["name"] if "." in n}
    return {n for n, t in zip(mods["name"], mods["type"])
            if n not in parents and n != "<model>" and t not in FP32_MODULE_TYPES}


def activation_headroom(facts: Facts) -> list[Finding]:
    """Warning: a leaf module's fp16 activations within HEADROOM_FACTOR of 65504, sustained."""
    mods = facts.modules
    if not facts.fp16 or not len(mods):
        return []
    leaves = _leaf_modules(facts)
    fwd = mods[(mods["phase"] == "forward") & mods["module"].isin(leaves) & ~mods["nonfinite"]
               & (mods["step"] <= facts.healthy_end)]
    limit = FP16_MAX / HEADROOM_FACTOR
    hits = []
    for name, g in fwd.groupby("module", sort=False):
        near = (g["amax"].astype(float) >= limit).to_numpy()
        best, cur, start, best_start = 0, 0, 0, 0
        for i, flag in enumerate(near):
            cur = cur + 1 if flag else 0
            if cur == 1:
                start = i
            if cur > best:
                best, best_start = cur, start
        if best >= HEADROOM_MIN_ROWS:
            rows = g.iloc[best_start:best_start + best]
            hits.append((float(rows["amax"].max()), name, rows))
    if not hits:
        return []
    hits.sort(key=lambda h: -h[0])
    peak, name, rows = hits[0]
    first, last = int(rows["step"].iloc[0]), int(rows["step"].iloc[-1])
    others = ", ".join(h[1] for h in hits[1:4])
    return [_finding(
        facts, "activation-headroom", "warning",
        f"Activations of {name} are within {FP16_MAX / peak:.1f}x of the fp16 limit",
        first, last,
        f"max |output| of {name} up to {num(round(peak))} against fp16's 65,504 on {len(rows)} recorded "
        f"steps in a row ({span(first, last)})" + (f"; also {others}" if others else ""),
        f"{name} will overflow to inf with a little more growth: keep it in fp32 (autocast disabled for "
        f"it), switch to bf16 autocast, or rescale it (a normalization before it, smaller init or "
        f"weight decay on the layer feeding it).")]


# -- non-finite values, outliers, divergence ---------------------------------------------------------

def _serious_events(facts: Facts) -> pd.DataFrame:
    """Events the scaler cannot absorb: forward/loss ones anywhere, gradient ones without a scaler or
    at a scale <= 1 (a scaled gradient overflow at a normal scale is the scaler's everyday job)."""
    ev = facts.events
    if not len(ev):
        return ev
    if facts.warmup:
        ev = ev[~ev["step"].isin(facts.warmup.skips)]
    fwd = (ev["phase"] == "forward") & ev["origin"]
    loss = ev["phase"] == "loss"
    grad = ((ev["phase"] == "backward") & ev["origin"]) | (ev["phase"] == "param_grad")
    if facts.scaling:
        grad &= ev["step"].map(facts.scale_at()).fillna(np.inf) <= 1.0
    return ev[fwd | loss | grad]


_PHASE_RANK = {"forward": 0, "backward": 1, "loss": 2, "param_grad": 3}

# A parameter whose norm grew 10x between two recorded steps did not get there by training (Adam
# moves each weight by ~lr per step; SGD by lr x grad): it was overwritten (a bad load, a corrupted
# update, an in-place bug). Healthy runs change parameter norms by a few percent per recorded step.
WEIGHT_JUMP = 10.0


def weight_jump(facts: Facts, module: str, step: int) -> Optional[tuple[str, float, float, int, int]]:
    """The parameter of ``module`` whose norm jumped >= WEIGHT_JUMP x (or became NaN/inf) by
    ``step``: (name, before, after, step before, step after), from the recorded parameter norms.
    Norms are measured before the optimizer step, so a NaN update at ``step`` does not count."""
    layers = facts.layers
    if not len(layers) or module in ("loss", "<model>"):
        return None
    # grad_zero_frac is present exactly when the step's detail (and so param_norm) was measured:
    # a missing norm must not read as a NaN one.
    rows = layers[layers["name"].str.startswith(module + ".") & (layers["step"] <= step)
                  & layers["grad_zero_frac"].notna()]
    for name, g in rows.groupby("name"):
        if len(g) >= 2:
            before, after = (float(g["param_norm"].iloc[i]) for i in (-2, -1))
            if before > 0 and math.isfinite(before) and not after < WEIGHT_JUMP * before:
                return name, before, after, int(g["step"].iloc[-2]), int(g["step"].iloc[-1])
    return None


def jump_text(jump: tuple[str, float, float, int, int]) -> str:
    name, before, after, s0, s1 = jump
    norms = f"{num(before)} -> {num(after)}"
    if not math.isfinite(after):
        return f"the weights of {name} became non-finite between steps {s0:,} and {s1:,} (norm {norms})"
    return f"the norm of {name} jumped {after / before:.3g}x between steps {s0:,} and {s1:,} ({norms})"


def origin_advice(facts: Facts, module: str, phase: str, step: int, kind: str = "inf") -> tuple[str, str]:
    """(extra evidence, advice) for an overflow born in ``module``/``phase`` at ``step``: an
    overwritten weight if the recorded norms show one, else the fix for that kind of origin."""
    jumped = weight_jump(facts, module, step)
    if jumped:
        return (f"; {jump_text(jumped)}",
                f"{jumped[0]} changed far more than training moves weights: something overwrote it (a bad "
                f"checkpoint load, an in-place bug, a corrupted update). Restore it from a checkpoint before "
                f"step {jumped[3]:,} and find what wrote it")
    if phase == "loss" and not facts.info.get("localize"):
        return "", ("Recorded with localize=False, so the loss is the first place this run sees it: record with "
                    "localize=True to find the module where it is born, and compute the loss in fp32")
    if phase == "forward" and kind == "nan":
        return "", (f"An operation inside {module} made NaN from finite inputs (0/0, inf-inf, log or sqrt of a "
                    f"negative): guard it with an eps or compute it in fp32")
    advice = fix_for_origin(module, phase)
    return "", advice[0].upper() + advice[1:]


def nonfinite_origin(facts: Facts) -> list[Finding]:
    """Error: the first step where NaN/Inf was born (outside warm-up): module, phase, kind."""
    ev = _serious_events(facts)
    if not len(ev):
        return []
    first = int(ev["step"].min())
    at_first = ev[ev["step"] == first].copy()
    at_first["rank"] = at_first["phase"].map(_PHASE_RANK)
    e = at_first.sort_values(["rank"]).iloc[0]
    module, phase = e["module"], e["phase"]
    bad_steps = sorted(set(int(s) for s in ev["step"]))
    same = ev[(ev["module"] == module) & (ev["phase"] == phase)]["step"].nunique()
    label = facts.module_label(module)
    what = {"forward": f"the forward output of {label}", "backward": f"the gradient {label} passes back",
            "loss": "the loss", "param_grad": f"the gradient of parameter {module}"}[phase]
    count = f"{int(e['count']):,} " if pd.notna(e["count"]) else ""
    dtype = f", {e['dtype']}" if isinstance(e["dtype"], str) else ""
    extra, advice = origin_advice(facts, module, phase, first, e["kind"])
    evidence = (f"step {first:,}: {what} holds {count}{e['kind']} value(s){dtype}"
                + (" while its inputs were finite" if e["origin"] else "")
                + f"; non-finite values at {len(bad_steps):,} step(s) ({span(bad_steps[0], bad_steps[-1])}),"
                  f" {same:,} of them born in the same place" + extra)
    kind = {"nan": "NaN", "inf": "Inf"}.get(e["kind"], "NaN/Inf")
    cls = facts.module_type(module)
    title = (f"Loss became {kind} at step {first:,}" if phase == "loss" else
             f"{kind} born in {module} ({cls + ', ' if cls else ''}{phase}) at step {first:,}")
    return [_finding(facts, "nonfinite-origin", "error", title, first, bad_steps[-1], evidence, advice + ".",
                     jump=facts.jump(first, first))]


def _outliers(steps: pd.Series, values: pd.Series, z: float, ratio: float, over_max: float) -> list[tuple]:
    """(step, value, median, ratio) of robust upward outliers against the previous OUTLIER_WINDOW.

    The spread is the trailing median of each point's absolute deviation from its own trailing
    median: a rolling-window MAD that pandas computes in C (a per-window MAD would be a Python loop).
    """
    v = pd.Series(values.to_numpy(dtype=float))
    med = v.rolling(OUTLIER_WINDOW, min_periods=OUTLIER_MIN_HISTORY).median().shift(1)
    mad = (v - med).abs().rolling(OUTLIER_WINDOW, min_periods=OUTLIER_MIN_HISTORY).median().shift(1) * 1.4826
    spread = np.maximum(mad.to_numpy(), 1e-12)
    m = med.to_numpy()
    zscore = (v.to_numpy() - m) / spread
    peak = v.rolling(OUTLIER_WINDOW, min_periods=OUTLIER_MIN_HISTORY).max().shift(1).to_numpy()
    x = v.to_numpy()
    # Ratios only mean something for positive series (a loss can be negative): then z alone, doubled.
    guard = np.where(m > 0, (x >= ratio * m) & (x >= over_max * peak), zscore >= 2 * z)
    hits = np.flatnonzero((zscore >= z) & guard & np.isfinite(m))
    s = steps.to_numpy()
    return [(int(s[i]), float(v[i]), float(m[i]), float(v[i] / m[i]) if m[i] > 0 else math.inf) for i in hits]


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
    parts = [f"step {p[0]:,}: {num(p[1])} vs median {num(p[2])} of the previous {OUTLIER_WINDOW} "
             f"({p[3]:.3g}x), {_aftermath(facts, p[0])}" for p in peaks[:5]]
    more = f"; and {len(peaks) - 5} more" if len(peaks) > 5 else ""
    title = (f"{label} {'spiked' if id == 'loss-spike' else 'exploded'} {len(peaks)} time(s): up to "
             f"{worst[3]:.3g}x the recent median (step {worst[0]:,})")
    return [_finding(facts, id, "warning", title, hits[0][0], hits[-1][0], "; ".join(parts) + more, advice,
                     jump=facts.jump(worst[0], worst[0]))]


def loss_spike(facts: Facts) -> list[Finding]:
    """Warning: loss values far above the median of the previous steps (median/MAD)."""
    s = facts.steps[facts.steps["step"] <= facts.healthy_end]
    s = s[np.isfinite(s["loss"].astype(float))]
    hits = _outliers(s["step"], s["loss"], **LOSS_SPIKE)
    clip = facts.info.get("config", {}).get("max_grad_norm")
    advice = ("Look at the batches of these steps (corrupt or outlier samples, a data-loader bug); "
              "a lower learning rate or a longer warm-up helps"
              + (f"; gradients are clipped at max_norm={clip}, which bounds the damage." if clip else
                 "; clip gradients (scaler.unscale_(opt); clip_grad_norm_(params, 1.0)) to bound the damage."))
    return _outlier_finding(facts, "loss-spike", "Loss", hits, advice)


def grad_norm_explosion(facts: Facts) -> list[Finding]:
    """Warning: gradient norms (unscaled, before clipping) far above their recent median."""
    s = facts.steps[(facts.steps["step"] <= facts.healthy_end) & ~facts.steps["skipped"]]
    s = s[np.isfinite(s["grad_norm"].astype(float))]
    hits = _outliers(s["step"], s["grad_norm"], **GRAD_SPIKE)
    median = float(s["grad_norm"].median()) if len(s) else float("nan")
    clip = facts.info.get("config", {}).get("max_grad_norm")
    advice = (f"Clip gradients after unscaling: scaler.unscale_(optimizer); "
              f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={2 * median:.2g}) (2x the run's "
              f"median norm {median:.3g})" + (f"; the configured max_grad_norm={clip} already bounds the update"
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
        return [_finding(facts, "divergence", "error",
                         f"Training diverged at step {onset:,}: the loss is {kinds} to the end", onset, end, evidence,
                         f"The run does not recover by itself: {restart}{fix}.", jump=facts.jump(onset, onset, pad=20))]
    rising = _rising_loss(facts)
    if rising is None:
        return []
    onset, evidence = rising
    return [_finding(facts, "divergence", "error",
                     f"Training is diverging: the loss has been rising since step {onset:,}", onset, end, evidence,
                     "Lower the learning rate (halve it), check the learning-rate schedule at that step and "
                     "clip gradients (max_norm=1.0); resume from a checkpoint before it.")]


# -- misuse ------------------------------------------------------------------------------------------

def misuse_config(facts: Facts) -> list[Finding]:
    """Scaler with bf16 (unnecessary), fp16 without a scaler, a scaler without autocast."""
    info, out = facts.info, []
    if not len(facts.steps):
        return [_finding(facts, "no-steps", "info", "No optimizer steps were recorded", 0, 0,
                         "the steps table is empty",
                         "With a GradScaler a step is counted at scaler.update(); without one at optimizer.step(). "
                         "Check the loop calls them, or that the run has started.", jump=(0, 0))]
    first, last = facts.first_step, facts.last_step
    dtype, scaler = info.get("amp_dtype"), info.get("scaler_enabled")
    if scaler and dtype == "bfloat16":
        skipped = int(facts.steps["skipped"].sum())
        out.append(_finding(facts, "misuse-scaler-bf16", "warning",
                            "GradScaler used with bfloat16 autocast: not needed", first, last,
                            f"amp_dtype=bfloat16 with an enabled GradScaler; {skipped:,} step(s) skipped",
                            "bf16 has fp32's exponent range, so loss scaling buys nothing and costs skipped steps: "
                            "drop the scaler (loss.backward(); optimizer.step()) or GradScaler(enabled=False).",
                            jump=(first, last)))
    if dtype == "float16" and not scaler:
        out.append(_finding(facts, "misuse-fp16-no-scaler", "warning", "fp16 autocast without a GradScaler",
                            first, last, "amp_dtype=float16 and no enabled GradScaler",
                            "Small gradients underflow to zero in fp16: use scaler = torch.amp.GradScaler(device); "
                            "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update() "
                            "(or bf16 autocast).",
                            jump=(first, last)))
    if scaler and not dtype:
        out.append(_finding(facts, "misuse-scaler-no-autocast", "info", "GradScaler enabled but no autocast was seen",
                            first, last, "no autocast region was active at the model's first forward",
                            "In fp32 a GradScaler is not needed; if you meant mixed precision, wrap the forward in "
                            "torch.autocast(device_type, dtype=torch.float16).", jump=(first, last)))
    return out


def misuse_clip_scaled(facts: Facts) -> list[Finding]:
    """Warning: a logged gradient norm equals scale x the true norm: clipping before unscale_."""
    m = facts.metrics
    if not facts.scaling or not len(m):
        return []
    if len(facts.notices) and (facts.notices["code"] == "clip-before-unscale").any():
        return []  # the recorder saw it directly: misuse_notices reports it, once
    s = facts.steps[~facts.steps["skipped"]].set_index("step")
    out = []
    for key, g in m[m["key"].str.contains("norm", case=False)].groupby("key"):
        g = g[g["step"].isin(s.index)]
        scale, true = g["step"].map(s["loss_scale"]).astype(float), g["step"].map(s["grad_norm"]).astype(float)
        ok = (scale >= CLIP_MIN_SCALE) & np.isfinite(true) & (true > 0) & np.isfinite(g["value"])
        ratio = (g["value"] / (true * scale))[ok]
        if len(ratio) < CLIP_MIN_STEPS:
            continue
        inside = ratio.between(*CLIP_RATIO_BAND).mean()
        if inside >= 0.5:
            steps = g.loc[ok, "step"]
            clip = facts.info.get("config", {}).get("max_grad_norm")
            out.append(_finding(
                facts, "misuse-clip-scaled", "warning", "Gradients were clipped while still scaled",
                int(steps.min()), int(steps.max()),
                f"logged '{key}' is {ratio.median():.3g} x scale x the true gradient norm on {inside:.0%} of "
                f"{len(ratio):,} steps (e.g. {num(float(g.loc[ok, 'value'].iloc[0]))} at scale "
                f"{num(float(scale[ok].iloc[0]))}, true norm {num(float(true[ok].iloc[0]))})",
                "Call scaler.unscale_(optimizer) before torch.nn.utils.clip_grad_norm_: on scaled gradients "
                f"max_norm{'=' + str(clip) if clip else ''} clips scale-times too hard and training barely moves."))
    return out


def misuse_notices(facts: Facts) -> list[Finding]:
    """Warnings for misuse the recorder noticed while recording (notices table)."""
    n = facts.notices
    if not len(n):
        return []
    advice = {"step-without-update": "Call scaler.update() once after every scaler.step(optimizer); without it "
                                     "the scale never adapts and the scaler refuses the next step.",
              "clip-before-unscale": "Call scaler.unscale_(optimizer) before torch.nn.utils.clip_grad_norm_: on "
                                     "scaled gradients max_norm clips scale-times too hard."}
    out = []
    for code, g in n.groupby("code", sort=False):
        steps = [int(x) for x in g["step"].dropna()] or [facts.first_step]
        out.append(_finding(facts, f"misuse-{code}", "warning", str(g["message"].iloc[0]), min(steps), max(steps),
                            f"recorder notice '{code}' at {len(g):,} step(s): {span(min(steps), max(steps))}",
                            advice.get(code, "See the message: the recorder saw the training loop use the scaler "
                                             "in an unexpected order."), jump=facts.jump(min(steps), max(steps))))
    return out


# Report order within one severity and step (the sort is stable): root causes before consequences.
RULES: list[Callable[[Facts], list[Finding]]] = [
    warmup_skips, nonfinite_origin, divergence, scale_collapse, recurring_overflow, scale_stuck_low,
    grad_underflow, activation_headroom, loss_spike, grad_norm_explosion, misuse_config, misuse_clip_scaled,
    misuse_notices,
]
