"""The accelerator path's reductions, batched: one ``_foreach_norm`` per chunk of observed tensors.

On a GPU a reduction per hooked tensor is a kernel launch (plus a memset) per tensor, and the
launches, not the arithmetic, are what an eager step pays for: on GPT-2 small (H100) one ``aminmax``
per tensor made the step 1.25x slower. Here a hook only appends the tensor to a pending list;
every ``CHUNK`` tensors (or ``CHUNK_BYTES`` of them: no more than that is held past its life; each
``_foreach_norm`` call costs ~50-100 us of host time, so flushing often costs more than it saves)
one multi-tensor ``torch._foreach_norm(..., inf)`` reduces them all to max |x| (NaN propagates into
it, inf stays inf: what the host needs to tell finite, inf and NaN apart and to measure headroom;
on the CPU, where that op is slow, :func:`.torch_access.max_abs_each` gets the same another way).
The observer also flushes when the root's forward returns and before the optimizer's step, so a
pending tensor never lives into the pass after the one that made it (an activation autograd frees,
such as a dropout's input, held into the backward; a backward's gradients held through the
optimizer's step, where a step's peak often is: ``bench/memory.py``).
At the step's end the per-observation maxima are folded into the stats buffer's (min, max) rows as
(-amax, amax), the running max kept for a slot observed several times, in a few ops per dtype.

What is given up against ``aminmax``: a slot holding both NaN and inf reads as NaN (its kind is
``nan``). A tensor changed in place while it waited (``ReLU(inplace=True)`` on a Linear's output, an
in-place residual add) would be measured as changed: modules seen to work in place flush the
pending tensors before they run, and a pending tensor whose version moved by the flush marks its
slot *changed* for this step (its value then counts for the modules that read it, not for the one
that made it) and *volatile*: reduced at once from then on, and never again read by another module
in its place (the observer re-learns its aliases).

Where reads are free (CPU) :class:`.hoststats.HostQueue` plays this part: it defers one ``aminmax``
per tensor to the end of a backward pass, and runs them only when the step needs them (see
:meth:`.observe.ModuleObserver.backward_done`), bounded by ``HOST_CHUNK_BYTES`` (it holds gradients
past their life) rather than by ``CHUNK``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .torch_access import max_abs_each

CHUNK = 64
CHUNK_BYTES = 1 << 30
HOST_CHUNK_BYTES = 64 << 20


class BatchedReducer:
    """Pending tensors per dtype index; reduced per chunk; folded into the stats views per step."""

    def __init__(self, dtypes: int) -> None:
        self._pending: list[list[torch.Tensor]] = [[] for _ in range(dtypes)]
        self._pending_slots: list[list[int]] = [[] for _ in range(dtypes)]
        self._versions: list[list[int]] = [[] for _ in range(dtypes)]
        self.volatile: set[int] = set()  # slots whose tensors were changed in place while pending
        self.changed: set[int] = set()   # this step's such slots (the observer takes and clears it)
        self._count = 0
        self._bytes = 0
        # 0-d maxima (and the 1-d maxima a compiled forward joined: join_traced)
        self._values: list[list[torch.Tensor]] = [[] for _ in range(dtypes)]
        self._slots: list[list[int]] = [[] for _ in range(dtypes)]
        # the same, appended by compiled graphs (observe.ModuleObserver._observe_traced)
        self.traced_values, self.traced_slots = self._values, self._slots
        # (dtype, slots of the step) -> (distinct slots, gather index) on the device, reused every step
        self._plans: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, Optional[torch.Tensor]]] = {}

    def add(self, d: int, t: torch.Tensor, slot: int) -> None:
        self._pending[d].append(t)
        self._pending_slots[d].append(slot)
        self._versions[d].append(t._version)
        self._count += 1
        self._bytes += t.nbytes
        if self._count >= CHUNK or self._bytes >= CHUNK_BYTES:
            self.flush()

    def reduce_now(self, d: int, tensors: list[torch.Tensor], slots: list[int]) -> None:
        """Reduce ``tensors`` (all of dtype index ``d``) at once, with the op a chunk uses (one
        launch; folded with the step's other maxima). For tensors that may not wait: inside a
        compiled graph the compiler may reuse their memory as soon as the op that saw them
        returns, and a volatile slot's tensor is changed in place after it is observed. One
        launch where an ``aminmax`` per tensor, folded into its row by ``minimum`` and
        ``maximum``, took three each."""
        self._values[d].extend(max_abs_each(tensors))
        self._slots[d].extend(slots)

    def keep(self, d: int, amax: torch.Tensor, slot: int) -> None:
        """A 0-d max |x| reduced elsewhere (a compiled graph), folded with the step's other maxima."""
        self._values[d].append(amax)
        self._slots[d].append(slot)

    def join_traced(self) -> None:
        """Under torch.compile, as the root's observed forward returns inside its graph: each
        dtype's maxima that the traced hooks appended, joined into one tensor by one ``stack`` in
        the graph. The graph then hands out one output per dtype instead of one 0-d tensor per
        observed tensor, each its own allocation, then stacked again on the host by
        :meth:`fold_into` (~1 ms of an observed inductor step on bench/hostcost.py's tree). Writing
        into the joined buffer, inductor fuses fewer maxima into the kernels that make their
        tensors: 373 kernels against 292 on the reference GPT's observed step (bench/inductor_kernels.py,
        before each tensor was observed once: 340 since).
        Eager: nothing."""
        if not torch.compiler.is_compiling():
            return
        for values in self._values:
            if len(values) > 1:
                joined = torch.stack(values)
                values.clear()
                values.append(joined)

    def flush(self) -> None:
        """Reduce every pending tensor now (one multi-tensor launch per dtype). Hooks queue tensors as they are, maybe requiring grad:
        reduced here under ``no_grad``, nothing is recorded for autograd."""
        if not self._count:
            return
        with torch.no_grad():
            self._flush()

    def _flush(self) -> None:
        for d, tensors in enumerate(self._pending):
            if not tensors:
                continue
            slots, versions = self._pending_slots[d], self._versions[d]
            if [t._version for t in tensors] != versions:  # one comparison for the usual chunk
                for t, slot, v in zip(tensors, slots, versions):
                    if t._version != v:
                        # changed in place since it was observed: its value now is what the modules
                        # that read it later saw, not what its own module made (``changed``: the
                        # origin analysis does not hold it against that module), and from now on
                        # the slot is reduced at once
                        self.changed.add(slot)
                        self.volatile.add(slot)
            self._values[d].extend(max_abs_each(tensors))
            self._slots[d].extend(slots)
            tensors.clear()
            slots.clear()
            versions.clear()
        self._count = self._bytes = 0

    def fold_into(self, views: list[torch.Tensor], traced: bool = False) -> None:
        """Write the step's maxima into the (S, 2) min/max ``views``, combining with what is there.
        ``traced``: compiled graphs may have handed some out joined (1-d, :meth:`join_traced`);
        otherwise every value is 0-d (a chunk's, a kept gradient's), not asked one by one."""
        if not self._count and not any(self._values):  # a step that observed nothing: most steps
            return
        self.flush()
        for d, values in enumerate(self._values):
            if not values:
                continue
            slots = self._slots[d]
            plan = self._plans.get((d, tuple(slots)))
            if plan is None:
                plan = self._plans[(d, tuple(slots))] = _plan(slots, views[d].device)
                if len(self._plans) > 64:  # a structure that never settles: keep the cache small
                    self._plans.pop(next(iter(self._plans)))
            index, gather = plan
            view = views[d]
            if len(values) == 1:  # one value, or the maxima a compiled forward joined (join_traced)
                amax = values[0].reshape(-1)
            elif not traced or all(v.dim() == 0 for v in values):
                amax = torch.stack(values)
            else:
                amax = torch.cat([v.reshape(-1) for v in values])
            if amax.dtype != view.dtype:  # CUDA's _foreach_norm answers half in float: max |x| casts back exactly
                amax = amax.to(view.dtype)
            if gather is not None:  # a slot observed more than once this step: its running max
                amax = torch.cat([amax, amax.new_full((1,), -math.inf)])[gather].amax(dim=1)
            top = torch.maximum(view[:, 1].index_select(0, index), amax)  # NaN propagates
            view[:, 1].index_copy_(0, index, top)
            view[:, 0].index_copy_(0, index, torch.minimum(view[:, 0].index_select(0, index), -amax))
            values.clear()
            slots.clear()

    def clear(self) -> None:
        for lists in (self._pending, self._pending_slots, self._versions, self._values, self._slots):
            for items in lists:
                items.clear()
        self._count = self._bytes = 0


def _plan(slots: list[int], device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Distinct slots in first-seen order, and, when some repeat, a (distinct, k) gather index into
    the maxima padded with one -inf at position len(slots)."""
    positions: dict[int, list[int]] = {}
    for i, s in enumerate(slots):
        positions.setdefault(s, []).append(i)
    index = torch.tensor(list(positions), dtype=torch.long, device=device)
    width = max(len(p) for p in positions.values())
    if width == 1:
        return index, None
    pad = len(slots)
    rows = [p + [pad] * (width - len(p)) for p in positions.values()]
    return index, torch.tensor(rows, dtype=torch.long, device=device)
