"""Headline figures of a run, as plain data: shared by the CLI, the dashboard and the doctor."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pandas as pd

from ..store.guard import reads
from ..store.reader import connect
from .ending import traceback_tail
from .warmup import warmup_end, warmup_in_file


def _finite(values: pd.Series) -> pd.Series:
    return values[np.isfinite(values.astype(float))]


def first_nonfinite_step(steps: pd.DataFrame, events: Optional[pd.DataFrame], warm: int) -> Optional[int]:
    """First step whose loss or grad norm is NaN/inf, or that has a non-finite event, not counting
    gradient overflow during the scaler's warm-up (steps before ``warm``, :mod:`.warmup`): that is
    normal.

    A column that is empty for the whole run (no loss logged) is not evidence of NaN.
    """
    candidates = []
    for col in ("loss", "grad_norm"):
        values = steps[col].astype(float) if len(steps) else pd.Series(dtype=float)
        if values.notna().any():
            bad = steps["step"][~np.isfinite(values) & ((steps["step"] >= warm) | (col == "loss"))]
            if len(bad):
                candidates.append(int(bad.min()))
    if events is not None and len(events):
        ev = events[(events["step"] >= warm) | events["phase"].isin(["forward", "loss"])]
        if len(ev):
            candidates.append(int(ev["step"].min()))
    return min(candidates) if candidates else None


def _first_nonfinite(steps: pd.DataFrame, col: str) -> Optional[int]:
    if not len(steps):
        return None
    values = steps[col].astype(float)
    # as in first_nonfinite_step: a column never measured (no loss logged) is not evidence of NaN
    bad = steps["step"][~np.isfinite(values)] if values.notna().any() else []
    return int(bad.min()) if len(bad) else None


@reads
def summarize(run: Any) -> dict[str, Any]:
    """Steps, skips, loss/scale/grad-norm figures and status of a :class:`ampwatch.Run`."""
    info, steps = run.info, run.steps
    n = len(steps)
    with connect(run.path) as conn:
        warm = warmup_end(warmup_in_file(conn, info["scaler_enabled"]), int(steps["step"].iloc[0]) if n else 0)
    skipped = int(steps["skipped"].sum()) if n else 0
    loss = steps["loss"] if n else pd.Series(dtype=float)
    finite_loss = _finite(loss)
    scale = steps["loss_scale"].dropna() if n else pd.Series(dtype=float)
    norms = _finite(steps["grad_norm"].dropna()) if n else pd.Series(dtype=float)
    return {
        "name": info["name"], "status": info["status"], "steps": n,
        "skipped": skipped, "skipped_pct": 100.0 * skipped / n if n else 0.0,
        "loss_first": float(loss.iloc[0]) if n else None,
        "loss_last": float(loss.iloc[-1]) if n else None,
        "loss_min": float(finite_loss.min()) if len(finite_loss) else None,
        "scale_start": float(scale.iloc[0]) if len(scale) else None,
        "scale_min": float(scale.min()) if len(scale) else None,
        "scale_final": float(scale.iloc[-1]) if len(scale) else None,
        "first_nonfinite_step": first_nonfinite_step(steps, run.events, warm),
        "warmup_end_step": warm,
        # the loss alone: gradient overflow during the scaler's warm-up is normal, a NaN loss is not
        "first_nonfinite_loss_step": _first_nonfinite(steps, "loss"),
        "grad_norm_p50": float(norms.quantile(0.5)) if len(norms) else None,
        "grad_norm_p90": float(norms.quantile(0.9)) if len(norms) else None,
        "grad_norm_p99": float(norms.quantile(0.99)) if len(norms) else None,
        "grad_norm_max": float(norms.max()) if len(norms) else None,
        "amp_dtype": info.get("amp_dtype"), "device": info.get("device"),
        "error_tail": error_tail(info) if info.get("status") == "crashed" else [],
        **_memory(run.memory),
    }


def _memory(memory: pd.DataFrame) -> dict[str, Optional[float]]:
    """First, last and largest reading of each memory figure, in bytes (None: never read)."""
    out: dict[str, Optional[float]] = {}
    for col in ("host_rss", "device_allocated"):
        values = memory[col].dropna() if len(memory) else pd.Series(dtype=float)
        for what, value in (("first", values.iloc[0] if len(values) else None),
                            ("last", values.iloc[-1] if len(values) else None),
                            ("max", values.max() if len(values) else None)):
            out[f"{col}_{what}"] = None if value is None else float(value)
    return out


def error_tail(info: dict, lines: int = 3) -> list[str]:
    """The last lines of a crashed run's traceback (the exception's line last)."""
    return traceback_tail(info.get("error"), lines) or ["(no traceback stored)"]
