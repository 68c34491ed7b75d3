"""Reading the rank files of a job side by side."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ..store.parallel import readers


def map_threads(fn: Callable, items: list) -> list:
    """``map(fn, items)`` on a few threads (as many as a spread read of one file opens,
    :func:`ampwatch.store.parallel.readers`): sqlite3 releases the GIL while SQLite works."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(readers(), len(items))) as pool:
        return list(pool.map(fn, items))
