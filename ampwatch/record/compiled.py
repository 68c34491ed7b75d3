"""torch.compile and the recorder's hooks: which module to hook, and keeping Dynamo's graph cache
honest about them (a graph traced without the hooks must never run for a watched model on a step
that observes it).

Dynamo caches a graph per code object (``forward`` of the model's class) and, by default
(``skip_nnmodule_hook_guards``), does not check on later calls that a module's hooks are the ones
it traced. Guarding them (turning that option off) makes every call of a compiled model check
every hook dict of every module it inlines: ~0.25 ms a step on GPT-2 small's 164-module tree
(bench/hostcost.py --compile inductor). So ampwatch leaves torch's default on and keeps the cache
honest another way:

- graphs traced with ampwatch's hooks guard on each hooked module's identity (observe._hooks), so
  they never run for another instance of the class;
- graphs traced before attach are dropped at attach (:func:`forget_graphs_without_hooks`);
- every compile that could trace the model without the hooks is noticed as it ends
  (:func:`_on_compile_end`): an unwatched module compiled from a watched module's forward code (a
  "twin": another instance of the class, say an EMA copy, or of a subclass), or any compile while a watched model's hooks are off (eager steps between observed ones,
  where a model compiled for the first time would be traced without them). The next call of a
  watched model then turns hook guards on, for good, and drops every compiled graph once
  (:func:`before_watched_call`): today's safe behaviour, paid only by runs that need it.

Where torch has no compile callbacks, hook guards are on from attach (:func:`guard_module_hooks`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, Optional

import torch

log = logging.getLogger("ampwatch")

_observers: dict = {}     # observe._OBSERVERS (given by watch_compiles): the watched models' observers
_guarded = False          # hook guards are on (set once, never undone)
_pending: Optional[str] = None  # why a graph may lack the hooks: turn guards on at the next watched call
_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = os.path.dirname(contextlib.__file__)


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile(model)`` returns an OptimizedModule: hook the module it compiles, so the hooks
    are traced into its graph (on its next call Dynamo recompiles once with them)."""
    return getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model


def guard_module_hooks() -> None:
    """Make Dynamo guard on module hooks from now on (torch's ``skip_nnmodule_hook_guards`` off):
    code compiled for another instance of the same class, or before the hooks were added, is then
    never reused for a watched model. It costs an identity or length check per hook dict of every
    inlined module on every call of a compiled model."""
    global _guarded
    _guarded = True
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    if config is not None and hasattr(config, "skip_nnmodule_hook_guards"):
        config.skip_nnmodule_hook_guards = False


def _callbacks() -> Any:
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return None
    return callback_handler if hasattr(callback_handler, "register_end_callback") else None


def watch_compiles(observers: dict) -> None:
    """At attach, for a model whose modules are hooked (``observers``: every live observer, by id):
    hear about every compile from now on, or, where torch cannot tell us, guard hooks."""
    global _observers
    _observers = observers
    if _guarded:
        return
    handler = _callbacks()
    if handler is None:
        guard_module_hooks()
    elif _on_compile_end not in handler.end_callbacks:
        handler.register_end_callback(_on_compile_end)


def before_watched_call() -> None:
    """A watched model is about to run (its root's pre-hook, outside any graph, before Dynamo picks
    one): if a graph without its hooks may exist, turn hook guards on and drop every graph, so this
    call traces the model with them. Also when ``torch._dynamo.reset()`` dropped our callback (it
    clears them all): what was compiled since is unknown."""
    global _pending
    if _guarded:
        return
    handler = _callbacks()
    reason = _pending
    if reason is None and handler is not None and _on_compile_end not in handler.end_callbacks:
        reason = "torch._dynamo.reset() ran"
    if reason is None:
        return
    _pending = None
    guard_module_hooks()
    torch._dynamo.reset()
    log.info("ampwatch: %s, so a compiled graph may lack ampwatch's hooks: torch.compile now guards on "
             "module hooks, and its caches were reset (the model recompiles once)", reason)


def _on_compile_end(*args: Any) -> None:
    """Dynamo finished compiling a frame: note when the graph may have been traced without a watched
    model's hooks. Never raises (it runs inside the user's compile); when unsure, it notes."""
    global _pending
    if _guarded or _pending is not None:
        return
    trigger = getattr(args[0], "callback_trigger", None) if args else None  # torch < 2.5 passes nothing
    if trigger is not None and getattr(trigger, "name", "DYNAMO") != "DYNAMO":
        return  # a lazy backward or an autotune: no forward graph was made
    try:
        observers = [o for o in list(_observers.values()) if o.active]
        if not observers:
            return
        module = _module_being_compiled()
        if module is None:  # a compiled function: it may call a watched model inline
            if any(not o._hooked for o in observers):
                _pending = "a function was compiled while a watched model's hooks were off"
            return
        owner = next((o for o in observers if id(module) in o._index_of), None)
        if owner is not None:
            if not owner._hooked:
                _pending = "the watched model was compiled on a step its hooks were off"
            return
        # Dynamo keeps graphs per code object: one compiled from the same forward code (the same
        # class, a subclass, or a decorator's wrapper shared by many classes) may be picked for ours
        code = _forward_code(module)
        if code is not None and any(code is _forward_code(m) for o in observers for m in o.modules):
            _pending = f"an unwatched {type(module).__name__} was compiled"
    except Exception:  # noqa: BLE001 - recording must never break the user's compile
        _pending = "a compile could not be checked"


def _forward_code(module: Any) -> Any:
    return getattr(getattr(type(module), "forward", None), "__code__", None)


def _module_being_compiled() -> Optional[torch.nn.Module]:
    """The module whose call Dynamo is compiling: the ``self`` of the nearest ``Module._call_impl``
    (or ``_wrapped_call_impl``) up the stack, with only torch's and the standard library's frames between
    (the compile was started by that call itself, not by a compiled helper inside a forward)."""
    frame = sys._getframe(2)
    calls = (torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__)
    while frame is not None:
        code = frame.f_code
        if code in calls:  # _wrapped_call_impl: a module compiled in place (``module.compile()``)
            module = frame.f_locals.get("self")
            return uncompiled(module) if isinstance(module, torch.nn.Module) else None
        if not code.co_filename.startswith((_TORCH_DIR, _STDLIB_DIR)):
            return None  # a user's frame first: a compiled function, not a module's forward
        frame = frame.f_back
    return None


def forget_graphs_without_hooks(model: torch.nn.Module) -> bool:
    """Drop graphs Dynamo compiled for this model's classes before the hooks existed; True if any.

    Dynamo caches a graph per code object (``forward`` of the model's class), so a graph traced
    before attach, for this model or for another instance of its class, has no module hook in it
    and, compiled without hook guards (torch's default), would go on running for the watched model
    with nothing inside it observed. Graphs compiled from now on guard on each hooked module's
    identity (observe._hooks) and are checked as they are compiled (:func:`_on_compile_end`), so a
    reset is needed once, and only when such a graph exists. It resets every compiled function of
    the process (each recompiles once on its next call)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return False
    codes = {getattr(type(m).forward, "__code__", None) for m in model.modules()}
    codes.add(torch.nn.Module._call_impl.__code__)  # what ``module.compile()`` compiles
    if any(_debug_get_cache_entry_list(code) for code in codes if code is not None):
        torch._dynamo.reset()
        return True
    return False
