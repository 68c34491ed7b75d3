"""Synthetic rank files of a distributed job, written with the run writer directly (no training)."""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Optional

import numpy as np

from ampwatch.store.writer import _INSERTS, create_run_file

_EVENT = ("INSERT INTO events (step, phase, module, kind, count, amax, dtype, origin, micro_batch)"
          " VALUES (?,?,?,?,?,?,?,?,?)")


def write_rank(folder: Path, stem: str, rank: int, world: int, rows: list, *, job_id: Optional[str] = None,
               sharding: Optional[str] = None, started: float = 1000.0, events: tuple = ()) -> Path:
    """One rank's file: ``rows`` in the writer's steps order, ``events`` as (step, phase, module, kind,
    count, amax, dtype, origin, micro_batch)."""
    path = folder / f"{stem}.sqlite"
    create_run_file(str(path), {"name": stem, "status": "finished", "started_at": started + rank, "rank": rank,
                                "world_size": world, "job_id": job_id, "grad_sharding": sharding}, [])
    conn = sqlite3.connect(path)
    conn.executemany(_INSERTS["steps"], rows)
    conn.executemany(_EVENT, events)
    conn.commit()
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    return path


def step_rows(norms: np.ndarray, losses: np.ndarray, skipped: set) -> list:
    return [(i, 0.0, 0.1, float(l), 1024.0, int(i in skipped), float(n), 1e-3, 1, 0)
            for i, (n, l) in enumerate(zip(norms, losses))]


def bad_batch_job(folder: Path, world: int = 3, steps: int = 40, bad_rank: int = 1, bad_step: int = 25) -> Path:
    """A DDP-like job: a forward overflow on ``bad_rank`` at ``bad_step`` (micro-batch 1), skipped everywhere."""
    rng = np.random.default_rng(0)
    for r in range(world):
        losses = rng.random(steps)
        if r == bad_rank:
            losses[bad_step] = np.inf
        events = [(bad_step, "param_grad", "0.weight", "inf", 8, None, "float32", 0, None)]
        if r == bad_rank:
            events.insert(0, (bad_step, "forward", "0", "inf", 16, None, "float16", 1, 1))
        write_rank(folder, f"job.rank{r}", r, world, step_rows(np.full(steps, 0.5), losses, {bad_step}),
                   sharding="replicated", events=tuple(events))
    return folder
