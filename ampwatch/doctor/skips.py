"""Every skipped step, explained: warm-up, the scaler probing its ceiling, an overflow that keeps
coming back from one origin, or a lone skip at a high scale (docs/doctor.md, "Skipped steps").

Each skip after warm-up gets one origin from its events, in this order: the forward origin, the
loss, the backward origin (for a container's own code, with the child the gradient went into), the
parameters whose gradients overflowed (a weight-gradient overflow), else none recorded.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from .facts import Facts
from .finding import Finding, counted, num, num_range, pct
from .origins import origin_advice, overwrite_advice, weight_jump
from .warmup import SCALE_FREE_PHASES

# Recurring overflow: GradScaler's defaults (growth_interval=2000) allow one probing skip per ~2000
# steps (0.05%). 2% is 40x that, and means 2% of the batches are thrown away; below 3 skips there is
# no pattern to speak of, below 50 steps no rate. A quarter of all steps skipped is an error:
# training is visibly slower and something is wrong every few steps.
SKIP_RATE_WARN = 0.02
SKIP_RATE_ERROR = 0.25
SKIP_MIN_COUNT = 3
SKIP_MIN_STEPS = 50

# The same origin behind 5+ skips that did not follow a growth of the scale: the gradients fitted
# at that scale before, and every skip halves it (5 skips: 32x), so they come back only when
# something keeps producing inf. A healthy run's early gradient growth costs a few such skips from
# one weight gradient (3 on the overflow_storm sample's steps 6-12, before its fault).
SAME_ORIGIN_MIN = 5

# Probing: each growth of the scale may overflow once (the scaler finds its ceiling). At the default
# growth_interval=2000 that is <= 0.05% of steps; 1% of steps thrown away this way (growth_interval
# <= ~100) is worth a line of config.
PROBE_RATE_WARN = 0.01

_KEY = ["phase", "module"]


def _skip_origin(ev: pd.DataFrame) -> tuple[str, str, Optional[str]]:
    """(phase, module, flows_into) explaining one skipped step from its events."""
    def origin_row(phase: str) -> pd.DataFrame:
        return ev[(ev["phase"] == phase) & ev["origin"]]
    if len(origin_row("input")):  # the batch brought it: no module, and not the scale
        return "input", "<model>", None
    fwd = origin_row("forward")
    if not len(fwd) and (ev["phase"] == "loss").any():
        return "loss", "loss", None
    for row, phase in ((fwd, "forward"), (origin_row("backward"), "backward")):
        if len(row):
            into = row["flows_into"].iloc[0]
            return phase, str(row["module"].iloc[0]), into if isinstance(into, str) else None
    params = sorted(ev.loc[ev["phase"] == "param_grad", "module"])
    if params:
        return "param_grad", ", ".join(params[:3]) + (f" (+{len(params) - 3})" if len(params) > 3 else ""), None
    return "none", "", None


def origin_label(phase: str, module: str, into: Optional[str] = None) -> str:
    if phase == "none":
        return "no module recorded (localize=False)"
    if phase == "loss":
        return "the loss"
    if phase == "input":
        return "the model's input batch"
    if phase == "param_grad":
        return f"the weight gradient of {module}"
    if into:
        return f"{module}'s own code ({phase}), flowing into {into}"
    return f"{module} ({phase})"


def classify(facts: Facts) -> pd.DataFrame:
    """One row per skipped step after warm-up (before a diverged tail): step, scale, probe (the
    scale grew since the previous backoff), phase, module, into, label. Cached on ``facts``."""
    cached = getattr(facts, "_skips", None)
    if cached is not None:
        return cached
    steps = facts.after_warmup()
    rows = steps[steps["skipped"]]
    skips = rows["step"].to_numpy(dtype=np.int64)
    ev = facts.events
    ev = ev[ev["step"].isin(set(skips.tolist()))] if len(ev) else ev
    by_step = {int(k): g for k, g in ev.groupby("step")} if len(ev) else {}
    origins = [_skip_origin(by_step[s]) if s in by_step else ("none", "", None) for s in skips.tolist()]
    before = [facts.warmup.last + 1 if facts.warmup else facts.first_step] + [int(s) + 1 for s in skips[:-1]]
    grew = facts.scales(skips) > facts.scales(np.array(before, dtype=np.int64)) if len(skips) else np.zeros(0, bool)
    out = pd.DataFrame({"step": skips, "scale": facts.scales(skips),
                        "phase": [o[0] for o in origins], "module": [o[1] for o in origins],
                        "into": [o[2] for o in origins]})
    # A forward overflow (or a batch that brought one) is never a probe: the scale plays no part in it.
    out["probe"] = grew & ~out["phase"].isin(SCALE_FREE_PHASES).to_numpy()
    out["label"] = [origin_label(p, m, i) for p, m, i in zip(out["phase"], out["module"], out["into"])]
    facts._skips = out
    return out


def _recurring(facts: Facts) -> pd.DataFrame:
    """The skips of the recurring-overflow finding: non-probe, non-forward skips when one origin is
    behind SAME_ORIGIN_MIN+ of them or they exceed SKIP_RATE_WARN of the steps after warm-up."""
    k = classify(facts)
    k = k[~k["probe"] & ~k["phase"].isin(["forward", "input"])]
    n = len(facts.after_warmup())
    if not len(k):
        return k
    counts = k.groupby(_KEY)["step"].transform("size")
    by_rate = n >= SKIP_MIN_STEPS and len(k) >= SKIP_MIN_COUNT and len(k) / n >= SKIP_RATE_WARN
    return k if by_rate else k[counts >= SAME_ORIGIN_MIN]


def _origins_text(k: pd.DataFrame, limit: int = 3) -> str:
    g = k.groupby("label", sort=False)["step"].agg(["size", "min"]).sort_values(["size", "min"], ascending=[False, True])
    parts = [f"{label} at {n:,} step{'s' if n != 1 else ''}" for label, (n, _) in g.head(limit).iterrows()]
    more = f"; {counted(len(g) - limit, 'other origin')}" if len(g) > limit else ""
    return "; ".join(parts) + more


def _steps_text(steps: list[int], limit: int = 12) -> str:
    """"step 7" or "steps 7, 9, 12, ..." (the first ``limit`` of them)."""
    shown = ", ".join(f"{s:,}" for s in steps[:limit]) + (", ..." if len(steps) > limit else "")
    return f"step {shown}" if len(steps) == 1 else f"steps {shown}"


def warmup_skips(facts: Facts) -> list[Finding]:
    """Info: the leading, back-to-back skips while the scale backs off from init_scale."""
    w = facts.warmup
    if w is None:
        return []
    from .scale import pow2
    ev = facts.events
    n_events = int(ev["step"].isin(w.skips).sum()) if len(ev) else 0
    if len(w.skips) == 1:
        title = f"Normal warm-up: step {w.last:,}, the first, skipped while the loss scale backed off"
        which = f"{_steps_text(w.skips)}, the first step, skipped"
    else:
        title = (f"Normal warm-up: {len(w.skips)} skipped steps in a row while the loss scale backed off, "
                 f"ended at step {w.last:,}")
        which = f"{_steps_text(w.skips)} skipped back to back from the first step"
    return [facts.finding(
        "warmup-skips", "info", title, w.first, w.last,
        f"{which}; scale {num(w.scale_from)} -> "
        f"{num(w.scale_to)}; {counted(n_events, 'gradient-overflow event')} in them are expected",
        _warmup_advice(w.first, pow2(w.scale_to)),
        jump=(w.first, min(facts.last_step, w.last + 5)))]


def _warmup_advice(first: int, fitted: str) -> str:
    if first > 0:  # numbered from first_step: a run resumed from a checkpoint
        return (f"This run starts at step {first:,}, resumed from a checkpoint: its GradScaler began at its "
                f"init_scale instead of the scale the run before had reached. Save scaler.state_dict() with "
                f"the checkpoint and restore it with scaler.load_state_dict() on resume: the resumed run then "
                f"skips no steps (or start at init_scale={fitted}).")
    return (f"Nothing to fix: GradScaler starts high and halves until the gradients fit. To skip the warm-up, "
            f"start at init_scale={fitted}.")


def scale_probing(facts: Facts) -> list[Finding]:
    """Info (warning when they waste >= PROBE_RATE_WARN of the steps): skips right after the scale grew."""
    k = classify(facts)
    probes = k[k["probe"]]
    if not len(probes):
        return []
    n = len(facts.after_warmup())
    gi = facts.info.get("growth_interval")
    many = len(probes) >= SKIP_MIN_COUNT and len(probes) / n >= PROBE_RATE_WARN
    steps = [int(s) for s in probes["step"]]
    evidence = (f"{len(probes):,} of {n:,} steps after warm-up ({pct(len(probes), n)}) skipped right after the scale "
                f"grew (growth_interval={gi}): {_steps_text(steps)}; overflow at {_origins_text(probes)}; "
                f"scale at those skips {num_range(probes['scale'].min(), probes['scale'].max())}")
    if many:
        advice = (f"The scaler grows the scale every {gi} clean steps and the next step overflows: raise growth_interval "
                  f"(2000 is the default) so fewer steps are thrown away; these overflows happen only at the grown scale.")
        title = f"The scaler's probing wastes {pct(len(probes), n)} of steps: growth_interval={gi} is too short"
    else:
        advice = "Nothing to fix: after each growth GradScaler may overflow once and back off (it finds its ceiling)."
        title = f"{counted(len(probes), 'skipped step')} right after the scale grew: the scaler probing its ceiling"
    return [facts.finding("scale-probing", "warning" if many else "info", title, steps[0], steps[-1], evidence, advice)]


def recurring_overflow(facts: Facts) -> list[Finding]:
    """Warning/error: skips that did not follow a growth keep coming back; names the origin."""
    k = _recurring(facts)
    if not len(k):
        return []
    n = len(facts.after_warmup())
    rate = len(k) / n if n else 1.0
    g = k.groupby(_KEY + ["label"], sort=False)["step"].agg(["size", "min"]).reset_index()
    top = g.sort_values(["size", "min"], ascending=[False, True]).iloc[0]
    steps = [int(s) for s in k["step"]]
    facts.claims["recurring-overflow"] = (top["module"], top["phase"])
    evidence = (f"{len(k):,} of {n:,} steps after warm-up skipped ({pct(len(k), n)}), none right after a growth of "
                f"the scale: {_steps_text(steps)}; overflow born in {_origins_text(k)}")
    if top["phase"] in ("none",):
        advice = "Turn localization on (ampwatch.attach(..., localize=True)) to see which module overflows."
    else:
        module = top["module"].split(",")[0] if top["phase"] == "param_grad" else top["module"]
        extra, advice = origin_advice(facts, module, top["phase"], steps[0])
        evidence += extra
        advice += "."
    return [facts.finding("recurring-overflow", "error" if rate >= SKIP_RATE_ERROR else "warning",
                          f"Overflow keeps coming back from {top['label']}: {counted(len(k), 'skipped step')} after "
                          f"clean steps", steps[0], steps[-1], evidence, advice)]


def lone_skips(facts: Facts) -> list[Finding]:
    """Info: the remaining skips after warm-up (not probes, not recurring, not a forward origin):
    gradients that overflowed once at the scale they carried."""
    k = classify(facts)
    taken = set(_recurring(facts)["step"])
    # a forward, an input batch or a loss that went non-finite is not the scale's doing: nonfinite-origin
    rest = k[~k["probe"] & ~k["phase"].isin(SCALE_FREE_PHASES) & ~k["step"].isin(taken)]
    if not len(rest):
        return []
    steps = [int(s) for s in rest["step"]]
    evidence = (f"{_steps_text(steps)} (scale {num(rest['scale'].max())} at the highest); overflow at "
                f"{_origins_text(rest)}; none right after a growth of the scale; the scaler halved the scale each time")
    first = rest.iloc[0]
    # rare skips are nothing to fix, unless a weight was overwritten before them: the overflows follow from it
    jumped = weight_jump(facts, str(first["module"]).split(",")[0], steps[0], str(first["phase"]))
    if jumped:
        extra, advice = overwrite_advice(facts, jumped, steps[0])
        return [facts.finding(
            "late-skips", "warning",
            f"{counted(len(steps), 'isolated skipped step')} after warm-up, after {jumped[0]} changed far more than "
            f"training moves it", steps[0], steps[-1], evidence + extra, advice + ".")]
    return [facts.finding(
        "late-skips", "info",
        f"{counted(len(steps), 'isolated skipped step')} after warm-up: gradients overflowed at the scale they carried",
        steps[0], steps[-1], evidence,
        "Nothing to fix while they stay rare: the gradients grew past what this scale leaves room for and "
        "GradScaler backed off. If they recur from the same place, that place is reported as a warning.")]


__all__ = ["classify", "warmup_skips", "scale_probing", "recurring_overflow", "lone_skips", "origin_label",
           "SKIP_RATE_WARN", "SKIP_RATE_ERROR", "SKIP_MIN_COUNT", "SKIP_MIN_STEPS", "SAME_ORIGIN_MIN",
           "PROBE_RATE_WARN"]
