"""A model class whose graphs Dynamo caches apart from every other class's: for benchmarks that
compile an unwatched copy beside a watched one in one process."""
from __future__ import annotations

import types


def with_own_code(cls: type) -> type:
    """A subclass of ``cls`` whose ``forward`` runs the same code under a code object of its own.
    Dynamo caches graphs, and checks their guards, per code object: an instance of it never shares
    them with instances of ``cls`` (a watched copy's graphs, and the guards those turned on)."""
    forward = cls.forward
    own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                             forward.__defaults__, forward.__closure__)
    own.__kwdefaults__ = forward.__kwdefaults__
    return type(cls.__name__, (cls,), {"forward": own, "__module__": cls.__module__})
