"""The dashboard's FP8 data: per fp8 layer and cast, over recorded steps (``fp8_layers``, docs/fp8.md).

Read-only SQL over one run file, plain pandas/numpy out. The heatmap reuses the Layers page's
:class:`~ampwatch.dashboard.layerdata.LayerGrid` (and so its figure): one row per layer and cast, one column
per recorded step, or the max over a bucket of steps when there are more than ``FP8_BUCKETS``.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pandas as pd

from ..store.reader import has_table, open_run
from .layerdata import LayerGrid

# metric -> (rows it is recorded on, whether a log colour scale suits it)
FP8_METRICS = {"flush_frac": ("casts", False), "amax": ("casts", True), "rel_err": ("output", False),
               "sat_frac": ("casts", False)}
FP8_BUCKETS = 1000


def has_fp8_layers(path: Any) -> bool:
    """Whether the run recorded fp8 layers (runs of older schemas: False)."""
    with open_run(path) as conn:
        return bool(conn.run_row.get("fp8_layers"))


def fp8_grid(path: Any, metric: str, start: Optional[int] = None, end: Optional[int] = None) -> LayerGrid:
    """(layer, cast) x recorded steps of ``metric`` (a key of :data:`FP8_METRICS`); the max per bucket.
    Rows are ``"<module> <role>"`` in the order the layers were recorded."""
    if metric not in FP8_METRICS:
        raise ValueError(f"fp8 metric must be one of {sorted(FP8_METRICS)}, got {metric!r}")
    rows = "role = 'output'" if FP8_METRICS[metric][0] == "output" else "role != 'output'"
    lo, hi = -(2 ** 62) if start is None else int(start), 2 ** 62 if end is None else int(end)
    with open_run(path) as conn:
        if not has_table(conn, "fp8_layers"):
            df = pd.DataFrame(columns=["step", "module", "role", "value", "nonfinite"])
        else:
            df = pd.read_sql_query(
                f"SELECT step, module, role, {metric} AS value, nonfinite FROM fp8_layers WHERE {rows}"
                " AND step BETWEEN ? AND ? ORDER BY step", conn, params=(lo, hi))
    df["name"] = df["module"] + " " + df["role"]
    names = list(dict.fromkeys(df["name"]))
    steps = np.sort(df["step"].unique()).astype(np.int64)
    width = 1
    if len(steps) > FP8_BUCKETS:
        width = int(np.ceil((steps[-1] - steps[0] + 1) / FP8_BUCKETS))
        df["step"] = steps[0] + (df["step"] - steps[0]) // width * width
        steps = np.sort(df["step"].unique()).astype(np.int64)
    values = np.full((len(names), len(steps)), np.nan)
    bad = np.zeros((len(names), len(steps)), dtype=bool)
    if len(df):
        df["value"] = df["value"].astype(float)
        g = df.groupby(["name", "step"]).agg(value=("value", "max"), nonfinite=("nonfinite", "max"))
        r = np.array([names.index(n) for n in g.index.get_level_values(0)])
        c = np.searchsorted(steps, g.index.get_level_values(1).to_numpy())
        values[r, c] = g["value"].to_numpy(dtype=float)
        bad[r, c] = g["nonfinite"].to_numpy() > 0
    return LayerGrid(names, metric, steps, width, values, bad)


def fp8_summary(path: Any) -> pd.DataFrame:
    """Per layer and cast: fp8 dtype, scaling, worst flush share, max amax, max amax/p99, and per
    layer the mean output error (row ``output``)."""
    with open_run(path) as conn:
        if not has_table(conn, "fp8_layers"):
            return pd.DataFrame(columns=["module", "role", "dtype", "scaling", "max_flush_frac", "max_amax",
                                         "max_outlier_ratio", "mean_rel_err", "steps"])
        return pd.read_sql_query(
            "SELECT module, role, dtype, scaling, MAX(flush_frac) AS max_flush_frac, MAX(amax) AS max_amax,"
            " MAX(CASE WHEN p99 > 0 THEN amax / p99 END) AS max_outlier_ratio, AVG(rel_err) AS mean_rel_err,"
            " COUNT(*) AS steps FROM fp8_layers GROUP BY module, role ORDER BY module, role", conn)
