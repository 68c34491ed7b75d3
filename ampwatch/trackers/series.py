"""What a tracker is sent: the run file's rows turned into per-step scalars under one tag prefix.

The live mirror and ``ampwatch export --to`` both go through :class:`SeriesBuilder`, so a run
mirrored while it trains and the same run exported afterwards carry the same tags and values.
The row tuples are the run file's column order (the writer's inserts and :data:`STEP_COLUMNS`),
so the builder reads rows the writer is about to commit and rows read back from the file alike.
"""
from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

from ..doctor.finding import FP16_MAX
from ..doctor.numerics import FP32_MODULE_TYPES
from ..store.reader import has_table
from ..store.schema import LAYER_NAN_BITS, STEP_NAN_BITS

PREFIX = "amp/"
LOSS, SCALE, SKIPPED, GRAD_NORM, LR = (PREFIX + t for t in ("loss", "loss_scale", "skipped", "grad_norm", "lr"))
LAYER_GRAD_NORM = PREFIX + "layer_grad_norm/"   # + parameter name
HEADROOM = PREFIX + "fp16_headroom_min"         # 65504 / the largest fp16 activation of the step
FINDINGS = PREFIX + "findings"                  # the doctor's findings, as text at their first step
NOTICES = PREFIX + "notices"                    # what the recorder noticed (misuse), as text
MEMORY = PREFIX + "memory/"                      # + host_rss, device_allocated, device_reserved (bytes)

STEP_COLUMNS = "step, time, duration_s, loss, loss_scale, skipped, grad_norm, lr, micro_batches, nan_mask"
LAYER_COLUMNS = "param_id, step, grad_norm, grad_amax, param_norm, grad_nonfinite, grad_zero_frac, nan_mask"
MODULE_COLUMNS = "module_id, phase, step, amax, nonfinite"
MEMORY_COLUMNS = ("step", "host_rss", "device_allocated", "device_reserved")


@dataclass
class Point:
    """One step's scalars. ``wall_time``: unix seconds at the step's end (None: unknown)."""
    step: int
    wall_time: Optional[float]
    values: dict[str, float] = field(default_factory=dict)


def _value(raw: Any, mask: int, bit: int) -> Optional[float]:
    """A stored float: NULL with its NaN bit set is NaN (SQLite keeps NaN as NULL), else unmeasured."""
    if raw is None:
        return math.nan if mask & bit else None
    return float(raw)


class SeriesBuilder:
    """Rows -> :class:`Point` lists.

    :param param_names: parameter id -> name (the run file's ``tensors`` ids).
    :param module_types: module id -> module class name (headroom skips fp32-computing modules).
    :param amp_dtype: the run's autocast dtype name; headroom is sent for ``'float16'`` only.
    """

    def __init__(self, param_names: dict[int, str], module_types: dict[int, str],
                 amp_dtype: Optional[str] = None) -> None:
        self.param_names = param_names
        self.fp16_modules = {i for i, t in module_types.items() if t not in FP32_MODULE_TYPES}
        self.amp_dtype = amp_dtype

    def points(self, steps: Iterable[tuple], layers: Iterable[tuple] = (),
               modules: Iterable[tuple] = (), memory: Iterable[tuple] = ()) -> list[Point]:
        """Points in step order: one per step row, per-layer norms and headroom on the steps that
        have layer and module rows (``layer_every`` steps, skipped and non-finite steps), and the
        process's memory on the steps it was read at."""
        by_step: dict[int, Point] = {}
        for step, time, _dur, loss, scale, skipped, grad_norm, lr, _mb, mask in steps:
            values = {SKIPPED: float(skipped)}
            for tag, v in ((LOSS, _value(loss, mask, STEP_NAN_BITS["loss"])), (SCALE, scale),
                           (GRAD_NORM, _value(grad_norm, mask, STEP_NAN_BITS["grad_norm"])), (LR, lr)):
                if v is not None:
                    values[tag] = float(v)
            by_step[step] = Point(step, time, values)
        for pid, step, grad_norm, _amax, _pnorm, _nf, _zero, mask in layers:
            v = _value(grad_norm, mask, LAYER_NAN_BITS["grad_norm"])
            name = self.param_names.get(pid)
            if v is not None and name is not None:
                self._point(by_step, step).values[LAYER_GRAD_NORM + name] = v
        if self.amp_dtype == "float16":
            for step, amax in self._largest_activation(modules).items():
                # inf or NaN activations leave no headroom at all
                headroom = FP16_MAX / amax if math.isfinite(amax) and amax > 0 else (
                    math.inf if amax == 0 else 0.0)
                self._point(by_step, step).values[HEADROOM] = headroom
        for row in memory:
            for column, value in zip(MEMORY_COLUMNS[1:], row[1:]):
                if value is not None:
                    self._point(by_step, row[0]).values[MEMORY + column] = float(value)
        return [by_step[s] for s in sorted(by_step)]

    def _largest_activation(self, modules: Iterable[tuple]) -> dict[int, float]:
        """Per step, the largest forward |value| over modules whose output is fp16 under autocast."""
        largest: dict[int, float] = {}
        for module_id, phase, step, amax, nonfinite in modules:
            if phase != 0 or module_id not in self.fp16_modules:
                continue
            a = math.inf if nonfinite else (float(amax) if amax is not None else None)
            if a is None:
                continue
            if a > largest.get(step, -1.0) or a != a:
                largest[step] = a
        return largest

    @staticmethod
    def _point(by_step: dict[int, Point], step: int) -> Point:
        if step not in by_step:  # layer rows committed before their step row (never by our writer)
            by_step[step] = Point(step, None)
        return by_step[step]


def builder_for(conn: sqlite3.Connection) -> SeriesBuilder:
    """The builder for a run file open on ``conn`` (its names and autocast dtype)."""
    params = dict(conn.execute("SELECT id, name FROM tensors WHERE kind = 'param'").fetchall())
    modules = dict(conn.execute("SELECT id, type FROM tensors WHERE kind = 'module'").fetchall())
    amp_dtype = conn.execute("SELECT amp_dtype FROM run WHERE id = 1").fetchone()[0]
    return SeriesBuilder(params, modules, amp_dtype)


def read_points(conn: sqlite3.Connection, chunk_steps: int = 20_000) -> Iterator[list[Point]]:
    """Every step of a run file as points, ``chunk_steps`` steps at a time (a 100,000-step run is
    not held in memory twice). Each chunk is in step order and chunks follow each other."""
    builder = builder_for(conn)
    lo, hi = conn.execute("SELECT MIN(step), MAX(step) FROM steps").fetchone()
    if lo is None:
        return
    has_memory = has_table(conn, "memory")
    for start in range(lo, hi + 1, chunk_steps):
        bounds = (start, start + chunk_steps)
        steps = conn.execute(f"SELECT {STEP_COLUMNS} FROM steps WHERE step >= ? AND step < ? ORDER BY step",
                             bounds).fetchall()
        layers = conn.execute(f"SELECT {LAYER_COLUMNS} FROM layers WHERE step >= ? AND step < ?",
                              bounds).fetchall()
        modules = conn.execute(f"SELECT {MODULE_COLUMNS} FROM modules WHERE step >= ? AND step < ? AND phase = 0",
                               bounds).fetchall()
        memory = conn.execute(f"SELECT {', '.join(MEMORY_COLUMNS)} FROM memory WHERE step >= ? AND step < ?",
                              bounds).fetchall() if has_memory else []
        yield builder.points(steps, layers, modules, memory)


def finding_texts(findings: Iterable[Any]) -> list[tuple[int, str]]:
    """The doctor's findings as ``(step, markdown)``, one text per step (several findings at one
    step are one text: a tracker shows one text per tag and step)."""
    by_step: dict[int, list[str]] = {}
    for f in findings:
        by_step.setdefault(int(f.steps[0]), []).append(finding_text(f))
    return [(step, "\n\n---\n\n".join(texts)) for step, texts in sorted(by_step.items())]


def finding_text(f: Any) -> str:
    """One finding as markdown: severity and title, the steps, the evidence, the advice."""
    first, last = f.steps
    where = f"step {first}" if first == last else f"steps {first}-{last}"
    return (f"**{f.severity.upper()}: {f.title}** (`{f.id}`, {where})\n\n{f.evidence}\n\n"
            f"*What to do:* {f.advice}")


def notice_texts(notices: Iterable[tuple]) -> list[tuple[int, str]]:
    """Recorder notices ``(step, code, message)`` as ``(step, markdown)``."""
    return [(int(step or 0), f"**{code}**: {message}") for step, code, message in notices]


__all__ = ["PREFIX", "LOSS", "SCALE", "SKIPPED", "GRAD_NORM", "LR", "LAYER_GRAD_NORM", "HEADROOM", "MEMORY", "FINDINGS",
           "NOTICES", "Point", "SeriesBuilder", "builder_for", "read_points", "finding_texts", "notice_texts"]
