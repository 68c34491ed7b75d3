"""Module observation: where NaN/Inf is born, at one reduction per hooked tensor.

Every module gets four fixed slots at attach, one per role: its forward input (IN), its forward
output (OUT), the gradient w.r.t. its output (GOUT) and w.r.t. its input (GIN). One stats buffer,
allocated once on the model's device, holds for each slot the min and max of what was observed this
step, once per floating dtype (one small (slots, 2) tensor each for fp64/fp32/fp16/bf16, so ``torch.aminmax``
writes its result straight into the slot in the tensor's own dtype: no casts, no stacking). NaN
propagates into min and max and inf shows as ±inf, so "non-finite" and its kind are read from the
slot on the host. A slot observed several times in a step (a shared module, micro-batches) keeps
the running min/max.

Eager: the first step (and any step after the module call count changed) is a *learning* step: the
hooks note which inputs are the very tensors another module already produced or received (the
residual stream, a container's input handed to its first child), and later steps skip reducing
those: the host reads the other module's slot instead. Under ``torch.compile`` the hooks skip the
Python bookkeeping and call the custom op ``ampwatch::observe`` (an ordered side effect that writes
the stats buffer), so Dynamo traces them into the graph with no graph break; gradients are observed with
``Tensor.register_hook``, which Dynamo also traces.

Micro-batches (issue 12: which one a value went non-finite in) cost nothing on a step with one
forward pass of the root module. On a step with k, each new root call marks, in one small per-slot
tensor, the slots that went non-finite during the previous micro-batch (a fixed handful of ops per
micro-batch, none per module call); a slot bad at the end and not marked went bad in the last one.

The fp32 counterfactual (``counterfactual.py``, option ``fp32_check``) is fed from the eager
pre-hooks: ``keeper.keep`` stores a reference to each module's latest inputs (a dict slot per
module, no copy, nothing grows). Under torch.compile the inner hooks keep nothing (None there).
"""
from __future__ import annotations

import math
import weakref
from functools import partial
from typing import Any, Iterator, Optional

import torch

from .. import probes
from .batched import BatchedReducer

IN, OUT, GIN, GOUT = range(4)
ROLES = 4
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
DTYPE_INDEX = {dt: i for i, dt in enumerate(DTYPES)}
DTYPE_NAMES = tuple(str(dt).replace("torch.", "") for dt in DTYPES)
_POS = (math.inf, -math.inf)


_BUFFERS: dict[int, list[torch.Tensor]] = {}  # observer id -> its per-dtype stats tensors


@torch.library.custom_op("ampwatch::observe", mutates_args=())
def observe(x: torch.Tensor, buffer: int, slot: int) -> None:
    """Fold min/max of ``x`` into row ``slot`` of observer ``buffer``'s stats for ``x``'s dtype.

    The buffer is looked up here rather than passed in: a compiled graph that took it as an input
    would save it for its backward, and any write to it between forward and backward (an eager
    module, another compiled graph) would fail autograd's version check. The op is registered as
    an ordered side effect instead, so it is neither dropped nor reordered."""
    stats = _BUFFERS.get(buffer)
    if stats is None or x.dtype not in DTYPE_INDEX:  # the watch was closed: a no-op
        return
    row = stats[DTYPE_INDEX[x.dtype]][slot]
    mn, mx = torch.aminmax(x)
    torch.minimum(row[0], mn, out=row[0])
    torch.maximum(row[1], mx, out=row[1])


@observe.register_fake
def _observe_fake(x: torch.Tensor, buffer: int, slot: int) -> None:
    return None


try:
    from torch._library.effects import EffectType
    observe.register_effect(EffectType.ORDERED)
except (ImportError, AttributeError):  # older torch: under compile the op may be dropped (eager is unaffected)
    pass


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Floating-point tensors inside a module's inputs/outputs (tuples, lists, dicts, HF outputs)."""
    for t in probes.nested_tensors(obj):  # a plain generator, as Dynamo traces it in compiled hooks
        if t.dtype in DTYPE_INDEX and t.numel() > 0:
            yield t


def _numpy_view(t: torch.Tensor) -> Any:
    """A numpy array sharing ``t``'s memory (CPU), or None (bfloat16, or no numpy)."""
    try:
        return t.numpy() if t.dtype != torch.bfloat16 else None
    except (RuntimeError, TypeError):
        return None


def _tensor_list(obj: Any) -> list[torch.Tensor]:
    if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
        return [obj] if obj.dtype in DTYPE_INDEX and obj.numel() > 0 else []
    return list(_tensors(obj))


class StatsBuffer:
    """Per dtype one (S, 2) min/max tensor on the device, allocated once, reset each step.

    Separate tensors, not views of one byte buffer: under torch.compile a view shares its base's
    version counter, and the backward graph saves the buffer it mutates."""

    def __init__(self, slots: int, device: torch.device) -> None:
        self.views = [torch.empty((slots, 2), dtype=dt, device=device) for dt in DTYPES]
        for v in self.views:
            v[:, 0].fill_(math.inf)
            v[:, 1].fill_(-math.inf)
        self._reset = [v.clone() for v in self.views]  # an empty step: min +inf, max -inf

    def as_bytes(self) -> list[torch.Tensor]:
        """The buffers as byte views (no copy), in the order :func:`decode` reads them."""
        return [v.view(-1).view(torch.uint8) for v in self.views]

    def reset(self) -> None:
        for v, image in zip(self.views, self._reset):
            v.copy_(image)


def stats_bytes(slots: int) -> int:
    """Bytes of the stats buffer as :meth:`StatsBuffer.as_bytes` lays it out (what :func:`decode` reads)."""
    return sum(slots * 2 * torch.empty((), dtype=dt).element_size() for dt in DTYPES)


def decode(raw: torch.Tensor, slots: int) -> list[list[tuple[float, float]]]:
    """Host side: per dtype, per slot (min, max) from a CPU copy of the byte buffer."""
    out, start = [], 0
    for dt in DTYPES:
        size = slots * 2 * torch.empty((), dtype=dt).element_size()
        values = raw[start:start + size].view(dt).float().view(slots, 2).tolist()
        out.append([tuple(v) for v in values])  # type: ignore[misc]
        start += size
    return out


class ModuleObserver:
    """Hooks every module of ``model``; the stats buffer and the learned structure live here."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.names: list[str] = []
        self.types: list[str] = []
        self._handles: list[Any] = []
        modules = []
        seen: set[int] = set()
        for name, module in model.named_modules():
            if id(module) in seen:  # a module registered twice is hooked once, under its first name
                continue
            seen.add(id(module))
            modules.append(module)
            self.names.append(name or "<model>")
            self.types.append(type(module).__name__)
        self.modules = modules
        self.slots = ROLES * len(modules)
        self.buffer = StatsBuffer(self.slots, device)
        self._views = self.buffer.views
        self._id = id(self)
        self._slot_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        _BUFFERS[self._id] = self.buffer.views
        self._reads_free = probes.reads_are_free(device)
        self._host = [_numpy_view(v) if self._reads_free else None for v in self._views]
        # accelerator path: reductions batched per chunk (batched.py), not one launch per tensor
        self._batch = None if self._reads_free else BatchedReducer(len(DTYPES))
        self._inplace: set[int] = set()  # modules whose output is their input (ReLU(inplace=True))
        self.active = True
        # learned structure: (module, call, position) of an input -> the slot that already holds it
        self.aliases: dict[tuple[int, int, int], int] = {}
        self.order: Optional[list[int]] = None  # modules in forward finish order (first call)
        self._learned_calls = -1
        self._learning = True
        # per slot, the micro-batch in which it first went non-finite (-1: not yet); made on first use
        self._first: Optional[torch.Tensor] = None
        self.keeper: Any = None  # counterfactual.InputKeeper when fp32_check is on
        self._new_step()
        for index, module in enumerate(modules):
            before, after = partial(self._before, index), partial(self._after, index)
            if index == 0:
                # torch.compile(model) runs the root's own hooks outside its graph, where Dynamo would
                # compile each as a graph of its own: keep them eager (they see no traced tensors)
                before, after = torch._dynamo.disable(before), torch._dynamo.disable(after)
            self._handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            self._handles.append(module.register_forward_hook(after))

    # -- per step --------------------------------------------------------------------------------
    def _new_step(self) -> None:
        self._written: set[int] = set()
        self._calls = 0
        self._call_of: dict[int, int] = {}
        self.counts: dict[int, list[float]] = {}     # slot -> [nan, inf] (only where reads are free)
        self._seen: dict[int, tuple[Any, int]] = {}  # learning step only: id(tensor) -> (ref, slot)
        self._finish: list[int] = []
        self.root_calls = 0          # forward calls of the root module: the step's micro-batches
        self._first_used = False     # ``_first`` holds marks of this step
        self.fp32_amax: dict[int, Optional[float]] = {}  # the counterfactual's answer (module -> amax)
        self.fp32_checked = False

    def take(self) -> dict:
        """The step's structure for the host (the stats themselves travel in the step's buffer)."""
        if self._batch is not None:
            self._batch.fold_into(self._views)
        if self._learning and self._calls:
            self.order = list(dict.fromkeys(self._finish))
            self._learned_calls = self._calls
        step = {"aliases": self.aliases, "order": self.order, "counts": self.counts,
                "observed": bool(self._calls) or bool(self._written),
                "micro_batches": self.root_calls, "first": self._first_used, "fp32": self.fp32_amax}
        if self.keeper is not None:
            self.keeper.clear()  # the step's kept inputs are released here
        # re-learn only when the structure visibly changed (the number of module calls)
        self._learning = self._calls != self._learned_calls and not (self._calls == 0 and self.order)
        if self._learning:
            self.aliases = {}
        self._new_step()
        return step

    def first_bytes(self) -> list[torch.Tensor]:
        """The micro-batch marks as bytes, when this step made any (several micro-batches)."""
        return [self._first.view(torch.uint8)] if self._first_used and self._first is not None else []

    def reset_buffer(self, first: bool = False) -> None:
        self.buffer.reset()
        if first and self._first is not None:
            self._first.fill_(-1.0)

    def _mark_micro_batch(self, finished: int) -> None:
        """Root call ``finished + 1`` starts: slots non-finite by now and not yet marked went bad in
        micro-batch ``finished``. A slot is bad when min < -inf is false or max < inf is false (NaN
        compares false); an unwritten slot (+inf, -inf) is not. Eager (root hooks are), no sync."""
        if self._batch is not None:  # the pending reductions belong to the micro-batch that ended
            self._batch.fold_into(self._views)
        if self._first is None:
            self._first = torch.full((self.slots,), -1.0, dtype=torch.float32, device=self._views[0].device)
        ok = None
        for v in self._views:
            fine = (v[:, 0] > -math.inf) & (v[:, 1] < math.inf)
            ok = fine if ok is None else ok.logical_and_(fine)
        self._first.masked_fill_(ok.logical_not_().logical_and_(self._first < 0), float(finished))
        self._first_used = True

    def forward_origin(self, names: list[str]) -> Optional[int]:
        """The forward origin of the step so far (module index), or None. Reads the stats buffer: a
        sync where reads are not free, so callers ask only on steps known to be bad."""
        from . import origins
        if self._batch is not None:
            self._batch.fold_into(self._views)
        raw = torch.cat(self.buffer.as_bytes()).cpu()
        values = origins.slot_values(decode(raw, self.slots), self.counts, self._reads_free)
        if not origins.any_nonfinite(values):
            return None
        order = self.order if not self._learning else list(dict.fromkeys(self._finish))
        return origins.analyse(values, self.aliases, order or None, names)[1][origins.FORWARD]

    def remove(self) -> None:
        """Remove every hook; gradient hooks still pending on live tensors become no-ops."""
        self.active = False
        _BUFFERS.pop(self._id, None)
        if self._batch is not None:
            self._batch.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- observation -------------------------------------------------------------------------------
    def _write(self, t: torch.Tensor, slot: int) -> bool:
        """Fold ``t`` into ``slot``; True when it is known (free host reads) to be non-finite."""
        d = DTYPE_INDEX.get(t.dtype)
        if d is None:
            return False
        stats = self._views[d]
        t = t.detach()
        if _compiling():
            torch.ops.ampwatch.observe(t, self._id, slot)
            return False
        if type(t) is not torch.Tensor:  # a DTensor is reduced on this rank's shard: no collective
            t = probes.local(t)
            if t.numel() == 0:
                return False
        if self._batch is not None:  # accelerator path: reduced with its chunk (batched.py)
            self._written.add(slot * 4 + d)
            self._batch.add(d, t, slot)
            return False
        key = slot * 4 + d
        views = self._slot_views.get(key)
        if views is None:  # made once per (slot, dtype): indexing costs microseconds per call
            views = self._slot_views[key] = (stats[slot, 0], stats[slot, 1])
        mn_v, mx_v = views
        if key in self._written:
            mn, mx = torch.aminmax(t)
            torch.minimum(mn_v, mn, out=mn_v)
            torch.maximum(mx_v, mx, out=mx_v)
        else:
            self._written.add(key)
            mn, mx = torch.aminmax(t, out=(mn_v, mx_v))
        if self._reads_free:
            host = self._host[d]  # a numpy view of the CPU buffer: reading it costs no dispatch
            lo, hi = host[slot] if host is not None else (mn.item(), mx.item())
            if not (math.isfinite(lo) and math.isfinite(hi)):
                c = self.counts.setdefault(slot, [0.0, 0.0])
                nan, inf = float(torch.isnan(t).sum()), float(torch.isinf(t).sum())
                c[0] += nan
                c[1] += inf
                return bool(nan or inf)
        return False

    def _watch_grad(self, t: torch.Tensor, slot: int) -> None:
        if t.requires_grad and torch.is_grad_enabled():
            t.register_hook(partial(self._on_grad, slot))

    def _on_grad(self, slot: int, grad: torch.Tensor) -> None:
        # runs inside the user's backward(): must never raise or return a tensor
        if self.active and grad is not None and grad.dtype in DTYPE_INDEX and grad.numel() > 0:
            self._write(grad, slot)

    # -- hooks -------------------------------------------------------------------------------------
    def _before(self, index: int, module: Any, args: Any, kwargs: Any) -> None:
        if not (self.active and module.training):
            return
        tensors = _tensor_list(args[0]) if len(args) == 1 and not kwargs else _tensor_list(args) + _tensor_list(kwargs)
        base = ROLES * index
        if _compiling():
            for t in tensors:
                self._write(t, base + IN)
                self._watch_grad(t, base + GIN)
            return
        if index in self._inplace and self._batch is not None:
            self._batch.flush()  # it is about to overwrite a tensor that may still be pending
        if index == 0:  # the root: a new micro-batch
            if self.root_calls:
                self._mark_micro_batch(self.root_calls - 1)
            self.root_calls += 1
        if self.keeper is not None:
            self.keeper.keep(index, args, kwargs, tensors)
        self._calls += 1
        call = self._call_of[index] = self._call_of.get(index, -1) + 1
        for pos, t in enumerate(tensors):
            if self._learning:
                hit = self._seen.get(id(t))
                if hit is not None and hit[0]() is t:  # another module's tensor: read its slot
                    self.aliases[(index, call, pos)] = hit[1]
                    continue
                self._seen[id(t)] = (weakref.ref(t), base + IN)
            elif (index, call, pos) in self.aliases:
                continue
            self._write(t, base + IN)
            self._watch_grad(t, base + GIN)

    def _after(self, index: int, module: Any, args: Any, output: Any) -> None:
        if not (self.active and module.training):
            return
        base = ROLES * index
        bad = False
        outputs = _tensor_list(output)
        if not _compiling() and self._learning and any(o is a for o in outputs for a in _tensor_list(args)):
            self._inplace.add(index)
        for t in outputs:
            bad = self._write(t, base + OUT) or bad
            self._watch_grad(t, base + GOUT)
            if not _compiling() and self._learning:
                self._seen[id(t)] = (weakref.ref(t), base + OUT)
        if bad and self.keeper is not None:  # free reads only: this call's output is non-finite
            self.keeper.settle(index)
        if not _compiling() and self._learning:
            self._finish.append(index)
