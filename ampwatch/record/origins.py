"""Which module is the origin of a non-finite value: pure Python over one step's slot values.

Runs in the writer thread. Input: per slot (see :mod:`.slots`) the min/max per dtype, the learned
input and output aliases, the learned forward order, where reads were free exact NaN/inf counts, and on steps of
several micro-batches the micro-batch each slot first went non-finite in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from .slots import BACKWARD, DTYPE_NAMES, FORWARD, GIN, GOUT, IN, INPUT, OUT, ROLES


@dataclass
class SlotValue:
    lo: float
    hi: float
    dtype: str
    nan: Optional[float] = None  # exact counts where they were paid for (free host reads), else None
    inf: Optional[float] = None
    first: int = 0  # the micro-batch it first went non-finite in (meaningful when bad)

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
    micro_batch: Optional[int] = None  # where it first went non-finite


def slot_values(per_dtype: list[list[tuple[float, float]]], counts: dict[int, list[float]],
                exact: bool, first: Optional[list[float]] = None, micro_batches: int = 1
                ) -> dict[int, SlotValue]:
    """Written slots only (an unwritten slot reads min=+inf, max=-inf), dtypes folded together.

    ``first``: per slot the micro-batch it was marked non-finite in (-1: not marked, i.e. the last
    of the step's ``micro_batches``); None on a step of one micro-batch."""
    out: dict[int, SlotValue] = {}
    last = max(micro_batches - 1, 0)
    for d, rows in enumerate(per_dtype):
        for slot, (lo, hi) in enumerate(rows):
            if lo == math.inf and hi == -math.inf:
                continue
            prev = out.get(slot)
            if prev is None:
                c = counts.get(slot) if exact else None
                out[slot] = SlotValue(lo, hi, DTYPE_NAMES[d], *(c or ((0.0, 0.0) if exact else (None, None))),
                                      first=int(first[slot]) if first and first[slot] >= 0 else last)
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
    folded = SlotValue(present[0].lo, present[0].hi, present[0].dtype, present[0].nan, present[0].inf,
                       present[0].first)
    for v in present[1:]:
        if v.bad and (not folded.bad or v.first < folded.first):
            folded.first = v.first
        folded.lo = v.lo if v.lo != v.lo or v.lo < folded.lo else folded.lo
        folded.hi = v.hi if v.hi != v.hi or v.hi > folded.hi else folded.hi
        if folded.nan is not None and v.nan is not None:
            folded.nan += v.nan
            folded.inf += v.inf  # type: ignore[operator]
        if v.bad and not present[0].bad:
            folded.dtype = v.dtype
    return folded


def _role_slots(modules: int, aliases: dict[tuple[int, int, int, int], int]) -> tuple[list[list[int]], ...]:
    """Per module, the slots holding its inputs, input gradients, outputs and output gradients: its
    own slot plus those of the modules whose very tensors it received or handed on (``aliases``,
    keyed (module, IN or OUT, call, position))."""
    ins = [[ROLES * m + IN] for m in range(modules)]
    gins = [[ROLES * m + GIN] for m in range(modules)]
    outs = [[ROLES * m + OUT] for m in range(modules)]
    gouts = [[ROLES * m + GOUT] for m in range(modules)]
    for (m, role, _call, _pos), slot in aliases.items():
        values, grads = (ins, gins) if role == IN else (outs, gouts)
        if slot not in values[m]:
            values[m].append(slot)
            grads[m].append(slot + (GIN - IN))  # IN->GIN and OUT->GOUT are both +2
    return ins, gins, outs, gouts


def grads_received(values: dict[int, SlotValue], aliases: dict, modules: list[int], n: int
                   ) -> dict[int, Optional[bool]]:
    """Per module of ``modules``: whether the gradient it received w.r.t. its output (its own slot and
    the slots of the tensors it handed on) was non-finite; None where none was observed."""
    _, _, _, gouts = _role_slots(n, aliases)
    out: dict[int, Optional[bool]] = {}
    for m in modules:
        folded = _fold(values, gouts[m])
        out[m] = None if folded is None else folded.bad
    return out


def _stat(value: SlotValue) -> ModuleStat:
    return ModuleStat(amax=value.amax, nonfinite=value.bad, nan=value.nan, inf=value.inf,
                      dtype=value.dtype, kind_nan=math.isnan(value.lo) or math.isnan(value.hi),
                      micro_batch=value.first if value.bad else None)


def _pick(candidates: list[int], names: list[str], rank: dict[int, Any], last: bool) -> Optional[int]:
    """The innermost candidate (a child beats its container); among unrelated ones, the first to run
    (forward: first in finish order; backward: gradients flow in reverse, so the last)."""
    if not candidates:
        return None
    def inside(child: str, parent: str) -> bool:
        return parent == "<model>" and child != parent or child.startswith(parent + ".")
    inner = [c for c in candidates if not any(o != c and inside(names[o], names[c]) for o in candidates)]
    order = sorted(inner, key=lambda m: rank.get(m, m))
    return order[-1] if last else order[0]


def _seen_at(m: int, values: dict[int, SlotValue], gins: list[int], rank: dict[int, int]) -> tuple:
    """When, in backward, module ``m``'s non-finite input gradient was seen: at the module owning
    the bad slot. An input shared with another module (BERT's attention output feeds both the
    intermediate and the output block) is one tensor whose gradient hook fires once, after every
    consumer's backward, at its producer's turn: a candidate that is bad only through it is ranked
    there, so a sibling whose own backward made the inf (seen earlier) wins."""
    owners = [s // ROLES for s in gins if s in values and values[s].bad]
    return max((rank.get(o, o), o == m) for o in owners) if owners else (rank.get(m, m), True)


def analyse(values: dict[int, SlotValue], aliases: dict, order: Optional[list[int]],
            names: list[str], changed: frozenset = frozenset()
            ) -> tuple[dict[tuple[int, str], ModuleStat], dict[str, Optional[int]]]:
    """Per (module, phase) statistics and the origin module of each phase (or None).

    Forward: a module whose output is non-finite while its inputs were finite. Backward: a module
    whose gradient w.r.t. its input is non-finite while the gradient w.r.t. its output was finite.
    ``changed``: output slots whose tensor was changed in place after its module returned (measured
    as changed: it counts for the modules that read it, not for the one that made it).
    """
    n = len(names)
    ins, gins, outs, gouts = _role_slots(n, aliases)
    rank = {m: i for i, m in enumerate(order or [])}
    stats: dict[tuple[int, str], ModuleStat] = {}
    fwd, bwd = [], []
    seen: dict[int, tuple] = {}
    for m in range(n):
        own = ROLES * m + OUT
        out = _fold(values, [s for s in outs[m] if s != own or s not in changed] if changed else outs[m])
        if out is not None:
            stats[(m, FORWARD)] = _stat(out)
            inp = _fold(values, ins[m])
            if out.bad and not (inp is not None and inp.bad):
                fwd.append(m)
        gin = _fold(values, gins[m])
        if gin is not None:
            stats[(m, BACKWARD)] = _stat(gin)
            gout = _fold(values, gouts[m])
            if gin.bad and not (gout is not None and gout.bad):
                bwd.append(m)
                seen[m] = _seen_at(m, values, gins[m], rank)
    found = {FORWARD: _pick(fwd, names, rank, False), BACKWARD: _pick(bwd, names, seen, True)}
    # only where it went on through the forward and no module made one of its own: a model that
    # cleans its inputs first (nan_to_num, a mask that drops NaN-padded positions) is fed NaN on
    # every step, healthy or not, and then its fault is elsewhere (a module's overflow, the loss)
    went_on = found[FORWARD] is None and any(s.nonfinite for (_, phase), s in stats.items() if phase == FORWARD)
    root = _brought_in(values, ins, names) if went_on else None
    if root is not None:
        stats[(root, INPUT)] = _stat(_fold(values, ins[root]))  # type: ignore[arg-type]
        found[INPUT] = root
    return stats, found


def _brought_in(values: dict[int, SlotValue], ins: list[list[int]], names: list[str]) -> Optional[int]:
    """The root module (``<model>``) when the model's own floating inputs held NaN or +inf: the
    batch brought them, before any module ran. An input that is only -inf below finite values is
    left out: an additive attention mask holds -inf on purpose. Asked only on a step whose forward
    values went non-finite too, with no module origin of their own."""
    if "<model>" not in names:
        return None
    root = names.index("<model>")
    v = _fold(values, ins[root])
    if v is None or not v.bad:
        return None
    if v.lo == -math.inf and math.isfinite(v.hi) and not v.nan:  # -inf only (counts, where known, agree)
        return None
    return root


def _child_of(container: str, name: str) -> Optional[str]:
    """The direct child of ``container`` that ``name`` lies in (``h.0`` + ``h.0.attn.c`` -> ``h.0.attn``)."""
    prefix = "" if container == "<model>" else container + "."
    if name == container or name == "<model>" or not name.startswith(prefix):
        return None
    return prefix + name[len(prefix):].split(".", 1)[0]


def flows_into(values: dict[int, SlotValue], aliases: dict, order: Optional[list[int]], names: list[str],
               found: dict[str, Optional[int]]) -> dict[str, Optional[str]]:
    """For an origin in a container's own code (between its children): the child the non-finite
    value went into. Forward: the first descendant, in forward finish order, whose input was
    non-finite. Backward: the first, in backward order (the reverse), whose output gradient was
    non-finite (gradients flow from the container's code into it). Named by the direct child."""
    out: dict[str, Optional[str]] = {FORWARD: None, BACKWARD: None}
    ins, _, _, gouts = _role_slots(len(names), aliases)
    ranked = list(order or [])
    known = set(ranked)
    ranked += [m for m in range(len(names)) if m not in known]
    if found[FORWARD] is not None:
        container = names[found[FORWARD]]
        for m in ranked:
            child = _child_of(container, names[m])
            folded = _fold(values, ins[m]) if child is not None else None
            if folded is not None and folded.bad:
                out[FORWARD] = child
                break
    if found[BACKWARD] is not None:
        container = names[found[BACKWARD]]
        for m in reversed(ranked):
            child = _child_of(container, names[m])
            gout = _fold(values, gouts[m]) if child is not None else None
            if gout is not None and gout.bad:
                out[BACKWARD] = child
                break
    return out
