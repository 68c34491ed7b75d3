"""A healthy step's module rows, computed with a few tensor ops instead of Python per slot.

Most observed steps are ``layer_every`` steps on which nothing is non-finite: all the writer needs
from them is, per module and phase, the max |x| over the slots that hold its values (its own and
those of the tensors it received or handed on, as :func:`.origins.analyse` folds them). The
per-slot Python of that analysis took ~2 ms a step on GPT-2 small's tree, in the writer thread,
holding the GIL that a host-bound training thread waits for; the whole step's rows now take ~0.4 ms
(``tests/test_healthy_rows.py`` checks both give the same rows). A step with any
non-finite slot goes the full way (origins, kinds, counts, micro-batches).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .observe import stats_rows
from .slots import GIN, IN, OUT, ROLES


def slot_amax(raw: torch.Tensor, slots: int, host: bool) -> Optional[torch.Tensor]:
    """Per slot the max |x| over its dtypes as float64 (-inf: never written), from the stats' bytes
    (:func:`.observe.stats_rows`); None when any slot holds NaN or ±inf."""
    per_dtype = []
    for rows in stats_rows(raw, slots, host):
        rows = rows.double()
        per_dtype.append(torch.maximum(-rows[:, 0], rows[:, 1]))  # unwritten: max(-inf, -inf); NaN propagates
    amax = torch.stack(per_dtype).amax(dim=0)
    if not bool((amax < math.inf).all()):  # NaN or inf somewhere: the full analysis
        return None
    return amax


def _gather_plan(modules: int, aliases: dict, changed: frozenset, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(modules, k) slot indices, padded with ``pad``: per module its output slots (forward) and its
    input-gradient slots (backward), as :func:`.origins.analyse` folds them (an own output changed
    in place after its module returned counts for its readers, not for it)."""
    outs = [[ROLES * m + OUT] for m in range(modules)]
    gins = [[ROLES * m + GIN] for m in range(modules)]
    for (m, role, _call, _pos), slot in aliases.items():
        if role == IN:
            if slot + (GIN - IN) not in gins[m]:
                gins[m].append(slot + (GIN - IN))
        elif slot not in outs[m]:
            outs[m].append(slot)
    outs = [[s for s in slots if s not in changed or s != ROLES * m + OUT] for m, slots in enumerate(outs)]

    def padded(lists: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(x) for x in lists))
        return torch.tensor([x + [pad] * (width - len(x)) for x in lists], dtype=torch.long)
    return padded(outs), padded(gins)


class HealthyRows:
    """Module rows of healthy steps; the gather plans cached per learned structure."""

    def __init__(self, modules: int) -> None:
        self.modules = modules
        self._plans: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def module_amax(self, amax: torch.Tensor, aliases: dict, changed: frozenset
                    ) -> tuple[list[float], list[float]]:
        """Per module the forward and backward max |x| (-inf: not observed this step)."""
        key = (tuple(aliases.items()), changed)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 16:  # a structure that never settles: keep the cache small
                self._plans.pop(next(iter(self._plans)))
            plan = self._plans[key] = _gather_plan(self.modules, aliases, changed, amax.numel())
        padded = torch.cat([amax, amax.new_full((1,), -math.inf)])
        forward, backward = (padded[index].amax(dim=1).tolist() for index in plan)
        return forward, backward
