"""What a user passes as a path (str, bytes or os.PathLike), as text, or one clear line saying why not.

Python's own messages for a wrong path type disagree with each other (``Path(123)`` and ``Path(b'x')``
say different things), and an empty string silently means the current folder; both reach users of
``load``, ``diagnose``, ``load_group`` and ``attach`` as tracebacks or as misleading lines."""
from __future__ import annotations

import os
from typing import Any, Optional


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def path_text(value: Any, error: type, what: str, example: str, type_error: Optional[type] = None) -> str:
    """``value`` as a str path, else ``error`` (``type_error`` for a value that is no path at all)
    naming what was passed, what ``what`` expects, and ``example``."""
    text = None
    if isinstance(value, (str, bytes, os.PathLike)):
        try:
            text = os.fsdecode(value)  # bytes paths are decoded the way os.* functions do
        except TypeError:  # an __fspath__ that returns neither str nor bytes
            text = None
    if text is None:
        raise (type_error or error)(f"{what} must be a str or pathlib.Path, got "
                                    f"{type(value).__name__} {short_repr(value)}: pass e.g. {example!r}")
    if not text:
        raise error(f"{what} is an empty string: pass a path, e.g. {example!r}")
    if "\x00" in text:
        raise error(f"{what} {short_repr(text)} contains a NUL character: pass a path, e.g. {example!r}")
    return text
