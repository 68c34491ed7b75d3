"""Under torch.compile, an observed forward observes each tensor once, as eager does.

Eager learns on its first step which tensors a module receives or hands out are the very tensors
another module already holds (the residual stream handed from module to module, a container's
input handed to its first child, a container's output that is its last child's) and observes each
once: those slots are aliases, read from the slot that holds the tensor (``observe.ModuleObserver._observe``).
A compiled observed forward does the same as Dynamo traces it: each traced hook looks its tensors up,
by identity (``is``, which Dynamo answers while tracing), among those observed so far in the trace
(:func:`observe_once`), and reduces and hooks only the new ones. What it decides is noted while
tracing (``torch._dynamo.comptime``: the notes run only then, never at run time) as the graph's
aliases (:func:`note`), which the host reads as eager's. The graph guards on the observer's flag
and on its list of observed tensors being empty as the forward begins: checks on each call
of the observed graph only (a few guards). On GPT-2 small's tree that halves the
observed graph's reductions and its backward's ``ampwatch::keep_max`` calls (~300 to ~150 each).

Identity is not value: a tensor the parent's code changes in place between two modules is the
same object. The note compares the version of its fake tensor then and now; on a change the alias is
not noted (that graph leaves the slot unobserved) and the observer traces its graph again without
aliases from its next observed step on.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .slots import IN, OUT, ROLES

try:  # runs a function while Dynamo traces, and nothing at run time
    from torch._dynamo.comptime import comptime
except ImportError:  # pragma: no cover - torch without it: every traced tensor observed on its own
    comptime = None

# Tried on torch 2.13 (tests/test_compile.py). 2.6 to 2.12 were not tried: there a note that fails
# turns aliases off (observe._trace_note never raises). Before 2.6 every traced tensor is observed apart
ENABLED = comptime is not None and tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 6)


def observe_once(observer: Any, trace_note: Callable[[Any], None], index: int, ins: list[torch.Tensor],
                 outs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """While Dynamo traces module ``index``'s hook: of its inputs ``ins`` and outputs ``outs``, the
    tensors to observe and their slots, leaving out each one already observed in this trace
    (``observer._trace_seen``: (tensor, slot), emptied as the forward returns). ``trace_note``:
    called through ``comptime`` with this frame's locals (``oid``, ``note``, ``t``, ``index``,
    ``role``, ``pos``, ``target``), it hands them to :func:`note`."""
    seen, oid = observer._trace_seen, observer._id  # noqa: F841 (oid: read by trace_note)
    if not seen:
        note = "start"  # noqa: F841 (read by trace_note)
        comptime(trace_note)
    # a module that works in place (pre-hooked for that, or seen handing out its input) changes
    # what it received: its tensors are observed anew, and later readers alias its slots
    inplace = index in observer._pre or any(o is a for o in outs for a in ins)
    tensors, slots = [], []
    for role, group in ((IN, ins), (OUT, outs)):
        slot = ROLES * index + role
        for pos, t in enumerate(group):
            target = None
            for u, s in seen:
                if u is t:
                    target = s
                    break
            if target is not None and not inplace:
                note = "alias"  # noqa: F841
                comptime(trace_note)
                continue
            if target is not None:  # changed in place by this module: later readers hold its slot
                seen[:] = [e for e in seen if e[0] is not t]
            seen.append((t, slot))
            note = "new"  # noqa: F841
            comptime(trace_note)
            tensors.append(t)
            slots.append(slot)
    return tensors, slots


def note(ctx: Any, observer: Any, kind: str) -> None:
    """At trace time: a note of ``kind`` from the frame of ``ctx``. ``start``: a trace begins. ``new``: tensor
    ``t`` is observed in its own slot (its version is noted). ``alias``: ``t`` is the very tensor slot
    ``target`` already holds: noted in the graph's aliases unless changed in place since (module
    docstring). ``called``: module ``index``'s call ended. ``end``: the forward returns."""
    if kind == "start" or observer._trace_notes is None:  # (or what an abandoned trace left)
        observer._trace_notes = {"versions": {}, "calls": {}}
    notes = observer._trace_notes
    if kind == "new":
        fake = ctx.get_local("t").as_fake()
        notes["versions"][id(fake)] = (fake, fake._version)  # the fake kept: its id is not reused
    elif kind == "alias":
        fake = ctx.get_local("t").as_fake()
        held = notes["versions"].get(id(fake))
        # ``held`` is None for a tensor observed in the graph before a graph break: its version
        # there is another fake's, and the identity is what there is to go by
        if held is not None and held[1] != fake._version:
            # changed in place since it was observed: no alias, so this graph leaves the slot
            # unobserved. Its flag goes off as the step ends (take), not now: this trace reads it
            # in every hook and must go on as it began. The graph guards on it, so the next
            # observed step compiles it again without aliases (restarting this trace instead
            # diverges from Dynamo's log of a graph break)
            observer._trace_dedupe_next = False
            return
        index = ctx.get_local("index").as_python_constant()
        key = (index, ctx.get_local("role").as_python_constant(), notes["calls"].get(index, 0),
               ctx.get_local("pos").as_python_constant())
        # straight into the graph's aliases: a model with graph breaks is traced in several frames
        observer._traced_aliases[key] = ctx.get_local("target").as_python_constant()
    elif kind == "called":
        index = ctx.get_local("index").as_python_constant()
        notes["calls"][index] = notes["calls"].get(index, 0) + 1
    elif kind == "end":
        observer._trace_notes = None
