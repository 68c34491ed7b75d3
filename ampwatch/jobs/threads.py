"""Reading the rank files of a job side by side."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable


def map_threads(fn: Callable, items: list) -> list:
    """``map(fn, items)`` on a few threads: sqlite3 releases the GIL while SQLite works."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1, len(items))) as pool:
        return list(pool.map(fn, items))
