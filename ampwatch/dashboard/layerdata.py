"""The dashboard's per-layer and per-module data: gradient heatmap, fp16 headroom, zero-gradient fractions.

Same rules as :mod:`ampwatch.dashboard.rundata`: read-only SQL over one run file, max per bucket so no spike
is hidden, plain pandas/numpy out.
"""
from __future__ import annotations

import json
import math
import sqlite3
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import pandas as pd

from ..store.guard import reads
from ..store.parallel import read_spread
from .rundata import DTYPE_MAX, frame_of, run_info
from ..store.reader import aliases_in, open_run
from ..store.schema import INF_BOUND, LAYER_NAN_BITS, STEP_NAN_BITS

# Heatmap columns. Each is one small GROUP BY over a primary-key range; ~1000 is the fastest split
# of 10M layer rows (fewer buckets mean bigger sorts, more mean more queries: bench/dashboard.py).
LAYER_BUCKETS = 1000

LAYER_METRICS = ("grad_norm", "grad_amax", "param_norm", "grad_zero_frac")
# Zero-gradient fractions are averaged over at most this many evenly spaced detail steps: a mean
# needs no exhaustive scan (unlike a max, which the heatmap takes over every row).
ZERO_FRAC_SAMPLES = 1000


@dataclass
class LayerGrid:
    """A layers x step-buckets grid of one metric: the max over each bucket, non-finite cells marked."""
    names: list[str]
    metric: str
    bucket_starts: np.ndarray           # first step of each column
    width: int                          # steps per column (1: each column is one recorded step)
    values: np.ndarray                  # (layers, columns); NaN = no row (or non-finite: see ``nonfinite``)
    nonfinite: np.ndarray               # (layers, columns) bool: a NaN/inf gradient somewhere in the bucket
    aliases: list[str] = field(default_factory=list)  # per layer: its other names (tied weights), or ""

    @property
    def labels(self) -> list[str]:
        """``transformer.wte.weight = lm_head.weight`` for a tied parameter, else the name."""
        return [alias_label(n, a) for n, a in zip(self.names, self.aliases or [""] * len(self.names))]


def alias_label(name: str, aliases: Any) -> str:
    return f"{name} = {aliases}" if isinstance(aliases, str) and aliases else name


def tensor_names(conn: sqlite3.Connection, kind: str = "param") -> pd.DataFrame:
    """id, name and aliases (the other names of a tied parameter / shared module, comma-separated;
    "" for none and for runs recorded before aliases were, schema < 3)."""
    df = frame_of(conn, "SELECT id, name FROM tensors WHERE kind = ? ORDER BY id", (kind,))
    others = aliases_in(conn)
    df["aliases"] = [", ".join(others.get(n, ())) for n in df["name"]]
    return df


def _param_names(conn: sqlite3.Connection) -> pd.DataFrame:
    return tensor_names(conn, "param")


def _layer_span(conn: sqlite3.Connection, start: Optional[int], end: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    lo, hi = conn.execute("SELECT (SELECT MIN(step) FROM layers), (SELECT MAX(step) FROM layers)").fetchone()
    if lo is None:
        return None, None
    return (lo if start is None else max(lo, int(start))), (hi if end is None else min(hi, int(end)))


@reads
def layer_heatmap(path: Any, metric: str = "grad_norm", start: Optional[int] = None, end: Optional[int] = None,
                  buckets: int = LAYER_BUCKETS) -> LayerGrid:
    """Per-layer ``metric`` (one of LAYER_METRICS) as a layers x buckets grid, max per bucket.

    One small GROUP BY per primary-key range (no sort of the whole table). In columns holding a
    step whose total grad norm is NaN/inf (found in ``steps``), a non-finite gradient folds in as
    +inf so the max keeps it and the cell is marked; other columns take the plain, cheaper MAX.
    For ``param_norm`` the marked cells are the non-finite weights only, so a finite jump of a
    weight's norm at the step its gradients overflow stays visible.
    """
    if metric not in LAYER_METRICS:
        raise ValueError(f"metric must be one of {LAYER_METRICS}, not {metric!r}")
    where = " FROM layers WHERE step >= ? AND step < ? AND step <= ? GROUP BY param_id"
    plain = f"SELECT ?, param_id, MAX({metric})" + where
    value = "grad_norm" if metric == "grad_norm" else f"CASE WHEN abs(grad_norm) > {INF_BOUND} THEN 9e999 ELSE {metric} END"
    flagged = (f"SELECT ?, param_id, MAX(CASE WHEN nan_mask & {LAYER_NAN_BITS['grad_norm']} OR grad_nonfinite > 0"
               f" THEN 9e999 ELSE {value} END)" + where)
    if metric == "param_norm":  # the weights' own figure: a NaN/inf gradient must not hide a finite jump
        flagged = f"SELECT ?, param_id, MAX(CASE WHEN nan_mask & {LAYER_NAN_BITS['param_norm']} THEN 9e999" \
                  " ELSE param_norm END)" + where
    with open_run(path) as conn:
        names = _param_names(conn)
        start, end = _layer_span(conn, start, end)
        if start is None or end < start:
            return LayerGrid(names["name"].tolist(), metric, np.array([], dtype=np.int64), 1,
                             np.full((len(names), 0), np.nan), np.zeros((len(names), 0), dtype=bool),
                             names["aliases"].tolist())
        every = conn.execute("SELECT layer_every FROM run").fetchone()[0] or 1
        if (end - start + 1) / every <= buckets:
            # Few enough detail steps to show each as its own column (no empty stripes between them).
            cols = np.array([r[0] for r in conn.execute(
                "SELECT step FROM layers WHERE step BETWEEN ? AND ? GROUP BY step", (start, end))], dtype=np.int64)
            width = 1
        else:  # a column is at least layer_every steps wide, so none is empty
            width = max(every, math.ceil((end - start + 1) / buckets))
            cols = start + width * np.arange(math.ceil((end - start + 1) / width))
        bounds = np.append(cols[1:], end + 1) if width == 1 else cols + width
        # A NaN/inf layer gradient makes the step's total norm NaN/inf (it is their root sum of squares).
        bad_steps = np.array([r[0] for r in conn.execute(
            f"SELECT step FROM steps WHERE step BETWEEN ? AND ? AND ((nan_mask & {STEP_NAN_BITS['grad_norm']}) != 0"
            f" OR abs(grad_norm) > {INF_BOUND})", (start, end))], dtype=np.int64)
        bad_cols = set((np.searchsorted(cols, bad_steps, side="right") - 1).tolist())
        buckets_read = [(i, lo, hi) for i, (lo, hi) in enumerate(zip(cols.tolist(), bounds.tolist()))]
        parts = read_spread(conn.path, lambda c, b: c.execute(flagged if b[0] in bad_cols else plain,
                                                              (*b, end)).fetchall(), buckets_read)
        rows = [r for part in parts for r in part]
    data = pd.DataFrame(rows, columns=["col", "pid", "value"]).to_numpy(dtype=float, na_value=math.nan)
    data = data.reshape(-1, 3)
    ids = names["id"].to_numpy(dtype=np.int64)  # sorted: ORDER BY id
    r = np.searchsorted(ids, data[:, 1].astype(np.int64)).clip(0, max(len(ids) - 1, 0))
    known = ids[r] == data[:, 1] if len(ids) else np.zeros(len(data), dtype=bool)
    r, c, v = r[known], data[known, 0].astype(np.int64), data[known, 2]
    values = np.full((len(ids), len(cols)), np.nan)
    values[r, c] = v
    bad = np.isinf(values)
    values[bad] = np.nan
    return LayerGrid(names["name"].tolist(), metric, cols, width, values, bad, names["aliases"].tolist())


def grid_frame(grid: LayerGrid) -> pd.DataFrame:
    """The grid as long rows (layer, first step of the column, value, nonfinite) for CSV export."""
    n, m = grid.values.shape
    return pd.DataFrame({"layer": np.repeat(grid.labels, m), "step_from": np.tile(grid.bucket_starts, n),
                         "steps": grid.width, f"max_{grid.metric}": grid.values.ravel(),
                         "nonfinite": grid.nonfinite.ravel()})


@reads
def zero_grad_fraction(path: Any, start: Optional[int] = None, end: Optional[int] = None,
                       samples: int = ZERO_FRAC_SAMPLES) -> pd.DataFrame:
    """Per layer: mean and max fraction of exactly-zero gradient elements (underflow), and the
    number of detail steps it is taken over (every one when there are at most ``samples``)."""
    with open_run(path) as conn:
        names = _param_names(conn)
        start, end = _layer_span(conn, start, end)
        steps: list[int] = []
        if start is not None:
            # Evenly spaced targets, each moved to the next detail step by one primary-key seek.
            targets = np.unique(np.linspace(start, end, samples).astype(np.int64)).tolist()
            seek = "SELECT MIN(step) FROM layers WHERE step >= ? AND step <= ? AND grad_zero_frac IS NOT NULL"
            steps = sorted({s for t in targets for s in conn.execute(seek, (t, end)).fetchone() if s is not None})
        df = frame_of(conn, "SELECT param_id AS id, grad_zero_frac FROM layers WHERE step IN"
                       " (SELECT value FROM json_each(?)) AND grad_zero_frac IS NOT NULL", (json.dumps(steps),))
    agg = df.groupby("id")["grad_zero_frac"].agg(["mean", "max", "count"])
    out = names.merge(agg, left_on="id", right_index=True, how="left")
    out = out.rename(columns={"name": "layer", "mean": "zero_frac_mean", "max": "zero_frac_max",
                              "count": "detail_steps"})
    out["detail_steps"] = out["detail_steps"].fillna(0).astype(int)
    return out.drop(columns=["id"])


@reads
def module_headroom(path: Any, start: Optional[int] = None, end: Optional[int] = None,
                    buckets: int = LAYER_BUCKETS) -> pd.DataFrame:
    """Per module and phase: max |value| seen, the dtype's limit and the headroom factor (limit / amax).

    The limit is the run's autocast dtype (float16: 65504; an fp8 run's, bfloat16's). Backward amax is
    the *scaled* gradient, which is what overflows.
    """
    with open_run(path) as conn:
        info = run_info(conn)
        lo, hi = conn.execute("SELECT (SELECT MIN(step) FROM modules), (SELECT MAX(step) FROM modules)").fetchone()
        names = frame_of(conn, "SELECT id AS module_id, name AS module, type FROM tensors WHERE kind = 'module'")
        cols = ["module", "type", "phase", "amax", "nonfinite_steps", "limit", "headroom"]
        if lo is None:
            return pd.DataFrame(columns=cols)
        start = lo if start is None else max(lo, int(start))
        end = hi if end is None else min(hi, int(end))
        width = max(1, math.ceil((end - start + 1) / buckets))
        # MAX only, one integer key: the per-bucket sort is the cost (15M rows: ~4 s, bench/dashboard.py).
        sql = ("SELECT module_id * 2 + phase, MAX(amax) FROM modules WHERE step >= ? AND step < ? AND step <= ?"
               " GROUP BY 1")
        parts = read_spread(conn.path, lambda c, lo_: c.execute(sql, (lo_, lo_ + width, end)).fetchall(),
                            range(start, end + 1, width))
        bad = frame_of(conn, "SELECT module, phase, COUNT(DISTINCT step) AS nonfinite_steps FROM events"
                        " WHERE step BETWEEN ? AND ? AND phase IN ('forward', 'backward') GROUP BY module, phase",
                  (start, end))
    df = pd.DataFrame([row for part in parts for row in part], columns=["key", "amax"])
    df["amax"] = df["amax"].astype(float)
    df = df.groupby("key", as_index=False)["amax"].max()
    df["module_id"], df["phase"] = df["key"] // 2, df["key"] % 2
    df = df.merge(names, on="module_id", how="left")
    df["phase"] = np.where(df["phase"] == 0, "forward", "backward")
    df = df.merge(bad, on=["module", "phase"], how="left")
    df["nonfinite_steps"] = df["nonfinite_steps"].fillna(0).astype(int)
    dtype = info.get("amp_dtype") or "float16"
    if dtype == "float8":  # torchao keeps an fp8 run's values in bfloat16 or float32 between its casts,
        dtype = "bfloat16"  # which are scaled per tensor (the FP8 page): bfloat16's is the lower limit
    limit = DTYPE_MAX.get(dtype, DTYPE_MAX["float16"])
    df["limit"] = limit
    with np.errstate(divide="ignore"):
        df["headroom"] = limit / df["amax"]
    return df[cols].sort_values("headroom", kind="stable").reset_index(drop=True)
