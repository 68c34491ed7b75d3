"""The dashboard's Ranks page data: the job a chosen run file belongs to, as plain data.

Everything returned pickles (Streamlit caches copies): DataFrames, dicts, lists; no open files.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from ..doctor.warmup import expected_overflow
from ..errors import RunError
from ..jobs.group import RunGroup, load_groups


@dataclass
class JobView:
    """A job for the Ranks page: ``files`` ``{rank: file name}``, ``missing`` ranks, ``unreadable``
    ``[(rank, file, reason)]``, the :class:`~ampwatch.jobs.combine.GroupOverview` pieces, ``first``
    (where NaN/Inf appeared first: step, rank, module, phase, micro_batch, and ``warmup``: a gradient
    overflow during the scaler's warm-up, expected) and ``findings``
    (the group doctor's, as dicts)."""
    name: str
    job_id: Optional[str]
    world_size: int
    grad_sharding: str
    files: dict[int, str]
    missing: list[int]
    unreadable: list[tuple[Optional[int], str, str]]
    ranks: pd.DataFrame
    steps: pd.DataFrame
    global_steps: pd.DataFrame
    every: int
    first: Optional[dict[str, Any]]
    findings: list[dict[str, Any]]


def group_of(folder: Any, file: str) -> RunGroup:
    """The group in ``folder`` that holds the run file named ``file``."""
    for group in load_groups(folder):
        if any(p.name == file for p in group.paths.values()):
            return group
    raise RunError(f"{file!r} is not a readable run in {str(folder)!r}")


def job_view(folder: Any, file: str) -> JobView:
    """The Ranks page's data for the job that ``folder/file`` belongs to."""
    from ..doctor.job import diagnose_group
    group = group_of(folder, file)
    ov = group.overview()
    first = group.first_nonfinite()
    first_d = None if first is None else {f.name: getattr(first, f.name) for f in fields(first) if f.name != "events"}
    if first_d is not None:  # a gradient overflow while the scaler backs off is expected (as on the Events page)
        first_d["warmup"] = expected_overflow(group.paths[first_d["rank"]], first_d["step"], first_d["phase"])
    return JobView(group.name, group.job_id, group.world_size, group.grad_sharding,
                   {r: Path(p).name for r, p in group.paths.items()}, group.missing,
                   [(u.rank, u.path.name, u.reason) for u in group.unreadable], ov.ranks, ov.steps,
                   ov.global_steps, ov.every, first_d, [f.to_dict() for f in diagnose_group(group, ov)])


__all__ = ["JobView", "job_view", "group_of"]
