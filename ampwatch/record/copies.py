"""Copies of watched objects leave ampwatch behind.

EMA and SWA copies (timm's ``ModelEmaV3``, torch's ``AveragedModel``), whole-module checkpoints
(``torch.save(model)``) and copies of the scaler are made with ``copy.deepcopy`` or pickle while a
watch is attached. Both take an object's state from its ``__getstate__``, and a watched object's
state holds ampwatch: the module hook dicts hold the observer's hooks, which reach the writer's
lock (``cannot pickle '_thread.lock'``) and functions made by ``torch._dynamo.disable`` (which
pickle cannot name); the scaler's ``__dict__`` holds its wrapped methods. A copy that kept them
would record into the original's run as if it were the trained model, or fail to load where
ampwatch is not installed.

So every watched module and scaler gets an instance ``__getstate__`` (looked up on the instance
first by deepcopy, copy and pickle) that returns what the class's ``__getstate__`` returns, less
ampwatch: its hooks left out of every hook dict, its method wrappers replaced by what they
wrapped, and itself. The copy is the object as it was before attach, with the user's own hooks;
the original keeps recording. Nothing here runs during training: only a copy pays.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Iterable

MISSING = object()  # a patched attribute that was not in the instance's __dict__ before

_OURS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()  # id -> hook


def ours(hook: Any) -> Any:
    """Mark ``hook`` (a callable about to be registered in a module hook dict) as ampwatch's, so
    copies of the module leave it out. Returns ``hook``."""
    _OURS[id(hook)] = hook
    return hook


def _is_ours(hook: Any) -> bool:
    return _OURS.get(id(hook)) is hook


class Patch(functools.partial):
    """An instance attribute ampwatch set on a user's object (a scaler method's wrapper, a
    ``__getstate__``). ``previous``: what the instance's ``__dict__`` held there before, or
    :data:`MISSING` when the class's attribute showed through. A partial: called at C speed."""

    previous: Any = MISSING
    users = 0  # watches sharing this __getstate__ (one object watched twice)


def patch(previous: Any, func: Any, *args: Any) -> Patch:
    """``functools.partial(func, *args)`` that remembers ``previous``."""
    wrapper = Patch(func, *args)
    wrapper.previous = previous
    return wrapper


def leave_out_of_copies(objects: Iterable[Any]) -> list[Any]:
    """Give each object the ``__getstate__`` described above (shared, counted, when several
    watches hold one object). Returns the objects it was given to, for :func:`release`."""
    done = []
    for obj in objects:
        state = getattr(obj, "__dict__", None)
        if not isinstance(state, dict):  # no instance dict: nothing of ours can be in its state
            continue
        current = state.get("__getstate__", MISSING)
        if isinstance(current, Patch) and current.func is _state_without_ampwatch and current.args[0]() is obj:
            current.users += 1
        else:
            getter = patch(current, _state_without_ampwatch, weakref.ref(obj))
            getter.users = 1
            state["__getstate__"] = getter  # the __dict__ itself: nn.Module.__setattr__ has no say here
        done.append(obj)
    return done


def release(objects: Iterable[Any]) -> None:
    """Undo :func:`leave_out_of_copies` once per object; the last watch restores what was there."""
    for obj in objects:
        state = obj.__dict__
        getter = state.get("__getstate__")
        if not (isinstance(getter, Patch) and getter.func is _state_without_ampwatch):
            continue  # replaced by someone else since: theirs stays
        getter.users -= 1
        if getter.users <= 0:
            if getter.previous is MISSING:
                del state["__getstate__"]
            else:
                state["__getstate__"] = getter.previous


def _state_without_ampwatch(ref: "weakref.ref[Any]") -> Any:
    obj = ref()
    getter = obj.__dict__.get("__getstate__")
    while isinstance(getter, Patch):
        getter = getter.previous
    if getter is not MISSING and getter is not None:
        state = getter()  # the user's own instance __getstate__
    else:
        class_getstate = getattr(type(obj), "__getstate__", None)  # object has none before 3.11
        state = class_getstate(obj) if class_getstate is not None else obj.__dict__
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):  # (dict, slots)
        return without_ampwatch(state[0]), state[1]
    return without_ampwatch(state) if isinstance(state, dict) else state


def without_ampwatch(state: dict) -> dict:
    """A copy of an object's state (its ``__dict__`` as ``__getstate__`` gave it) with every
    :class:`Patch` replaced by what it replaced, and ampwatch's hooks out of the hook dicts (with
    their ids out of the dicts torch keys by hook id: ``_forward_hooks_with_kwargs`` and the like)."""
    state = dict(state)  # object.__getstate__ returns the live __dict__ itself
    dropped: set[int] = set()
    for key, value in state.items():
        if isinstance(key, str) and "hook" in key and isinstance(value, dict):
            dropped.update(k for k, hook in value.items() if _is_ours(hook))
    for key, value in list(state.items()):
        if isinstance(value, Patch):
            while isinstance(value, Patch):
                value = value.previous
            if value is MISSING:
                del state[key]
            else:
                state[key] = value
        elif (dropped and isinstance(key, str) and "hook" in key and isinstance(value, dict)
              and not dropped.isdisjoint(value)):
            kept = type(value)()
            for k, v in value.items():
                if k not in dropped:
                    kept[k] = v
            state[key] = kept
    return state
