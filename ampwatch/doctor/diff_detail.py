"""The layers and modules of two runs compared in SQLite, for :mod:`ampwatch.doctor.diff`.

A long run's detail tables are long: 10M layer rows and 15M module rows at 1M steps
(bench/dashboard.py). Read into pandas, their names decoded and merged, two 100,000-step runs took
tens of seconds to compare and two 1M-step runs minutes. Here run b is ATTACHed to a read-only
connection on run a (:func:`ampwatch.store.reader.paired`), b's ids are matched to a's by name in
a temp table, and a temp view joins the rows both runs recorded, with each figure's relative
difference worked out per row by SQLite (in C, without the GIL). Python gets aggregates (the largest
difference, the steps compared) and the rows of the few steps it asks about.

The rules are diff.py's, row for row: :func:`ampwatch.doctor.diff.rel_diff` (0 where equal or both
NaN, inf where only one is finite; SQLite stores NaN as NULL, and a value not measured reads NaN in
pandas too) and :func:`ampwatch.doctor.diff.parting` (beyond the tolerance at a step and still
beyond it at the key's next shared step, or at its last; or infinitely apart). Rows are read in run
a's key order (step, then id: the order diff.py's merges kept), so a tie for the largest goes to
the first row, as ``np.argmax`` gives it.
"""
from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass
from typing import Any, Optional

INF = "9e999"  # SQLite reads it as +inf
BIG = "1.7976931348623157e308"  # the largest finite double: beyond it, an infinity


def _rel(x: str, y: str, floor: str = "0.0") -> str:
    """diff.rel_diff(x, y, floor) in SQL; ``floor`` a finite non-negative expression (0: none)."""
    return (f"(CASE WHEN {x} IS NULL AND {y} IS NULL THEN 0.0 WHEN {x} IS NULL OR {y} IS NULL THEN {INF} "
            f"WHEN {x} = {y} THEN 0.0 WHEN abs({x}) > {BIG} OR abs({y}) > {BIG} THEN {INF} "
            f"ELSE abs({x} - {y}) / max(abs({x}), abs({y}), {floor}) END)")


# A layer's gradient is measured against the step's whole gradient norm, the larger of the two runs'
# where both are finite (diff.py's ``whole``): a layer whose own gradient nearly cancels (a bias)
# moves by many of its own units from rounding alone.
_WHOLE = (f"(CASE WHEN abs(sa.grad_norm) > {BIG} OR abs(sb.grad_norm) > {BIG} THEN 0.0 "
          f"ELSE max(coalesce(abs(sa.grad_norm), 0.0), coalesce(abs(sb.grad_norm), 0.0)) END)")


def _unscaled(amax: str, scale: str) -> str:
    """A backward maximum divided by its step's loss scale (1 without one), as numpy divides; a
    forward one as it is."""
    return (f"(CASE WHEN a.phase = 1 THEN (CASE WHEN {scale} = 0 THEN (CASE WHEN {amax} > 0 THEN {INF} END) "
            f"ELSE {amax} / {scale} END) ELSE {amax} END)")


_STEPS = "LEFT JOIN main.steps sa ON sa.step = a.step LEFT JOIN b.steps sb ON sb.step = a.step"

# CROSS JOIN keeps run a's table as the outer loop: rows come in a's key order, and a range of its
# steps is a range of its primary key.
_VIEWS = {
    "layers": f"""
        SELECT a.step AS step, a.param_id AS id, 0 AS phase,
               a.grad_norm AS grad_norm_a, b.grad_norm AS grad_norm_b,
               a.param_norm AS param_norm_a, b.param_norm AS param_norm_b,
               {_rel("a.param_norm", "b.param_norm")} AS param_norm_rel,
               {_rel("a.grad_norm", "b.grad_norm", _WHOLE)} AS grad_norm_rel
        FROM main.layers a CROSS JOIN temp.layer_pairs k ON k.a_id = a.param_id
        CROSS JOIN b.layers b ON b.step = a.step AND b.param_id = k.b_id {_STEPS}""",
    "modules": f"""
        SELECT step, id, phase, amax_a, amax_b,
               CASE WHEN nonfinite_a != nonfinite_b THEN {INF} ELSE {_rel("amax_a", "amax_b")} END AS amax_rel
        FROM (SELECT a.step AS step, a.module_id AS id, a.phase AS phase,
                     {_unscaled("a.amax", "coalesce(sa.loss_scale, 1.0)")} AS amax_a,
                     {_unscaled("b.amax", "coalesce(sb.loss_scale, 1.0)")} AS amax_b,
                     a.nonfinite != 0 AS nonfinite_a, b.nonfinite != 0 AS nonfinite_b
              FROM main.modules a CROSS JOIN temp.module_pairs k ON k.a_id = a.module_id
              CROSS JOIN b.modules b ON b.step = a.step AND b.module_id = k.b_id AND b.phase = a.phase {_STEPS})""",
}
_ID = {"layers": "param_id", "modules": "module_id"}
FIGURES = {"layers": ("param_norm", "grad_norm"), "modules": ("amax",)}


@dataclass(frozen=True)
class Row:
    """One shared row: its step, run a's id, phase (0 forward, 1 backward; 0 for layers) and per
    figure (a, b, rel)."""
    step: int
    id: int
    phase: int
    values: dict[str, tuple[Any, Any, float]]


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


class Compared:
    """One detail table of the pair, matched by name: ``pairs`` (run a's id, run b's id)."""

    def __init__(self, conn: sqlite3.Connection, table: str, pairs: list[tuple[int, int]], rtol: float) -> None:
        self.conn, self.table, self.rtol = conn, table, rtol
        self.figures = FIGURES[table]
        kind = "layer" if table == "layers" else "module"
        conn.execute(f"CREATE TEMP TABLE {kind}_pairs (a_id INTEGER PRIMARY KEY, b_id INTEGER NOT NULL)")
        conn.executemany(f"INSERT INTO temp.{kind}_pairs VALUES (?, ?)", pairs)
        conn.execute(f"CREATE TEMP VIEW {table}_ab AS {_VIEWS[table]}")
        self.view = f"temp.{table}_ab"
        self._columns = ", ".join(f"{f}_a, {f}_b, {f}_rel" for f in self.figures)

    def ids_in(self, schema: str) -> set[int]:
        """The ids the table holds rows for in run a (``main``) or run b (``b``)."""
        col = _ID[self.table]
        return {r[0] for r in self.conn.execute(f"SELECT DISTINCT {col} FROM {schema}.{self.table}")}

    def _row(self, r: tuple) -> Row:
        values = {f: (_num(r[3 + 3 * i]), _num(r[4 + 3 * i]), float(r[5 + 3 * i])) for i, f in enumerate(self.figures)}
        return Row(int(r[0]), int(r[1]), int(r[2]), values)

    def largest(self) -> tuple[int, dict[tuple[str, Optional[int]], Row]]:
        """The steps both runs recorded this table on, and per (figure, phase) the row where the
        figure differs most (the first such row; none where it never differs). Modules are taken
        per phase (0 forward, 1 backward: the other phase's rows count as 0, as diff.py's
        ``np.where`` had them), layers as one (phase None). One scan per entry, the first counting
        the steps."""
        wanted = [(f, p) for f in self.figures for p in ((0, 1) if self.table == "modules" else (None,))]
        steps, out = 0, {}
        for i, (fig, phase) in enumerate(wanted):
            rel = f"{fig}_rel" if phase is None else f"CASE WHEN phase = {int(phase)} THEN {fig}_rel ELSE 0.0 END"
            count = ", count(DISTINCT step)" if i == 0 else ""
            r = self.conn.execute(f"SELECT max({rel}), step, id, phase, {self._columns}{count} "
                                  f"FROM {self.view}").fetchone()
            if count:
                steps, r = int(r[-1]), r[:-1]
            if r[0] is not None and r[0] > 0:
                out[(fig, phase)] = self._row(r[1:])
        return steps, out

    def first_parting(self) -> Optional[tuple[int, list[tuple[Row, dict[str, bool]]]]]:
        """The first step where some row parts, with every row of that step and, per figure,
        whether it parts there (diff.parting's rule); None if none does."""
        beyond = " OR ".join(f"{f}_rel > :rtol" for f in self.figures)
        after = -1
        while True:
            got = self.conn.execute(f"SELECT step FROM {self.view} WHERE step > :after AND ({beyond}) "
                                    f"ORDER BY step LIMIT 1", {"after": after, "rtol": self.rtol}).fetchone()
            if got is None:
                return None
            step = int(got[0])
            rows = [self._row(r) for r in self.conn.execute(
                f"SELECT step, id, phase, {self._columns} FROM {self.view} WHERE step = ?", (step,))]
            marked = [(row, self._parts(row)) for row in rows]
            if any(any(p.values()) for _, p in marked):
                return step, marked
            after = step  # differences beyond the tolerance that came back at the next step: rounding

    def _parts(self, row: Row) -> dict[str, bool]:
        """Per figure: beyond the tolerance here and at the key's next shared step (or it has
        none), or infinitely apart."""
        out, following = {}, None
        for f in self.figures:
            rel = row.values[f][2]
            if math.isinf(rel):
                out[f] = True
                continue
            if not rel > self.rtol:
                out[f] = False
                continue
            if following is None:
                following = self.conn.execute(
                    f"SELECT {', '.join(f'{g}_rel' for g in self.figures)} FROM {self.view} "
                    f"WHERE step > ? AND id = ? AND phase = ? ORDER BY step LIMIT 1",
                    (row.step, row.id, row.phase)).fetchone() or ()
            out[f] = not following or following[self.figures.index(f)] > self.rtol
        return out
