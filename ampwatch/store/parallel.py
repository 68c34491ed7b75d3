"""Reading one run file on several connections at once: the dashboard's bucket scans of long runs.

The dashboard reads a long run as one small query per bucket of steps (a primary-key range each,
never a sort of the whole table). SQLite lets go of Python's GIL while it steps through a query, so
buckets spread over a few read-only connections, each in a thread of its own, run on as many cores:
on a 1,000,000-step run the heatmap's 1,000 GROUP BYs took 4.0 s on one connection and 2.3 s on two,
on two cores (``bench/dashboard.py``). Each connection reads a contiguous run of buckets, so each
walks its own part of the file in order.
"""
from __future__ import annotations

import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Sequence, TypeVar

from .reader import connect

T = TypeVar("T")
R = TypeVar("R")

# Past four the scans wait on memory and on the file, not on a core; and a dashboard serves several
# viewers at once.
MAX_READERS = 4
# Fewer buckets than this per connection are read on fewer connections: a connection costs more.
MIN_PER_READER = 16
# How many connections a spread read opens at most; None: the cores, up to MAX_READERS (tests set it)
READERS: Optional[int] = None


def cores() -> int:
    """The cores this process may run on (a container's share, where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return os.cpu_count() or 1


def readers() -> int:
    """How many connections a spread read may open: :data:`READERS`, else the cores up to
    :data:`MAX_READERS`."""
    return max(1, READERS or min(MAX_READERS, cores()))


def read_spread(path: Path, query: Callable[[sqlite3.Connection, T], R], items: Sequence[T],
                min_each: int = MIN_PER_READER) -> list[R]:
    """``[query(conn, item) for item in items]``, the items cut into contiguous slices, each read on
    a read-only connection of its own (:func:`ampwatch.store.reader.connect`) in a thread of its own;
    results in the items' order. At most :func:`readers` connections, each given at least
    ``min_each`` items. A bad file raises one :class:`~ampwatch.errors.RunError`, as a single
    connection would."""
    items = list(items)
    n = max(1, min(readers(), len(items) // max(1, min_each)))
    if n == 1:
        with connect(path) as conn:
            return [query(conn, item) for item in items]
    size = -(-len(items) // n)
    slices = [items[i:i + size] for i in range(0, len(items), size)]

    def read(part: list[T]) -> list[R]:
        with connect(path) as conn:
            return [query(conn, item) for item in part]

    with ThreadPoolExecutor(len(slices), thread_name_prefix="ampwatch-read") as pool:
        return [result for part in pool.map(read, slices) for result in part]


def step_ranges(first: int, last: int, parts: int) -> list[tuple[int, int]]:
    """``[first, last]`` cut into at most ``parts`` contiguous ranges of steps, in order, covering
    every step once: for a scan of a whole table read as :func:`read_spread`'s items."""
    parts = max(1, min(parts, last - first + 1))
    cuts = [first + (last - first + 1) * i // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1] - 1) for i in range(parts)]
