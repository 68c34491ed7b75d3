"""Numbers across the ranks of a job: the per-step combination, the fast overview, the first NaN/Inf.

Pure reading (SQLite, numpy, pandas); no torch. :class:`ampwatch.group.RunGroup` calls in here.

Why the overview samples: a 64-rank x 100,000-step job holds 6.4M step rows, and turning SQLite rows
into Python objects costs about a microsecond each, so reading them all takes seconds whatever is
done with them. The overview instead asks each rank's file, inside SQLite, for every k-th step
(the same steps on every rank, so the global numbers there are exact) plus every skipped or
non-finite step of any rank, and then the other ranks' rows at those steps: a skip or a NaN is
never sampled away. ``RunGroup.global_steps`` is the full-resolution table.
"""
from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import pandas as pd

from .reader import connect
from .schema import STEP_NAN_BITS

_INF = 1.7976931348623157e308  # abs(x) > this  <=>  x is +/-inf (SQLite has no isinf())
_NAN_BITS = STEP_NAN_BITS["loss"] | STEP_NAN_BITS["grad_norm"]
_EXCEPTIONAL = f"skipped != 0 OR (nan_mask & {_NAN_BITS}) != 0 OR abs(loss) > {_INF} OR abs(grad_norm) > {_INF}"
# Skipped / non-finite steps kept one by one up to this many per rank (a run that skips half its
# steps is sampled like the rest past it).
EXACT_LIMIT = 20_000
# Forward-pass phases: born on the rank whose batch caused it (backward is all-reduced under DDP).
RANK_LOCAL_PHASES = ("forward", "loss")
PHASE_ORDER = {"forward": 0, "loss": 1, "backward": 2, "param_grad": 3}
_STEP_COLS = "step, loss, loss_scale, skipped, grad_norm, nan_mask"
GLOBAL_COLUMNS = ["step", "ranks", "loss_mean", "loss_std", "loss_min", "loss_max", "grad_norm", "skipped",
                  "skipped_agree", "skipped_ranks", "nonfinite_ranks", "loss_scale"]


def _threads(fn: Callable, items: list) -> list:
    """``map(fn, items)`` on a few threads: sqlite3 releases the GIL while SQLite works."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1, len(items))) as pool:
        return list(pool.map(fn, items))


def _steps_frame(rows: list, rank: int) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=["step", "loss", "loss_scale", "skipped", "grad_norm", "nan_mask"])
    for col, bit in STEP_NAN_BITS.items():
        df[col] = df[col].astype(float).where((df["nan_mask"] & bit) == 0, float("nan"))
    df["loss_scale"] = df["loss_scale"].astype(float)
    df["skipped"] = df["skipped"].astype(bool)
    df.insert(0, "rank", rank)
    return df.drop(columns=["nan_mask"])


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
    :ivar steps: per-rank rows at the sampled steps (every ``every``-th step, plus every step that
        some rank skipped or saw NaN/inf at), same columns as ``RunGroup.steps``' core.
    :ivar global_steps: :func:`combine_ranks` of ``steps``: exact at every sampled step.
    :ivar disagree_steps: steps where the ranks did not all skip or all step (exact).
    """
    ranks: pd.DataFrame
    steps: pd.DataFrame
    global_steps: pd.DataFrame
    every: int
    disagree_steps: list[int]


def _sample_rank(args: tuple) -> tuple[pd.DataFrame, int, Optional[float], Optional[int]]:
    rank, path, first, every, limit = args
    with connect(path) as conn:
        rows = conn.execute(f"SELECT {_STEP_COLS} FROM steps WHERE (step - ?) % ? = 0 OR {_EXCEPTIONAL}"
                            f" ORDER BY step LIMIT ?", (first, every, limit)).fetchall()
        tail = conn.execute("SELECT loss, nan_mask FROM steps ORDER BY step DESC LIMIT 1").fetchone()
        ev = conn.execute("SELECT MIN(step) FROM events").fetchone()[0]
    df = _steps_frame(rows, rank)
    last_loss = None if tail is None else (math.nan if tail[1] & STEP_NAN_BITS["loss"] else tail[0])
    return df, int(df["skipped"].sum()), last_loss, ev


def _rows_at(args: tuple) -> pd.DataFrame:
    rank, path, wanted = args
    with connect(path) as conn:
        rows = conn.execute(f"SELECT {_STEP_COLS} FROM steps WHERE step IN (SELECT value FROM json_each(?))"
                            " ORDER BY step", (json.dumps(wanted),)).fetchall()
    return _steps_frame(rows, rank)


def group_overview(group: Any, points: int = 2000) -> GroupOverview:
    """Per-rank headline figures and the sampled per-step view of a :class:`~ampwatch.group.RunGroup`.

    About ``points`` grid steps plus every exceptional step; each file is scanned once inside
    SQLite, on a few threads. 64 ranks x 100,000 steps: see README "Distributed jobs"."""
    files = list(group.files.values())
    firsts = [f.first_step for f in files if f.first_step is not None]
    lasts = [f.last_step for f in files if f.last_step is not None]
    first = min(firsts) if firsts else 0
    every = max(1, math.ceil((max(lasts) - first + 1) / points)) if lasts else 1
    limit = points + 1 + EXACT_LIMIT
    sampled = _threads(_sample_rank, [(f.rank, f.path, first, every, limit) for f in files])
    frames = [s[0] for s in sampled]
    exceptional = set()
    for df in frames:
        off_grid = (df["step"] - first) % every != 0
        exceptional.update(df.loc[off_grid, "step"].tolist())
    extra = _threads(_rows_at, [(f.rank, f.path, sorted(exceptional - set(df["step"].tolist())))
                                for f, df in zip(files, frames)]) if exceptional else []
    steps = pd.concat(frames + [e for e in extra if len(e)], ignore_index=True) if frames else \
        pd.DataFrame(columns=["rank", "step", "loss", "loss_scale", "skipped", "grad_norm"])
    steps = steps.sort_values(["step", "rank"], kind="stable").reset_index(drop=True)
    global_steps = combine_ranks(steps, group.grad_sharding, group.world_size)
    ranks = pd.DataFrame([{"rank": f.rank, "file": f.path.name, "status": f.status, "steps": f.steps,
                           "skipped": sk, "first_nonfinite_step": _first_bad(df, ev), "last_loss": last}
                          for f, (df, sk, last, ev) in zip(files, sampled)],
                         columns=["rank", "file", "status", "steps", "skipped", "first_nonfinite_step", "last_loss"])
    disagree = global_steps.loc[~global_steps["skipped_agree"].astype(bool), "step"].astype(int).tolist()
    return GroupOverview(ranks, steps, global_steps, every, disagree)


def _first_bad(df: pd.DataFrame, event_step: Optional[int]) -> Optional[int]:
    loss_logged = df["loss"].notna().any()
    bad = df["step"][(~np.isfinite(df["loss"]) & loss_logged) | np.isinf(df["grad_norm"])]
    found = [int(bad.min())] if len(bad) else []
    if event_step is not None:
        found.append(int(event_step))
    return min(found) if found else None


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


def _event_columns(conn: Any) -> str:
    cols = {r[1] for r in conn.execute("PRAGMA table_info(events)")}
    return "micro_batch" if "micro_batch" in cols else "NULL AS micro_batch"


def _first_step(args: tuple) -> Optional[int]:
    path, scan_steps = args
    with connect(path) as conn:
        ev = conn.execute("SELECT MIN(step) FROM events").fetchone()[0]
        if ev is not None or not scan_steps:
            return ev
        # no localization: the steps table is the only evidence (one scan, inside SQLite)
        return conn.execute(f"SELECT MIN(step) FROM steps WHERE (nan_mask & {_NAN_BITS}) != 0"
                            f" OR abs(loss) > {_INF} OR abs(grad_norm) > {_INF}").fetchone()[0]


def _events_at(args: tuple) -> pd.DataFrame:
    rank, path, step, phases = args
    with connect(path) as conn:
        where = "step = ?" if phases is None else \
            f"step = ? AND phase IN ({', '.join('?' * len(phases))})"
        df = pd.read_sql_query(f"SELECT step, phase, module, kind, count, amax, dtype, origin, {_event_columns(conn)}"
                               f" FROM events WHERE {where} ORDER BY id", conn, params=(step, *(phases or ())))
    df.insert(0, "rank", rank)
    return df


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
        firsts = _threads(_first_step, [(f.path, True) for f in files])
    else:
        firsts = _threads(_first_phase_step, [(f.path, tuple(phases)) for f in files])
    found = [(s, f) for s, f in zip(firsts, files) if s is not None]
    if not found:
        return None
    step = min(s for s, _ in found)
    at = [f for s, f in found if s == step]
    ev = pd.concat(_threads(_events_at, [(f.rank, f.path, step, phases) for f in at]), ignore_index=True)
    ev["origin"] = ev["origin"].astype(bool)
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
    return dict(zip([f.rank for f in files], _threads(one, files)))


__all__ = ["combine_ranks", "group_overview", "first_nonfinite", "phase_steps", "GroupOverview", "FirstNonfinite",
           "RANK_LOCAL_PHASES", "GLOBAL_COLUMNS", "EXACT_LIMIT"]
