"""Learn the clip threshold from the ``clip_grad_norm_`` call itself.

Loops pass ``max_norm`` as a literal or under their own config key (nanoGPT ``grad_clip``, HF
``max_grad_norm``, Lightning ``gradient_clip_val``), so the recorder watches the call instead.
While at least one watch is attached, torch's clipping functions are wrapped: the wrapper hands
``(parameters, max_norm)`` to every attached watch and calls the original unchanged. The last
watch to close restores them.

Why a wrapper rather than inferring the threshold from how much the gradients shrank: the wrapper
costs one Python call per clip and no device work or sync, and it learns ``max_norm`` even on
steps where nothing was clipped (the ratio would need a second norm of every gradient per step,
and would say nothing until the threshold is hit).

What is wrapped: ``torch.nn.utils.clip_grad._clip_grads_with_norm_`` (private, torch >= 2.6),
which ``clip_grad_norm_`` looks up at call time, so a loop that did
``from torch.nn.utils import clip_grad_norm_`` before attaching is seen too; and the public
``torch.nn.utils.clip_grad_norm_`` / ``clip_grads_with_norm_`` names for older torch and direct
calls. A clip that bypasses all of these (FSDP1's ``model.clip_grad_norm_``, a hand-written clip)
is not seen; the dashboard then falls back to the run's config keys.

The clip's own per-gradient norms are handed over too. ``clip_grad_norm_`` computes the norm of
every gradient (``torch._foreach_norm``) to get the total; the recorder needs exactly those norms
every step, so a loop that clips pays for them once instead of twice. While torch's
``_get_total_norm`` (before torch 2.6: the whole ``clip_grad_norm_``) runs on the calling thread,
``torch._foreach_norm`` and ``torch.stack`` are swapped for shims that keep what they return; the
total the clip uses is torch's own, computed by
torch's own code (training is unchanged). Each listener's ``on_clip_norms(tensors, norms, vector,
parameters)`` then gets the tensors, their norms, when torch stacked exactly those norms the stacked
vector (one op fewer for the recorder), and, when the total was ``clip_grad_norm_``'s over one
device and dtype, the clip's parameter list (torch's tensors are then ``[p.grad for p in parameters
if p.grad is not None]``, in that order: a listener that knows the parameters need not read each
gradient to map the norms). The swap is skipped (the call goes through untouched) while
another thread holds it, while Dynamo traces, and for a norm other than L2.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

from .torch_access import dynamo_compiling

# (module, attribute) pairs wrapped while a watch listens; missing ones are skipped.
_TARGETS = (
    ("torch.nn.utils.clip_grad", "_clip_grads_with_norm_"),
    ("torch.nn.utils", "clip_grads_with_norm_"),
    ("torch.nn.utils", "clip_grad_norm_"),
    ("torch.nn.utils.clip_grad", "clip_grad_norm_"),
)

_lock = threading.Lock()
# A tuple, replaced whole under the lock: the wrapper reads it without locking or copying (iterating a
# WeakSet cost ~30x the rest of the wrapper). Watches are held until they close, as their scaler
# wrappers hold them anyway.
_listeners: tuple = ()
_installed: dict[tuple[str, str], tuple[Any, Any]] = {}  # target -> (original, our wrapper)

# torch's total-norm helpers (torch >= 2.6): the clip's per-gradient norms are captured inside them
_NORM_TARGETS = (
    ("torch.nn.utils.clip_grad", "_get_total_norm"),
    ("torch.nn.utils", "get_total_norm"),
)
_swap = threading.Lock()  # one capture at a time: the swap of torch._foreach_norm is process-wide
# thread id -> the parameter list of the clip_grad_norm_ call running on that thread (the listeners
# heard it): its total-norm call hands it on with the norms, and its own call of
# _clip_grads_with_norm_ is not told to them a second time
_clip_calls: dict[int, Any] = {}
_NORM_COMPUTING = {"clip_grad_norm_"}  # the targets that compute the total norm themselves
# torch >= 2.6: clip_grad_norm_ calls _get_total_norm, whose wrapper takes the norms; before, the
# wrapper of clip_grad_norm_ takes them
_TOTAL_NORM_APART = hasattr(torch.nn.utils.clip_grad, "_get_total_norm")


def _module(name: str) -> Any:
    import importlib
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _wrap(original: Callable) -> Callable:
    computes_norm = getattr(original, "__name__", "") in _NORM_COMPUTING

    @functools.wraps(original)
    def clip(parameters: Any, max_norm: Any, *args: Any, **kwargs: Any) -> Any:
        # a clip inside a compiled function is not listened to: telling a listener would break
        # the graph (the writer's queue takes a lock); the threshold then comes from the config.
        # Nor is the _clip_grads_with_norm_ that a heard clip_grad_norm_ calls: heard already
        if not _listeners or dynamo_compiling():
            return original(parameters, max_norm, *args, **kwargs)
        thread = threading.get_ident()
        if thread in _clip_calls:
            return original(parameters, max_norm, *args, **kwargs)
        if not isinstance(parameters, (torch.Tensor, list, tuple)):
            # a generator (model.parameters()): listed here, as clip_grad_norm_ lists it first
            # thing (the generator runs once either way); an empty one goes on as it is, for
            # torch's warning about it
            listed = list(parameters)
            parameters = listed or parameters
        for listener in _listeners:
            listener.on_clip(parameters, max_norm)  # Watch.on_clip never raises
        if not computes_norm:
            return original(parameters, max_norm, *args, **kwargs)
        if not _TOTAL_NORM_APART:  # torch < 2.6: the norms are taken inside clip_grad_norm_ itself
            norm_type = args[0] if args else kwargs.get("norm_type", 2.0)
            if not _is_l2(norm_type):
                return original(parameters, max_norm, *args, **kwargs)
            return _with_norms(lambda: original(parameters, max_norm, *args, **kwargs), parameters)
        _clip_calls[thread] = parameters
        try:
            return original(parameters, max_norm, *args, **kwargs)
        finally:
            del _clip_calls[thread]
    return clip


def _wrap_total_norm(original: Callable) -> Callable:
    @functools.wraps(original)
    def total_norm(tensors: Any, norm_type: Any = 2.0, *args: Any, **kwargs: Any) -> Any:
        if not _listeners or dynamo_compiling() or not _is_l2(norm_type):
            return original(tensors, norm_type, *args, **kwargs)
        return _with_norms(lambda: original(tensors, norm_type, *args, **kwargs),
                           _clip_calls.get(threading.get_ident()))
    return total_norm


def _with_norms(call: Callable[[], Any], parameters: Any) -> Any:
    """``call()``, a computation of the L2 total norm of gradients (torch's ``_get_total_norm``; before
    torch 2.6 the whole ``clip_grad_norm_``), with ``torch._foreach_norm`` and ``torch.stack`` swapped
    for shims that keep what they return on this thread; then the listeners get the per-gradient
    norms (``parameters``: the clip's parameter list, handed on when the norms came in one group)."""
    real_norm, real_stack = getattr(torch, "_foreach_norm", None), torch.stack
    if real_norm is None or not _swap.acquire(blocking=False):
        return call()
    seen: list[tuple[Any, Any]] = []
    stacked: list[tuple[Any, Any]] = []
    thread = threading.get_ident()

    def foreach_norm(group: Any, *a: Any, **kw: Any) -> Any:
        out = real_norm(group, *a, **kw)
        if threading.get_ident() == thread:
            seen.append((group, out))
        return out

    def stack(items: Any, *a: Any, **kw: Any) -> Any:
        out = real_stack(items, *a, **kw)
        if threading.get_ident() == thread:
            stacked.append((items, out))
        return out

    torch._foreach_norm, torch.stack = foreach_norm, stack
    try:
        result = call()
    finally:
        torch._foreach_norm, torch.stack = real_norm, real_stack
        _swap.release()
    if seen:
        if len(seen) == 1:  # one device and dtype, the usual case: torch's own lists, not copies
            grads, norms = seen[0]
        else:
            grads = [t for group, _ in seen for t in group]
            norms = [n for _, out in seen for n in out]
        # torch stacks the norms to sum them: that vector, when it holds exactly these norms
        vector = next((out for items, out in stacked
                       if len(items) == len(norms) and items[0] is norms[0] and items[-1] is norms[-1]), None)
        # one group: torch's own list, in the clip's parameter order (see the module docstring)
        for listener in _listeners:
            listener.on_clip_norms(grads, norms, vector, parameters if len(seen) == 1 else None)
    return result


def _is_l2(norm_type: Any) -> bool:
    try:
        return float(norm_type) == 2.0
    except (TypeError, ValueError, RuntimeError):
        return False


def listen(listener: Any) -> None:
    """Start telling ``listener.on_clip(parameters, max_norm)`` about every clip, and
    ``listener.on_clip_norms(tensors, norms, vector, parameters)`` the per-gradient norms it
    computed; wraps on first use."""
    global _listeners
    with _lock:
        if listener not in _listeners:
            _listeners = _listeners + (listener,)
        if _installed:
            return
        for targets, wrap in ((_TARGETS, _wrap), (_NORM_TARGETS, _wrap_total_norm)):
            for target in targets:
                module = _module(target[0])
                original = getattr(module, target[1], None) if module is not None else None
                if callable(original):
                    wrapper = wrap(original)
                    _installed[target] = (original, wrapper)
                    setattr(module, target[1], wrapper)


def stop(listener: Any) -> None:
    """Stop telling ``listener``; the last listener to stop restores torch's functions."""
    global _listeners
    with _lock:
        _listeners = tuple(x for x in _listeners if x is not listener)
        if _listeners:
            return
        for (module_name, attr), (original, wrapper) in _installed.items():
            module = _module(module_name)
            if module is not None and getattr(module, attr, None) is wrapper:  # not re-wrapped by someone else
                setattr(module, attr, original)
        _installed.clear()
