"""The scaler's warm-up: the one rule, read from a run's frames (the doctor, ``ampwatch summary``)
or straight from its file with SQL (the dashboard's runs table and events, fast on a 1M-step run).

GradScaler starts at ``init_scale`` (2**16 by default; people pass 2**24) and halves on each
overflow until the gradients fit. So warm-up is the leading run of skipped steps, back to back from
the first step, while the scale falls from its initial value (docs/doctor.md). It ends at the first
step that breaks any of these:

- the step was skipped, and directly follows the previous one (no gap in the recorded steps);
- the scale is at least 1 and lower than the step before's (a scale that does not fall is not backing off);
- no forward pass or loss went non-finite at that step (a NaN born in the forward is a fault, not
  a scale that is too high for the gradients);
- the step lies before a diverged tail (a NaN/inf loss on the last NAN_TAIL_MIN+ steps).

and the scale after it must be lower than the first one. A skip after a clean step is never warm-up:
the gradients fitted at that scale once, so something changed. Runs without a GradScaler have none.
"""
from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np
import pandas as pd

from ..store.reader import open_run
from ..store.schema import INF_BOUND, STEP_NAN_BITS

# Where a non-finite value is never the loss scale's doing: a forward pass, the loss, or the model's
# own input (the batch brought it). The scale multiplies only the gradients.
SCALE_FREE_PHASES = ("forward", "loss", "input")

# A diverged tail: NaN/inf loss on the last 3+ steps (one or two are an overflow the scaler may
# still fix). Health rules judge only the steps before it; the divergence finding covers the rest.
NAN_TAIL_MIN = 3
# Rows read per round by the SQL form: a warm-up halves the scale on every row, so from float32's
# largest value it is over within 128 rows; a custom backoff_factor can make it longer.
_SQL_CHUNK = 256
# What a first NaN/Inf that is the warm-up's is called, where a job's is named (the CLI's summary of
# a folder, the dashboard's Ranks page)
WARMUP_NOTE = ("a gradient overflow during the scaler's warm-up, expected (it halves its initial scale until "
               "the gradients fit), not a fault")


@dataclass
class Warmup:
    """Steps ``first`` .. ``last`` (``skips``, back to back) while the scale fell from ``scale_from``
    to ``scale_to`` (the scale the first clean step ran at)."""
    first: int
    last: int
    skips: list[int]
    scale_from: float
    scale_to: float

    @property
    def end(self) -> int:
        """The first step after the warm-up."""
        return self.last + 1


def leading_warmup(steps: Iterable[int], scales: Iterable[float], skipped: Iterable[bool],
                   forward_bad: set, healthy_end: int) -> Optional[Warmup]:
    """The rule itself over the first rows of a run in step order (as many as it needs, plus the
    row after the warm-up when there is one)."""
    step, scale, skip = list(steps), [float(s) for s in scales], [bool(s) for s in skipped]
    n = 0
    while (n < len(step) and skip[n] and step[n] == step[0] + n and step[n] <= healthy_end
           and int(step[n]) not in forward_bad and scale[n] >= 1.0 and (n == 0 or scale[n] < scale[n - 1])):
        n += 1
    if not n:
        return None
    after = scale[n] if n < len(scale) else scale[n - 1] / 2
    if not after < scale[0]:  # a warm-up is the scale backing off; without a drop it is something else
        return None
    skips = [int(x) for x in step[:n]]
    return Warmup(skips[0], skips[-1], skips, scale[0], float(after))


def nan_tail_start(steps: pd.DataFrame, has_loss: bool) -> Optional[int]:
    """The first step of a diverged tail (NaN/inf loss on the last NAN_TAIL_MIN+ steps), else None."""
    if not has_loss:
        return None
    finite = np.isfinite(steps["loss"].to_numpy(dtype=float))
    n_bad = len(finite) - (int(np.flatnonzero(finite).max()) + 1 if finite.any() else 0)
    if n_bad < NAN_TAIL_MIN:
        return None
    return int(steps["step"].iloc[len(finite) - n_bad])


def warmup_of(steps: pd.DataFrame, events: Optional[pd.DataFrame], scaler_enabled: bool,
              healthy_end: Optional[int] = None) -> Optional[Warmup]:
    """The warm-up of a run read as frames: ``steps`` as :attr:`ampwatch.Run.steps` (NaN already
    decoded, in step order), ``events`` as :attr:`ampwatch.Run.events`."""
    scaling = scaler_enabled and len(steps) and steps["loss_scale"].notna().any()
    if not scaling or not bool(steps["skipped"].iloc[0]):
        return None
    if healthy_end is None:
        tail = nan_tail_start(steps, bool(steps["loss"].notna().any()))
        healthy_end = int(steps["step"].max()) if tail is None else tail - 1
    bad_fwd = set(events.loc[events["phase"].isin(SCALE_FREE_PHASES), "step"]) \
        if events is not None and len(events) else set()
    return leading_warmup(steps["step"].to_numpy(), steps["loss_scale"].to_numpy(dtype=float),
                          steps["skipped"].to_numpy(dtype=bool), bad_fwd, healthy_end)


def warmup_in_file(conn: sqlite3.Connection, scaler_enabled: bool) -> Optional[Warmup]:
    """The same warm-up read with SQL from an open run file: only the leading rows, the tail's
    finite-loss boundary and the forward events among those rows (fast on a 1M-step run)."""
    if not scaler_enabled:
        return None
    loss_nan = STEP_NAN_BITS["loss"]
    has_scale, has_loss, last, last_finite = conn.execute(
        f"SELECT EXISTS(SELECT 1 FROM steps WHERE loss_scale IS NOT NULL),"
        f" EXISTS(SELECT 1 FROM steps WHERE loss IS NOT NULL OR (nan_mask & {loss_nan}) != 0),"
        f" (SELECT MAX(step) FROM steps),"
        f" (SELECT MAX(step) FROM steps WHERE (nan_mask & {loss_nan}) = 0 AND abs(loss) <= {INF_BOUND})"
    ).fetchone()
    if not has_scale or last is None:
        return None
    healthy_end = last
    if has_loss:
        n_bad = conn.execute("SELECT COUNT(*) FROM steps WHERE step > ?",
                             (-(2 ** 62) if last_finite is None else last_finite,)).fetchone()[0]
        if n_bad >= NAN_TAIL_MIN:
            first_bad = conn.execute("SELECT MIN(step) FROM steps WHERE step > ?",
                                     (-(2 ** 62) if last_finite is None else last_finite,)).fetchone()[0]
            healthy_end = first_bad - 1
    rows: list[tuple] = []
    while True:
        after = rows[-1][0] if rows else -(2 ** 62)
        chunk = conn.execute("SELECT step, loss_scale, skipped FROM steps WHERE step > ? ORDER BY step LIMIT ?",
                             (after, _SQL_CHUNK)).fetchall()
        rows += chunk
        # stop once a row that ends any warm-up was read (a clean step), or the file is read whole
        if len(chunk) < _SQL_CHUNK or any(not r[2] for r in chunk):
            break
    if not rows or not rows[0][2]:
        return None
    bad_fwd = {r[0] for r in conn.execute("SELECT DISTINCT step FROM events WHERE phase IN ('forward', 'loss')"
                                          " AND step BETWEEN ? AND ?", (rows[0][0], rows[-1][0]))}
    scales = [np.nan if r[1] is None else r[1] for r in rows]
    return leading_warmup([r[0] for r in rows], scales, [r[2] for r in rows], bad_fwd, healthy_end)


def warmup_end(warmup: Optional[Warmup], first_step: int) -> int:
    """The first step after the warm-up, or the run's first step when it had none."""
    return warmup.end if warmup is not None else first_step


def warmup_end_in(path: Any) -> int:
    """The first step after the scaler's warm-up in the run file ``path`` (its first step when it
    had none)."""
    with open_run(path) as conn:
        first = conn.execute("SELECT MIN(step) FROM steps").fetchone()[0] or 0
        return warmup_end(warmup_in_file(conn, bool(conn.run_row.get("scaler_enabled"))), first)


def expected_overflow(path: Any, step: int, phase: Optional[str]) -> bool:
    """Whether a first NaN/Inf at ``step`` of the run file ``path``, in ``phase`` (None: seen in the
    steps table only, without localization), is the scaler's warm-up: a gradient overflow before
    the warm-up ended. A forward pass, loss or input batch that went non-finite never is (a fault,
    not a scale too high for the gradients). One read of the file's leading rows."""
    return phase not in SCALE_FREE_PHASES and step < warmup_end_in(path)
