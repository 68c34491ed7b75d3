"""The fp32 counterfactual: is a forward overflow fp16's range, or is the computation broken?

When a step's forward origin is known (the first module whose fp16/bf16 output is non-finite while
its inputs were finite), that one module is run again on the same inputs in fp32 (autocast off,
floating inputs and its parameters and buffers upcast) and the max |output| is stored with the
origin's event (``events.fp32_amax``). Finite there: fp16's range is the problem. NaN/inf there too:
the weights or inputs are broken, or the op itself makes NaN.

How it stays out of training's way:

* During the step, :class:`InputKeeper` holds a reference to each hooked module's latest forward
  inputs (one dict slot per module, replaced on the next call, cleared at the step's end: no list
  grows; fed by the eager forward hooks of :class:`~ampwatch.record.observe.ModuleObserver`, which
  receive the arguments the module ran on, after any pre-hook replaced them). No copy is made and
  nothing is read: on clean steps it costs a dict store per module call. Without free reads the slot
  holds the last micro-batch's call: an origin born in an earlier micro-batch gets no recompute.
  Memory: inputs that autograd would have freed during backward stay alive until the step ends. Most
  are saved for backward anyway (a Linear keeps its input); the extra is the inputs of modules whose
  backward does not need them (dropout, elementwise, residual containers): up to one forward's
  activations, at the step's peak (GPT-2 small's widths, 2 x 64 tokens: +44 MiB on a 781 MiB peak,
  ``bench/memory.py``).
* So where a skipped step can be replayed (replay.py: an accelerator, one process) it keeps nothing
  on the steps it observes live (the ``layer_every`` steps): it keeps during replays only, and a
  live observed step that turns out bad gets its origin's inputs back by running that micro-batch's
  forward again (:meth:`.replay.Replayer.inputs_of`: no grad, the same RNG and autocast state,
  buffers restored), once, on that step only.
* The recompute runs only on a step already known to be bad without a sync: where reads are free
  (CPU) the hooks saw the non-finite value; on an accelerator, only a step the GradScaler skipped
  (it did not call ``optimizer.step()``: the host knows that for free). An accelerator run without a
  scaler gets no recompute (``fp32_amax`` stays None). On a bad step it costs one sync and one
  forward of one module.
* It changes nothing training sees: ``torch.no_grad`` (no graph), the RNG state forked and restored
  (dropout draws no numbers from the training stream; its mask differs from the original call's),
  parameters and buffers replaced by fp32 copies (torch.func.functional_call's mechanism; BatchNorm
  updates running stats on the copies), the recorder's own hooks paused. The module's ``forward`` is
  called, not the module: its own hooks already ran on the kept inputs (its children's hooks, other
  code's included, do run).
* An input modified in place after the call (its version counter moved) makes the recompute
  meaningless: then none is done (None). Under ``torch.compile`` the hooks traced into the graph
  keep no inputs: on the accelerator path they are fetched as for a step observed live (the forward
  run again, eagerly), so the origin gets its recompute; on the CPU path nothing runs again: None.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from . import torch_access
from .compiled import run_eagerly, uncompiled
from .observe import ModuleObserver, tensor_list, nested_tensors_of


def _upcast(obj: Any, depth: int = 0) -> Any:
    """Floating tensors (in tuples, lists, dicts) as fp32 copies; everything else as it is."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().float() if obj.is_floating_point() else obj
    if depth < 3 and isinstance(obj, (tuple, list)):
        return type(obj)(_upcast(x, depth + 1) for x in obj)
    if depth < 3 and isinstance(obj, dict):
        return {k: _upcast(v, depth + 1) for k, v in obj.items()}
    return obj


def _versions(args: Any, kwargs: Any) -> list[int]:
    """Version counters of a call's floating tensors, listed as the observer's pre-hook lists them."""
    tensors = tensor_list(args[0]) if len(args) == 1 and not kwargs else tensor_list(args) + tensor_list(kwargs)
    return [t._version for t in tensors]


def output_amax(output: Any) -> Optional[float]:
    """Max |value| over the floating tensors of ``output``: NaN if any is NaN; None if none."""
    tensors = list(nested_tensors_of(output))
    if not tensors:
        return None
    worst = -math.inf
    for t in tensors:
        t = t.detach().float()
        if torch.isnan(t).any():
            return math.nan
        worst = max(worst, float(t.abs().max()))
    return worst


class InputKeeper:
    """One slot per hooked module: the latest forward inputs of the step (references, no copies).

    Where reads are free the observer tells it which call made a non-finite output; when that call's
    inputs were finite they are kept (pinned) instead of the latest: the first such call wins."""

    def __init__(self, observer: ModuleObserver) -> None:
        self._observer = observer
        self._inputs: dict[int, tuple[Any, Any, list[int], list]] = {}
        self._pinned: set[int] = set()
        self.autocast: Optional[dict[str, tuple[bool, torch.dtype]]] = None
        # a replay.Replayer: keep only while it replays, and fetch a live step's inputs from it
        self.replayer: Any = None

    def keep(self, index: int, args: Any, kwargs: Any, tensors: list) -> None:
        """Called by the observer's pre-hook with the call's floating tensors (already listed)."""
        if self.replayer is not None and not self.replayer.replaying:  # a live step: fetched if bad
            return
        if index == 0:  # the root, once per micro-batch: the autocast state its modules ran under
            self.autocast = autocast_state()
        if index not in self._pinned:  # one input (most modules): no comprehension frame
            versions = [tensors[0]._version] if len(tensors) == 1 else [t._version for t in tensors]
            self._inputs[index] = (args, kwargs, versions, tensors, self._observer.root_calls - 1)

    def settle(self, index: int) -> None:
        """Module ``index``'s call just made a non-finite output (host path: reads are free)."""
        kept = self._inputs.get(index)
        if kept is None or index in self._pinned:
            return
        if all(bool(torch.isfinite(t).all()) for t in kept[3]):
            self._pinned.add(index)

    def clear(self) -> None:
        self._inputs.clear()
        self._pinned.clear()

    def recompute(self, index: int, micro_batch: Optional[int] = None) -> tuple[Optional[float], Optional[float]]:
        """Max |output| of module ``index`` run again on its kept inputs: (in fp32, in its original
        dtypes and autocast state), each None where not done.

        The second run is done only when the fp32 one is finite: then it tells an intermediate
        value that overflows inside the module (non-finite again) from a call the recompute cannot
        reproduce (finite again). ``micro_batch``: the one whose call made the non-finite output.
        Unpinned (no free reads), the kept inputs are the module's latest call's, from the step's
        last micro-batch: when the overflow was in an earlier one, they are not the inputs that
        overflowed, so (None, None)."""
        kept = self._inputs.get(index)
        if kept is None and self.replayer is not None:  # a step observed live: its inputs fetched now
            kept = self._fetch(index, micro_batch)
        if kept is None:
            return None, None
        args, kwargs, versions, _, kept_batch = kept
        if index not in self._pinned and micro_batch is not None and max(kept_batch, 0) != micro_batch:
            return None, None
        if _versions(args, kwargs) != versions:
            return None, None  # modified in place since the call: not the inputs it saw
        module = self._observer.modules[index]
        cleared = _without_cache(module, args, kwargs)
        if cleared is None:
            return None, None
        args, kwargs = cleared
        fp32 = recompute_fp32(module, args, kwargs, self._observer)
        if fp32 is None or not math.isfinite(fp32):
            return fp32, None
        return fp32, recompute_as_run(module, args, kwargs, self.autocast, self._observer)

    def _fetch(self, index: int, micro_batch: Optional[int]) -> Optional[tuple]:
        """Module ``index``'s inputs in ``micro_batch`` (None: the last), by running that forward
        again with the observer paused."""
        batch = len(self.replayer.batches) - 1 if micro_batch is None else micro_batch
        observer = self._observer
        was_active, observer.active = observer.active, False
        try:
            got = self.replayer.inputs_of(observer.modules[index], batch)
        finally:
            observer.active = was_active
        if got is None:
            return None
        args, kwargs, self.autocast = got
        tensors = tensor_list(args) + tensor_list(kwargs)
        kept = self._inputs[index] = (args, kwargs, _versions(args, kwargs), tensors, batch)
        return kept


def _is_cache(obj: Any) -> bool:
    """A key/value cache object (transformers' ``Cache``: DynamicCache and kin), by its methods."""
    return callable(getattr(obj, "update", None)) and callable(getattr(obj, "get_seq_length", None))


def _without_cache(module: torch.nn.Module, args: Any, kwargs: Any) -> Optional[tuple[Any, Any]]:
    """The call's arguments with a key/value cache left out, or None when that would change the call.

    An attention module given a cache appends its keys and values to it: after the call the cache
    holds them, so running it again with the cache would attend over them twice (and append them
    again, changing the user's object). A training forward starts from an empty cache, which the
    model creates: then the cache's length for the module's layer is exactly the call's sequence
    length, and the call ran as it would have with no cache. A cache that held more (a module that
    continued a prefilled one) cannot be put back as it was: no recompute."""
    found = [k for k, v in kwargs.items() if _is_cache(v)] if isinstance(kwargs, dict) else []
    if not found:
        return args, kwargs
    hidden = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
    layer = getattr(module, "layer_idx", None)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or not isinstance(layer, int):
        return None
    try:
        if any(kwargs[k].get_seq_length(layer) != hidden.shape[-2] for k in found):
            return None
    except Exception:  # a cache of another shape of API: not one we know how to leave out
        return None
    return args, {k: (None if k in found else v) for k, v in kwargs.items()}


def _swapped(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Any:
    """Parameters and buffers of ``module`` replaced by ``tensors`` for the ``with`` block, restored
    after (torch.func.functional_call's mechanism; it would also re-run the module's own hooks)."""
    from torch.nn.utils.stateless import _reparametrize_module
    return _reparametrize_module(module, tensors, tie_weights=True, strict=False)


def recompute_fp32(module: torch.nn.Module, args: Any, kwargs: Any, observer: Optional[ModuleObserver] = None
                   ) -> Optional[float]:
    """Run ``module`` on fp32 copies of ``args``/``kwargs``, its parameters and buffers, with autocast
    off, no grad, the RNG forked and the observer's hooks paused; return max |output|.

    None where it cannot be done faithfully: parameters sharded across ranks (FSDP2's DTensors,
    FSDP1's flat parameters, whose storage is freed after the forward) exist whole only inside the
    framework's own forward, and a module that will not run on fp32 inputs (a dtype assertion in
    user code) has no fp32 answer. Either way the run is recorded as before, without the verdict."""
    if not _whole(module):
        return None
    params = {n: p.detach().float() if p.is_floating_point() else p for n, p in module.named_parameters()}
    # Buffers are cloned even when already fp32: BatchNorm updates running stats in place.
    # (.float() of an fp32 tensor is that same tensor: copy=True makes the copy.)
    buffers = {n: b.detach().to(torch.float32, copy=True) if b.is_floating_point() else b.clone()
               for n, b in module.named_buffers()}
    return _run_again(module, params, buffers, lambda device_type: (False, None),
                      lambda: (_upcast(args), _upcast(kwargs)), observer)


def autocast_state() -> dict[str, tuple[bool, torch.dtype]]:
    """Whether autocast is on, and its dtype, per device type that can run it here (a few C calls)."""
    kinds = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    return {k: (torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds}


def recompute_as_run(module: torch.nn.Module, args: Any, kwargs: Any,
                     autocast: Optional[dict[str, tuple[bool, torch.dtype]]],
                     observer: Optional[ModuleObserver] = None) -> Optional[float]:
    """Run ``module`` again as training ran it: its own parameters, its inputs as they were, under the
    autocast state its micro-batch ran with (``autocast``, from :func:`autocast_state`), with no
    grad, the RNG forked, buffers replaced by copies and the observer's hooks paused; return max
    |output|. None where it cannot be done (see :func:`recompute_fp32`) or the state is unknown."""
    if autocast is None or not _whole(module):
        return None
    params = {n: p.detach() for n, p in module.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}  # BatchNorm updates them in place
    return _run_again(module, params, buffers, lambda device_type: autocast.get(device_type, (False, None)),
                      lambda: (_detached(args), _detached(kwargs)), observer)


def _whole(module: torch.nn.Module) -> bool:
    """The module's parameters exist whole here (not sharded across ranks, not freed after a forward)."""
    return not any(torch_access.is_sharded(p) or p.untyped_storage().size() == 0 for p in module.parameters())


def _run_again(module: torch.nn.Module, params: dict, buffers: dict, autocast_for: Callable,
               inputs: Callable, observer: Optional[ModuleObserver]) -> Optional[float]:
    """The module's forward (not __call__: its own hooks already ran on the kept inputs) with
    ``params`` and ``buffers`` swapped in, no grad, the RNG forked, autocast as ``autocast_for(device
    type)`` says and the observer paused; max |output|, or None (the user's module refusing to run
    this way: no verdict, not a failure)."""
    device = next(iter(params.values()), next(iter(buffers.values()), None))
    devices = [device.device] if device is not None and device.device.type == "cuda" else []
    device_type = device.device.type if device is not None else "cpu"
    enabled, dtype = autocast_for(device_type)
    was_active = observer.active if observer is not None else None
    if observer is not None:
        observer.active = False
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), run_eagerly(), \
                torch.autocast(device_type, dtype=dtype, enabled=enabled), _swapped(module, {**params, **buffers}):
            args, kwargs = inputs()
            # blocks compiled on their own run eagerly here: called without grad or autocast, each
            # would otherwise be compiled again (compiled.inside_compiled)
            out = uncompiled(module).forward(*args, **kwargs)
        return output_amax(out)
    except Exception:  # the user's module, run again outside its call: no verdict, not a failure
        return None
    finally:
        if observer is not None:
            observer.active = was_active


def _detached(obj: Any, depth: int = 0) -> Any:
    """Tensors (in tuples, lists, dicts) detached, in their own dtypes; everything else as it is."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if depth < 3 and isinstance(obj, (tuple, list)):
        return type(obj)(_detached(x, depth + 1) for x in obj)
    if depth < 3 and isinstance(obj, dict):
        return {k: _detached(v, depth + 1) for k, v in obj.items()}
    return obj


def check_step(observer: ModuleObserver, skipped: bool) -> None:
    """On a step known to be bad (host path: a hook saw it; accelerator: the scaler skipped it),
    recompute the forward origin in fp32 once and leave the result with the observer's step."""
    keeper = observer.keeper
    if keeper is None or observer.fp32_checked or not (observer.counts or (skipped and observer.root_calls)):
        return
    observer.fp32_checked = True
    origin = observer.forward_origin(observer.names)
    if origin is not None:
        fp32, lowp = keeper.recompute(origin, observer.bad_micro_batch(origin))
        observer.fp32_amax[origin], observer.lowp_amax[origin] = fp32, lowp
