"""torch.compile and the recorder's hooks: which module to hook, and keeping Dynamo's graph cache
honest about them (a graph traced without the hooks must never run on an observed step, and a
graph traced with them never for another model).

Between ``layer_every`` steps the module hooks are out of their dicts (observe.py), so a compiled
model traces a graph without them, the same graph it traces without ampwatch; an observed step puts
them back and needs the graph traced with them. By default Dynamo does not guard on empty hook dicts
(``skip_nnmodule_hook_guards``), so it would run the graph without hooks there too. Turning that
default off makes every compiled model of the process check every module's hook dicts before each
call: ~0.19 ms a forward on GPT-2 small's tree (bench/guards.py), paid on every step.

Instead the watched model's ``forward`` becomes a wrapper (:class:`GraphSplit`) that reads one
flag, on only on observed steps, and calls the forward it replaced. Dynamo compiles the wrapper's
frame, and its guards check the flag: one check per call, and the graph between observed steps is
otherwise the graph the model traces without ampwatch. Each watched model's wrapper runs under a
code object of its own, and Dynamo caches graphs per code object, so another instance of the
model's class (a twin: an EMA copy, an eval model) never shares a graph with the watched one.

That holds while the whole model is one frame. A graph break inside the model makes Dynamo compile
the forwards of its classes as frames of their own, cached with every instance of the class and not
guarded on the flag; the model's forward may also be replaced over the wrapper. Either way the split
sees it on the next observed step (graphs cached for the model's classes, or its forward no longer
the wrapper) and falls back, once, to guards on every hook dict, with Dynamo's caches reset.
"""
from __future__ import annotations

import contextlib
import operator
import sys
import types
from typing import Any, Optional

import torch

from . import copies


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile(model)`` returns an OptimizedModule: hook the module it compiles, so the hooks
    are traced into its graph."""
    return getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model


def run_eagerly() -> Any:
    """A context in which compiled code runs eagerly, as Python (``torch.compiler.set_stance``,
    torch >= 2.6; a no-op before): for runs whose numbers are thrown away (a replay, the fp32
    recompute), which must not compile graphs of their own or skip the module hooks they rely on."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def inside_compiled(root: torch.nn.Module, observed: Any = None) -> set[int]:
    """The ids of the modules below ``root`` that run inside compiled blocks: modules of one class
    compiled one by one, two or more of them (torchtitan compiles each transformer block:
    ``torch.compile(block)`` or ``block.compile()``). Hooks there would be traced into the class's
    graph with each module's own constants: one graph per block, until Dynamo's recompile limit
    makes the rest run eagerly. Inside an ``OptimizedModule`` that is every module of its inner
    module (the OptimizedModule itself is called eagerly, and its hooks see the block's inputs and
    outputs from outside); inside a module compiled in place, what lies below it. A submodule
    compiled alone keeps its hooks: one graph, traced with them.
    ``observed(module)``: whether an OptimizedModule is hooked; when it is not (the block was
    compiled after attach), its inner module stays out of the set: its own hooks run eagerly too,
    around the compiled forward, and see what the OptimizedModule's would."""
    inside: set[int] = set()
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing is compiled
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is None:
        return inside
    blocks: dict[Any, list[tuple[torch.nn.Module, Any]]] = {}  # forward code -> (module, its inner)
    for module in root.modules():
        if module is root:
            continue
        if isinstance(module, optimized):  # FSDP2 swaps in a subclass of its own
            inner = getattr(module, "_orig_mod", None)
            if isinstance(inner, torch.nn.Module):
                blocks.setdefault(getattr(type(inner).forward, "__code__", type(inner)), []).append((module, inner))
        elif getattr(module, "_compiled_call_impl", None) is not None:
            blocks.setdefault(getattr(type(module).forward, "__code__", type(module)), []).append((module, None))
    for found in blocks.values():
        if len(found) < 2:
            continue
        for module, inner in found:
            if inner is None:  # compiled in place
                inside.update(id(m) for m in module.modules() if m is not module)
            else:
                keep = observed is not None and not observed(module)
                inside.update(id(m) for m in inner.modules() if not (keep and m is inner))
    return inside


class CompiledBlocks:
    """:func:`inside_compiled`, worked out again only when the module tree changed (a child replaced,
    as by ``blocks[i] = torch.compile(block)``, or a module compiled in place): it is asked as each
    observed step begins and ends, and walking the tree took ~80 us on GPT-2 small's. One object
    answers both the observer (``observed`` given: blocks compiled after attach keep their inner
    module's hooks) and the graph split (every block), from one look at the tree."""

    def __init__(self, root: torch.nn.Module, observed: Any = None) -> None:
        self.root, self.observed = root, observed
        self._refresh()

    def _refresh(self) -> None:
        self._modules = list(self.root.modules())
        self._key = self._tree_key()
        self.inside = inside_compiled(self.root, self.observed)
        self.inside_all = inside_compiled(self.root) if self.observed is not None else self.inside

    def _tree_key(self) -> tuple:
        # each module's children as they stand, and which modules are compiled in place: C loops
        # (map), not a Python iteration per child (~30% less of the walk)
        return (list(map(tuple, map(dict.values, map(_CHILDREN, self._modules)))),
                list(map(_COMPILED_CALL, self._modules)).count(None))

    def get(self, look: bool = True, every_block: bool = False) -> set[int]:
        """The ids of the modules inside blocks compiled on their own; ``every_block``: counting
        blocks compiled after attach too (the graph split's). ``look=False``: as the tree stood
        at the last look (the caller looked a moment ago, in the same step transition)."""
        if look and self._tree_key() != self._key:
            self._refresh()
        return self.inside_all if every_block else self.inside


_CHILDREN = operator.attrgetter("_modules")  # a module's dict of children
_COMPILED_CALL = operator.attrgetter("_compiled_call_impl")  # nn.Module's, None unless compiled in place


def guard_module_hooks() -> None:
    """Make Dynamo guard on module hooks from now on, for every compiled model of the process. By
    default it does not guard empty hook dicts (``skip_nnmodule_hook_guards``): a graph traced
    without hooks would go on running after hooks were added."""
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    if config is not None and hasattr(config, "skip_nnmodule_hook_guards"):
        config.skip_nnmodule_hook_guards = False


class Flag:
    """What the wrapper's graphs guard on: ``on`` only on observed steps (and replays)."""

    def __init__(self, on: bool) -> None:
        self.on = on


def _forward(flag: Flag, finish: Any, forward: Any, /, *args: Any, **kwargs: Any) -> Any:
    # the template of each model's wrapper. Dynamo guards on the branch: one graph per value of
    # flag.on, compiled the first time each is seen, and nothing of ampwatch in the graph when off.
    # ``finish`` runs as the observed forward returns, traced into its graph (the observer joins
    # the maxima its hooks traced into one output per dtype)
    if flag.on:
        output = forward(*args, **kwargs)
        finish()
        return output
    return forward(*args, **kwargs)


def _nothing() -> None:
    return None


def _cache_entries(code: Any) -> int:
    global _entry_list
    if _entry_list is None:  # looked up once: this runs for each of the model's forwards, twice a block
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list as _entry_list
        except ImportError:  # pragma: no cover - very old torch: assume graphs exist
            return 1
    return len(_entry_list(code))


_entry_list: Any = None  # torch._dynamo.eval_frame._debug_get_cache_entry_list, once imported


class GraphSplit:
    """The watched root's ``forward`` wrapped so compiled graphs tell observed steps from the others
    by one flag (module docstring). In eager it costs one Python call per forward of the root."""

    def __init__(self, root: torch.nn.Module, on: bool, finish: Any = None,
                 blocks: Optional[CompiledBlocks] = None) -> None:
        self.root = root
        self.flag = Flag(on)
        self.guarded = False  # fell back to Dynamo's guards on every hook dict
        # the forwards Dynamo would compile as frames of their own after a graph break
        self._blocks = blocks if blocks is not None else CompiledBlocks(root)  # the observer's, shared
        self._codes_of: Any = None  # the blocks' set _codes was worked out for
        self._codes = self._model_codes()
        # graphs cached for them before attach were traced without the hooks, for this model or a
        # twin, and so were those of the frames Dynamo resumes in after a graph break (code objects
        # of their own, which only a reset reaches): all dropped, so any found later were compiled
        # since (a graph break, or a twin)
        if any(_cache_entries(code) for code in self._codes):
            torch._dynamo.reset()
        template = _forward.__code__
        own = types.FunctionType(template.replace(), _forward.__globals__, "forward")  # a code object of its own
        state = root.__dict__
        current = root.forward  # the class's bound forward, or an instance forward set before us
        self.wrapper = copies.patch(state.get("forward", copies.MISSING), own, self.flag, finish or _nothing, current)
        self.wrapper.__wrapped__ = current  # inspect.signature(model.forward) reads the model's own
        state["forward"] = self.wrapper  # straight into __dict__: nn.Module.__setattr__ has no say

    def set(self, on: bool, look: bool = True) -> None:
        """Flag this step observed or not. As an observed step ends, and before the next, check that
        the split still holds. At the end, the graphs of the model's classes were compiled with the
        hooks in, and their guards hold the hooks, so the hook guards are turned on and every graph
        is kept (compiling them again cost the HF Trainer's GPT-2 a third more graphs); the one
        case this misses is an unwatched twin of those classes compiled during that same observed
        step. Before the next, a graph compiled with the hooks out may exist (the model compiled
        first between observed steps), so every graph is dropped."""
        was = self.flag.on
        self.flag.on = on
        if self.guarded or on == was:
            return
        if self._broken(look):
            self.fall_back(drop_all=on)

    def _model_codes(self, look: bool = True) -> set:
        """The forwards of the model's classes, but for those of blocks compiled on their own
        (:func:`inside_compiled`): no hook is traced into their graphs, which need no telling apart.
        ``look=False``: the blocks as the caller just found them (CompiledBlocks.get)."""
        inside = self._blocks.get(look, every_block=True)
        if inside is not self._codes_of:  # blocks may have been compiled since
            self._codes_of = inside
            self._codes = {code for m in self.root.modules() if id(m) not in inside
                           and (code := getattr(getattr(type(m), "forward", None), "__code__", None)) is not None}
        return self._codes

    def _broken(self, look: bool = True) -> bool:
        if self.root.__dict__.get("forward") is not self.wrapper:
            return True
        return any(_cache_entries(code) for code in self._model_codes(look))

    def fall_back(self, drop_all: bool = True) -> None:
        """Guard every hook dict from now on; ``drop_all``: drop every graph of the process, so none
        traced without those guards runs again."""
        self.guarded = True
        guard_module_hooks()
        if drop_all:
            torch._dynamo.reset()

    def remove(self) -> None:
        """Put back the forward the wrapper replaced, unless something replaced the wrapper since:
        then it stays in the chain, flag off, until that is removed (a second watch's wrapper puts
        back what was there before both)."""
        self.flag.on = False
        self.wrapper.removed = True
        state = self.root.__dict__
        if state.get("forward") is self.wrapper:
            previous = self.wrapper.previous
            while isinstance(previous, copies.Patch) and getattr(previous, "removed", False):
                previous = previous.previous  # a wrapper of a watch that closed first
            if previous is copies.MISSING:
                del state["forward"]
            else:
                state["forward"] = previous
