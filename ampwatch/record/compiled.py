"""torch.compile and the recorder's hooks: which module to hook, and keeping Dynamo's graph cache
honest about them (a graph traced without the hooks must never run for a watched model)."""
from __future__ import annotations

import torch


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile(model)`` returns an OptimizedModule: hook the module it compiles, so the hooks
    are traced into its graph (on its next call Dynamo recompiles once with them)."""
    return getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model


def guard_module_hooks() -> None:
    """Make Dynamo guard on module hooks from now on. By default it does not
    (``skip_nnmodule_hook_guards``): code compiled for another instance of the same class, say an
    unwatched copy of the model, would then be reused for this one with none of ampwatch's hooks in
    it, and nothing inside the model would be observed. The guards cost a few identity and length
checks per module per call (observe._hooks keeps them few)."""
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    if config is not None and hasattr(config, "skip_nnmodule_hook_guards"):
        config.skip_nnmodule_hook_guards = False


def forget_graphs_without_hooks(model: torch.nn.Module) -> bool:
    """Drop graphs Dynamo compiled for this model's classes before the hooks existed; True if any.

    Dynamo caches a graph per code object (``forward`` of the model's class), so a graph traced
    before attach, for this model or for another instance of its class, has no module hook in it
    and, compiled without hook guards (torch's default), would go on running for the watched model
    with nothing inside it observed. Graphs compiled from now on guard on hooks
    (:func:`guard_module_hooks`) and on each hooked module's identity (observe._hooks), so a reset
    is needed once, and only when such a graph exists. It resets every compiled function of the
    process (each recompiles once on its next call)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return False
    codes = {getattr(type(m).forward, "__code__", None) for m in model.modules()}
    if any(_debug_get_cache_entry_list(code) for code in codes if code is not None):
        torch._dynamo.reset()
        return True
    return False
