"""Keeping ampwatch's hooks out of Dynamo: frames it must never compile, root hooks it must never trace.

Dynamo compiles every Python frame that runs while a compiled module is called, hooks included, and
traces into its graph every function a traced frame calls. Two needs follow:

- the module hooks run inside a compiled forward are traced (on observed steps that is the point),
  but must never become frames of their own: :func:`never_a_frame_of_its_own`;
- the root's hooks (the replay's, the backward-end trigger's, the observer's root hooks) must run
  eagerly always: ``torch.compile(model)`` calls them outside its graph, and a compiled function
  that calls the model would otherwise trace them. :func:`eager_hook`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def _frame_skipper() -> Any:
    """torch >= 2.6: a function that marks a code object skipped by Dynamo at frame level, with
    every frame it calls; None on older torch."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except (ImportError, AttributeError):
        return None
    strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    return lambda code: set_code_exec_strategy(code, strategy)


_SKIP_FRAMES = _frame_skipper()


def never_a_frame_of_its_own(*functions: Any) -> None:
    """A model with graph breaks of its own runs the modules around a break eagerly, and their
    hooks would then be compiled as frames of their own: once per module (Dynamo specializes on the
    module and its index), up to its recompile limit, each call then a graph of its own (+80 ms a
    step on GPT-2 small's tree). Skipping their code, and the frames it calls, at frame level keeps
    them eager there; inlined into a module's compiled forward (no frame of their own) they are
    still traced."""
    if _SKIP_FRAMES is not None:  # torch >= 2.6: the frame and every frame it calls
        for fn in functions:
            _SKIP_FRAMES(fn.__code__)
        return
    skip_code = getattr(torch._dynamo.eval_frame, "skip_code", None)  # older torch: the frame alone
    for fn in functions if skip_code is not None else ():
        skip_code(fn.__code__)


def eager_hook(fn: Callable) -> Callable:
    """``fn`` for a root module's hook dict, always run eagerly: what ``torch._dynamo.disable(fn)``
    gives, without its wrapper's cost on every call (it swaps Dynamo's frame callback out and back
    in: ~13 Python lines and two C calls a call; three root hooks run on every step). Here the
    hook's code, and every frame it calls, is skipped at frame level, and the attribute Dynamo
    reads when it traces a call makes it break the graph there and run the hook eagerly, as it
    does for a disabled function. Older torch (no frame-level skip of called frames): the wrapper."""
    if _SKIP_FRAMES is None:
        return torch._dynamo.disable(fn)

    def hook(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)
    hook._torchdynamo_disable = True  # type: ignore[attr-defined]
    return hook


if _SKIP_FRAMES is not None:  # every hook made by eager_hook shares this one code object
    _SKIP_FRAMES(eager_hook(print).__code__)
