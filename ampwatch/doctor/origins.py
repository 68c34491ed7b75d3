"""Where an overflow or NaN was born, said in words, with the fix for that kind of origin."""
from __future__ import annotations

import math
from typing import Optional

import pandas as pd

from .finding import DTYPE_MAX, FP16_MAX, num
from .facts import Facts

# A parameter whose norm grew 10x between two recorded steps did not get there by training (Adam
# moves each weight by ~lr per step; SGD by lr x grad): it was overwritten (a bad load, a corrupted
# update, an in-place bug). Healthy runs change parameter norms by a few percent per recorded step.
WEIGHT_JUMP = 10.0


# Modules whose forward is a matrix product or a lookup: an fp16 overflow inside them (products or
# sums beyond 65504 become inf, and inf - inf in the next sum makes NaN) is the usual way they make
# NaN from finite inputs.
MATMUL_TYPES = ("Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
                "ConvTranspose3d", "Conv1D", "MultiheadAttention")  # also subclasses named ...Linear
LOOKUP_TYPES = ("Embedding", "EmbeddingBag")


def is_matmul(cls: str) -> bool:
    return cls.endswith(MATMUL_TYPES) or cls in LOOKUP_TYPES


def undecided_nan_advice(facts: Facts, module: str, dtype: str) -> str:
    """Advice for NaN born in a forward without an fp32 verdict (none was recorded, or the recompute
    did not reproduce it): the cause is not known, so the candidates, overflow first for a matmul."""
    limit = num(DTYPE_MAX.get(dtype, FP16_MAX))
    fix = "keep it in fp32 or use bf16 autocast" if dtype == "float16" else "find what made its inputs or weights grow"
    overflow = (f"an overflow: a product or sum inside {module} beyond {dtype}'s {limit} becomes inf, and inf - inf "
                f"makes NaN ({fix})")
    op = "an operation that makes NaN from finite inputs (0/0, log or sqrt of a negative: guard it with an eps)"
    cls = facts.module_type(module) or ""
    if is_matmul(cls):
        return (f"Cause undetermined (no fp32 verdict for this step). {module} is a {cls}, so the likely cause is "
                f"{overflow}; check the size of its inputs and weights at this step. Otherwise: {op}")
    return f"Cause undetermined (no fp32 verdict for this step): either {overflow}, or {op}"


def place(module: str, phase: str) -> str:
    """``h.0.mlp.fc (forward)``, or ``the loss``."""
    return "the loss" if phase == "loss" else f"{module} ({phase})"


def describe_origins(origins: pd.DataFrame, limit: int = 3) -> str:
    parts = [f"{place(r.module, r.phase)} at {r.n:,} step{'s' if r.n != 1 else ''}"
             for r in origins.head(limit).itertuples()]
    return "; ".join(parts)


def fix_for_origin(module: str, phase: str) -> str:
    """Concrete advice for the module/phase where the overflow is born."""
    if phase == "forward":
        return (f"keep {module} in fp32: run it under torch.autocast(device_type, enabled=False) with its "
                f"input cast by .float(), or use bf16 autocast; or find what made its inputs or weights grow")
    if phase == "loss":
        return "compute the loss in fp32 (logits.float()) and guard logs/divisions with an eps"
    if phase == "param_grad":
        return f"look at what feeds {module}'s gradient (its module's backward) and keep that module in fp32"
    return (f"the backward of {module} overflows: keep {module} in fp32, or guard the operation whose "
            f"derivative is unbounded (sqrt/pow/div at 0) with an eps")


def weight_jump(facts: Facts, module: str, step: int) -> Optional[tuple[str, float, float, int, int]]:
    """The parameter of ``module`` whose norm jumped >= WEIGHT_JUMP x (or became NaN/inf) by
    ``step``: (name, before, after, step before, step after), from the recorded parameter norms.
    Norms are measured before the optimizer step, so a NaN update at ``step`` does not count."""
    if module in ("loss", "<model>"):
        return None
    norms = facts.last_param_norms(module + ".", step)
    for name in sorted(norms):
        if len(norms[name]) >= 2:
            (s0, before), (s1, after) = norms[name]
            if before > 0 and math.isfinite(before) and not after < WEIGHT_JUMP * before:
                return name, before, after, s0, s1
    return None


def jump_text(jump: tuple[str, float, float, int, int]) -> str:
    name, before, after, s0, s1 = jump
    norms = f"{num(before)} -> {num(after)}"
    if not math.isfinite(after):
        return f"the weights of {name} became non-finite between steps {s0:,} and {s1:,} (norm {norms})"
    return f"the norm of {name} jumped {after / before:.3g}x between steps {s0:,} and {s1:,} ({norms})"


def restore_text(facts: Facts, jump: tuple[str, float, float, int, int], step: int) -> str:
    """Which checkpoint holds the weight before it was overwritten, and what that bound rests on."""
    name, _, _, s0, _ = jump
    good = facts.last_good_step(step)
    measured = f"its norm was last measured normal at step {s0:,}"
    if good is None or good <= s0:
        return f"Restore it from a checkpoint saved at step {s0:,} or before ({measured})"
    return (f"Restore it from a checkpoint saved by the end of step {good:,} (the last step before step {step:,} "
            f"with a finite loss and an applied update; {measured})")


def origin_advice(facts: Facts, module: str, phase: str, step: int, kind: str = "inf",
                  dtype: str = "float16") -> tuple[str, str]:
    """(extra evidence, advice) for an overflow born in ``module``/``phase`` at ``step``: an
    overwritten weight if the recorded norms show one, else the fix for that kind of origin (for NaN
    born in a forward, the candidates: without an fp32 verdict its cause is not known)."""
    jumped = weight_jump(facts, module, step)
    if jumped:
        return (f"; {jump_text(jumped)}",
                f"{jumped[0]} changed far more than training moves weights: something overwrote it (a bad "
                f"checkpoint load, an in-place bug, a corrupted update). {restore_text(facts, jumped, step)} "
                f"and find what wrote it")
    why = facts.unlocalized(step) if phase == "loss" else None
    if why is not None and not facts.info.get("localize"):
        return "", ("Recorded with localize=False, so the loss is the first place this run sees it: record with "
                    "localize=True to find the module where it is born, and compute the loss in fp32")
    if why is not None:
        return (f"; step {step:,} was not localized: {why}",
                f"Where it was born is unknown: step {step:,} was not localized, so the loss is only the "
                f"first place this run sees it, not evidence that the loss computation is at fault. "
                + ("Later bad steps are localized live (module values are measured on every step after it); to "
                   "observe every step from the start, attach with replay=False" if "replay" in why else
                   "If it recurs, a localized bad step (one with module values) names the place"))
    if phase == "forward" and "nan" in str(kind):  # NaN, or NaN and inf
        return "", undecided_nan_advice(facts, module, dtype)
    advice = fix_for_origin(module, phase)
    return "", advice[0].upper() + advice[1:]
