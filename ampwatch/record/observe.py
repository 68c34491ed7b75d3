"""Module observation: where NaN/Inf is born, at one reduction per hooked tensor.

Every module gets four fixed slots at attach, one per role: its forward input (IN), its forward
output (OUT), the gradient w.r.t. its output (GOUT) and w.r.t. its input (GIN). One stats buffer,
allocated once on the model's device, holds for each slot the min and max of what was observed this
step, once per floating dtype (one small (slots, 2) tensor each for fp64/fp32/fp16/bf16, so ``torch.aminmax``
writes its result straight into the slot in the tensor's own dtype: no casts, no stacking). NaN
propagates into min and max and inf shows as ±inf, so "non-finite" and its kind are read from the
slot on the host. A slot observed several times in a step (a shared module, micro-batches) keeps
the running min/max.

Eager: the first observed step (and the next observed step after the module call count changed or
a slot turned out to be changed in place while pending) is a *learning* step: the
hooks note which inputs and outputs are the very tensors another module already produced or
received, unchanged since (the residual stream, a container's input handed to its first child, a
container's output that is its last child's), and later steps skip reducing those and skip their
gradient hooks: the host reads the other module's slot instead. Inputs are observed in the forward
hook, after the module ran, so a module costs one Python hook call per forward: only the root
(micro-batches) and modules that work in place (their input must be measured before they change
it) also get a pre-hook. Under ``torch.compile`` the hooks skip the
Python bookkeeping and Dynamo traces them into the graph with no graph break; a tensor already
observed in the trace is not observed again, and the trace notes the alias, as eager's learning step
learns it (:mod:`.traced_aliases`). On an accelerator a
forward hook traces ``x.abs().amax()`` for each tensor (inductor fuses it into the kernel that makes
``x``) and appends the 0-d result to the step's maxima, a list mutation Dynamo replays after the
graph; the root's wrapper joins them in the graph as its forward returns, so the maxima leave the
graph as one output per dtype: no op call, no Python per module call (the root's forward hook,
outside the graph, folds them before another graph runs). Gradients are observed with
``Tensor.register_hook``, which Dynamo also traces, into the backward graph, where a hook cannot hand
a value out that way: there the hook traces ``g.abs().amax()`` as well and hands the 0-d result to
the op ``ampwatch::keep_max``, whose body keeps a copy of it. Where reads are free (and for a tensor
subclass) every traced hook calls the op ``ampwatch::observe`` instead, whose body reduces the
tensors at run time. Both ops are registered as side effects, so the compilers keep them. Eager
fills the same gradient hook dict without the public method's Python costs (:func:`add_grad_hook`:
the same gradient, at a fifth of the host cost). Between observed steps the hooks are removed, in
eager and under torch.compile alike (:meth:`ModuleObserver.set_observing`).

Where reads are free (CPU) the stats live on the host instead (:mod:`.hoststats`): a hook queues
its tensor; at the flush one ``aminmax`` per tensor is read into an array of doubles, which the
step pack copies whole; nothing else touches a tensor. Writing each result into a
buffer row (``out=`` views) and reading it back cost three times as much host time, and each op
costs ~15 us inside a training step on the CPU.

Micro-batches (which one a value went non-finite in) cost nothing on a step with one
forward pass of the root module. On a step with k, each new root call marks, in one small per-slot
tensor, the slots that went non-finite during the previous micro-batch (a fixed handful of ops per
micro-batch, none per module call); a slot bad at the end and not marked went bad in the last one.

The fp32 counterfactual (``counterfactual.py``, option ``fp32_check``) is fed from the eager
hooks: ``keeper.keep`` stores a reference to each module's latest inputs (a dict slot per
module, no copy, nothing grows). Under torch.compile the inner hooks keep nothing (None there).
"""
from __future__ import annotations

import contextlib
import math
import weakref
from collections import OrderedDict
from functools import partial
from typing import Any, Iterator, Optional

import torch

from . import torch_access, traced_aliases
from .batched import BatchedReducer
from .compiled import CompiledBlocks, GraphSplit
from .copies import ours
from .hoststats import HostQueue, HostStats
from .slots import DTYPE_NAMES, GIN, GOUT, IN, OUT, ROLES

DTYPES = tuple(getattr(torch, name) for name in DTYPE_NAMES)
DTYPE_INDEX = {dt: i for i, dt in enumerate(DTYPES)}


_OBSERVERS: dict[int, "ModuleObserver"] = {}  # observer id -> observer, for the op


def _trace_note(ctx: Any) -> None:
    """While Dynamo traces an observed forward (``torch._dynamo.comptime``; never at run time): the
    observer named by the local ``oid`` notes what its traced hooks decided (:func:`.traced_aliases.note`).
    Never raises inside the user's compile: a failure notes no alias, and none from then on."""
    observer = None
    try:
        observer = _OBSERVERS.get(ctx.get_local("oid").as_python_constant())
        if observer is not None:
            traced_aliases.note(ctx, observer, ctx.get_local("note").as_python_constant())
    except Exception:
        if observer is not None:
            observer._trace_dedupe_next = False


_LIBRARY = torch.library.Library("ampwatch", "DEF")
# CUDA graphs (torch.compile's "reduce-overhead" and "max-autotune" modes) replay the kernels they
# captured without running Python: the op's body would run once, at capture, and later steps would
# record nothing (its results left in the graph's memory pool). Tagged unsafe, inductor keeps the
# op out of its CUDA graphs (it splits the graph around the op where graph partitioning is on, the
# default in recent torch, and otherwise runs that graph without CUDA graphs); where torch has no
# such tag, the body checks for a capture and stops observing modules with a warning.
_CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)
_LIBRARY.define("observe(Tensor[] xs, int buffer, int[] slots) -> ()",
                tags=(_CUDAGRAPH_UNSAFE,) if _CUDAGRAPH_UNSAFE is not None else ())


def observe(xs: list[torch.Tensor], buffer: int, slots: list[int]) -> None:
    """``ampwatch::observe``: reduce each of ``xs`` into its slot of observer ``buffer``'s stats.

    The op under torch.compile: hooks traced into a graph call it, once per module call for all
    its tensors, and its body runs at run time (as Python, inside compiled graphs too). The stats
    are looked up here rather than passed in: a compiled graph that took them as an input would
    save them for its backward, and any write to them between forward and backward (an eager
    module, another compiled graph) would fail autograd's version check. Defined with
    ``torch.library.Library`` and one kernel for every backend, not ``torch.library.custom_op``:
    its inputs never require grad, and the custom op's Python autograd layer cost tens of us per
    call, on every module call of every step (bench/hostcost.py --compile)."""
    observer = _OBSERVERS.get(buffer)
    if observer is None or not observer.active:  # the watch was closed or stopped: a no-op
        return
    observer.traced = True  # its hooks are in a compiled graph (the root's hook folds what it hands out)
    if not observer.observing:  # a step between layer_every steps that a replay localizes (replay.py)
        return
    try:
        if _CUDAGRAPH_UNSAFE is None and xs and xs[0].is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("module observation cannot run inside a CUDA graph capture (torch.compile "
                               "mode 'reduce-overhead' or 'max-autotune' on torch without the cudagraph_unsafe "
                               "tag): compile with mode='default', or upgrade torch")
        observer.reduce_traced(xs, slots)
    except Exception as exc:  # inside the user's compiled forward: recording must never take it down
        observer._failed(exc)


_LIBRARY.impl("observe", observe, "CompositeExplicitAutograd")


@torch.library.register_fake("ampwatch::observe")
def _observe_fake(xs: list[torch.Tensor], buffer: int, slots: list[int]) -> None:
    return None


_LIBRARY.define("keep_max(Tensor amax, int buffer, int slot) -> ()",
                tags=(_CUDAGRAPH_UNSAFE,) if _CUDAGRAPH_UNSAFE is not None else ())


def keep_max(amax: torch.Tensor, buffer: int, slot: int) -> None:
    """``ampwatch::keep_max``: a gradient's max |x|, reduced inside a compiled backward graph (the
    compiler fuses the reduction into the kernel that makes the gradient), kept for ``slot`` of
    observer ``buffer``. A gradient hook in a backward graph cannot hand a value out as a graph
    output the way the forward's hooks do (:meth:`ModuleObserver._observe_traced`); this op call is
    the way out. Its body keeps a copy of the 0-d tensor (the compiler may reuse its memory once the
    op returns): one small copy where :func:`observe` ran a ``_foreach_norm`` over the gradient.
    Writing the max into a buffer inside the graph instead (a forward input mutated in the backward,
    which AOTAutograd keeps since torch 2.5) works for one graph, but the graph saves the buffer for
    its backward: where another graph's backward writes it first (each block compiled on its own)
    or eager code does between forward and backward, autograd's version check fails the user's
    ``backward()`` (tried on torch 2.13, aot_eager and inductor)."""
    observer = _OBSERVERS.get(buffer)
    if observer is None or not observer.active or not observer.observing:
        return
    try:
        if _CUDAGRAPH_UNSAFE is None and amax.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("module observation cannot run inside a CUDA graph capture (torch.compile "
                               "mode 'reduce-overhead' or 'max-autotune' on torch without the cudagraph_unsafe "
                               "tag): compile with mode='default', or upgrade torch")
        observer._batch.keep(DTYPE_INDEX[amax.dtype], amax.clone(), slot)
    except Exception as exc:  # inside the user's compiled backward: recording must never take it down
        observer._failed(exc)


_LIBRARY.impl("keep_max", keep_max, "CompositeExplicitAutograd")


@torch.library.register_fake("ampwatch::keep_max")
def _keep_max_fake(amax: torch.Tensor, buffer: int, slot: int) -> None:
    return None


def _keep_in_graphs(op: Any) -> None:
    """An op that returns nothing and mutates nothing would be dropped from compiled graphs as dead
    code. Where the compilers' dead-code check (``torch._library.utils.is_impure``) honours FX's
    side-effect registry, registering it there keeps it at the cost of a plain op call; older
    torch gets an ordered effect instead (each call then also pays the effect token's Python
    wrapper, tens of us)."""
    if hasattr(torch._library.utils, "is_impure"):
        torch.fx.node.has_side_effect(op)
        return
    try:
        from torch._higher_order_ops import effects
        register = getattr(torch.library, "_register_effectful_op", None) or effects._register_effectful_op
        register(op, effects._EffectType.ORDERED)
    except (ImportError, AttributeError):  # older torch: under compile the op may be dropped (eager is unaffected)
        pass


_keep_in_graphs(torch.ops.ampwatch.observe.default)
_keep_in_graphs(torch.ops.ampwatch.keep_max.default)


_compiling = torch_access.dynamo_compiling  # a module global: one lookup in each hook call


def nested_tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    """Floating-point tensors inside a module's inputs/outputs (tuples, lists, dicts, HF outputs)."""
    for t in torch_access.nested_tensors(obj):  # a plain generator, as Dynamo traces it in compiled hooks
        if t.dtype in DTYPE_INDEX and t.numel() > 0:
            yield t


def tensor_list(obj: Any) -> list[torch.Tensor]:
    if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
        return [obj] if obj.dtype in DTYPE_INDEX and obj.numel() > 0 else []
    return list(nested_tensors_of(obj))


def _inputs(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """A call's floating inputs, positional then keyword (the positions aliases are keyed by)."""
    return tensor_list(args[0]) if len(args) == 1 and not kwargs else tensor_list(args) + tensor_list(kwargs)


def add_grad_hook(t: torch.Tensor, node: Any, hook: Any) -> None:
    """``t.register_hook(hook)`` for a non-leaf ``t`` of ``node``, without its Python costs (a
    RemovableHandle, an OrderedDict created per tensor, torch-function checks: ~8 us of host time
    per tensor inside a training step, where it runs for every module output). It fills the same
    dict on ``t`` that ``Tensor.register_hook`` fills and registers it on ``node`` the same way, so
    the hook sees the gradient of ``t``'s value at registration even if ``t`` is changed in place
    later (torch then starts a new dict for the new value), and the user's own hooks on ``t`` run
    as before. Keyed by the hook itself, never an int (the keys handles use); not removable: the
    tensor dies with the step. A tensor subclass (DTensor) goes the public way: it may dispatch
    ``register_hook`` through ``__torch_function__``."""
    if type(t) is not torch.Tensor:
        t.register_hook(hook)
        return
    hooks = t._backward_hooks
    if hooks is None:
        register = getattr(node, "_register_hook_dict", None)
        if register is None:  # a node type without it: the public way
            t.register_hook(hook)
            return
        hooks = t._backward_hooks = OrderedDict()
        register(t)
    hooks[hook] = hook


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


def stats_bytes(slots: int, host: bool = False) -> int:
    """Bytes of the stats as ``as_bytes`` lays them out (what :func:`decode` reads): the device
    buffer (:class:`StatsBuffer`) or, ``host``, the doubles of :class:`.hoststats.HostStats`."""
    if host:
        return len(DTYPES) * slots * 2 * 8
    return sum(slots * 2 * dt.itemsize for dt in DTYPES)


def stats_rows(raw: torch.Tensor, slots: int, host: bool = False) -> Iterator[torch.Tensor]:
    """Host side: per dtype (in :data:`DTYPES`' order) the (slots, 2) min/max rows, views of a CPU
    copy of the stats' bytes as ``as_bytes`` (or, ``host``, :class:`.hoststats.HostStats`) lays them out."""
    start = 0
    for dt in DTYPES:
        dt = torch.float64 if host else dt
        size = slots * 2 * dt.itemsize
        yield raw[start:start + size].view(dt).view(slots, 2)
        start += size


def decode(raw: torch.Tensor, slots: int, host: bool = False) -> list[list[tuple[float, float]]]:
    """Host side: per dtype, per slot (min, max) from a CPU copy of the stats' bytes."""
    return [[tuple(v) for v in (rows if host else rows.float()).tolist()] for rows in stats_rows(raw, slots, host)]


def all_finite(raw: torch.Tensor, slots: int, host: bool = False) -> bool:
    """Host side: True when no written slot in the stats' bytes holds NaN or ±inf, without decoding
    them (two reductions per dtype instead of a Python tuple per slot: the writer asks this on
    every healthy step, and its Python holds the GIL beside a host-bound training thread). An
    unwritten slot (min +inf, max -inf) is finite; NaN fails both comparisons."""
    for rows in stats_rows(raw, slots, host):
        if not bool((rows * _SIGN[rows.dtype]).max() < math.inf):  # max of (-min, max): NaN propagates
            return False
    return True


_SIGN = {dt: torch.tensor([-1.0, 1.0], dtype=dt) for dt in DTYPES}


# take()'s answer for a step that observed nothing (its values are read only where "observed")
_QUIET_STEP = {"aliases": {}, "order": None, "counts": {}, "changed": frozenset(), "observed": False,
               "micro_batches": 0, "first": False, "fp32": {}, "lowp": {}}


class ModuleObserver:
    """Hooks every module of ``model``; the stats buffer and the learned structure live here."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.names: list[str] = []
        self.types: list[str] = []
        self._handles: list[Any] = []
        self._handle_modules: list[int] = []  # the module index of each of _handles
        self._entries: Optional[list] = None  # the dict entries of _handles (torch_access.hook_entries)
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
        self._reads_free = self.host_stats = torch_access.reads_are_free(device)
        self._id = id(self)
        _OBSERVERS[self._id] = self
        if self._reads_free:  # CPU: stats on the host, read as they are made
            self._host: Optional[HostStats] = HostStats(len(DTYPES), self.slots)
            self.buffer: Any = self._host
            self._views = self._host.views()
            self._batch: Any = HostQueue(self._host, self._host_nonfinite)
        else:  # accelerator: a device buffer, reductions batched per chunk (batched.py)
            self._host = None
            self.buffer = StatsBuffer(self.slots, device)
            self._views = self.buffer.views
            self._batch = BatchedReducer(len(DTYPES))
        self._inplace: set[int] = set()  # modules whose output is their input (ReLU(inplace=True))
        self._pre: set[int] = set()      # modules with a pre-hook: their inputs are observed there
        self.active = True
        # this step's module values are measured; off between layer_every steps when a skipped
        # step is localized by replaying it (replay.py). Read at run time, never traced: the
        # compiled graph stays one graph
        self.observing = True
        self.traced = False  # the hooks ran inside a compiled graph: the root's hook folds its maxima
        # torch < 2.11 traced a compiled step whose gradient hooks (and, where reads are free, every
        # hook) it left out (torch_access.TRACES_TENSOR_HOOKS): the watch tells the run once
        self.hooks_left_out = False
        # Under torch.compile, an observed forward's trace observes each tensor once, as eager's
        # learned aliases do (traced_aliases.py): the tensors observed so far in the trace with their
        # slots (emptied as each observed forward ends), whether to look them up at all (off for
        # good once a tensor was changed in place between two modules), what the trace noted
        # (_trace_note), and the aliases of the graph that runs
        self._trace_seen: list[tuple[torch.Tensor, int]] = []
        self._trace_dedupe = self._trace_dedupe_next = traced_aliases.ENABLED
        self._trace_notes: Optional[dict] = None
        self._traced_aliases: dict[tuple[int, int, int, int], int] = {}
        self._hooked = True  # the hooks of _handles are in their modules' hook dicts
        self._first_forward_seen = False
        self._replay_handles: Optional[list] = None  # inside_compiled_blocks: its hooks
        self._replay_inside: set[int] = set()
        self._taken: list[list[tuple[dict, int, Any]]] = []  # their entries, taken out while not _hooked
        # learned structure: (module, IN or OUT, call, position) of a tensor -> the slot that already holds it
        self.aliases: dict[tuple[int, int, int, int], int] = {}
        self._targets: set[int] = set()  # the slots aliases point to (their tensors are checked each step)
        self._alias_modules: set[int] = set()  # modules with an input or output alias
        self.order: Optional[list[int]] = None  # modules in forward finish order (first call)
        self._learned_calls = -1
        self._learning = True
        # per slot, the micro-batch in which it first went non-finite (-1: not yet); made on first use
        self._first: Optional[torch.Tensor] = None
        self.keeper: Any = None  # counterfactual.InputKeeper when fp32_check is on
        self.on_error: Any = None  # called with an internal failure (the watch warns once, stops)
        self._grad_hooks: dict[int, Any] = {}  # value slot -> the hook observing its gradient
        self._new_step()
        # id(module) -> its index: the hooks find their module's index here (see _hooks)
        self._index_of: dict[int, int] = {id(m): i for i, m in enumerate(modules)}
        self._before_hook, self._after_hook = _hooks(self._id)
        self._blocks = CompiledBlocks(modules[0], self._is_observed)
        # the root's forward wrapped so a compiled model's graphs tell observed steps apart by one
        # flag instead of guards on every hook dict (compiled.py)
        # (on an accelerator its compiled forward joins the maxima its hooks traced: batched.py)
        self._split = GraphSplit(modules[0], self.observing, self._finish_traced, self._blocks)
        inside = self._blocks.inside
        for index, module in enumerate(modules):
            if id(module) in inside:  # inside a block compiled on its own: observed from outside it
                continue
            after: Any = self._after_hook
            if index == 0:
                # torch.compile(model) runs the root's own hooks outside its graph, where Dynamo would
                # compile each as a graph of its own: keep them eager (they see no traced tensors)
                after = torch._dynamo.disable(after)
            self._hook(index, False, after)
            if index == 0 or getattr(module, "inplace", False) is True:
                self._add_pre_hook(index)

    def _hook(self, index: int, pre: bool, fn: Any) -> None:
        # called while the hooks are in (at attach, or from a hook on a learning step)
        module = self.modules[index]
        register = module.register_forward_pre_hook if pre else module.register_forward_hook
        handle = register(ours(fn), with_kwargs=True)
        if self._replay_handles is not None and id(module) in self._replay_inside:
            self._replay_handles.append(handle)  # inside a compiled block: for this replay only
            return
        self._handles.append(handle)
        self._handle_modules.append(index)
        self._entries = None

    def _add_pre_hook(self, index: int) -> None:
        before: Any = self._before_hook
        if index == 0:
            before = torch._dynamo.disable(before)
        self._hook(index, True, before)
        self._pre.add(index)

    def set_observing(self, on: bool) -> None:
        """Measure module values this step or not. Off, the hooks are removed, so torch calls every
        module the way it calls an unhooked one. Eager, a hook that returns at once still costs its
        call (1.05x on GPT-2 small's tree, bench/hostcost.py). Under torch.compile, Dynamo checks
        every hooked module's hooks and what the hooks read (the module's identity, its index, its
        ``training`` flag) before each call of the graph: ~20 guards a module, +0.5 ms a step on
        GPT-2 small's tree, where the graph traced without the hooks guards only the flag of the
        forward's wrapper (compiled.py). Taking the hooks out and putting the very same entries back
        (keys and hooks: ``torch_access.unhook``; on that tree 0.05 ms out, 0.02 ms back in, where
        registering anew took 0.25-0.8 ms) costs no recompile: Dynamo keeps both graphs (the one with
        the hooks compiled once, on the first observed step)."""
        self.observing = on
        hooking = on and self.active and not self._hooked  # the hooks go back in now
        if hooking:
            self._blocks.get()  # one look at the module tree, for the split and the hooks both
        self._split.set(on and self.active, look=not hooking)
        if on:
            self._quiet = False
        if not self.active or on == self._hooked:
            return
        self._hooked = on
        if on:  # the entries taken out last time, put back as they were
            self._leave_compiled_blocks(look=False)
            torch_access.rehook(self._taken)
            self._taken = []
        else:
            if self._entries is None:
                self._entries = torch_access.hook_entries(self._handles)
            self._taken = torch_access.unhook(self._entries)
            # out right after take() began a new step (the observed step that ended): nothing was
            # observed since, and the step is as quiet as one that began unhooked (take). After a
            # replay mid-step (its values are this step's) it is not
            if not (self._calls or self._wrote or self.root_calls):
                self._quiet = True

    def _leave_compiled_blocks(self, look: bool = True) -> None:
        """Take out for good the hooks of modules inside blocks compiled since attach
        (``compiled.inside_compiled``), before they are traced into the blocks' graphs: at the
        first forward, and as each observed step begins. Such a block keeps its own hooks (its
        OptimizedModule came after them): they run around its graph, at its call."""
        inside = self._blocks.get(look)
        if not inside:
            return
        kept = []
        for i, index in enumerate(self._handle_modules):
            if id(self.modules[index]) not in inside:
                kept.append(i)
            elif self._hooked:
                self._handles[i].remove()
        if len(kept) == len(self._handles):
            return
        if not self._hooked:
            kept_keys = {self._handles[i].id for i in kept}
            self._taken = [entry for entry in self._taken if entry[1] in kept_keys]
        self._handles = [self._handles[i] for i in kept]
        self._handle_modules = [self._handle_modules[i] for i in kept]
        self._entries = None

    def _is_observed(self, module: torch.nn.Module) -> bool:
        return id(module) in self._index_of

    @contextlib.contextmanager
    def inside_compiled_blocks(self) -> Iterator[None]:
        """For a replay (its numbers are thrown away): hooks on the modules inside blocks compiled on
        their own, and compiled code run eagerly (``torch.compiler.set_stance``, torch >= 2.6), so
        a replayed fault is localized inside its block. Nothing is traced: no graph compiles."""
        inside = self._blocks.get()
        set_stance = getattr(torch.compiler, "set_stance", None)
        indices = [i for i, m in enumerate(self.modules) if id(m) in inside]
        if not indices or set_stance is None:
            yield
            return
        handles: list[Any] = []
        self._replay_handles, self._replay_inside = handles, inside  # pre-hooks learned now: _hook
        try:
            for index in indices:
                module = self.modules[index]
                handles.append(module.register_forward_hook(ours(self._after_hook), with_kwargs=True))
                if getattr(module, "inplace", False) is True or index in self._pre:
                    handles.append(module.register_forward_pre_hook(ours(self._before_hook), with_kwargs=True))
            with set_stance("force_eager"):
                yield
        finally:
            self._replay_handles, self._replay_inside = None, set()
            for handle in handles:
                handle.remove()

    # -- per step --------------------------------------------------------------------------------
    def _learn_alias(self, index: int, role: int, call: int, pos: int, t: torch.Tensor, slot: int,
                     may_alias: bool) -> bool:
        """Learning steps: True when ``t`` (input or output ``pos`` of ``call`` of module ``index``,
        own ``slot``) is the very tensor, unchanged, that another (non-volatile) slot already holds;
        the alias is learned. Otherwise ``t`` is noted as held by ``slot``."""
        hit = self._seen.get(id(t))
        if (may_alias and hit is not None and hit[0]() is t and hit[2] == t._version
                and hit[1] not in self._batch.volatile):
            self.aliases[(index, role, call, pos)] = hit[1]
            return True
        self._seen[id(t)] = (weakref.ref(t), slot, t._version)
        return False

    def _observe(self, index: int, role: int, call: int, pos: int, t: torch.Tensor, grad: bool,
                 may_alias: bool = True) -> bool:
        """Eager: observe input or output ``pos`` (``role`` IN or OUT) of ``call`` of module ``index``:
        its value into its slot, and with ``grad`` its gradient into the matching gradient slot.
        Nothing when another slot holds the very tensor: learning steps find such aliases; later
        steps check them (a model may hand on a different tensor on some steps: a wrapper that
        returns its child's output, except when it changes it; then the alias is broken for this
        step, left out of the analysis, and ``t`` is observed in its own slot). True when known
        (free reads) to be non-finite."""
        slot = ROLES * index + role
        if self._learning:
            if self._learn_alias(index, role, call, pos, t, slot, may_alias):
                return False
        else:
            if index in self._alias_modules:  # most modules have none: no key is built for them
                key = (index, role, call, pos)
                target = self.aliases.get(key)
                if target is not None:
                    held = self._held.get(target)
                    if held is not None and held() is t:
                        return False
                    self._broken.add(key)
            if slot in self._targets:  # another slot's alias points here: note this step's tensor
                self._held[slot] = weakref.ref(t)
        batch = self._batch
        if type(t) is torch.Tensor and slot not in batch.volatile:  # _write's usual case, without its frame
            self._wrote = True
            batch.add(DTYPE_INDEX[t.dtype], t, slot)
            bad = False
        else:
            bad = self._write(t, slot)
        if grad and t.requires_grad:  # IN -> GIN, OUT -> GOUT
            hook = self._grad_hooks.get(slot)
            if hook is None:
                hook = self._grad_hooks[slot] = partial(self._on_grad, slot + 2)
            node = t.grad_fn
            if node is None:  # a leaf
                t.register_hook(hook)
            else:
                add_grad_hook(t, node, hook)
        return bad

    def _new_step(self) -> None:
        self._held: dict[int, Any] = {}  # alias target slot -> weak reference to its tensor this step
        self._broken: set[tuple[int, int, int, int]] = set()  # aliases that did not hold this step
        self._wrote = False
        self._traced_step = False  # a compiled forward handed out maxima this step
        self._calls = 0
        self._call_of: dict[int, int] = {}
        self.counts: dict[int, list[float]] = {}     # slot -> [nan, inf] (only where reads are free)
        self._seen: dict[int, tuple[Any, int, int]] = {}  # learning only: id(tensor) -> (ref, slot, version)
        self._finish: list[int] = []
        self.root_calls = 0          # forward calls of the root module: the step's micro-batches
        self._first_used = False     # ``_first`` holds marks of this step
        self.fp32_amax: dict[int, Optional[float]] = {}  # the counterfactual's answer (module -> amax)
        self.lowp_amax: dict[int, Optional[float]] = {}  # the same, re-run in the call's own dtypes
        self.fp32_checked = False
        # the hooks are out as this step begins: while no set_observing(True) puts them back (a
        # layer_every step, a replay), nothing observes anything this step (take)
        self._quiet = not self._hooked

    def _settle(self) -> None:
        """Reduce what is pending and bring it into the stats (the device buffer, or the host's)."""
        self._batch.fold_into(self._views, self.traced)

    def take(self) -> dict:
        """The step's structure for the host (the stats themselves travel in the step's buffer)."""
        if self._quiet and not self._hooked:
            # the hooks were out for the whole step (most steps between layer_every ones, replay
            # on): nothing touched the step's state, which stays as _new_step left it
            if self.keeper is not None:
                self.keeper.clear()
            if self._trace_dedupe and not self._trace_dedupe_next:
                self._trace_dedupe, self._traced_aliases = False, {}
            return dict(_QUIET_STEP)
        self._settle()
        if self._learning and self._calls:
            self.order = list(dict.fromkeys(self._finish))
            self._learned_calls = self._calls
            self._targets = set(self.aliases.values())
            self._alias_modules = {key[0] for key in self.aliases}
        changed = self._batch.changed
        aliases = self.aliases if not self._broken else {k: v for k, v in self.aliases.items() if k not in self._broken}
        if self._traced_step and self._traced_aliases:  # a compiled forward's, noted as it was traced
            aliases = {**aliases, **self._traced_aliases}
        if self._trace_dedupe and not self._trace_dedupe_next:  # graphs traced from now on have none
            self._trace_dedupe, self._traced_aliases = False, {}
        step = {"aliases": aliases, "order": self.order, "counts": self.counts, "changed": frozenset(changed),
                # where reads are free, a step whose queue was dropped unreduced has empty stats: the
                # writer skips decoding them (most CPU steps)
                "observed": (bool(self._calls) or self._wrote) and (self._host is None or self._host.touched),
                "micro_batches": self.root_calls, "first": self._first_used, "fp32": self.fp32_amax,
                "lowp": self.lowp_amax}
        if self.keeper is not None:
            self.keeper.clear()  # the step's kept inputs are released here
        # re-learn only when the structure visibly changed (the number of module calls), or a slot
        # turned volatile (no module may read it any more); a step that called no module (not
        # observed) tells neither, and leaves a pending re-learning for the next observed step
        if self._calls or changed:
            self._learning = self._calls != self._learned_calls or bool(changed)
        changed.clear()
        if self._learning:
            self.aliases = {}
            self._targets = set()
            self._alias_modules = set()
        self._new_step()
        return step

    def discard(self) -> None:
        """Forget what this step measured (a replay that did not reproduce its step)."""
        self.take()
        self.reset_buffer(first=True)

    def backward_done(self, needed: bool) -> None:
        """A backward pass ended. Where reads are free, what is pending (this micro-batch's module
        values, forward and backward) is reduced only when ``needed``: the step's loss or gradients
        are non-finite, or module rows are written this step (``layer_every``). On other steps
        nothing would be written from them: their reductions are skipped, ~11 ops of ~12 us each on
        a small MLP. (A non-finite value masked before it reaches the loss and the gradients,
        -inf through a ReLU, is then seen on ``layer_every`` steps only.) Learning steps always
        reduce: they learn which slots change in place while pending."""
        if self._host is None or self._learning:
            return
        if needed:
            self._batch.flush()
        else:
            self._batch.drop()

    def flush_pending(self) -> None:
        """Reduce what waits for its chunk now (the accelerator path; one launch): the gradients a
        backward left pending, before the optimizer's step, often a training step's peak."""
        if self._host is None and self.observing:
            try:
                self._batch.flush()
            except Exception as exc:
                self._failed(exc)

    def first_bytes(self) -> list[torch.Tensor]:
        """The micro-batch marks as bytes, when this step made any (several micro-batches)."""
        return [self._first.view(torch.uint8)] if self._first_used and self._first is not None else []

    def reset_buffer(self, first: bool = False) -> None:
        self.buffer.reset()
        if first and self._first is not None:
            self._first.fill_(-1.0)

    def bad_micro_batch(self, index: int) -> int:
        """The micro-batch in which module ``index``'s output first went non-finite this step (the
        last one when unmarked). Reads one mark: a sync where reads are not free (bad steps only)."""
        last = max(self.root_calls - 1, 0)
        if not self._first_used or self._first is None:
            return last
        mark = float(self._first[ROLES * index + OUT])
        return int(mark) if mark >= 0 else last

    def _mark_micro_batch(self, finished: int) -> None:
        """Root call ``finished + 1`` starts: slots non-finite by now and not yet marked went bad in
        micro-batch ``finished``. A slot is bad when min < -inf is false or max < inf is false (NaN
        compares false); an unwritten slot (+inf, -inf) is not. Eager (root hooks are), no sync."""
        self._settle()  # what is pending belongs to the micro-batch that ended
        if self._first is None:
            self._first = torch.full((self.slots,), -1.0, dtype=torch.float32, device=self._views[0].device)
        ok = None
        for v in self._views:
            fine = (v[:, 0] > -math.inf) & (v[:, 1] < math.inf)
            ok = fine if ok is None else ok.logical_and_(fine)
        self._first.masked_fill_(ok.logical_not_().logical_and_(self._first < 0), float(finished))
        self._first_used = True

    def stats_host_bytes(self) -> memoryview:
        """Free reads: the host stats' bytes as they stand (no copy), laid out as ``host_stats``."""
        return memoryview(self._host.values).cast("B")

    def stats_parts(self) -> list[torch.Tensor]:
        """The stats as bytes (no copy), in the order :func:`decode` reads them (``host_stats``)."""
        return self.buffer.as_bytes()

    def forward_origin(self, names: list[str]) -> Optional[int]:
        """The forward origin of the step so far (module index), or None. Reads the stats buffer: a
        sync where reads are not free, so callers ask only on steps known to be bad."""
        from . import origins
        self._settle()
        raw = torch.cat(self.buffer.as_bytes()).cpu()
        values = origins.slot_values(decode(raw, self.slots, self.host_stats), self.counts, self._reads_free)
        if not origins.any_nonfinite(values):
            return None
        order = self.order if not self._learning else list(dict.fromkeys(self._finish))
        aliases = {k: v for k, v in self.aliases.items() if k not in self._broken}
        return origins.analyse(values, aliases, order or None, names,
                               frozenset(self._batch.changed))[1][origins.FORWARD]

    def _failed(self, exc: Exception) -> None:
        self.active = False
        if self.on_error is not None:
            self.on_error(exc)
        else:
            import warnings
            warnings.warn(f"ampwatch stopped observing modules: {type(exc).__name__}: {exc}", RuntimeWarning)

    def remove(self) -> None:
        """Remove every hook; gradient hooks still pending on live tensors become no-ops."""
        self.active = False
        self._hooked = False
        self._taken = []
        self._split.remove()
        _OBSERVERS.pop(self._id, None)
        self._batch.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._handle_modules.clear()
        self._entries = None

    # -- observation -------------------------------------------------------------------------------
    def _finish_traced(self) -> None:
        """As an observed forward returns inside its graph (the wrapper's ``finish``, traced): the
        maxima joined (accelerator); the trace's notes let go (their fake tensors) and its list of
        observed tensors emptied, so that none of them leaves the graph as an output. Eager:
        nothing."""
        if not _compiling():
            return
        if self._host is None:
            self._batch.join_traced()
        if self._trace_seen:
            oid, note = self._id, "end"  # noqa: F841 (read by _trace_note)
            traced_aliases.comptime(_trace_note)
            self._trace_seen.clear()

    def _observe_traced(self, index: int, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Under torch.compile: each of a module call's tensors (its inputs ``ins``, its outputs
        ``outs``) not observed yet in this trace (:func:`.traced_aliases.observe_once`) reduced in the graph
        (accelerator) or one op call for all of them (free reads), into its slot; and a tensor hook
        for each one's gradient."""
        if not torch_access.TRACES_TENSOR_HOOKS:
            # before torch 2.11 Dynamo cannot trace a gradient hook here (each one broke the graph,
            # and the trace then failed); the forward is observed in the graph, except where reads
            # are free: there the op's graph trained to other numbers than the model's (torch 2.4)
            self.hooks_left_out = True
            if self._host is not None:
                return
        if self._trace_dedupe:
            tensors, slots = traced_aliases.observe_once(self, _trace_note, index, ins, outs)
        else:
            tensors = ins + outs
            slots = [ROLES * index + IN] * len(ins) + [ROLES * index + OUT] * len(outs)
        rest, rest_slots = [], []
        for t, slot in zip(tensors, slots):
            if self._host is None and type(t) is torch.Tensor:
                # on an accelerator the reduction is traced into the graph (the compiler fuses it
                # into the kernel that makes the tensor) and its 0-d result leaves the graph as an
                # output that Dynamo appends to the step's maxima: no op call, nothing held past
                # its life
                self._batch.traced_values[DTYPE_INDEX[t.dtype]].append(t.detach().abs().amax())
                self._batch.traced_slots[DTYPE_INDEX[t.dtype]].append(slot)
                self.traced = True
            else:  # free reads, or a tensor subclass (a DTensor is reduced on this rank's shard)
                rest.append(t.detach())
                rest_slots.append(slot)
        if rest:
            torch.ops.ampwatch.observe(rest, self._id, rest_slots)
        if torch.is_grad_enabled() and torch_access.TRACES_TENSOR_HOOKS:  # before torch 2.11: forward only
            for t, slot in zip(tensors, slots):
                if t.requires_grad:
                    t.register_hook(partial(self._on_grad, slot + (GIN - IN)))  # IN->GIN, OUT->GOUT

    def reduce_traced(self, tensors: list[torch.Tensor], slots: list[int]) -> None:
        """The op's body: where reads are free one ``aminmax`` each; on an accelerator the maxima
        of all of them (one ``_foreach_norm`` launch per dtype, usually one), joined to the step's
        other maxima. Not queued: a compiler may reuse their memory once the op returns."""
        if self._host is not None:
            for t, slot in zip(tensors, slots):
                self.reduce_now(t, slot)
            return
        dtypes = [DTYPE_INDEX[t.dtype] for t in tensors]
        if len(set(dtypes)) == 1:
            self._batch.reduce_now(dtypes[0], tensors, slots)
            return
        for d in set(dtypes):  # a module call whose tensors differ in dtype (a cast)
            mine = [i for i, e in enumerate(dtypes) if e == d]
            self._batch.reduce_now(d, [tensors[i] for i in mine], [slots[i] for i in mine])

    def _write(self, t: torch.Tensor, slot: int) -> bool:
        """Eager: queue ``t`` for ``slot`` (reduced at the next flush, with no grad recorded), or
        reduce it now if the slot is volatile; True when known (free reads) to be non-finite."""
        d = DTYPE_INDEX.get(t.dtype)
        if d is None:
            return False
        if type(t) is not torch.Tensor:  # a DTensor is reduced on this rank's shard: no collective
            t = torch_access.local(t.detach())
            if t.numel() == 0:
                return False
        self._wrote = True
        if slot in self._batch.volatile:  # its tensors change in place after it is observed
            return self.reduce_now(t.detach(), slot)
        self._batch.add(d, t, slot)  # reduced with its chunk (batched.py)
        return False

    def _host_nonfinite(self, t: torch.Tensor, slot: int) -> None:
        """Free reads: a queued tensor found non-finite at the flush. Its exact NaN/inf counts; a
        module output pins that call's kept inputs for the fp32 recompute (counterfactual.py)."""
        if self._count(t, slot) and self.keeper is not None and slot % ROLES == OUT:
            self.keeper.settle(slot // ROLES)

    def _count(self, t: torch.Tensor, slot: int) -> bool:
        c = self.counts.setdefault(slot, [0.0, 0.0])
        nan, inf = float(torch.isnan(t).sum()), float(torch.isinf(t).sum())
        c[0] += nan
        c[1] += inf
        return bool(nan or inf)

    def reduce_now(self, t: torch.Tensor, slot: int) -> bool:
        """``t`` reduced now, not queued (a volatile slot in eager; the op's body where reads are
        free). On an accelerator its max |x| joins the step's other maxima (one launch; see
        :meth:`.batched.BatchedReducer.reduce_now`). Where reads are free one ``aminmax``, read and
        folded into ``slot``; then also True when ``t`` is non-finite, with its NaN/inf counts."""
        d = DTYPE_INDEX[t.dtype]
        if t.requires_grad:
            t = t.detach()
        if self._host is None:
            self._batch.reduce_now(d, [t], [slot])
            return False
        mn, mx = torch.aminmax(t)
        lo, hi = mn.item(), mx.item()
        self._host.fold(d, slot, lo, hi)
        if math.isfinite(lo) and math.isfinite(hi):
            return False
        return self._count(t, slot)

    def _on_grad(self, slot: int, grad: torch.Tensor) -> None:
        # every gradient hook, eager and compiled; runs inside the user's backward(): must never
        # raise or return a tensor
        if self.active and grad is not None and grad.dtype in DTYPE_INDEX and grad.numel() > 0:
            if _compiling():  # a compiled backward (Dynamo traced the tensor hook)
                if self._host is None and type(grad) is torch.Tensor:
                    # on an accelerator the reduction is traced into the backward graph too
                    torch.ops.ampwatch.keep_max(grad.detach().abs().amax(), self._id, slot)
                else:  # free reads (an aminmax and counts), or a tensor subclass (DTensor: its shard)
                    torch.ops.ampwatch.observe([grad.detach()], self._id, [slot])
                return
            try:
                batch = self._batch
                if type(grad) is torch.Tensor and slot not in batch.volatile:  # as in _observe
                    self._wrote = True
                    batch.add(DTYPE_INDEX[grad.dtype], grad, slot)
                else:
                    self._write(grad, slot)
            except Exception as exc:
                self._failed(exc)

    # -- hooks -------------------------------------------------------------------------------------
    def _before(self, index: int, module: Any, args: Any, kwargs: Any) -> None:
        """The root (micro-batches) and modules that work in place: their inputs before they change."""
        if not (self.active and module.training):
            return
        if _compiling():
            # Dynamo guards on ``observing``: a step that observes nothing runs a graph with no
            # ampwatch op at all, the one it would run without ampwatch (the other graph is
            # compiled once, on the first observed step)
            if self.observing:
                self._observe_traced(index, _inputs(args, kwargs), [])
            return
        if not self.observing:  # hooks kept for a compiled graph, run eagerly around a break
            return
        if not torch.is_grad_enabled() and torch.is_inference_mode_enabled():  # nothing to learn from,
            return                                                              # and no version counters
        try:
            self._before_eager(index, args, kwargs)
        except Exception as exc:  # recording must never take training down
            self._failed(exc)

    def _before_eager(self, index: int, args: Any, kwargs: Any) -> None:
        tensors = _inputs(args, kwargs)
        if index == 0:  # the root: a new micro-batch
            if not self._first_forward_seen:  # blocks compiled between attach and the first step
                self._first_forward_seen = True
                self._leave_compiled_blocks()
            if self.root_calls:
                self._mark_micro_batch(self.root_calls - 1)
            self.root_calls += 1
        # (the keeper keeps this call's inputs in the forward hook: the args the module ran on, after
        # any pre-hook registered after ours replaced them)
        call = self._call_of[index] = self._call_of.get(index, -1) + 1
        inplace = index in self._inplace
        if inplace:
            self._batch.flush()  # pending tensors may be the one it is about to overwrite
        grad = torch.is_grad_enabled()
        for pos, t in enumerate(tensors):
            self._observe(index, IN, call, pos, t, grad)
        if inplace:
            self._batch.flush()  # and its own input is measured before it changes

    def _after(self, index: int, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        """Every module's forward hook: its inputs (unless a pre-hook saw them) and its outputs.
        Eager, one Python frame per module call plus two per observed tensor (``_observe``, the
        queue's ``add``): this runs for every module of every observed step."""
        if not (self.active and module.training):
            return
        if _compiling():
            if self.observing:  # as in _before: unobserved steps trace no ampwatch op
                self._observe_traced(index, [] if index in self._pre else _inputs(args, kwargs),
                                     tensor_list(output))
                if self._trace_dedupe:
                    oid, note = self._id, "called"  # noqa: F841 (read by _trace_note)
                    traced_aliases.comptime(_trace_note)
            return
        if not self.observing:
            return
        grad = torch.is_grad_enabled()
        if not grad and torch.is_inference_mode_enabled():  # inference mode disables grad
            return
        try:
            if index == 0 and self.traced:
                # maxima a compiled graph handed out are its outputs (under CUDA graphs, memory the
                # next replay overwrites): folded into the stats now, before another graph runs
                self._settle()
                self._traced_step = True  # its aliases are the graph's (take)
                # the trace's list of observed tensors is emptied inside the graph as the forward
                # returns, except across a graph break inside the model, where Dynamo hands it
                # from graph to graph as it stood: emptied here, so no step sees another's
                self._trace_seen.clear()
            outputs = tensor_list(output)
            self._calls += 1
            learning = self._learning
            tensors = None
            if index in self._pre:
                call = self._call_of.get(index, 0)
                if self.keeper is not None and index not in self._inplace:  # in place: its input changed
                    self.keeper.keep(index, args, kwargs, _inputs(args, kwargs))
            else:
                call = self._call_of[index] = self._call_of.get(index, -1) + 1
                tensors = _inputs(args, kwargs)
                if self.keeper is not None:
                    self.keeper.keep(index, args, kwargs, tensors)
                for pos, t in enumerate(tensors):
                    self._observe(index, IN, call, pos, t, grad)
            if learning and index not in self._inplace:
                ins = tensors if tensors is not None else _inputs(args, kwargs)
                if any(o is a for o in outputs for a in ins):  # it works in place: measure inputs before it
                    self._inplace.add(index)
                    # not once the hooks are in a compiled graph (this is then a replay, in eager):
                    # Dynamo guards on the hook dicts and would recompile the model
                    if index not in self._pre and not self.traced:
                        self._add_pre_hook(index)
            bad = False
            may_alias = index not in self._inplace  # an in-place module's output is not its input's value
            for pos, t in enumerate(outputs):
                bad = self._observe(index, OUT, call, pos, t, grad, may_alias) or bad
            if bad and self.keeper is not None:  # free reads, reduced at once: this call's output is non-finite
                self.keeper.settle(index)
            if learning:
                self._finish.append(index)
            if index == 0 and self._host is None:
                # the forward is done: what waits for its chunk is reduced now, not held into the
                # backward (activations autograd frees, such as a dropout's input, at its peak)
                self._batch.flush()
        except Exception as exc:  # recording must never take training down
            self._failed(exc)


def never_a_frame_of_its_own(*functions: Any) -> None:
    """Dynamo compiles every Python frame that runs while a compiled module is called, hooks
    included. A model with graph breaks of its own runs the modules around a break eagerly, and
    their hooks would then be compiled as frames of their own: once per module (Dynamo
    specializes on the module and its index), up to its recompile limit, each call then a graph of
    its own (+80 ms a step on GPT-2 small's tree). Skipping their code, and the frames it calls,
    at frame level keeps them eager there; inlined into a module's compiled forward (no frame of
    their own) they are still traced."""
    try:  # torch >= 2.6: the frame and every frame it calls
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
        for fn in functions:
            set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except (ImportError, AttributeError):  # older torch: the frame alone, where it can
        skip_code = getattr(torch._dynamo.eval_frame, "skip_code", None)
        for fn in functions if skip_code is not None else ():
            skip_code(fn.__code__)


def _hooks(key: int) -> tuple[Any, Any]:
    """One pre-hook and one forward hook for every module of observer ``key``: plain functions that
    look the observer up in the registry and the module's index up by ``id(module)``.

    Why not a ``partial`` holding the observer and the index, one per module: under torch.compile
    Dynamo guards every hook of every module on every call of the compiled model. A partial is
    a tree of guards (its function, its arguments, each argument), and one observer held by 164
    partials is one object under 164 names, which Dynamo checks stay one object with a Python
    check per name: together ~1.2 ms a step on GPT-2 small's tree (bench/hostcost.py --compile).
    One function shared by all modules is one identity check per module; the observer, looked up
    in the registry, has one name; ``id(module)`` is one identity guard on the module, which also
    keeps a graph traced for this model from being reused for another instance of its class."""
    def before(module: Any, args: Any, kwargs: Any) -> None:
        observer = _OBSERVERS.get(key)
        if observer is not None:
            index = observer._index_of.get(id(module))
            if index is not None:
                observer._before(index, module, args, kwargs)

    def after(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        observer = _OBSERVERS.get(key)
        if observer is not None:
            index = observer._index_of.get(id(module))
            if index is not None:
                observer._after(index, module, args, kwargs, output)
    return before, after


never_a_frame_of_its_own(ModuleObserver._before, ModuleObserver._after, ModuleObserver._on_grad,
                         *_hooks(-1))  # every observer's hooks share these two code objects
