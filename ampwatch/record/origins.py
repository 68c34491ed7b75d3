"""Which module is the origin of a non-finite value: pure Python over one step's slot values.

Runs in the writer thread. Input: per slot (see :mod:`.observe`) the min/max per dtype, the learned
input aliases, the learned forward order, and, where reads were free, exact NaN/inf counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .observe import DTYPE_NAMES, GIN, GOUT, IN, OUT, ROLES

FORWARD, BACKWARD = "forward", "backward"


@dataclass
class SlotValue:
    lo: float
    hi: float
    dtype: str
    nan: Optional[float] = None  # exact counts where they were paid for (free host reads), else None
    inf: Optional[float] = None

    @property
    def bad(self) -> bool:
        return not (math.isfinite(self.lo) and math.isfinite(self.hi))

    @property
    def amax(self) -> float:
        if math.isnan(self.lo) or math.isnan(self.hi):
            return math.nan
        return max(-self.lo, self.hi)


@dataclass
class ModuleStat:
    amax: float = 0.0
    nonfinite: bool = False
    nan: Optional[float] = 0.0
    inf: Optional[float] = 0.0
    dtype: str = ""
    kind_nan: bool = False  # a NaN was seen (from the min/max when counts are unknown)


def slot_values(per_dtype: list[list[tuple[float, float]]], counts: dict[int, list[float]],
                exact: bool) -> dict[int, SlotValue]:
    """Written slots only (an unwritten slot reads min=+inf, max=-inf), dtypes folded together."""
    out: dict[int, SlotValue] = {}
    for d, rows in enumerate(per_dtype):
        for slot, (lo, hi) in enumerate(rows):
            if lo == math.inf and hi == -math.inf:
                continue
            prev = out.get(slot)
            if prev is None:
                c = counts.get(slot) if exact else None
                out[slot] = SlotValue(lo, hi, DTYPE_NAMES[d], *(c or ((0.0, 0.0) if exact else (None, None))))
            else:  # the same role seen in two dtypes: keep the extremes, name the lower precision
                prev.lo = lo if lo != lo or lo < prev.lo else prev.lo
                prev.hi = hi if hi != hi or hi > prev.hi else prev.hi
                prev.dtype = DTYPE_NAMES[d]
    return out


def any_nonfinite(values: dict[int, SlotValue]) -> bool:
    return any(v.bad for v in values.values())


def _fold(values: dict[int, SlotValue], slots: list[int]) -> Optional[SlotValue]:
    present = [values[s] for s in slots if s in values]
    if not present:
        return None
    folded = SlotValue(present[0].lo, present[0].hi, present[0].dtype, present[0].nan, present[0].inf)
    for v in present[1:]:
        folded.lo = v.lo if v.lo != v.lo or v.lo < folded.lo else folded.lo
        folded.hi = v.hi if v.hi != v.hi or v.hi > folded.hi else folded.hi
        if folded.nan is not None and v.nan is not None:
            folded.nan += v.nan
            folded.inf += v.inf  # type: ignore[operator]
        if v.bad and not present[0].bad:
            folded.dtype = v.dtype
    return folded


def _role_slots(modules: int, aliases: dict[tuple[int, int, int], int]) -> tuple[list[list[int]], list[list[int]]]:
    """Per module, the slots holding its inputs and its input gradients (own slot plus aliases)."""
    ins = [[ROLES * m + IN] for m in range(modules)]
    gins = [[ROLES * m + GIN] for m in range(modules)]
    for (m, _call, _pos), slot in aliases.items():
        if slot not in ins[m]:
            ins[m].append(slot)
            gins[m].append(slot + (GIN - IN))  # IN->GIN and OUT->GOUT are both +2
    return ins, gins


def _stat(value: SlotValue) -> ModuleStat:
    return ModuleStat(amax=value.amax, nonfinite=value.bad, nan=value.nan, inf=value.inf,
                      dtype=value.dtype, kind_nan=math.isnan(value.lo) or math.isnan(value.hi))


def _pick(candidates: list[int], names: list[str], rank: dict[int, int], last: bool) -> Optional[int]:
    """The innermost candidate (a child beats its container); among unrelated ones, the first to run
    (forward: first in finish order; backward: gradients flow in reverse, so the last)."""
    if not candidates:
        return None
    def inside(child: str, parent: str) -> bool:
        return parent == "<model>" and child != parent or child.startswith(parent + ".")
    inner = [c for c in candidates if not any(o != c and inside(names[o], names[c]) for o in candidates)]
    order = sorted(inner, key=lambda m: rank.get(m, m))
    return order[-1] if last else order[0]


def analyse(values: dict[int, SlotValue], aliases: dict, order: Optional[list[int]],
            names: list[str]) -> tuple[dict[tuple[int, str], ModuleStat], dict[str, Optional[int]]]:
    """Per (module, phase) statistics and the origin module of each phase (or None).

    Forward: a module whose output is non-finite while its inputs were finite. Backward: a module
    whose gradient w.r.t. its input is non-finite while the gradient w.r.t. its output was finite.
    """
    n = len(names)
    ins, gins = _role_slots(n, aliases)
    rank = {m: i for i, m in enumerate(order or [])}
    stats: dict[tuple[int, str], ModuleStat] = {}
    fwd, bwd = [], []
    for m in range(n):
        out = values.get(ROLES * m + OUT)
        if out is not None:
            stats[(m, FORWARD)] = _stat(out)
            inp = _fold(values, ins[m])
            if out.bad and not (inp is not None and inp.bad):
                fwd.append(m)
        gin = _fold(values, gins[m])
        if gin is not None:
            stats[(m, BACKWARD)] = _stat(gin)
            gout = values.get(ROLES * m + GOUT)
            if gin.bad and not (gout is not None and gout.bad):
                bwd.append(m)
    return stats, {FORWARD: _pick(fwd, names, rank, False), BACKWARD: _pick(bwd, names, rank, True)}
