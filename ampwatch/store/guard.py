"""Damaged run files: one place that turns any failure while reading a bad file into one RunError line.

A run file is a post-mortem people copy between machines and keep after crashes, so readers meet
truncated files, flipped bits and zeroed pages. SQLite checks the header when a file is
opened but finds a damaged page only when a query reads it, and a flipped type byte can hand a reader
text where it expects a number. Instead of a try/except in every caller, every public reader goes
through :func:`guard` (the :func:`reads` decorator, or :func:`ampwatch.store.reader.connect`): when reading
fails, the file is checked (``PRAGMA quick_check`` and column types, per table, on the error path
only). A damaged file becomes :class:`RunError` naming the damaged tables and how to salvage the rest;
a clean file lets the original exception through, because then it is a bug in ampwatch, not bad input.
"""
from __future__ import annotations

import functools
import os
import sqlite3
import urllib.parse
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

from ..errors import RunError

F = TypeVar("F", bound=Callable[..., Any])

# What a declared column type may hold in a file ampwatch wrote (SQLite stores NaN as NULL).
_SCHEMA = "<schema>"  # stands for "the file cannot even list its tables"
_ALLOWED = {"INTEGER": ("integer", "real", "null"), "REAL": ("real", "integer", "null"), "TEXT": ("text", "null")}


def decode_text(raw: bytes) -> str:
    """The readers' text_factory: text that is not valid UTF-8 (a damaged page) reads with U+FFFD."""
    return raw.decode("utf-8", errors="replace")


def _read_errors() -> tuple[type, ...]:
    import pandas as pd  # only readers get here; the training box never imports pandas
    return sqlite3.Error, pd.errors.DatabaseError, UnicodeError


def recover_hint(path: Path) -> str:
    q = str(path).replace("'", "'\\''")
    return f"recover what is left with: sqlite3 '{q}' \".recover\" | sqlite3 recovered.sqlite"


def _first_line(exc: BaseException) -> str:
    cause = exc.__cause__ if exc.__cause__ is not None and not isinstance(exc, sqlite3.Error) else exc
    text = str(cause).strip().splitlines()
    # pandas wraps sqlite errors as "Execution failed on sql '...': <reason>": the reason is what matters
    line = text[-1] if text else type(cause).__name__
    return line.rsplit("': ", 1)[-1][:200]


def read_only_uri(path: Path) -> str:
    """``mode=ro``, plus ``immutable=1`` for a WAL-mode file without its ``-wal`` (a copy of a killed
    run, or a damaged header): a read-only open of such a file would create ``-wal``/``-shm`` beside it."""
    uri = f"file:{urllib.parse.quote(str(path.absolute()))}?mode=ro"
    try:
        with open(path, "rb") as fh:
            head = fh.read(20)
    except OSError:
        return uri
    if 2 in head[18:20] and not Path(f"{path}-wal").exists():
        uri += "&immutable=1"
    return uri


def open_read_only(path: Path, factory: type = sqlite3.Connection) -> sqlite3.Connection:
    """A connection that cannot write ``path``, decoding damaged text instead of raising."""
    conn = sqlite3.connect(read_only_uri(path), uri=True, check_same_thread=False, factory=factory)
    conn.text_factory = decode_text
    return conn


def _table_is_sound(conn: sqlite3.Connection, table: str) -> bool:
    try:
        if [r[0] for r in conn.execute(f'PRAGMA quick_check("{table}")')] != ["ok"]:
            return False
        bad = [f'typeof("{name}") NOT IN {_ALLOWED[decl.upper()]}'
               for _, name, decl, *_ in conn.execute(f'PRAGMA table_info("{table}")') if decl.upper() in _ALLOWED]
        return not bad or conn.execute(f'SELECT 1 FROM "{table}" WHERE {" OR ".join(bad)} LIMIT 1').fetchone() is None
    except (sqlite3.Error, UnicodeError):  # SQLite's message may quote damaged (non-UTF-8) schema text
        return False


def damaged_tables(path: Any) -> list[str]:
    """The tables of ``path`` that fail SQLite's quick_check or hold values of the wrong type;
    ``[_SCHEMA]`` when the file cannot even list its tables; [] for a sound file.
    Never writes. Cost: reads the whole file (only ever on an error path; remembered per file version)."""
    p = Path(os.fspath(path)).absolute()
    try:
        version = tuple((s.st_size, s.st_mtime_ns) for s in (p.stat(),)) + _wal_version(p)
    except OSError:
        return [_SCHEMA]
    return list(_check(p, version))


def _wal_version(p: Path) -> tuple:
    try:
        s = Path(f"{p}-wal").stat()
        return ((s.st_size, s.st_mtime_ns),)
    except OSError:
        return ()


@functools.lru_cache(maxsize=64)  # several readers of one damaged file: one check
def _check(p: Path, version: tuple) -> tuple[str, ...]:
    try:
        conn = open_read_only(p)
    except (sqlite3.Error, UnicodeError):
        return (_SCHEMA,)
    try:
        try:
            tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY rootpage")]
        except (sqlite3.Error, UnicodeError):
            return (_SCHEMA,)
        return tuple(t for t in tables if not _table_is_sound(conn, t))
    finally:
        conn.close()


def header_size(path: Path) -> Optional[tuple[int, int]]:
    """(page count, page size) from the SQLite header, or None where the header does not say.

    Bytes 28-31 hold the page count and 16-17 the page size (1 means 65536); the count is valid only
    while bytes 92-95 equal the change counter (24-27), as they do in every file SQLite >= 3.7 wrote."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(100)
    except OSError:
        return None
    if len(head) < 100:
        return None
    size = int.from_bytes(head[16:18], "big")
    size = 65536 if size == 1 else size
    pages = int.from_bytes(head[28:32], "big")
    valid = head[24:28] == head[92:96]
    return (pages, size) if valid and pages and size >= 512 and size & (size - 1) == 0 else None


def truncation_error(path: Path) -> Optional[RunError]:
    """A RunError when ``path`` is shorter than its header says (a cut-short or partial copy), else None.

    Only for a file with no non-empty ``-wal`` beside it: a live run keeps new pages there."""
    said = header_size(path)
    try:
        actual = path.stat().st_size
        wal = Path(f"{path}-wal").stat().st_size if Path(f"{path}-wal").exists() else 0
    except OSError:
        return None
    if said is None or wal or actual >= said[0] * said[1]:
        return None
    pages, size = said
    return RunError(f"{str(path)!r} is truncated: {actual:,} bytes, shorter than the {pages * size:,} its header "
                    f"says ({pages:,} pages of {size:,}), so it is a cut-short or partial copy: copy the whole "
                    f"file again, or {recover_hint(path)}")


def read_error(path: Any, exc: BaseException) -> Optional[RunError]:
    """The one line for a failure while reading ``path``, or None when it is not the file's fault.

    Damaged file: which tables, what SQLite said, how to salvage the rest. Sound file: SQLite and
    decoding errors still mean the file cannot be read now (locked, removed); anything else is a bug.
    """
    p = Path(os.fspath(path))
    if not p.is_file():  # removed or replaced while we read it
        return RunError(f"{str(p)!r} disappeared while it was being read ({_first_line(exc)}): check the path")
    truncated = truncation_error(p)  # cheap (100 bytes), and says more than "malformed"
    if truncated is not None:
        return truncated
    tables, said = damaged_tables(p), _first_line(exc)
    sqlite_error = isinstance(exc, _read_errors())
    if tables or (sqlite_error and any(w in said for w in ("malformed", "not a database", "corrupt"))):
        where = ""
        if tables == [_SCHEMA]:
            where = "; its table list is damaged"
        elif tables:
            where = f"; damaged table(s): {', '.join(tables)}, the others still read"
        return RunError(f"{str(p)!r} is corrupt or truncated ({said}{where}): {recover_hint(p)}")
    if sqlite_error:
        return RunError(f"cannot read {str(p)!r}: {said}")
    return None


@contextmanager
def guard(path: Any) -> Iterator[None]:
    """Turn any failure while reading ``path`` into one RunError line when the file is to blame;
    anything else (a bug in ampwatch, not bad input) is re-raised unchanged."""
    try:
        yield
    except RunError:
        raise
    except Exception as exc:  # noqa: BLE001 - sorted out by read_error: bad file -> RunError, else re-raised
        error = read_error(path, exc)
        if error is None:
            raise
        raise error from None


def reads(fn: F) -> F:
    """Decorator for a public reader whose first argument is a path or has ``.path`` (a Run)."""
    @functools.wraps(fn)
    def wrapper(first: Any, *args: Any, **kwargs: Any) -> Any:
        with guard(getattr(first, "path", first)):
            return fn(first, *args, **kwargs)
    return wrapper  # type: ignore[return-value]
