"""Where an overflow or NaN was born, said in words, with the fix for that kind of origin."""
from __future__ import annotations

import math
from typing import Optional

import pandas as pd

from .finding import num
from .facts import Facts

# A parameter whose norm grew 10x between two recorded steps did not get there by training (Adam
# moves each weight by ~lr per step; SGD by lr x grad): it was overwritten (a bad load, a corrupted
# update, an in-place bug). Healthy runs change parameter norms by a few percent per recorded step.
WEIGHT_JUMP = 10.0


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
