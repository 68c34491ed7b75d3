"""Ground truth straight from a run file: plain sqlite3, read-only, independent of ampwatch's reader."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pandas as pd


def sql_frame(path: Path, query: str, params: tuple = ()) -> pd.DataFrame:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return pd.read_sql_query(query, conn, params=params)
    finally:
        conn.close()
