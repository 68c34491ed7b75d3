"""Headline figures of a run, as plain data: shared by the CLI, the dashboard and the doctor."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pandas as pd

from ..store.guard import reads
from ..store.reader import connect
from ..store.schema import STEP_NAN_BITS
from .cost import cost_line, recent_cost
from .ending import UNFINISHED, traceback_tail
from .warmup import SCALE_FREE_PHASES, warmup_end, warmup_in_file


def _finite(values: pd.Series) -> pd.Series:
    return values[np.isfinite(values.astype(float))]


def first_nonfinite_step(steps: pd.DataFrame, events: Optional[pd.DataFrame], warm: int,
                         measured: Optional[dict[str, np.ndarray]] = None) -> Optional[int]:
    """First step whose loss or grad norm is NaN/inf, or that has a non-finite event, not counting
    gradient overflow during the scaler's warm-up (steps before ``warm``, :mod:`.warmup`): that is
    normal.

    A column that is empty for the whole run (no loss logged) is not evidence of NaN, nor is a value
    not measured where ``measured`` (column -> per row, :func:`measured_cells`) says so.
    """
    candidates = []
    for col in ("loss", "grad_norm"):
        values = steps[col].astype(float) if len(steps) else pd.Series(dtype=float)
        if values.notna().any():
            seen = measured[col] if measured is not None else True
            bad = steps["step"][~np.isfinite(values) & seen & ((steps["step"] >= warm) | (col == "loss"))]
            if len(bad):
                candidates.append(int(bad.min()))
    if events is not None and len(events):
        ev = events[(events["step"] >= warm) | events["phase"].isin(SCALE_FREE_PHASES)]
        if len(ev):
            candidates.append(int(ev["step"].min()))
    return min(candidates) if candidates else None


def _first_nonfinite(steps: pd.DataFrame, col: str, measured: dict[str, np.ndarray]) -> Optional[int]:
    if not len(steps):
        return None
    values = steps[col].astype(float)
    # as in first_nonfinite_step: a column never measured (no loss logged) is not evidence of NaN
    bad = steps["step"][~np.isfinite(values) & measured[col]] if values.notna().any() else []
    return int(bad.min()) if len(bad) else None


def measured_cells(run: Any, steps: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per row of ``steps`` (as :attr:`ampwatch.Run.steps`, where a NULL reads NaN like a NaN),
    whether its loss and grad norm were measured: a value, or NULL with its NaN bit. A step the
    run ended in before its loss was known (a ``step-unfinished`` notice) holds NULL there."""
    if not len(steps):
        return {col: np.zeros(0, dtype=bool) for col in STEP_NAN_BITS}
    # by step: a live run may have grown since ``steps`` was read
    read = run.query("SELECT step, nan_mask FROM steps WHERE step <= ?", (int(steps["step"].iloc[-1]),))
    mask = read.set_index("step")["nan_mask"].reindex(steps["step"]).fillna(0).to_numpy(dtype=np.int64)
    return {col: steps[col].notna().to_numpy() | ((mask & bit) != 0) for col, bit in STEP_NAN_BITS.items()}


@reads
def summarize(run: Any) -> dict[str, Any]:
    """Steps, skips, loss/scale/grad-norm figures and status of a :class:`ampwatch.Run`."""
    info, steps = run.info, run.steps
    n = len(steps)
    with connect(run.path) as conn:
        warm = warmup_end(warmup_in_file(conn, info["scaler_enabled"]), int(steps["step"].iloc[0]) if n else 0)
    skipped = int(steps["skipped"].sum()) if n else 0
    measured = measured_cells(run, steps)
    loss = steps["loss"][measured["loss"]] if n else pd.Series(dtype=float)
    finite_loss = _finite(loss)
    scale = steps["loss_scale"].dropna() if n else pd.Series(dtype=float)
    norms = _finite(steps["grad_norm"].dropna()) if n else pd.Series(dtype=float)
    return {
        "name": info["name"], "status": info["status"], "steps": n,
        # a run resumed from a checkpoint is numbered from its first_step
        "first_step": int(steps["step"].iloc[0]) if n else None,
        "last_step": int(steps["step"].iloc[-1]) if n else None,
        "skipped": skipped, "skipped_pct": 100.0 * skipped / n if n else 0.0,
        "loss_first": float(loss.iloc[0]) if len(loss) else None,
        "loss_last": float(loss.iloc[-1]) if len(loss) else None,
        "loss_min": float(finite_loss.min()) if len(finite_loss) else None,
        "scale_start": float(scale.iloc[0]) if len(scale) else None,
        "scale_min": float(scale.min()) if len(scale) else None,
        "scale_final": float(scale.iloc[-1]) if len(scale) else None,
        "first_nonfinite_step": first_nonfinite_step(steps, run.events, warm, measured),
        "warmup_end_step": warm,
        # the loss alone: gradient overflow during the scaler's warm-up is normal, a NaN loss is not
        "first_nonfinite_loss_step": _first_nonfinite(steps, "loss", measured),
        "grad_norm_p50": float(norms.quantile(0.5)) if len(norms) else None,
        "grad_norm_p90": float(norms.quantile(0.9)) if len(norms) else None,
        "grad_norm_p99": float(norms.quantile(0.99)) if len(norms) else None,
        "grad_norm_max": float(norms.max()) if len(norms) else None,
        "amp_dtype": info.get("amp_dtype"), "device": info.get("device"),
        "error_tail": error_tail(info) if info.get("status") == "crashed" else [],
        # what the per-layer detail steps cost, from the run's own step times (doctor/cost.py)
        "detail_cost": cost_line(recent_cost(run.query, int(steps["step"].iloc[0]), int(steps["step"].iloc[-1]),
                                             info.get("layer_every"))[0]) if n else None,
        **_unfinished(run, steps, measured),
        **_memory(run.memory),
    }


def _unfinished(run: Any, steps: pd.DataFrame, measured: dict[str, np.ndarray]) -> dict[str, Any]:
    """The last step when the run closed inside it (notice ``step-unfinished``): ``unfinished_step``,
    ``unfinished_text`` (how far it got, the notice's first clause) and ``unfinished_loss`` (whether
    its loss was known by then); None, None, None otherwise."""
    n = run.notices
    last = int(steps["step"].iloc[-1]) if len(steps) else None
    hit = n[(n["code"] == UNFINISHED) & (n["step"] == last)] if len(n) and last is not None else n.iloc[:0]
    if not len(hit):
        return {"unfinished_step": None, "unfinished_text": None, "unfinished_loss": None}
    return {"unfinished_step": last, "unfinished_text": str(hit["message"].iloc[0]).split(";")[0],
            "unfinished_loss": bool(measured["loss"][-1])}


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
