"""Find where NaN/Inf is born: forward and backward module hooks that never sync per module.

Each hooked call reduces a tensor with one ``torch.aminmax`` (NaN and inf propagate into the
min/max, so "non-finite" is "min or max not finite"; research/overhead-anchors.md: 0.18 ns/element
on CPU against ~3 ns for ``isfinite``). Where reading a value is free (CPU tensors), the hook reads
min/max at once and counts NaN/inf only for a bad tensor. Elsewhere the min/max and the counts stay
on the device as one small tensor per call, concatenated into the step's single transfer.

Which module is the *origin* is decided later, on the host, by :func:`analyse` (pure Python).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, Optional

import torch

from . import probes

FORWARD, BACKWARD = "forward", "backward"


@dataclass
class Slot:
    """One reduced tensor: either host floats already, or an index into the device stats."""
    dtype: str
    host: Optional[tuple[float, float, float, float]] = None  # (min, max, nan_count, inf_count)
    device_index: int = -1


@dataclass
class StepRecords:
    """What the hooks saw during one optimizer step, in execution order."""
    slots: list[Slot] = field(default_factory=list)
    device_stats: list[torch.Tensor] = field(default_factory=list)  # each (4,) in pack dtype
    # forward calls in finish order: (module index, input slot ids, output slot ids, micro-batch)
    calls: list[tuple[int, list[int], list[int], int]] = field(default_factory=list)
    # backward hook firings in order: (slot id of the gradient, [(module index, "in"|"out"), ...],
    # micro-batch of the forward pass being differentiated)
    grads: list[tuple[int, list[tuple[int, str]], int]] = field(default_factory=list)
    host_bad: bool = False  # a host-read slot was non-finite (known for free where reads are free)
    # fp32 recompute of the forward origin (module index -> max |output|), see counterfactual.py
    fp32_amax: dict[int, Optional[float]] = field(default_factory=dict)
    fp32_checked: bool = False


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    # str(dtype) costs a microsecond per call, and hooks call this for every tensor of every module
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _tensor_list(obj: Any) -> list[torch.Tensor]:
    """:func:`_tensors` as a list, with a fast path for the common single-tensor case."""
    if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
        return [obj] if obj.is_floating_point() and obj.numel() > 0 else []
    return list(_tensors(obj))


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Floating-point tensors inside a module's inputs/outputs (tuples, lists, dicts, HF outputs)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel() > 0:
            yield obj
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)


class Localizer:
    """Hooks every module of ``model``; :meth:`take` hands over one step's records."""

    def __init__(self, model: torch.nn.Module, pack_device: torch.device,
                 should_record: Callable[[], bool]) -> None:
        self.names: list[str] = []
        self.types: list[str] = []
        self._pack_dtype = probes.pack_dtype(pack_device)
        self._pack_device = pack_device
        self._should_record = should_record
        self._handles: list[Any] = []
        self._active = True
        self.modules: list[torch.nn.Module] = []
        # Optional observer of forward inputs (counterfactual.InputKeeper): keep/settle per call.
        self.keeper: Any = None
        seen: set[int] = set()
        for name, module in model.named_modules():
            if id(module) in seen:  # a module registered twice is hooked once, under its first name
                continue
            seen.add(id(module))
            index = len(self.names)
            self.names.append(name or "<model>")
            self.types.append(type(module).__name__)
            self.modules.append(module)
            self._handles.append(module.register_forward_pre_hook(
                partial(self._before_forward, index), with_kwargs=True))
            self._handles.append(module.register_forward_hook(partial(self._after_forward, index)))
        self._reset()

    # -- per-step state ----------------------------------------------------------------------
    def _reset(self) -> None:
        self._records = StepRecords()
        self._slot_of: dict[int, tuple[weakref.ref, int]] = {}
        self._grad_roles: dict[int, tuple[weakref.ref, list[tuple[int, str]]]] = {}
        self._pending_inputs: dict[int, list[list[int]]] = {}
        self._micro_batch = -1  # forward calls of the root module this step, minus one

    def take(self) -> StepRecords:
        """Hand over this step's records and start a new step. No sync."""
        records = self._records
        self._reset()
        return records

    def remove(self) -> None:
        """Remove every hook; gradient hooks still pending on live tensors become no-ops."""
        self._active = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._reset()

    # -- reductions ----------------------------------------------------------------------------
    def _reduce(self, t: torch.Tensor) -> int:
        t = t.detach()
        records = self._records
        mn, mx = torch.aminmax(t)
        if probes.reads_are_free(t.device):
            lo, hi = mn.item(), mx.item()
            nan = inf = 0.0
            if not (math.isfinite(lo) and math.isfinite(hi)):
                nan, inf = float(torch.isnan(t).sum()), float(torch.isinf(t).sum())
                records.host_bad = True
            records.slots.append(Slot(_dtype_name(t.dtype), host=(lo, hi, nan, inf)))
        else:
            stats = torch.stack([mn.to(self._pack_dtype), mx.to(self._pack_dtype),
                                 torch.isnan(t).sum().to(self._pack_dtype),
                                 torch.isinf(t).sum().to(self._pack_dtype)])
            records.device_stats.append(stats.to(self._pack_device, non_blocking=True))
            records.slots.append(Slot(_dtype_name(t.dtype), device_index=len(records.device_stats) - 1))
        return len(records.slots) - 1

    def _slot_for(self, t: torch.Tensor) -> int:
        """Reduce each tensor once per step even when it is one module's output and the next one's input."""
        key = id(t)
        hit = self._slot_of.get(key)
        if hit is not None and hit[0]() is t:
            return hit[1]
        slot = self._reduce(t)
        self._slot_of[key] = (weakref.ref(t), slot)
        return slot

    # -- hooks ---------------------------------------------------------------------------------
    def _before_forward(self, index: int, module: Any, args: Any, kwargs: Any) -> None:
        if not (self._active and self._should_record()):
            return
        if index == 0:  # the root: a new micro-batch (issue 12: "rank 3's micro-batch 2")
            self._micro_batch += 1
        if len(args) == 1 and not kwargs:
            tensors = _tensor_list(args[0])
        else:
            tensors = _tensor_list(args) + _tensor_list(kwargs)
        self._pending_inputs.setdefault(index, []).append([self._slot_for(t) for t in tensors])
        if self.keeper is not None:
            self.keeper.keep(index, args, kwargs, tensors)
        if torch.is_grad_enabled():
            for t in tensors:
                if t.requires_grad:
                    self._watch_grad(t, index, "in")

    def _after_forward(self, index: int, module: Any, args: Any, output: Any) -> None:
        if not (self._active and self._should_record()):
            return
        stack = self._pending_inputs.get(index)
        inputs = stack.pop() if stack else []
        tensors = _tensor_list(output)
        outputs = [self._slot_for(t) for t in tensors]
        self._records.calls.append((index, inputs, outputs, max(self._micro_batch, 0)))
        if self.keeper is not None and self._records.host_bad:  # host path only: values known now
            slots = self._records.slots
            bad = [not _slot_finite(slots[i]) for i in outputs], [not _slot_finite(slots[i]) for i in inputs]
            self.keeper.settle(index, any(bad[0]), any(bad[1]))
        if torch.is_grad_enabled():
            for t in tensors:
                if t.requires_grad:
                    self._watch_grad(t, index, "out")

    def forward_origin(self) -> Optional[int]:
        """The forward origin of the step so far (module index), or None. Reads device stats: a
        sync where reads are not free, so callers ask only on steps known to be bad."""
        records = self._records
        values = [] if not records.device_stats else torch.cat(records.device_stats).tolist()
        resolved = resolve_values(records, values)
        if not any_nonfinite(resolved):
            return None
        return analyse(records, resolved, self.names)[1][FORWARD]

    def _watch_grad(self, t: torch.Tensor, index: int, role: str) -> None:
        key = id(t)
        hit = self._grad_roles.get(key)
        if hit is not None and hit[0]() is t:
            hit[1].append((index, role))
            return
        roles = [(index, role)]
        self._grad_roles[key] = (weakref.ref(t), roles)
        t.register_hook(partial(self._on_grad, roles))

    def _on_grad(self, roles: list[tuple[int, str]], grad: torch.Tensor) -> None:
        # Must never raise or return a tensor: it runs inside the user's backward().
        if self._active and grad is not None and grad.is_floating_point() and grad.numel() > 0:
            # backward k follows forward k in an accumulation loop: the current micro-batch
            self._records.grads.append((self._reduce(grad), roles, max(self._micro_batch, 0)))


def _slot_finite(slot: Slot) -> bool:
    return slot.host is None or (math.isfinite(slot.host[0]) and math.isfinite(slot.host[1]))


# -- host-side analysis (pure Python over one step's resolved values) ---------------------------

@dataclass
class ModuleStat:
    amax: float = 0.0
    nonfinite: bool = False
    nan: float = 0.0
    inf: float = 0.0
    dtype: str = ""
    micro_batch: Optional[int] = None  # where it first went non-finite


def _slot_summaries(values: list[tuple[float, float, float, float]]) -> tuple[list[bool], list[float]]:
    """Per slot: non-finite? and max |value| (NaN when a NaN was present). The writer's hot loop."""
    isfinite, isnan, nan = math.isfinite, math.isnan, math.nan
    bad = [not (isfinite(lo) and isfinite(hi)) for lo, hi, _, _ in values]
    amax = [nan if isnan(lo) or isnan(hi) else max(-lo, hi, lo, -hi) for lo, hi, _, _ in values]
    return bad, amax


def any_nonfinite(values: list[tuple[float, float, float, float]]) -> bool:
    isfinite = math.isfinite
    return not all(isfinite(v[0]) and isfinite(v[1]) for v in values)


def _innermost(candidates: list[int], names: list[str]) -> int:
    """Of several modules flagged by one tensor, the one nested deepest (a child beats its container)."""
    def depth(i: int) -> int:
        return -1 if names[i] == "<model>" else names[i].count(".")
    return max(candidates, key=lambda i: (depth(i), -candidates.index(i)))


def _merge(stats: dict, key: tuple[int, str], slot: int, bad: list[bool], amax: list[float],
           values: list, dtype: str, micro_batch: int) -> None:
    stat = stats.get(key)
    a = amax[slot]
    if stat is None:
        stat = stats[key] = ModuleStat(amax=a, dtype=dtype)
    elif a != a or a > stat.amax:  # NaN (a != a) wins: it was seen
        stat.amax = a
    if bad[slot]:
        if not stat.nonfinite:
            stat.micro_batch = micro_batch
        stat.nonfinite = True
        stat.nan += values[slot][2]
        stat.inf += values[slot][3]


def analyse(records: StepRecords, values: list[tuple[float, float, float, float]],
            names: list[str]) -> tuple[dict[tuple[int, str], ModuleStat], dict[str, Optional[int]]]:
    """Per (module, phase) statistics and the origin module of each phase (or None).

    Forward: the first call to finish whose output is non-finite while its inputs were finite
    (inner modules finish before their containers, so it is the innermost). Backward, in the order
    gradients flow: the first module whose gradient w.r.t. its input is non-finite while the
    gradient w.r.t. its output was finite.
    """
    bad, amax = _slot_summaries(values)
    slots = records.slots
    stats: dict[tuple[int, str], ModuleStat] = {}
    origins: dict[str, Optional[int]] = {FORWARD: None, BACKWARD: None}
    for module, inputs, outputs, micro_batch in records.calls:
        for s in outputs:
            _merge(stats, (module, FORWARD), s, bad, amax, values, slots[s].dtype, micro_batch)
        if origins[FORWARD] is None and any(bad[s] for s in outputs) and not any(bad[s] for s in inputs):
            origins[FORWARD] = module
    out_bad: dict[int, bool] = {}
    for slot, roles, micro_batch in records.grads:
        is_bad = bad[slot]
        candidates = []
        for module, role in roles:
            if role == "out":
                out_bad[module] = out_bad.get(module, False) or is_bad
        for module, role in roles:
            if role == "in":
                _merge(stats, (module, BACKWARD), slot, bad, amax, values, slots[slot].dtype, micro_batch)
                if is_bad and not out_bad.get(module, False):
                    candidates.append(module)
        if candidates and origins[BACKWARD] is None:
            origins[BACKWARD] = _innermost(candidates, names)
    return stats, origins


def _child_of(container: str, name: str) -> Optional[str]:
    """The direct child of ``container`` that ``name`` lies in (``h.0`` + ``h.0.attn.c`` -> ``h.0.attn``)."""
    prefix = "" if container == "<model>" else container + "."
    if name == container or name == "<model>" or not name.startswith(prefix):
        return None
    return prefix + name[len(prefix):].split(".", 1)[0]


def flows_into(records: StepRecords, values: list[tuple[float, float, float, float]], names: list[str],
               origins: dict[str, Optional[int]]) -> dict[str, Optional[str]]:
    """For an origin in a container's own code (between its children): the child the non-finite
    value went into. Forward: the first child call with a non-finite input. Backward: the first
    child whose output gradient is non-finite (gradients flow from the container's code into it)."""
    bad, _ = _slot_summaries(values)
    out: dict[str, Optional[str]] = {FORWARD: None, BACKWARD: None}
    if origins[FORWARD] is not None:
        container = names[origins[FORWARD]]
        for module, inputs, _outputs, _micro in records.calls:
            child = _child_of(container, names[module])
            if child is not None and any(bad[s] for s in inputs):
                out[FORWARD] = child
                break
    if origins[BACKWARD] is not None:
        container = names[origins[BACKWARD]]
        for slot, roles, _micro in records.grads:
            if bad[slot]:
                child = next((c for c in (_child_of(container, names[m]) for m, role in roles if role == "out")
                              if c is not None), None)
                if child is not None:
                    out[BACKWARD] = child
                    break
    return out


def resolve_values(records: StepRecords, device_values: list[float]) -> list[tuple[float, float, float, float]]:
    """Each slot's (min, max, nan, inf), taking device slots from the step's transferred values."""
    if not records.device_stats:
        return [slot.host for slot in records.slots]  # type: ignore[misc]
    out = []
    for slot in records.slots:
        if slot.host is not None:
            out.append(slot.host)
        else:
            i = slot.device_index * 4
            out.append(tuple(device_values[i:i + 4]))  # type: ignore[arg-type]
    return out
