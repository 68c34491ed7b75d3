"""Where reads are free (CPU): module stats kept on the host, and the queue that fills them.

A hook appends its tensor to :class:`HostQueue`; when the values are needed (see
:meth:`.observe.ModuleObserver.backward_done`) the queue runs one ``aminmax`` per tensor back to back, reads the two numbers and folds them into
:class:`HostStats`, an array of doubles the step pack copies whole. Inside a CPU training step an op
costs ~15 us of host time and a Python call ~1 us, so the flush is one flat loop: no call per
tensor besides the reduction and its two reads, and no op besides the reduction (no ``detach``:
the flush runs under ``no_grad``).

A tensor changed in place while it waited (its version counter moved) is measured as its readers
saw it: its slot is marked *changed* for the step (the origin analysis does not hold the value
against the module that made it) and *volatile* (reduced at once from then on, never aliased).
"""
from __future__ import annotations

import math
from array import array
from typing import Any, Callable

import torch

from .batched import HOST_CHUNK_BYTES

# Tensors pending at most. The bound that matters is HOST_CHUNK_BYTES (what is held past its life);
# batched.CHUNK (64), used here before, made any model with more than ~30 modules reduce every step
# (the reference GPT queues ~90 tensors a step), defeating the reduction only when needed.
HOST_CHUNK = 4096

EMPTY = (math.inf, -math.inf)  # an unwritten slot: min +inf, max -inf
_INF = math.inf
_NEG_INF = -math.inf


class HostStats:
    """Per dtype, per slot, (min, max) as doubles in one host array.

    An array item write costs ~30 ns; a tensor over the same memory lets the step pack copy all of
    it in its one concatenation. Values are exact: a float16/bfloat16/float32 min or max is a double."""

    def __init__(self, dtypes: int, slots: int) -> None:
        self.dtypes, self.slots = dtypes, slots
        self._empty = array("d", EMPTY * (dtypes * slots))
        self.values = array("d", self._empty)
        self.tensor = torch.frombuffer(self.values, dtype=torch.float64)
        self.touched = False  # a value was folded in since the last reset (else every slot is empty)

    def fold(self, d: int, slot: int, lo: float, hi: float) -> None:
        self.touched = True
        values, i = self.values, 2 * (d * self.slots + slot)
        if lo != lo or lo < values[i]:  # a NaN already there stays (NaN < x is false)
            values[i] = lo
        if hi != hi or hi > values[i + 1]:
            values[i + 1] = hi

    def views(self) -> list[torch.Tensor]:
        """Per dtype the (S, 2) rows, as float64 tensors sharing the array's memory."""
        return list(self.tensor.view(self.dtypes, self.slots, 2).unbind(0))

    def as_bytes(self) -> list[torch.Tensor]:
        return [self.tensor.view(torch.uint8)]

    def reset(self) -> None:
        if self.touched:  # most CPU steps reduce nothing (observe.backward_done): nothing to reset
            self.values[:] = self._empty  # a memcpy, no op
            self.touched = False


class HostQueue:
    """Pending tensors, reduced into :class:`HostStats` at each flush.

    ``nonfinite(t, slot)`` is called for a tensor whose min or max is not finite (it pays for exact
    counts). The interface matches :class:`.batched.BatchedReducer` (``add``, ``flush``,
    ``fold_into``, ``volatile``, ``changed``, ``clear``)."""

    def __init__(self, stats: HostStats, nonfinite: Callable[[torch.Tensor, int], Any]) -> None:
        self._stats = stats
        self._nonfinite = nonfinite
        self._pending: list[tuple[torch.Tensor, int, int, int]] = []  # (tensor, slot, value index, version)
        self._bytes = 0
        self.volatile: set[int] = set()  # slots whose tensors were changed in place while pending
        self.changed: set[int] = set()   # this step's such slots (the observer takes and clears it)

    def add(self, d: int, t: torch.Tensor, slot: int) -> None:
        pending = self._pending
        pending.append((t, slot, 2 * (d * self._stats.slots + slot), t._version))
        self._bytes += t.nbytes
        if len(pending) >= HOST_CHUNK or self._bytes >= HOST_CHUNK_BYTES:  # it holds tensors past their life
            self.flush()

    def flush(self) -> None:
        """Reduce every pending tensor now, one ``aminmax`` each, under ``no_grad`` (the queued
        tensors may require grad: nothing is recorded for autograd, and no ``detach`` is paid)."""
        pending = self._pending
        if not pending:
            return
        self._pending, self._bytes = [], 0
        self._stats.touched = True
        values, aminmax = self._stats.values, torch.aminmax
        with torch.no_grad():
            for t, slot, i, version in pending:
                if t._version != version:  # changed in place since: its readers' value (see above)
                    self.changed.add(slot)
                    self.volatile.add(slot)
                lo, hi = aminmax(t)
                lo, hi = lo.item(), hi.item()
                if lo < values[i] or lo != lo:  # a NaN already there stays (NaN < x is false)
                    values[i] = lo
                if hi > values[i + 1] or hi != hi:
                    values[i + 1] = hi
                if not (_NEG_INF < lo and hi < _INF):  # NaN compares false
                    self._nonfinite(t, slot)

    def drop(self) -> None:
        """Forget what is pending, unreduced: its values are not needed (see ``observe``)."""
        self._pending, self._bytes = [], 0

    def fold_into(self, views: Any, traced: bool = False) -> None:
        self.flush()  # the stats are the host array itself

    clear = drop  # the observer's remove(): nothing else is held between flushes
