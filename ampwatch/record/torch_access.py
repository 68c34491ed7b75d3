"""Pure functions over torch objects: scaler state and gradient reductions.

All access to GradScaler's private attributes lives here, once, each with a public fallback
(a test pins the behaviour on the torch version we ship with). Nothing here syncs the host
unless its docstring says so.
"""
from __future__ import annotations

import enum
import math
import os
import sys
from typing import Any, Iterator, Optional, Sequence, Union

import torch

# AMPWATCH_CPU_AS_ACCELERATOR=1 makes ampwatch treat the CPU like CUDA: no free host reads, the
# device-resident (foreach, one-transfer) path everywhere, so CI exercises the accelerator path.

# float64 keeps counts exact and scales like 2**24 exact; MPS has no float64.
def pack_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def reads_are_free(device: torch.device) -> bool:
    """True where reading a tensor's value costs no device sync (CPU tensors are computed eagerly),
    unless ``AMPWATCH_CPU_AS_ACCELERATOR=1`` asks for the accelerator path on the CPU."""
    return device.type == "cpu" and not cpu_as_accelerator()


def cpu_as_accelerator() -> bool:
    """Read at call time (tests switch it per test with monkeypatch.setenv)."""
    return os.environ.get("AMPWATCH_CPU_AS_ACCELERATOR", "") not in ("", "0")


# Whether Dynamo is tracing the code that asks: bound once (a Python frame less per call); Dynamo
# knows the function and folds it to True. ``is_dynamo_compiling`` (torch >= 2.3) is a bare
# ``return False`` in eager, where ``is_compiling`` also asks ``torch.jit.is_scripting()``: two
# Python frames where one does, in every module's hook and every gradient hook of an observed eager
# step (~300 calls on GPT-2 small's), and in each clip call. Dynamo's traces, the backward's hooks
# included (tests/test_compile.py), take the compiled branch; a trace that is not Dynamo's (a
# non-strict ``torch.export``) runs the hooks as eager code, as it runs the model's.
dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", None) or torch.compiler.is_compiling


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


TORCH_VERSION = _version(torch.__version__)

# Dynamo traces ``register_hook`` on a tensor made inside the graph from torch 2.11 on (pytorch
# PR #172126, issue #172020); before, each such call is a graph break ("Compilation of intermediate
# hooks requires compiled autograd") and the hook cannot be traced into the backward graph
TRACES_TENSOR_HOOKS = TORCH_VERSION >= (2, 11)


# --- GradScaler -----------------------------------------------------------------------------

def scaler_enabled(scaler: Any) -> bool:
    return scaler is not None and bool(scaler.is_enabled())


def scaler_settings(scaler: Any) -> dict[str, Any]:
    """The scaler's configuration through its public getters (no sync)."""
    if scaler is None:
        return {"scaler_enabled": False, "init_scale": None, "growth_factor": None,
                "backoff_factor": None, "growth_interval": None}
    enabled = scaler_enabled(scaler)
    return {
        "scaler_enabled": enabled,
        "init_scale": float(getattr(scaler, "_init_scale", 0.0)) if enabled else None,
        "growth_factor": float(scaler.get_growth_factor()) if enabled else None,
        "backoff_factor": float(scaler.get_backoff_factor()) if enabled else None,
        "growth_interval": int(scaler.get_growth_interval()) if enabled else None,
    }


def scale_tensor(scaler: Any) -> Optional[torch.Tensor]:
    """A copy of the current scale as a device tensor, or None before the scaler's first use. No sync."""
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor):
        return scale.detach().reshape(()).clone()
    return None


def live_scale(scaler: Any) -> Optional[torch.Tensor]:
    """The scaler's own scale tensor (not a copy: ``update()`` changes it in place, so read it
    before), or None before the scaler's first use. No op, no sync."""
    scale = getattr(scaler, "_scale", None)
    if not isinstance(scale, torch.Tensor):
        return None
    return scale.detach() if scale.requires_grad else scale  # GradScaler's never does: no detach a step


class ScaleReads:
    """Where reads are free: the scaler's scale as a float, read again only when the scale tensor
    changed (on a device, its inverse, made again only then). Its version counter moves with every
    in-place change (``update()``, ``fill_``), and a read costs ~15 us inside a CPU training step;
    a step reads the scale twice or more (each backward's end, and before ``update()``)."""

    def __init__(self) -> None:
        self._tensor: Optional[torch.Tensor] = None
        self._version = -1
        self._value: Optional[float] = None
        self._inverse: Optional[torch.Tensor] = None  # on a device: 1/scale, made for _inverse_of
        self._inverse_of: tuple = (None, -1)

    def value(self, scaler: Any) -> Optional[float]:
        scale = getattr(scaler, "_scale", None)
        if not isinstance(scale, torch.Tensor):
            return None
        if scale is not self._tensor or scale._version != self._version:
            self._tensor, self._version, self._value = scale, scale._version, float(scale.item())
        return self._value

    def inverse(self, scale: torch.Tensor) -> torch.Tensor:
        """1/scale as a float32 device tensor, made again only when the scale tensor changed (its
        version counter, host metadata: no sync). The scale changes at ``update()`` when it grows
        or backs off, rarely; the three ops are saved on every other backward pass."""
        if self._inverse is None or self._inverse_of[0] is not scale or self._inverse_of[1] != scale._version:
            self._inverse = scale.detach().reshape(()).double().reciprocal().float()
            self._inverse_of = (scale, scale._version)
        return self._inverse


def inverse_scale(scaler: Any, reads_free: Optional[bool] = None,
                  reads: Optional[ScaleReads] = None) -> Optional[Union[torch.Tensor, float]]:
    """1/scale, for unscaling norms measured on scaled gradients: where reads are free a Python
    float (no op), else a float32 device tensor computed in float64 (a scale need not be a power of
    two). Either rounds 1/scale to float32 when multiplied into float32 norms. No sync.
    ``reads``: a :class:`ScaleReads` that spares reading an unchanged scale again (or, on a device,
    computing its inverse again)."""
    scale = getattr(scaler, "_scale", None)
    if not isinstance(scale, torch.Tensor):
        return None
    if reads_are_free(scale.device) if reads_free is None else reads_free:
        value = reads.value(scaler) if reads is not None else scale.item()
        return 1.0 / value if value else math.inf
    if reads is not None:
        return reads.inverse(scale)
    return scale.detach().reshape(()).double().reciprocal().float()


def found_inf(scaler: Any, optimizer: Any) -> Optional[torch.Tensor]:
    """Sum of the scaler's per-device inf flags for ``optimizer`` (between step() and update()), a
    0-d float32 tensor. No sync."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not states or id(optimizer) not in states:
        return None
    flags = list(states[id(optimizer)].get("found_inf_per_device", {}).values())
    if not flags:
        return None
    if len(flags) == 1:  # one device, the usual case: the scaler's own flag (nothing changes it
        flag = flags[0]    # in place before update()), with no op a step (GradScaler's is 0-d)
        return flag if flag.dim() == 0 else flag.reshape(())
    device = flags[0].device
    return torch.stack([f.to(device, non_blocking=True).reshape(()) for f in flags]).sum()


def optimizer_stage_unscaled(scaler: Any, optimizer: Any) -> bool:
    """Whether unscale_ already ran for ``optimizer`` this iteration (the scaler's OptState)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not states or id(optimizer) not in states:
        return False
    stage = states[id(optimizer)].get("stage")
    if not isinstance(stage, enum.Enum):
        return getattr(stage, "name", str(stage)) in ("UNSCALED", "STEPPED")
    done = _DONE_STAGES.get(type(stage))
    if done is None:  # the enum's members by name, once: its ``.name`` is a Python property
        done = _DONE_STAGES[type(stage)] = tuple(s for s in type(stage) if s.name in ("UNSCALED", "STEPPED"))
    return stage in done


_DONE_STAGES: dict[type, tuple] = {}  # GradScaler's OptState -> its members UNSCALED and STEPPED


def run_hook_first(optimizer: Any, handle: Any) -> None:
    """Move the optimizer step post-hook behind ``handle`` ahead of the optimizer's others (its
    private ordered dict of hooks; where it has none, the hook stays last)."""
    hooks = getattr(optimizer, "_optimizer_step_post_hooks", None)
    key = getattr(handle, "id", None)
    if hasattr(hooks, "move_to_end") and key in hooks:
        hooks.move_to_end(key, last=False)


def steps_inside_kernel(optimizer: Any) -> bool:
    """Fused optimizers take the scale themselves: GradScaler always calls their step()."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def backward_pass_id() -> int:
    """An id of the backward pass now running (-1 outside one), to act once per pass."""
    return _current_graph_task_id() if _current_graph_task_id is not None else -1


def at_backward_end(callback: Any) -> None:
    """Run ``callback`` once the current backward pass has finished (call from inside an autograd hook).

    The engine runs queued callbacks after syncing the leaf streams, so on CUDA the callback may read
    any gradient on the current stream. We queue a callback that queues ours: callbacks added while
    callbacks run go last, so ours runs after every callback queued during the pass, such as DDP's
    finalize_backward, which waits for the gradient all-reduce."""
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(callback))


# --- module hooks ----------------------------------------------------------------------------

def hook_entries(handles: Sequence[Any]) -> list[tuple[dict, int]]:
    """The (hook dict, key) pairs that registered module hooks occupy (``RemovableHandle``'s dicts:
    the hook's, and the ``with_kwargs`` or ``always_call`` flags'), for :func:`unhook`. Worked out
    once per set of handles: the weak references resolved here cost more than taking the hooks out."""
    entries = []
    for handle in handles:  # torch.utils.hooks.RemovableHandle
        for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
            hooks = ref()
            if hooks is not None:
                entries.append((hooks, handle.id))
    return entries


def unhook(entries: Sequence[tuple[dict, int]]) -> list[tuple[dict, int, Any]]:
    """Take registered module hooks out of their modules' dicts, as ``handle.remove()`` would, and
    return what was taken: :func:`rehook` puts the very same entries back. ``entries`` from
    :func:`hook_entries`; one already gone (its handle removed) is skipped. One comprehension for
    every module's hooks: ~0.3 us a hook against ~5 us for registering anew (a handle, its
    weakrefs), times every module on each observed step."""
    return [(hooks, key, hooks.pop(key)) for hooks, key in entries if key in hooks]


def rehook(taken: list[tuple[dict, int, Any]]) -> None:
    """Undo :func:`unhook`: the same key and hook, at the end of each dict (where registering puts it)."""
    for hooks, key, value in taken:
        hooks[key] = value


# --- distributed ----------------------------------------------------------------------------

def is_dtensor(t: Any) -> bool:
    """A ``DTensor`` (FSDP2 parameters and gradients, tensor parallelism), without importing it."""
    return hasattr(t, "placements") and hasattr(t, "to_local")


_PLAIN = {torch.Tensor, torch.nn.Parameter}  # types that are their own local part (see local)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, else ``t``. No collective, no sync.

    Every reduction the recorder makes goes through here first: a reduction on a sharded DTensor
    would return a ``Partial`` result whose use issues an all-reduce on the training step."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:  # the common case, cheaply
        return t
    if is_dtensor(t):
        return t.detach().to_local()
    return t


def is_sharded(t: Any) -> bool:
    """Whether a DTensor is split across ranks (some ``Shard`` placement) rather than replicated."""
    return is_dtensor(t) and any(getattr(p, "is_shard", lambda: False)() for p in t.placements)


def fsdp1_wrapped(model: torch.nn.Module) -> bool:
    """Whether ``model`` is or holds a ``FullyShardedDataParallel`` (FSDP1) module: flat sharded grads."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FullyShardedDataParallel", None) if fsdp is not None else None
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def agreed_value(key: str, proposal: str) -> Optional[str]:
    """The value all ranks of the default process group agree on for ``key``: the first rank to ask
    stores its ``proposal`` and every later rank reads it back (one compare-and-set on the
    rendezvous store, at attach time only: a key-value request, not a collective, and it waits for
    no other rank). None when there is no store to ask."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        value = store.compare_set(key, "", proposal)
    except (AttributeError, RuntimeError, ValueError, NotImplementedError):
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


# --- gradients ------------------------------------------------------------------------------

def _group_by_device(tensors: Sequence[torch.Tensor]) -> dict[torch.device, list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return groups


def tensor_norms(tensors: Sequence[torch.Tensor], out_device: torch.device) -> torch.Tensor:
    """L2 norm of each tensor, as one float32 vector on ``out_device`` (one foreach call per device).

    A norm is inf/NaN exactly when its tensor holds inf/NaN, so this also flags non-finite grads.
    DTensors give this rank's shard norm (:func:`local`). No sync, no collective.
    """
    if not tensors:
        return torch.zeros(0, device=out_device)
    if all(type(t) is torch.Tensor and t.device == out_device for t in tensors):  # the usual case
        return torch.stack(_foreach_norm_f32(list(tensors)))
    tensors = [local(t) for t in tensors]
    result: list[Optional[torch.Tensor]] = [None] * len(tensors)
    for device, idx in _group_by_device(tensors).items():
        group = [tensors[i] for i in idx]
        norms = _foreach_norm_f32(group)
        for i, n in zip(idx, norms):
            result[i] = n.to(out_device, non_blocking=True)
    return torch.stack(result)  # type: ignore[arg-type]


def tensor_norms_read(tensors: Sequence[torch.Tensor], out_device: torch.device) -> list[float]:
    """Where reads are free: :func:`tensor_norms` as Python floats, the same values. float32 plain
    tensors (the usual gradients) skip the ``dtype`` argument and the stack: one op, not two, where
    each op costs ~15 us inside a CPU training step."""
    if tensors and all(type(t) is torch.Tensor and t.dtype is torch.float32 for t in tensors):
        foreach_norm = getattr(torch, "_foreach_norm", None)
        if foreach_norm is not None:
            return [v.item() for v in foreach_norm(list(tensors), 2)]
    return tensor_norms(tensors, out_device).tolist()


def _foreach_norm_f32(group: list[torch.Tensor]) -> list[torch.Tensor]:
    foreach_norm = getattr(torch, "_foreach_norm", None)
    if foreach_norm is not None:
        try:
            return list(foreach_norm(group, 2, dtype=torch.float32))
        except (TypeError, RuntimeError):
            pass
    return [torch.linalg.vector_norm(t, dtype=torch.float32) for t in group]


_ABS_COPIES_BYTES = 64 << 20


def max_abs_each(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """max |x| of each tensor (all on one device, none empty), 0-d, in each one's dtype or float32:
    NaN propagates, inf stays inf. No sync, nothing recorded for autograd.

    On an accelerator one multi-tensor ``_foreach_norm(inf)`` launch. On the CPU that op runs
    ``vector_norm(inf)`` tensor by tensor, unvectorized: ~3 ns an element, ~10x an ``aminmax``
    (a list of 146 small gradients: 1.04 ms), where ``_foreach_abs`` then ``_foreach_max`` take a
    quarter of it (0.27 ms), holding |x| of every tensor for a moment: above ``_ABS_COPIES_BYTES``
    of them, one tensor's at a time. CPU tensors come here on a GPU's path too (FSDP's CPU offload)."""
    with torch.no_grad():
        if tensors[0].device.type == "cpu":
            foreach_max = getattr(torch, "_foreach_max", None)  # torch >= 2.5
            if foreach_max is not None and sum([t.nbytes for t in tensors]) <= _ABS_COPIES_BYTES:
                return list(foreach_max(torch._foreach_abs(list(tensors))))
            return [t.abs().amax() for t in tensors]
        return list(torch._foreach_norm(list(tensors), math.inf))


def tensor_details(grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                   out_device: torch.device, dtype: torch.dtype,
                   known_finite: Optional[Sequence[bool]] = None) -> torch.Tensor:
    """Per gradient: [max |g|, NaN count, inf count, zero count, param L2 norm], shape (n, 5). No sync.

    DTensors are reduced on this rank's shard (:func:`local`): no collective.

    Paid only on ``layer_every`` steps and bad steps. ``aminmax`` instead of ``abs().amax()``
    or ``_foreach_norm(inf)``: 2-18x cheaper on CPU (shared/research/overhead-anchors.md).
    ``known_finite[i]`` (when the caller could read the norms for free) skips the two full passes
    that count NaN/inf in gradients already known to be finite.
    """
    rows = []
    grads, params = [local(g) for g in grads], [local(p) for p in params]
    zero_count = torch.zeros((), dtype=dtype, device=grads[0].device) if grads else None
    for i, (g, p) in enumerate(zip(grads, params)):
        if g.numel() == 0:  # a rank's shard may be empty (FSDP pads; a bias of 1 on 2 ranks)
            rows.append(torch.zeros(5, dtype=dtype, device=out_device))
            continue
        mn, mx = torch.aminmax(g.detach())
        amax = torch.maximum(mn.abs(), mx.abs()).to(dtype)
        if known_finite is not None and known_finite[i]:
            nan = inf = zero_count.to(g.device)
        else:
            nan = torch.isnan(g).sum().to(dtype)
            inf = torch.isinf(g).sum().to(dtype)
        zero = (g.numel() - torch.count_nonzero(g)).to(dtype)
        pnorm = torch.linalg.vector_norm(p.detach(), dtype=torch.float32).to(dtype)
        rows.append(torch.stack([amax, nan, inf, zero, pnorm]).to(out_device, non_blocking=True))
    if not rows:
        return torch.zeros((0, 5), dtype=dtype, device=out_device)
    return torch.stack(rows)


def tensor_details_read(grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                        known_finite: Optional[Sequence[bool]] = None) -> list[float]:
    """:func:`tensor_details` where reads are free (CPU), as a flat list (5 floats per gradient):
    each value is read as it is made, so a gradient costs three reductions (``aminmax``,
    ``count_nonzero``, the parameter norm), plus the NaN/inf counts where it is not known to be
    finite, instead of a dozen small ops."""
    rows: list[float] = []
    for i, (g, p) in enumerate(zip(grads, params)):
        g, p = local(g).detach(), local(p).detach()
        if g.numel() == 0:  # a rank's shard may be empty (FSDP pads; a bias of 1 on 2 ranks)
            rows += (0.0, 0.0, 0.0, 0.0, 0.0)
            continue
        mn, mx = torch.aminmax(g)
        lo, hi = mn.item(), mx.item()
        amax = lo if lo != lo else max(-lo, hi)  # NaN propagates
        if known_finite is not None and known_finite[i]:
            nan = inf = 0.0
        else:
            nan, inf = float(torch.isnan(g).sum()), float(torch.isinf(g).sum())
        zero = float(g.numel() - int(torch.count_nonzero(g)))
        pnorm = float(torch.linalg.vector_norm(p, dtype=torch.float32))
        rows += (amax, nan, inf, zero, pnorm)
    return rows


def tensor_details_foreach(grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                           out_device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The accelerator path of :func:`tensor_details`: a handful of ``torch._foreach_*`` calls over
    all gradients at once, shape (n, 5). NaN/inf counts are not paid for here: they are -1
    ("not counted"); the writer knows a gradient with a finite norm has none. No sync."""
    if not grads:
        return torch.zeros((0, 5), dtype=dtype, device=out_device)
    # set comprehensions, not a call per tensor: this runs over every parameter on each detailed step
    if not {type(t) for t in grads} | {type(t) for t in params} <= _PLAIN:
        grads, params = [local(g) for g in grads], [local(p) for p in params]  # DTensors: this rank's shard
    device = grads[0].device
    numels = tuple([g.numel() for g in grads])
    # a gradient lies on its parameter's device (torch refuses any other ``.grad``): the gradients'
    # devices say it for both (a device object made per tensor asked)
    if 0 in numels or len({t.device for t in grads}) > 1:
        # rare (model parallel; an empty shard, whose inf-norm is undefined): per tensor
        return tensor_details(grads, params, out_device, dtype)
    # under no_grad, not a ``detach`` per tensor (two dispatched ops per parameter, ~300 on
    # GPT-2 small): the foreach ops record nothing for autograd either way
    with torch.no_grad():
        amax = torch.stack(max_abs_each(grads)).float()
        nonzero = torch.stack(torch._foreach_norm(grads, 0, dtype=torch.float32))
        pnorm = torch.stack(torch._foreach_norm(params, 2, dtype=torch.float32))
        unknown = torch.full_like(amax, -1.0)
        rows = torch.stack([amax, unknown, unknown, _element_counts(numels, device) - nonzero, pnorm], dim=1)
        return rows.to(out_device, dtype, non_blocking=True)


# (device, element count of each gradient) -> those counts as a float32 tensor on the device: made
# once per layout, not a host list copied to the device on every detailed step (from pageable
# memory, a copy the host waits for on CUDA)
_COUNTS: dict[tuple, torch.Tensor] = {}


def _element_counts(numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    key = (device, numels)
    counts = _COUNTS.get(key)
    if counts is None:
        if len(_COUNTS) >= 16:  # layouts that never settle (a model that changes its parameters)
            _COUNTS.clear()
        counts = _COUNTS[key] = torch.tensor(numels, dtype=torch.float32).to(device)
    return counts


def call_is_compiled(module: torch.nn.Module) -> bool:
    """Whether this call of ``module`` goes through torch.compile: ``torch.compile(module)`` (an
    OptimizedModule is calling it) or ``module.compile()``. For an eager hook of ``module`` itself,
    which runs before Dynamo traces the forward. False where torch does not say (a compiled
    function that calls the module)."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing is compiled
    check = getattr(eval_frame, "_is_in_optimized_module", None)
    return bool(check()) if check is not None else False


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """:func:`nested_tensors` as a list, in the same order, without a generator frame per level:
    for eager hooks that run on every forward (the replay's root hooks)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    found: list[torch.Tensor] = []
    _collect(obj, found, 0)
    return found


def _collect(obj: Any, found: list, depth: int) -> None:
    if isinstance(obj, (tuple, list)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return
    for item in items:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif depth < 2 and isinstance(item, (tuple, list, dict)):
            _collect(item, found, depth + 1)


def nested_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor inside a module's inputs or outputs: a tensor, or tuples, lists and dicts of
    them (HF's ModelOutput is a dict) up to three levels deep."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from nested_tensors(item, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            yield from nested_tensors(item, depth + 1)
