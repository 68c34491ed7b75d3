"""The ranks of one distributed job, read back together: :func:`load_group`.

Each rank of a job writes its own run file. A group is recognised from what the files record:

1. ``run.job_id`` (``TORCHELASTIC_RUN_ID``, else the rendezvous address and start time): files with
   the same job id are one job.
2. Files without a job id (written before schema 2, or by an older ampwatch) with ``world_size > 1``
   fall back to their **file name** and **start time**: the same stem once the rank number is taken
   out (``ddp.rank0`` and ``ddp.rank3`` -> ``ddp.rank*``; ``fsdp_0`` -> ``fsdp_*``), the same
   ``world_size``, and start times within :data:`JOB_START_WINDOW_S` of the job's first rank
   (a second run of the same script later is a second job).
3. A single-process run (``world_size`` 1) is a group of one.

A rank whose file is absent is in :attr:`RunGroup.missing`; a file that cannot be read (truncated,
corrupt, not a run) is in :attr:`RunGroup.unreadable` with the reason, attributed to a rank by its
file name where the name says which. Neither is fatal.

Cost: opening a group reads each file's run row, step bounds, last loss and the steps with NaN/Inf
events (index lookups only: milliseconds per file, on a few threads). The fast
per-step view is :meth:`RunGroup.overview` (:mod:`ampwatch.jobs.combine`); ``steps`` and
``global_steps`` read every row of every rank.
"""
from __future__ import annotations

import glob as _glob
import math
import os
import re
import sqlite3
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd

from ..store.guard import truncation_error
from ..errors import RunError
from ..store.schema import STEP_NAN_BITS
from ..store.reader import RUN_SUFFIXES, Run, effective_status, open_run
from ..userpath import path_text
from .combine import combine_ranks, core_steps, first_nonfinite, group_overview
from .threads import map_threads

# Steps with NaN/Inf events kept one by one up to this many per rank (a run that is NaN for most
# of its steps is sampled like the rest past it).
EVENT_STEPS_LIMIT = 20_000
# Ranks of one job start within seconds of each other (they meet at the rendezvous); ten minutes
# tolerates slow nodes and still separates two runs of the same script one after the other.
JOB_START_WINDOW_S = 600.0


@dataclass(frozen=True)
class Unreadable:
    """A file that belongs (or may belong) to the job but cannot be read."""
    rank: Optional[int]  # from the file's run row, else from its name; None when neither says
    path: Path
    reason: str


@dataclass
class RankFile:
    """What one rank's file says about itself (its run row and step bounds)."""
    path: Path
    rank: int
    world_size: int
    job_id: Optional[str]
    grad_sharding: Optional[str]
    name: str
    started_at: float
    status: str
    steps: int
    first_step: Optional[int]
    last_step: Optional[int]
    event_steps: list[int]  # steps with NaN/Inf events (from the events_step index), up to EVENT_STEPS_LIMIT
    last_loss: Optional[float]


def _read_rank_file(path: Path) -> RankFile:
    """The run row and step bounds of one file; RunError if it is not a readable run.

    Constant time (no table scan): a file shorter than its own header's page count says is truncated."""
    with open_run(path) as conn:
        p, row = conn.path, conn.run_row
        _check_length(p)
        lo = conn.execute("SELECT MIN(step) FROM steps").fetchone()[0]  # apart: together they scan
        hi = conn.execute("SELECT MAX(step) FROM steps").fetchone()[0]
        n = 0 if lo is None else hi - lo + 1  # steps are numbered without gaps
        events = [r[0] for r in conn.execute("SELECT DISTINCT step FROM events ORDER BY step LIMIT ?",
                                             (EVENT_STEPS_LIMIT,))]
        tail = conn.execute("SELECT loss, nan_mask FROM steps ORDER BY step DESC LIMIT 1").fetchone()
    last_loss = None if tail is None else (math.nan if tail[1] & STEP_NAN_BITS["loss"] else tail[0])
    world = int(row.get("world_size") or 1)
    return RankFile(p, int(row.get("rank") or 0), world, row.get("job_id"), row.get("grad_sharding"),
                    row["name"], float(row.get("started_at") or 0.0), effective_status(row), int(n), lo, hi,
                    events, last_loss)


def _check_length(p: Path) -> None:
    # a live run keeps new pages in its -wal file: only a file without one must hold them all
    error = truncation_error(p)
    if error is not None:
        raise error


# -- recognising jobs ---------------------------------------------------------------------------------

def _rank_pattern(stem: str, rank: int) -> str:
    """The stem with its rank number replaced by ``*`` (``ddp.rank3-2`` -> ``ddp.rank*-2``)."""
    m = re.search(rf"rank{rank}(?!\d)", stem)
    if m:
        return stem[:m.start()] + "rank*" + stem[m.end():]
    hits = list(re.finditer(rf"(?<!\d){rank}(?!\d)", stem))
    if hits:
        m = hits[-1]
        return stem[:m.start()] + "*" + stem[m.end():]
    return stem


def _name_candidates(stem: str) -> list[tuple[str, int]]:
    """(pattern, rank) readings of a file name whose content could not be read."""
    return [(stem[:m.start()] + "*" + stem[m.end():], int(m.group())) for m in re.finditer(r"\d+", stem)] + \
        [(stem[:m.start()] + "rank*" + stem[m.end():], int(m.group(1))) for m in re.finditer(r"rank(\d+)", stem)]


def _job_label(pattern: str) -> str:
    label = re.sub(r"[._-]?(rank)?\*", "", pattern, count=1).strip("._-")
    return label or pattern


def _cluster(files: list[RankFile]) -> list[list[RankFile]]:
    """Split files of one name pattern into jobs by start time (a rank appears once per job)."""
    jobs: list[list[RankFile]] = []
    for f in sorted(files, key=lambda f: (f.started_at, f.rank)):
        job = jobs[-1] if jobs else None
        if job is None or f.rank in {g.rank for g in job} or f.started_at - job[0].started_at > JOB_START_WINDOW_S:
            jobs.append([f])
        else:
            job.append(f)
    return jobs


def _group_files(files: list[RankFile]) -> list[list[RankFile]]:
    by_key: dict[tuple, list[RankFile]] = {}
    for f in files:
        if f.job_id:
            key: tuple = ("job", f.job_id)
        elif f.world_size > 1:
            key = ("name", str(f.path.parent), _rank_pattern(f.path.stem, f.rank), f.world_size)
        else:
            key = ("single", str(f.path))
        by_key.setdefault(key, []).append(f)
    jobs: list[list[RankFile]] = []
    for key, members in by_key.items():
        jobs.extend(_cluster(members) if key[0] == "name" else [sorted(members, key=lambda f: f.rank)])
    return sorted(jobs, key=lambda j: min(str(f.path) for f in j))  # folder order, as `ls` shows it


def _expand(folder_or_glob: Any) -> list[Path]:
    """The run files a folder holds (directly), a glob matches, or the one file named."""
    text = path_text(folder_or_glob, RunError, "the folder, glob or run file", "runs/ddp_job")
    p = Path(text)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in RUN_SUFFIXES)
        if not files:
            raise RunError(f"no runs in {text!r}: expected .sqlite files written by ampwatch")
        return files
    if p.is_file():
        return [p]
    if _glob.has_magic(text):
        files = sorted(Path(f) for f in _glob.glob(text) if Path(f).is_file())
        if not files:
            raise RunError(f"no files match {text!r}: check the pattern (e.g. 'runs/job.rank*.sqlite')")
        return files
    raise RunError(f"no folder or run file at {text!r}: pass a folder of rank files, a glob or one file")


def _read_one(path: Path) -> Any:
    try:
        return _read_rank_file(path)
    except RunError as exc:
        return str(exc)
    except sqlite3.DatabaseError as exc:
        return f"{str(path)!r} is corrupt or truncated ({exc})"


def load_groups(folder_or_glob: Any) -> list["RunGroup"]:
    """Every job in a folder (or matched by a glob), in file-name order; single-process runs are groups of one.

    Files that cannot be read are attributed to the job their name points at (``ddp.rank3.sqlite``
    -> rank 3 of the job whose files are ``ddp.rank*``); the others go to the one group's
    ``unreadable`` when there is one group, else each becomes a group of its own with no readable rank.

    :param folder_or_glob: a folder (its run files, not sub-folders), a glob such as
        ``'runs/ddp.rank*.sqlite'``, or one run file.
    """
    paths = _expand(folder_or_glob)
    read, bad = [], []
    for path, got in zip(paths, map_threads(_read_one, paths)):  # a RankFile, or why not (a str)
        if isinstance(got, str):
            bad.append((path, got))
        else:
            read.append(got)
    groups = [RunGroup(files) for files in _group_files(read)]
    for path, reason in bad:
        owner = _owner(groups, path)
        if owner is not None:
            owner._add_unreadable(Unreadable(owner._rank_from_name(path), path, reason))
        elif len(groups) == 1:
            groups[0]._add_unreadable(Unreadable(None, path, reason))
        else:
            groups.append(RunGroup([], unreadable=[Unreadable(None, path, reason)]))
    return groups


def _owner(groups: list["RunGroup"], path: Path) -> Optional["RunGroup"]:
    for pattern, rank in _name_candidates(path.stem):
        for g in groups:
            if g.world_size > 1 and rank < g.world_size and rank not in g.paths and pattern in g.patterns \
                    and path.parent in {p.parent for p in g.paths.values()}:
                return g
    return None


def load_group(folder_or_glob: Any, job: Optional[str] = None) -> "RunGroup":
    """The ranks of one distributed job as a :class:`RunGroup`.

    >>> group = ampwatch.load_group("runs/")              # or "runs/ddp.rank*.sqlite"
    >>> group.global_steps                                 # one row per step, across the ranks
    >>> group.first_nonfinite()                            # step, rank, module, phase

    :param folder_or_glob: a folder of rank files, a glob, or one run file.
    :param job: pick one job when the folder holds several: its job id or its name (as listed in
        the error :func:`load_group` raises otherwise; :func:`load_groups` returns them all).

    Raises :class:`RunError` when nothing readable is found, or when several jobs match and
    ``job`` does not pick one. Missing and unreadable ranks are reported, not raised.
    """
    every = load_groups(folder_or_glob)
    groups = [g for g in every if g.paths]
    if job is not None:
        groups = [g for g in groups if job in (g.job_id, g.name)]
        if not groups:
            raise RunError(f"no job {job!r} in {os.fspath(folder_or_glob)!r}: "
                           f"see `ampwatch summary {os.fspath(folder_or_glob)}` for the jobs there")
    if not groups:
        reasons = [u.reason for g in every for u in g.unreadable]
        if len(reasons) == 1:  # one file: its own reason says what and what to do
            raise RunError(reasons[0])
        raise RunError(f"no readable run in {os.fspath(folder_or_glob)!r}: every file failed to open"
                       + (f" (first: {reasons[0]})" if reasons else ""))
    if len(groups) > 1:
        names = ", ".join(f"{g.name!r} ({len(g.paths)} of {g.world_size} ranks)" for g in groups[:8])
        more = f" and {len(groups) - 8} more" if len(groups) > 8 else ""
        raise RunError(f"{os.fspath(folder_or_glob)!r} holds {len(groups)} jobs: {names}{more}; pick one with "
                       f"load_group(..., job=NAME), a glob such as 'DIR/NAME*.sqlite', or use load_groups()")
    return groups[0]


# -- the group ------------------------------------------------------------------------------------------

class RunGroup:
    """The ranks of one job (see the module docstring for how they are recognised).

    :ivar name: the job's name: the common file stem without the rank (``ddp`` for ``ddp.rank*``).
    :ivar job_id: ``run.job_id`` when recorded, else None.
    :ivar world_size: the job's world size (from its files).
    :ivar grad_sharding: ``'sharded'`` (FSDP: the global grad norm is sqrt of the ranks' summed
        squares), ``'replicated'`` (DDP: any rank's norm is the global one) or ``'none'``. Files
        that do not record it (older runs) read as ``'replicated'`` under ``world_size > 1``: the
        recorder only recorded DDP then.
    :ivar paths: ``{rank: Path}`` of the readable rank files.
    :ivar missing: ranks below ``world_size`` with no file at all.
    :ivar unreadable: :class:`Unreadable` files (truncated, corrupt), with the reason.
    """

    def __init__(self, files: list[RankFile], unreadable: Optional[list[Unreadable]] = None) -> None:
        self.files = {f.rank: f for f in sorted(files, key=lambda f: f.rank)}
        self.paths = {r: f.path for r, f in self.files.items()}
        first = next(iter(self.files.values()), None)
        self.world_size = max([f.world_size for f in files] or [1])
        self.job_id = first.job_id if first else None
        shardings = {f.grad_sharding for f in files if f.grad_sharding}
        self.grad_sharding = (sorted(shardings)[0] if shardings
                              else "replicated" if self.world_size > 1 else "none")
        self.patterns = {_rank_pattern(f.path.stem, f.rank) for f in files}
        stem = sorted(self.patterns)[0] if self.patterns else None
        self.name = _job_label(stem) if stem and self.world_size > 1 else (first.name if first else "?")
        self.unreadable: list[Unreadable] = []
        for u in unreadable or []:
            self._add_unreadable(u)

    def _add_unreadable(self, u: Unreadable) -> None:
        self.unreadable.append(u)

    def _rank_from_name(self, path: Path) -> Optional[int]:
        for pattern, rank in _name_candidates(path.stem):
            if pattern in self.patterns and rank < self.world_size:
                return rank
        return None

    @property
    def ranks(self) -> list[int]:
        """The ranks whose files were read."""
        return list(self.paths)

    @property
    def missing(self) -> list[int]:
        """Ranks below ``world_size`` with no file (an unreadable file's rank is not missing)."""
        known = set(self.paths) | {u.rank for u in self.unreadable if u.rank is not None}
        return [r for r in range(self.world_size) if r not in known]

    @property
    def complete(self) -> bool:
        """Every rank of the job was read."""
        return len(self.paths) == self.world_size

    @cached_property
    def runs(self) -> dict[int, Run]:
        """``{rank: Run}``, opened read-only."""
        return {r: Run(p) for r, p in self.paths.items()}

    @property
    def info(self) -> pd.DataFrame:
        """One row per readable rank: rank, file, name, status, started_at, steps, first/last step."""
        return pd.DataFrame([{"rank": f.rank, "file": f.path.name, "name": f.name, "status": f.status,
                              "started_at": f.started_at, "steps": f.steps, "first_step": f.first_step,
                              "last_step": f.last_step} for f in self.files.values()],
                            columns=["rank", "file", "name", "status", "started_at", "steps", "first_step",
                                     "last_step"])

    @cached_property
    def _steps(self) -> pd.DataFrame:
        frames = [run.steps.assign(rank=r) for r, run in self.runs.items()]
        if not frames:
            return pd.DataFrame(columns=["rank", "step", "loss", "loss_scale", "skipped", "grad_norm"])
        df = pd.concat(frames, ignore_index=True)
        return df[["rank"] + [c for c in df.columns if c != "rank"]]

    @property
    def steps(self) -> pd.DataFrame:
        """One row per rank and step: ``rank`` plus every column of :attr:`ampwatch.Run.steps`.

        Reads every row of every rank (about 0.2 s per 100,000-step rank)."""
        return self._steps.copy()

    @cached_property
    def _global(self) -> pd.DataFrame:
        return combine_ranks(core_steps(self), self.grad_sharding, self.world_size)

    @property
    def global_steps(self) -> pd.DataFrame:
        """One row per step across the ranks (see :func:`ampwatch.jobs.combine.combine_ranks` for the columns):
        the global grad norm rebuilt from the ranks, skipped with ``skipped_agree``, loss mean and spread.

        Reads five columns of every row of every rank (64 ranks x 100,000 steps: docs/performance.md)."""
        return self._global.copy()

    def overview(self, points: Optional[int] = None) -> Any:
        """The job at a glance, fast: per-rank headline figures and the steps sampled for a chart
        (:func:`ampwatch.jobs.combine.group_overview`)."""
        return group_overview(self, points)

    def first_nonfinite(self) -> Any:
        """Where NaN/Inf appeared first across the job (:func:`ampwatch.jobs.combine.first_nonfinite`)."""
        return first_nonfinite(self)

    def __repr__(self) -> str:
        return (f"<ampwatch.RunGroup {self.name!r} ranks {len(self.paths)}/{self.world_size}"
                f" missing={self.missing} unreadable={len(self.unreadable)}>")


def rank_list(ranks: Any) -> str:
    """``2``, ``0, 1 and 3``, ``0-63`` for display."""
    ranks = sorted(int(r) for r in ranks)
    if not ranks:
        return "none"
    if len(ranks) > 3 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) == 1:
        return str(ranks[0])
    return ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


__all__ = ["JOB_START_WINDOW_S", "RunGroup", "Unreadable", "load_group", "load_groups", "rank_list"]
