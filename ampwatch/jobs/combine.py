"""Numbers across the ranks of a job: the per-step combination, the fast overview, the first NaN/Inf.

Pure reading (SQLite, numpy, pandas); no torch. :class:`ampwatch.jobs.group.RunGroup` calls in here.

Why the overview samples: a 64-rank x 100,000-step job holds 6.4M step rows, and turning SQLite rows
into Python objects costs about a microsecond each, so reading them all takes seconds whatever is
done with them. The overview instead reads, from every rank's file, the same grid steps (so the
global numbers there are exact) plus every step at which any rank recorded a NaN/Inf event, by
primary-key lookups: a skip or a NaN is never sampled away. ``RunGroup.global_steps`` is the
full-resolution table.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pandas as pd

from ..store.reader import connect, decode_nan_mask, event_columns
from ..store.schema import INF_BOUND, STEP_NAN_BITS
from .threads import map_threads

_NAN_BITS = STEP_NAN_BITS["loss"] | STEP_NAN_BITS["grad_norm"]
# Forward-pass phases: born on the rank whose batch caused it (backward is all-reduced under DDP);
# "input": the batch itself held NaN/Inf as the model's forward began.
RANK_LOCAL_PHASES = ("input", "forward", "loss")
PHASE_ORDER = {"input": -1, "forward": 0, "loss": 1, "backward": 2, "param_grad": 3}
_STEP_COLS = "step, loss, loss_scale, skipped, grad_norm, nan_mask"
_MMAP = 1 << 28  # read pages through mmap: a sampled read touches most of a file's pages
GLOBAL_COLUMNS = ["step", "ranks", "loss_mean", "loss_std", "loss_min", "loss_max", "grad_norm", "skipped",
                  "skipped_agree", "skipped_ranks", "nonfinite_ranks", "loss_scale"]


def _steps_frame(rows: list, rank: Any) -> pd.DataFrame:
    """``rank, step, loss, loss_scale, skipped, grad_norm`` from raw step rows (NULL + nan_mask bit -> NaN).

    ``rank`` is one rank or an array with one per row: one frame for many ranks is built once
    (pandas costs milliseconds per frame, which adds up over 64 ranks)."""
    a = np.array(rows, dtype=float).reshape(-1, 6)  # None -> nan
    mask = np.nan_to_num(a[:, 5]).astype(np.int64)
    df = pd.DataFrame({"rank": np.broadcast_to(np.asarray(rank, dtype=np.int64), (len(a),)).copy(),
                       "step": a[:, 0].astype(np.int64), "loss": a[:, 1], "loss_scale": a[:, 2],
                       "skipped": np.nan_to_num(a[:, 3]).astype(bool), "grad_norm": a[:, 4]})
    return decode_nan_mask(df, STEP_NAN_BITS, mask=mask)


def _all_rows(path: Any) -> pd.DataFrame:
    with connect(path) as conn:
        return _steps_frame(conn.execute(f"SELECT {_STEP_COLS} FROM steps ORDER BY step").fetchall(), 0)


def core_steps(group: Any) -> pd.DataFrame:
    """Every rank's ``rank, step, loss, loss_scale, skipped, grad_norm`` (what :func:`combine_ranks` needs)."""
    files = list(group.files.values())
    frames = [df.assign(rank=f.rank) for f, df in zip(files, map_threads(_all_rows, [f.path for f in files]))]
    return pd.concat(frames, ignore_index=True) if frames else _steps_frame([], 0)


# -- the per-step combination ---------------------------------------------------------------------------

def combine_ranks(steps: pd.DataFrame, grad_sharding: str, world_size: int) -> pd.DataFrame:
    """One row per step from per-rank rows (``rank, step, loss, grad_norm, skipped, loss_scale``).

    Columns: ``step``; ``ranks`` (how many ranks have the step); ``loss_mean``, ``loss_std``
    (population), ``loss_min``, ``loss_max`` across ranks (NaN when any rank's loss is NaN);
    ``grad_norm``, the global norm: sqrt of the ranks' summed squares when ``grad_sharding`` is
    ``'sharded'`` (NaN unless all ``world_size`` ranks are there), else the lowest rank's (DDP's
    gradients are all-reduced replicas); ``skipped`` (any rank skipped), ``skipped_agree`` (every
    rank there did the same), ``skipped_ranks``; ``nonfinite_ranks`` (ranks whose loss or grad
    norm is NaN/inf); ``loss_scale`` (the lowest rank's).
    """
    if not len(steps):
        return pd.DataFrame(columns=GLOBAL_COLUMNS)
    step_ids, si = np.unique(steps["step"].to_numpy(dtype=np.int64), return_inverse=True)
    rank_ids, ri = np.unique(steps["rank"].to_numpy(dtype=np.int64), return_inverse=True)
    shape = (len(step_ids), len(rank_ids))

    def grid(col: str, fill: Any, dtype: Any = float) -> np.ndarray:
        out = np.full(shape, fill, dtype=dtype)
        out[si, ri] = steps[col].to_numpy(dtype=dtype)
        return out

    present = np.zeros(shape, dtype=bool)
    present[si, ri] = True
    n = present.sum(axis=1)
    loss, norm, scale = grid("loss", np.nan), grid("grad_norm", np.nan), grid("loss_scale", np.nan)
    skipped = grid("skipped", False, bool) & present
    lz = np.where(present, loss, 0.0)
    with np.errstate(invalid="ignore"):
        mean = lz.sum(axis=1) / n
        std = np.sqrt((np.where(present, lz - mean[:, None], 0.0) ** 2).sum(axis=1) / n)
        first = present.argmax(axis=1)  # the lowest rank that has the step
        if grad_sharding == "sharded":
            global_norm = np.sqrt((np.where(present, norm, 0.0) ** 2).sum(axis=1))
            global_norm = np.where(n == world_size, global_norm, np.nan)
        else:
            global_norm = norm[np.arange(len(step_ids)), first]
    logged = np.isfinite(loss).any(axis=0)  # a rank that never logged a loss is not NaN everywhere
    bad = present & ((~np.isfinite(loss) & logged) | (np.isinf(norm) | (np.isnan(norm) & np.isfinite(norm).any(axis=0))))
    k = skipped.sum(axis=1)
    return pd.DataFrame({
        "step": step_ids, "ranks": n, "loss_mean": mean, "loss_std": std,
        "loss_min": np.where(present, loss, np.inf).min(axis=1), "loss_max": np.where(present, loss, -np.inf).max(axis=1),
        "grad_norm": global_norm, "skipped": k > 0, "skipped_agree": (k == 0) | (k == n), "skipped_ranks": k,
        "nonfinite_ranks": bad.sum(axis=1), "loss_scale": scale[np.arange(len(step_ids)), first],
    }, columns=GLOBAL_COLUMNS)


# -- the overview -----------------------------------------------------------------------------------------

@dataclass
class GroupOverview:
    """A job at a glance.

    :ivar ranks: one row per readable rank: ``rank, file, status, steps, skipped, first_nonfinite_step,
        last_loss``.
    :ivar steps: per-rank rows ``rank, step, loss, loss_scale, skipped, grad_norm`` at the sampled
        steps (every ``every``-th step, plus every step at which some rank recorded a NaN/Inf event).
    :ivar global_steps: :func:`combine_ranks` of ``steps``: exact at every sampled step.
    :ivar disagree_steps: steps where the ranks did not all skip or all step (exact).
    """
    ranks: pd.DataFrame
    steps: pd.DataFrame
    global_steps: pd.DataFrame
    every: int
    disagree_steps: list[int]


def _rows_at(args: tuple) -> list:
    path, wanted = args
    with connect(path) as conn:
        conn.execute(f"PRAGMA mmap_size = {_MMAP}")
        return conn.execute(f"SELECT {_STEP_COLS} FROM steps WHERE step IN (SELECT value FROM json_each(?))"
                            " ORDER BY step", (wanted,)).fetchall()


# Points drawn per rank: the chart draws ranks x points per series, and each point costs a page
# read per rank file (the sampled reads dominate the overview's time, docs/performance.md).
POINTS_BUDGET, POINTS_MIN, POINTS_MAX = 32_000, 250, 1000


def default_points(ranks: int) -> int:
    """Grid steps per rank for an overview of ``ranks`` ranks: 1,000 up to 32 ranks, 500 at 64."""
    return max(POINTS_MIN, min(POINTS_MAX, POINTS_BUDGET // max(1, ranks)))


def group_overview(group: Any, points: Optional[int] = None) -> GroupOverview:
    """Per-rank headline figures and the sampled per-step view of a :class:`~ampwatch.jobs.group.RunGroup`.

    The steps drawn: every ``every``-th step (about ``points``) and every step at which any rank
    recorded a NaN/Inf event (``points`` default: :func:`default_points`). The recorder writes an event for every non-finite gradient or loss,
    so every skipped step is among them (under FSDP the ranks whose own shard stayed finite skip
    too, and are read at the steps the others flagged). Only primary-key and index lookups: no
    file is scanned, so the cost grows with ranks x points, not with steps."""
    files = list(group.files.values())
    points = points or default_points(len(files))
    firsts = [f.first_step for f in files if f.first_step is not None]
    lasts = [f.last_step for f in files if f.last_step is not None]
    if not lasts:
        empty = pd.DataFrame(columns=["rank", "step", "loss", "loss_scale", "skipped", "grad_norm"])
        return GroupOverview(_rank_table(files, empty, [([], None)] * len(files)), empty, combine_ranks(empty, group.grad_sharding,
                                                                              group.world_size), 1, [])
    first, last = min(firsts), max(lasts)
    every = max(1, math.ceil((last - first + 1) / points))
    marked = [(f.event_steps, f.last_loss) for f in files]
    exceptional = sorted(set().union(*(set(f.event_steps) for f in files)))
    wanted = json.dumps(sorted(set(range(first, last + 1, every)) | set(exceptional)))
    rows = map_threads(_rows_at, [(f.path, wanted) for f in files])
    steps = _steps_frame([r for part in rows for r in part], np.repeat([f.rank for f in files], [len(r) for r in rows]))
    global_steps = combine_ranks(steps, group.grad_sharding, group.world_size)
    disagree = global_steps.loc[~global_steps["skipped_agree"].astype(bool), "step"].astype(int).tolist()
    return GroupOverview(_rank_table(files, steps, marked), steps, global_steps, every, disagree)


def _rank_table(files: list, steps: pd.DataFrame, marked: list) -> pd.DataFrame:
    """Per-rank figures from the sampled rows, with one vectorised pass (not a frame per rank)."""
    cols = ["rank", "file", "status", "steps", "skipped", "first_nonfinite_step", "last_loss"]
    logged = steps.groupby("rank")["loss"].transform(lambda v: v.notna().any()) if len(steps) else steps["loss"]
    bad = steps[(~np.isfinite(steps["loss"]) & logged.astype(bool)) | np.isinf(steps["grad_norm"])]
    first_bad = bad.groupby("rank")["step"].min().to_dict()
    skipped = steps.groupby("rank")["skipped"].sum().to_dict()
    rows = []
    for f, (events, last_loss) in zip(files, marked):
        found = [v for v in (first_bad.get(f.rank), events[0] if events else None) if v is not None]
        rows.append({"rank": f.rank, "file": f.path.name, "status": f.status, "steps": f.steps,
                     "skipped": int(skipped.get(f.rank, 0)), "first_nonfinite_step": int(min(found)) if found else None,
                     "last_loss": last_loss})
    return pd.DataFrame(rows, columns=cols)


# -- where NaN/Inf appeared first ------------------------------------------------------------------------

@dataclass
class FirstNonfinite:
    """Where NaN/Inf appeared first across a job.

    ``rank``, ``module``, ``phase``, ``kind``, ``micro_batch``: the first event at ``step``, forward
    before loss before backward before parameter gradients (the order a step runs in), then by
    micro-batch, origin before spread, and rank. ``ranks``: every rank with a NaN/Inf at ``step``;
    ``forward_ranks``: those whose forward pass (or loss) held it; ``events``: all of them, with a
    ``rank`` column. ``module``/``phase`` are None when no rank localized it (``localize=False``).
    """
    step: int
    rank: int
    module: Optional[str]
    phase: Optional[str]
    kind: Optional[str]
    micro_batch: Optional[int]
    ranks: list[int]
    forward_ranks: list[int]
    events: pd.DataFrame


def _first_step(args: tuple) -> Optional[int]:
    path, scan_steps = args
    with connect(path) as conn:
        ev = conn.execute("SELECT MIN(step) FROM events").fetchone()[0]
        if ev is not None or not scan_steps:
            return ev
        # no localization: the steps table is the only evidence (one scan, inside SQLite)
        return conn.execute(f"SELECT MIN(step) FROM steps WHERE (nan_mask & {_NAN_BITS}) != 0"
                            f" OR abs(loss) > {INF_BOUND} OR abs(grad_norm) > {INF_BOUND}").fetchone()[0]


_EVENT_COLS = ["rank", "step", "phase", "module", "kind", "count", "amax", "dtype", "origin", "micro_batch"]


def _events_at(args: tuple) -> list:
    rank, path, step, phases = args
    with connect(path) as conn:
        where = "step = ?" if phases is None else f"step = ? AND phase IN ({', '.join('?' * len(phases))})"
        return conn.execute(f"SELECT {int(rank)}, step, phase, module, kind, count, amax, dtype, origin"
                            f"{event_columns(conn, ('micro_batch',))} FROM events WHERE {where} ORDER BY id",
                            (step, *(phases or ()))).fetchall()


def _ordered(ev: pd.DataFrame) -> pd.DataFrame:
    key = pd.DataFrame({"p": ev["phase"].map(PHASE_ORDER).fillna(9), "m": ev["micro_batch"].fillna(0),
                        "o": ~ev["origin"].astype(bool), "r": ev["rank"]})
    return ev.iloc[np.lexsort([key["r"], key["o"], key["m"], key["p"]])].reset_index(drop=True)


def first_nonfinite(group: Any, phases: Optional[tuple] = None) -> Optional[FirstNonfinite]:
    """The step, rank, module and phase where NaN/Inf appeared first across the job, or None.

    :param phases: only events of these phases (e.g. :data:`RANK_LOCAL_PHASES`: where a forward
        pass went non-finite first); None for any NaN/Inf, including a NaN loss or grad norm of a
        run recorded without localization.

    Cost: one indexed lookup per rank file (plus one scan of the steps table of a rank that has
    no NaN/Inf events and did not localize).
    """
    files = list(group.files.values())
    if phases is None:
        firsts = map_threads(_first_step, [(f.path, True) for f in files])
    else:
        firsts = map_threads(_first_phase_step, [(f.path, tuple(phases)) for f in files])
    found = [(s, f) for s, f in zip(firsts, files) if s is not None]
    if not found:
        return None
    step = min(s for s, _ in found)
    at = [f for s, f in found if s == step]
    parts = map_threads(_events_at, [(f.rank, f.path, step, phases) for f in at])
    ev = pd.DataFrame([r for part in parts for r in part], columns=_EVENT_COLS)
    ev["origin"] = ev["origin"].astype(bool)
    ev["amax"] = ev["amax"].astype(float)
    forward = sorted(set(ev.loc[ev["phase"].isin(RANK_LOCAL_PHASES), "rank"].astype(int)))
    ranks = sorted(f.rank for f in at)
    if not len(ev):  # found in the steps table only: no module to name
        return FirstNonfinite(step, ranks[0], None, None, None, None, ranks, forward, ev)
    ev = _ordered(ev)
    top = ev.iloc[0]
    mb = None if pd.isna(top["micro_batch"]) else int(top["micro_batch"])
    return FirstNonfinite(step, int(top["rank"]), top["module"], top["phase"], top["kind"], mb, ranks, forward, ev)


def _first_phase_step(args: tuple) -> Optional[int]:
    path, phases = args
    with connect(path) as conn:
        return conn.execute(f"SELECT MIN(step) FROM events WHERE phase IN ({', '.join('?' * len(phases))})",
                            phases).fetchone()[0]


def phase_steps(group: Any, phases: tuple = RANK_LOCAL_PHASES) -> dict[int, list[int]]:
    """``{rank: [steps]}`` at which each rank had NaN/Inf events of ``phases`` (forward by default)."""
    def one(f: Any) -> list[int]:
        with connect(f.path) as conn:
            rows = conn.execute(f"SELECT DISTINCT step FROM events WHERE phase IN ({', '.join('?' * len(phases))})"
                                " ORDER BY step", phases).fetchall()
        return [int(r[0]) for r in rows]
    files = list(group.files.values())
    return dict(zip([f.rank for f in files], map_threads(one, files)))


__all__ = ["combine_ranks", "core_steps", "group_overview", "first_nonfinite", "phase_steps", "GroupOverview", "FirstNonfinite",
           "RANK_LOCAL_PHASES", "GLOBAL_COLUMNS"]
