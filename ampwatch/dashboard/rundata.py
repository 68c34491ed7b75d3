"""The dashboard's data: SQL over one run file, downsampled so nothing that matters is hidden.

Long runs are drawn from a subset of rows chosen in SQL: per step bucket, the rows where each
series (loss, loss scale, grad norm, lr) is smallest and largest, the bucket's first and last step,
plus every non-finite and every skipped step. So a single spike, NaN or skip in 1,000,000 steps is
still drawn at its exact step (reservoir or point sampling, as in TensorBoard or W&B, drops them).
Buckets are walked as ranges of the primary key, so no query sorts the whole table: a GROUP BY on
``step / width`` would sort every row first (6 s on 10M layer rows, bench/dashboard.py).

Every function opens the file read-only through :func:`ampwatch.store.reader.open_run` and returns plain
pandas/numpy data; no Streamlit, no Plotly. Per-layer and per-module data: :mod:`ampwatch.dashboard.layerdata`.
"""
from __future__ import annotations

import json
import math
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd

from ..store.guard import reads
from ..store.parallel import read_spread, readers
from ..errors import RunError
from ..store.reader import (RunConnection, aliases_in, decode_nan_mask, event_columns, clip_threshold, effective_status,
                            find_runs, has_table, nonfinite_counts, open_run)
from ..store.schema import INF_BOUND, LAYER_NAN_BITS, STEP_NAN_BITS
from ..doctor.summary import error_tail
from ..doctor.warmup import SCALE_FREE_PHASES, warmup_end, warmup_in_file

# About one point per horizontal pixel of a wide chart; each bucket contributes up to ~10 rows.
STEP_BUCKETS = 2000
# Skipped / non-finite steps are returned one by one up to this many; past it (a run that skips
# half its steps) the first and last of each bucket are kept, which still marks every bucket with one.
EXACT_MARKS_LIMIT = 50_000
DTYPE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}
_NONFINITE_STEP = (f"(nan_mask & {STEP_NAN_BITS['loss'] | STEP_NAN_BITS['grad_norm']}) != 0"
                   f" OR abs(loss) > {INF_BOUND} OR abs(grad_norm) > {INF_BOUND}")
SERIES = ("loss", "loss_scale", "grad_norm", "lr")


def frame_of(conn: sqlite3.Connection, sql: str, params: Any = ()) -> pd.DataFrame:
    return pd.read_sql_query(sql, conn, params=params)


def _steps_frame(df: pd.DataFrame) -> pd.DataFrame:
    """NULL + nan_mask bit -> NaN; NULL without the bit stays 'not measured' (also NaN in pandas)."""
    df = decode_nan_mask(df, STEP_NAN_BITS, flags=tuple(STEP_NAN_BITS))
    for col in SERIES:
        df[col] = df[col].astype(float)
    df["skipped"] = df["skipped"].astype(bool)
    df["nonfinite"] = df["loss_nan"] | df["grad_norm_nan"] | ~np.isfinite(df["loss"].fillna(0.0)) \
        | ~np.isfinite(df["grad_norm"].fillna(0.0))
    return df


# -- runs table -------------------------------------------------------------------------------------

@reads
def run_row(path: Any) -> dict[str, Any]:
    """One row of the runs table, from SQL aggregates (fast on a 1M-step run)."""
    with open_run(path) as conn:
        info = conn.run_row
        n, skipped, first, last = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(skipped), 0), MIN(step), MAX(step) FROM steps").fetchone()
        tail = conn.execute("SELECT loss, loss_scale, nan_mask FROM steps ORDER BY step DESC LIMIT 1").fetchone()
        warm = warmup_end(warmup_in_file(conn, bool(info.get("scaler_enabled"))), first or 0)
        bad = conn.execute(f"SELECT MIN(step) FROM steps WHERE ({_NONFINITE_STEP}) AND (step >= ? OR"
                           f" (nan_mask & {STEP_NAN_BITS['loss']}) != 0 OR abs(loss) > {INF_BOUND})", (warm,)).fetchone()[0]
        # a NaN the scale cannot have made counts inside the warm-up too
        free = ", ".join("?" * len(SCALE_FREE_PHASES))
        ev = conn.execute(f"SELECT MIN(step) FROM events WHERE step >= ? OR phase IN ({free})",
                          (warm, *SCALE_FREE_PHASES)).fetchone()[0]
    last_loss = None
    if tail is not None:
        last_loss = math.nan if tail[2] & STEP_NAN_BITS["loss"] else tail[0]
    firsts = [s for s in (bad, ev) if s is not None]
    return {"name": info["name"], "file": Path(path).name, "status": effective_status(info),
            "steps": n, "skipped": skipped, "skipped_pct": 100.0 * skipped / n if n else 0.0,
            "final_scale": tail[1] if tail is not None else None,
            "first_nonfinite_step": min(firsts) if firsts else None, "last_loss": last_loss,
            "started": pd.to_datetime(info["started_at"], unit="s", errors="coerce"), "amp_dtype": info.get("amp_dtype"),
            "first_step": first, "last_step": last, "error_tail": error_tail(info) if effective_status(info) == "crashed" else []}


def run_health(path: Any) -> str:
    """The doctor's one-line verdict on a run: worst severity and first root cause, or ``ok``."""
    from ..doctor import diagnose, health
    from ..store.reader import Run
    try:
        return health(diagnose(Run(path)))
    except RunError as exc:
        return f"unreadable: {exc}"


def run_files(folder: Any) -> list[tuple[Path, Optional[str]]]:
    """The run files in ``folder``, each with None, or with why it is not opened (a symlink out of
    the folder: only the folder's own files are read). RunError for a folder that cannot be listed."""
    root = Path(folder).resolve()
    return [(f, None) if f.resolve().parent == root
            else (f, f"{f.name!r} links outside {str(folder)!r}: not opened") for f in find_runs(folder)]


def runs_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The runs table from :func:`run_row`'s rows."""
    df = pd.DataFrame(rows)
    if rows:  # object dtype keeps None (no loss logged) apart from NaN (the loss was NaN)
        df["last_loss"] = pd.Series([r["last_loss"] for r in rows], dtype=object)
    return df


def runs_table(folder: Any) -> tuple[pd.DataFrame, list[tuple[str, str]]]:
    """Every run in ``folder`` with the doctor's verdict on each, and every unreadable file with
    its reason (RunError for a bad folder). The app builds the same table from :func:`run_row`
    per file and its verdicts in the background (app/loaders.py)."""
    rows, bad = [], []
    for f, refused in run_files(folder):
        if refused is not None:
            bad.append((f.name, refused))
            continue
        try:
            rows.append(run_row(f))
        except RunError as exc:
            bad.append((f.name, str(exc)))
            continue
        rows[-1]["health"] = run_health(f)
    return runs_frame(rows), bad


# -- steps: overview and compare --------------------------------------------------------------------

@dataclass
class Overview:
    """Downsampled step rows of one range plus what the charts mark on them."""
    steps: pd.DataFrame                 # step, loss, loss_scale, grad_norm, lr, skipped, nonfinite, ...
    skipped_steps: np.ndarray           # every skipped step in range (bucket ends past EXACT_MARKS_LIMIT)
    nonfinite_steps: np.ndarray
    scale_changes: pd.DataFrame         # step, loss_scale, previous, kind ('backoff' | 'growth')
    bucket: int                         # 1 = every step is drawn
    first: Optional[int] = None
    last: Optional[int] = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def clip_threshold(self) -> Optional[float]:
        """max_norm as seen in the clip_grad_norm_ call, else from the config (reader.clip_threshold)."""
        return clip_threshold(self.info)


def step_bounds(conn: sqlite3.Connection) -> tuple[Optional[int], Optional[int]]:
    # Two subqueries: SQLite answers a lone MIN or MAX of the key with one seek, both together with a scan.
    return conn.execute("SELECT (SELECT MIN(step) FROM steps), (SELECT MAX(step) FROM steps)").fetchone()


def _range(conn: sqlite3.Connection, start: Optional[int], end: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    lo, hi = step_bounds(conn)
    if lo is None:
        return None, None
    start = lo if start is None else max(lo, int(start))
    end = hi if end is None else min(hi, int(end))
    return start, max(start, end)


_BUCKET_SQL = ("SELECT MIN(step), MAX(step), MIN(loss), MAX(loss), MIN(grad_norm), MAX(grad_norm), MIN(lr),"
               f" MAX(lr), MIN(loss_scale), MAX(loss_scale), SUM(skipped), SUM({_NONFINITE_STEP})"
               " FROM steps WHERE step >= ? AND step < ? AND step <= ?")
# Only when a range has more than EXACT_MARKS_LIMIT skipped or non-finite steps (rare): their ends per bucket.
_MARK_ENDS_SQL = ("SELECT MIN(CASE WHEN skipped THEN step END), MAX(CASE WHEN skipped THEN step END),"
                  f" MIN(CASE WHEN {_NONFINITE_STEP} THEN step END), MAX(CASE WHEN {_NONFINITE_STEP} THEN step END)"
                  " FROM steps WHERE step >= ? AND step < ? AND step <= ?")
_STEP_COLS = "s.step, s.loss, s.loss_scale, s.skipped, s.grad_norm, s.lr, s.nan_mask"


def _bucket_stats(conn: RunConnection, start: int, end: int, width: int) -> np.ndarray:
    """One aggregate per primary-key range (a loop over buckets, never over rows; no sort), the
    buckets spread over a few connections (store/parallel.py)."""
    rows = read_spread(conn.path, lambda c, lo: c.execute(_BUCKET_SQL, (lo, lo + width, end)).fetchone(),
                       range(start, end + 1, width))
    return pd.DataFrame([r for r in rows if r[0] is not None]).to_numpy(dtype=float, na_value=math.nan).reshape(-1, 12)


def _mark_ends(conn: RunConnection, start: int, end: int, width: int) -> np.ndarray:
    rows = read_spread(conn.path, lambda c, lo: c.execute(_MARK_ENDS_SQL, (lo, lo + width, end)).fetchone(),
                       range(start, end + 1, width))
    return pd.DataFrame(rows).to_numpy(dtype=float, na_value=math.nan).ravel()


def _scale_changes(conn: sqlite3.Connection, start: int, end: int, limit: int = EXACT_MARKS_LIMIT) -> pd.DataFrame:
    # A join on step - 1 walks the primary key (0.14 s on 1M steps; LAG() over the same rows: 0.8 s).
    df = frame_of(conn, "SELECT a.step, a.loss_scale, b.loss_scale AS previous FROM steps a JOIN steps b"
                   " ON b.step = a.step - 1 WHERE a.step BETWEEN ? AND ? AND a.loss_scale != b.loss_scale"
                   " ORDER BY a.step LIMIT ?", (start, end, limit))
    df["kind"] = np.where(df["loss_scale"] < df["previous"], "backoff", "growth")
    return df


def downsample_steps(conn: RunConnection, start: int, end: int, buckets: int = STEP_BUCKETS,
                     changes: Optional[pd.DataFrame] = None) -> tuple[pd.DataFrame, int]:
    """Step rows in [start, end] for drawing: all of them when few, else the rows chosen in the module doc.
    ``changes``: the range's loss-scale changes, up to ``EXACT_MARKS_LIMIT + 1`` (read here if not given)."""
    n = end - start + 1
    if n <= 2 * buckets:
        df = frame_of(conn, f"SELECT {_STEP_COLS} FROM steps s WHERE s.step BETWEEN ? AND ? ORDER BY s.step",
                 (start, end))
        return _steps_frame(df), 1
    width = math.ceil(n / buckets)
    stats = _bucket_stats(conn, start, end, width)
    extra = [stats[:, 0], stats[:, 1]]  # every bucket's first and last step
    exact = f"s.skipped = 1 OR {_NONFINITE_STEP}"  # bare names: only ``steps`` has these columns
    if stats[:, 10].sum() > EXACT_MARKS_LIMIT or stats[:, 11].sum() > EXACT_MARKS_LIMIT:
        exact = "0"  # too many to draw one by one: the first and last of each bucket still mark it
        extra.append(_mark_ends(conn, start, end, width))
    if changes is None:
        changes = _scale_changes(conn, start, end, EXACT_MARKS_LIMIT + 1)
    scale_rule = "0"
    if len(changes) > EXACT_MARKS_LIMIT:  # a scale that changes on most steps: its min/max per bucket instead
        scale_rule = "(a.c0 < a.c1 AND s.loss_scale IN (a.c0, a.c1))"
    else:
        extra.append(changes["step"].to_numpy(dtype=float))
    extra_steps = np.unique(np.concatenate(extra))
    extra_steps = extra_steps[~np.isnan(extra_steps)].astype(np.int64).tolist()
    # JSON has no NaN/inf: None (NULL) compares false, and non-finite rows are kept by ``exact``/``extra``.
    head = stats[:, :10]
    cells = head.astype(object)
    cells[~np.isfinite(head)] = None
    marked = stats[:, 10] + stats[:, 11] > 0
    # Three parts, each as cheap as it can be: the spread rules scan every bucket once; the exact marks
    # scan only buckets that have one; the extra steps are primary-key seeks. UNION drops duplicates.
    sql = ("WITH a(lo, hi, l0, l1, g0, g1, r0, r1, c0, c1) AS MATERIALIZED (SELECT value->>0, value->>1,"
           " value->>2, value->>3, value->>4, value->>5, value->>6, value->>7, value->>8, value->>9"
           " FROM json_each(:b)), am(lo, hi) AS MATERIALIZED (SELECT value->>0, value->>1 FROM json_each(:m))"
           f" SELECT {_STEP_COLS} FROM a CROSS JOIN steps s ON s.step >= a.lo AND s.step <= a.hi"
           " WHERE (a.l0 < a.l1 AND s.loss IN (a.l0, a.l1)) OR (a.g0 < a.g1 AND s.grad_norm IN (a.g0, a.g1))"
           f" OR (a.r0 < a.r1 AND s.lr IN (a.r0, a.r1)) OR {scale_rule}"
           f" UNION SELECT {_STEP_COLS} FROM am CROSS JOIN steps s ON s.step >= am.lo AND s.step <= am.hi"
           f" WHERE {exact}"
           f" UNION SELECT {_STEP_COLS} FROM steps s WHERE s.step IN (SELECT value FROM json_each(:x))")
    # The buckets cut into a few contiguous parts, each one query on a connection of its own
    # (store/parallel.py); a step chosen by two parts (an extra step) is kept once.
    parts = np.array_split(np.arange(len(stats)), readers())
    extra_at = np.array(extra_steps, dtype=np.int64)

    def chosen(c: sqlite3.Connection, rows: np.ndarray) -> pd.DataFrame:
        lo = stats[rows[0], 0] if rows[0] > 0 else -math.inf  # the extra steps of this part's steps
        hi = stats[rows[-1], 1] if rows[-1] < len(stats) - 1 else math.inf
        mine = extra_at[(extra_at >= lo) & (extra_at <= hi)]
        return frame_of(c, sql, {"b": json.dumps(cells[rows].tolist()), "x": json.dumps(mine.tolist()),
                                 "m": json.dumps(head[rows][marked[rows]][:, :2].tolist())})

    frames = read_spread(conn.path, chosen, [p for p in parts if len(p)], min_each=1)
    if not frames:  # no step in the range (a zoom into a gap of the numbering)
        frames = [frame_of(conn, f"SELECT {_STEP_COLS} FROM steps s LIMIT 0")]
    df = pd.concat(frames, ignore_index=True).drop_duplicates("step").sort_values("step", kind="stable")
    return _steps_frame(df.reset_index(drop=True)), width


def run_info(conn: RunConnection) -> dict[str, Any]:
    row = dict(conn.run_row)
    try:
        row["config"] = json.loads(row.pop("config_json", None) or "{}")
    except ValueError:
        row["config"] = {}
    row["status"] = effective_status(row) if row else "unknown"
    return row


@reads
def overview_data(path: Any, start: Optional[int] = None, end: Optional[int] = None,
                  buckets: int = STEP_BUCKETS) -> Overview:
    """Everything the run overview draws, for steps [start, end] (default: the whole run)."""
    with open_run(path) as conn:
        info = run_info(conn)
        start, end = _range(conn, start, end)
        if start is None:
            empty = _steps_frame(frame_of(conn, f"SELECT {_STEP_COLS} FROM steps s LIMIT 0"))
            return Overview(empty, np.array([], dtype=np.int64), np.array([], dtype=np.int64),
                            pd.DataFrame(columns=["step", "loss_scale", "previous", "kind"]), 1, info=info)
        changes = _scale_changes(conn, start, end, EXACT_MARKS_LIMIT + 1)
        steps, width = downsample_steps(conn, start, end, buckets, changes)
        changes = changes.iloc[:EXACT_MARKS_LIMIT].reset_index(drop=True)
    skipped = steps["step"][steps["skipped"]].to_numpy(dtype=np.int64)
    nonfinite = steps["step"][steps["nonfinite"]].to_numpy(dtype=np.int64)
    return Overview(steps, skipped, nonfinite, changes, width, start, end, info)


@reads
def detail_cost_text(path: Any) -> Optional[str]:
    """What the per-layer detail steps cost the run, as ``ampwatch summary`` says it (doctor/cost.py),
    from the last RECENT_STEPS steps' times: a primary-key range, milliseconds on any run."""
    from ..doctor.cost import cost_line, recent_cost
    with open_run(path) as conn:
        first, last = conn.execute("SELECT MIN(step), MAX(step) FROM steps").fetchone()
        if first is None:
            return None
        cost, _ = recent_cost(lambda sql, params: frame_of(conn, sql, params), first, last,
                              conn.run_row.get("layer_every"))
    return cost_line(cost)


MEMORY_COLUMNS = ("host_rss", "device_allocated", "device_reserved")


@reads
def memory_data(path: Any, start: Optional[int] = None, end: Optional[int] = None,
                buckets: int = STEP_BUCKETS) -> pd.DataFrame:
    """The process's memory readings (bytes) in steps [start, end]: ``step`` and each column of the
    ``memory`` table, every reading, or above ``buckets`` readings the lowest and the highest of
    each bucket of steps (a leak shows in the lows, a spike in the highs), each at its bucket's
    first step. Empty where the run read none (files before schema 7, a non-Linux host off CUDA)."""
    columns = ["step", *MEMORY_COLUMNS]
    with open_run(path) as conn:
        known = has_table(conn, "memory")
        lo, hi = _range(conn, start, end)
        if not known or lo is None:
            return pd.DataFrame({c: pd.Series(dtype="float64") for c in columns})
        (count,) = conn.execute("SELECT COUNT(*) FROM memory WHERE step BETWEEN ? AND ?", (lo, hi)).fetchone()
        if count <= buckets:
            df = frame_of(conn, f"SELECT {', '.join(columns)} FROM memory WHERE step BETWEEN ? AND ? ORDER BY step",
                          (lo, hi))
        else:
            width = max(1, math.ceil((hi - lo + 1) / buckets))
            lows = ", ".join(f"MIN({c}) AS {c}" for c in MEMORY_COLUMNS)
            highs = ", ".join(f"MAX({c}) AS {c}" for c in MEMORY_COLUMNS)
            group = "FROM memory WHERE step BETWEEN ? AND ? GROUP BY (step - ?) / ?"
            df = pd.concat([frame_of(conn, f"SELECT MIN(step) AS step, {cols} {group}", (lo, hi, lo, width))
                            for cols in (lows, highs)]).sort_values("step", kind="stable")
    return df.astype({c: "float64" for c in MEMORY_COLUMNS}).reset_index(drop=True)


@reads
def skip_rate(path: Any, buckets: int = 200) -> pd.DataFrame:
    """Skipped fraction per bucket of steps (Compare's skip-rate chart): step (bucket start), rate."""
    with open_run(path) as conn:
        start, end = _range(conn, None, None)
        if start is None:
            return pd.DataFrame({"step": [], "rate": []})
        width = max(1, math.ceil((end - start + 1) / buckets))
        sql = ("WITH RECURSIVE b(lo) AS (SELECT :start UNION ALL SELECT lo + :w FROM b WHERE lo + :w <= :end) "
               "SELECT lo, (SELECT AVG(skipped) FROM steps WHERE step >= b.lo AND step < b.lo + :w) FROM b")
        rows = conn.execute(sql, {"start": start, "end": end, "w": width}).fetchall()
    return pd.DataFrame(rows, columns=["step", "rate"])


# -- per step ---------------------------------------------------------------------------------------

def _with_aliases(conn: sqlite3.Connection, df: pd.DataFrame, column: str = "module") -> pd.DataFrame:
    """An ``aliases`` column: the other names of a tied parameter / shared module ("" for none)."""
    others = aliases_in(conn)
    df["aliases"] = [", ".join(others.get(m, ())) for m in df[column]]
    return df


def _event_columns(conn: sqlite3.Connection) -> str:
    return event_columns(conn, ("fp32_amax", "lowp_amax", "micro_batch", "flows_into"), missing_as_null=False)


@reads
def events(path: Any) -> pd.DataFrame:
    """NaN/Inf events, origin first within each step (the module where it was born).

    ``warmup`` is True for gradient overflow during the scaler's warm-up (:mod:`ampwatch.doctor.warmup`):
    expected, the scaler backing off from its initial scale (the runs table does not count them).
    """
    with open_run(path) as conn:
        df = frame_of(conn, f"SELECT step, origin, module, phase, kind, count, amax, dtype{_event_columns(conn)}"
                       " FROM events ORDER BY step, origin DESC, id")
        df = _with_aliases(conn, df)
        first = conn.execute("SELECT MIN(step) FROM steps").fetchone()[0] or 0
        warm = warmup_end(warmup_in_file(conn, bool(conn.run_row.get("scaler_enabled"))), first)
    df["origin"] = df["origin"].astype(bool)
    df["warmup"] = (df["step"] < warm) & ~df["phase"].isin(SCALE_FREE_PHASES)
    return df


@reads
def step_detail(path: Any, step: int) -> dict[str, Any]:
    """Every recorded figure at ``step``: its steps row, layers, modules, events and metrics."""
    with open_run(path) as conn:
        row = _steps_frame(frame_of(conn, "SELECT step, time, duration_s, loss, loss_scale, skipped, grad_norm, lr,"
                                     " micro_batches, nan_mask FROM steps WHERE step = ?", (int(step),)))
        layers = frame_of(conn, "SELECT t.name AS layer, l.grad_norm, l.grad_amax, l.param_norm, l.grad_nonfinite,"
                           " l.grad_zero_frac, l.nan_mask FROM layers l JOIN tensors t ON t.id = l.param_id"
                           " WHERE l.step = ? ORDER BY l.param_id", (int(step),))
        layers = decode_nan_mask(layers, LAYER_NAN_BITS, flags=("grad_norm",), drop=False)
        layers = _with_aliases(conn, layers, "layer")
        modules = frame_of(conn, "SELECT t.name AS module, CASE m.phase WHEN 0 THEN 'forward' ELSE 'backward' END"
                            " AS phase, m.amax, m.nonfinite FROM modules m JOIN tensors t ON t.id = m.module_id"
                            " WHERE m.step = ? ORDER BY m.module_id, m.phase", (int(step),))
        ev = frame_of(conn, f"SELECT origin, module, phase, kind, count, amax, dtype{_event_columns(conn)} FROM events"
                       " WHERE step = ? ORDER BY origin DESC, id", (int(step),))
        ev["origin"] = ev["origin"].astype(bool)
        ev = _with_aliases(conn, ev)
        metrics = frame_of(conn, "SELECT key, value FROM metrics WHERE step = ? ORDER BY key", (int(step),))
        near = conn.execute("SELECT MAX(step) FROM layers WHERE step <= ?", (int(step),)).fetchone()[0]
        inputs = saved_inputs(conn, step)
    row["time"] = pd.to_datetime(row["time"], unit="s", errors="coerce")  # UTC, not raw epoch seconds
    return {"step": row, "layers": layers.drop(columns=["nan_mask"]), "modules": modules, "events": ev,
            "metrics": metrics, "layer_step_at_or_before": near, "inputs": inputs}


def input_arrays(path: Any, step: int) -> bytes:
    """Every input saved from ``step`` as the bytes of one NumPy ``.npz`` (``mb0/args[0]``, ...; a
    dtype numpy lacks, bfloat16 or float8, as its raw bits): empty when none was saved."""
    import io

    from ..store.reader import Run
    run = Run(path)
    saved = run.batches
    buffer = io.BytesIO()
    arrays = {f"mb{mb}/{name}": array for mb in sorted(set(saved[saved["step"] == step]["micro_batch"]))
              for name, array in run.batch(step, int(mb)).items()}
    if not arrays:
        return b""
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def saved_inputs(conn: Any, step: int) -> pd.DataFrame:
    """The model's inputs saved from ``step`` (schema 8, a step whose loss or outputs went NaN/Inf
    or the step a crash stopped): one row per tensor with its NaN/inf counts read from its bytes."""
    columns = ["micro-batch", "input", "dtype", "shape", "bytes", "NaN", "inf", "sha256"]
    if not has_table(conn, "batches"):
        return pd.DataFrame(columns=columns)
    rows = []
    for micro_batch, name, dtype, shape, nbytes, digest, data in conn.execute(
            "SELECT micro_batch, name, dtype, shape, nbytes, sha256, data FROM batches WHERE step = ?"
            " ORDER BY micro_batch, name", (int(step),)):
        counts = nonfinite_counts(dtype, data) if data is not None else None
        rows.append((micro_batch, name, dtype, "×".join(map(str, json.loads(shape))) or "scalar", nbytes,
                     counts[0] if counts else None, counts[1] if counts else None,
                     digest if digest is not None else "not saved (over the budget)"))
    return pd.DataFrame(rows, columns=columns)


# -- layers and modules -----------------------------------------------------------------------------
