"""What the rules know about a run: its steps, plus answers to narrow questions asked on demand.

:class:`Facts` is the only place the doctor reads a run file. The steps table is read once (five
columns). The detail tables are never loaded whole: on a long run they hold tens of millions of rows
(one per parameter, or two per module, on every recorded step), so each question a rule asks is one
query that filters or aggregates inside SQLite and returns only the rows that can matter.
"""
from __future__ import annotations

import json
import math
import sys
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import numpy as np
import pandas as pd

from .finding import Finding
from .warmup import nan_tail_start, warmup_of
from ..store.parallel import read_spread, readers, step_ranges
from ..store.reader import connect, decode_nan_mask, has_table, negative_inf_count, nonfinite_counts
from ..store.schema import LAYER_NAN_BITS, STEP_NAN_BITS

# Warm-up and the diverged tail: one rule for the doctor, the summary and the dashboard (.warmup).

# "Finite" in SQL: SQLite stores NaN as NULL (which fails every comparison) and keeps +-inf, which
# falls outside this range.
_FINITE = f"BETWEEN {-sys.float_info.max!r} AND {sys.float_info.max!r}"
_NO_STEP = -(2 ** 62)  # a lower step bound below any real step


class Facts:
    """A run's steps and the answers several rules share: warm-up, diverged tail, healthy range.

    Open it with :meth:`open` (one read-only connection for the whole diagnosis)."""

    def __init__(self, run: Any, conn: Any) -> None:
        self.info = run.info
        self._run, self._conn = run, conn
        self._norms: dict[tuple[str, int], dict[str, list[tuple[int, float]]]] = {}
        self._nonfinite_inputs: dict[int, list] = {}  # step -> its saved inputs holding NaN/inf
        self.steps, self.has_loss = self._read_steps()
        self.first_step = int(self.steps["step"].min()) if len(self.steps) else 0
        self.last_step = int(self.steps["step"].max()) if len(self.steps) else 0
        self.fp16 = self.info.get("amp_dtype") == "float16"
        self.scaling = bool(self.info.get("scaler_enabled")) and self.steps["loss_scale"].notna().any()
        self.nan_tail_start = nan_tail_start(self.steps, self.has_loss)
        self.healthy_end = self.last_step if self.nan_tail_start is None else self.nan_tail_start - 1
        self.warmup = warmup_of(self.steps, self.events, self.scaling, self.healthy_end)
        # (module, phase) a finding is about, set by the rules: how consequences find their cause
        self.claims: dict[str, tuple[str, str]] = {}
        # answers a rule module works out once for several of its rules (signals.py: the step
        # series' rolling medians)
        self.memo: dict[str, Any] = {}

    @classmethod
    @contextmanager
    def open(cls, run: Any) -> Iterator["Facts"]:
        """Facts of an opened :class:`ampwatch.Run`, valid inside the ``with`` block."""
        with connect(run.path) as conn:  # connect's damage guard also covers the rules run inside
            yield cls(run, conn)

    def _query(self, sql: str, params: tuple = ()) -> pd.DataFrame:
        return pd.read_sql_query(sql, self._conn, params=params)

    def _spread(self, query: Any, first: Optional[int], last: int) -> pd.DataFrame:
        """A scan of a detail table over steps ``[first, last]`` (``first`` None: from the start) as
        ``query(lo, hi) -> (sql, params)`` over contiguous ranges of steps, each range read on a
        connection of its own (store/parallel.py); the frames joined in step order."""
        lo = self.first_step if first is None else first
        ranges = step_ranges(lo, last, readers()) if last >= lo else [(lo, last)]
        if first is None:
            ranges[0] = (_NO_STEP, ranges[0][1])  # rows before the first step row, if any

        def read(conn: Any, steps: tuple[int, int]) -> pd.DataFrame:
            sql, params = query(*steps)
            return pd.read_sql_query(sql, conn, params=params)

        frames = read_spread(self._run.path, read, ranges, min_each=1)
        return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]

    def _read_steps(self) -> tuple[pd.DataFrame, bool]:
        s = self._query("SELECT step, loss, loss_scale, skipped, grad_norm, nan_mask FROM steps ORDER BY step")
        mask = s["nan_mask"].to_numpy()
        # The loss is "logged" when any row holds one, or NaN (SQLite keeps NaN as NULL plus a bit):
        # an all-NaN loss is a run that was NaN from its first step, not one that never logged it.
        has_loss = bool(s["loss"].notna().any() or (mask & STEP_NAN_BITS["loss"]).any())
        s = decode_nan_mask(s, STEP_NAN_BITS)
        s["loss_scale"] = s["loss_scale"].astype(float)
        s["skipped"] = s["skipped"].astype(bool)
        return s, has_loss

    def ask(self, sql: str, params: tuple = ()) -> pd.DataFrame:
        """One narrow question from a rule module (filter and aggregate inside SQLite)."""
        return self._query(sql, params)

    def has_table(self, name: str) -> bool:
        """Whether the run file has table ``name`` (files of older schemas lack the newer ones)."""
        return has_table(self._conn, name)

    @cached_property
    def saved_input_steps(self) -> list[int]:
        """Steps whose model inputs the run file holds (schema 8: record/batches.py), ascending."""
        if not self.has_table("batches"):
            return []
        df = self._query("SELECT DISTINCT step FROM batches WHERE data IS NOT NULL ORDER BY step")
        return [int(v) for v in df["step"]]

    def _saved(self, step: int) -> list[tuple[str, int, str, bytes]]:
        if step not in self.saved_input_steps:
            return []
        return self._conn.execute("SELECT name, micro_batch, dtype, data FROM batches WHERE step = ? AND data IS NOT"
                                  " NULL ORDER BY micro_batch, name", (step,)).fetchall()

    def ignored_labels(self, step: int) -> list[tuple[str, int, int, int]]:
        """The saved integer inputs of ``step`` named like labels whose every value is one negative
        number (PyTorch's and Hugging Face's ignore index is -100): ``(name, micro_batch, value,
        numel)``. A mean cross-entropy over such a batch divides 0 by 0 tokens."""
        found = []
        for name, micro_batch, dtype, data in self._saved(step):
            if "label" in name.lower() and dtype in ("int64", "int32") and data:
                values = np.frombuffer(data, dtype=dtype)
                if values[0] < 0 and (values == values[0]).all():
                    found.append((name, int(micro_batch), int(values[0]), int(values.size)))
        return found

    def nonfinite_inputs(self, step: int) -> list[tuple[str, int, int, int, int]]:
        """The saved inputs of ``step`` that hold NaN or inf: ``(name, micro_batch, nan, inf,
        numel)`` each, read from their bytes (float16/32/64 and bfloat16); read once a step. An
        input whose only non-finite values are -inf is left out: an additive attention mask holds
        them on purpose."""
        if step in self._nonfinite_inputs:
            return self._nonfinite_inputs[step]
        found = self._nonfinite_inputs[step] = []
        for name, micro_batch, dtype, data in self._saved(step):
            counts = nonfinite_counts(dtype, data)
            if counts is not None and (counts[0] or counts[1] > negative_inf_count(dtype, data)):
                found.append((name, int(micro_batch), *counts))
        return found

    def saved_inputs_text(self, step: int) -> str:
        """A sentence pointing at ``step``'s saved inputs, or "" when the file holds none for it."""
        if step not in self.saved_input_steps:
            return ""
        name = Path(str(self._run.path)).name
        return (f" To run step {step:,} again, its inputs are saved in the run file: `ampwatch batch {name} --step "
                f"{step} --out step{step}.pt` writes them (ampwatch.load_batch in Python).")

    # -- small tables, read whole on first use -----------------------------------------------------

    @cached_property
    def events(self) -> pd.DataFrame:
        return self._run.events

    @cached_property
    def tensors(self) -> pd.DataFrame:
        return self._run.tensors

    @cached_property
    def notices(self) -> pd.DataFrame:
        return self._run.notices

    @cached_property
    def norm_metrics(self) -> pd.DataFrame:
        """Logged metrics whose key contains ``norm`` (any case): step, key, value."""
        df = self._query("SELECT step, key, value FROM metrics WHERE key LIKE '%norm%' ORDER BY step, key")
        df["value"] = df["value"].astype(float)
        return df

    # -- names ---------------------------------------------------------------------------------------

    @cached_property
    def _names(self) -> dict[int, str]:
        return dict(zip(self.tensors["id"].astype(int), self.tensors["name"]))

    def _ids(self, names: Iterable[str]) -> str:
        """The tensor ids named ``names``, as a JSON array for ``IN (SELECT value FROM json_each(?))``."""
        wanted = set(names)
        return json.dumps([i for i, n in self._names.items() if n in wanted])

    def _named(self, df: pd.DataFrame, id_col: str, as_col: str) -> pd.DataFrame:
        df.insert(0, as_col, df.pop(id_col).map(self._names))
        return df

    def module_type(self, name: str) -> Optional[str]:
        """The class of module ``name`` (e.g. ``Linear``), when the run recorded it."""
        t = self.tensors
        row = t[(t["kind"] == "module") & (t["name"] == name)] if len(t) else t
        return row["type"].iloc[0] if len(row) and isinstance(row["type"].iloc[0], str) else None

    def module_label(self, name: str) -> str:
        """``h.0.mlp.fc (Linear)``: the name with its class, when the run recorded it."""
        kind = self.module_type(name)
        return f"{name} ({kind})" if kind else name

    def also(self, name: str) -> str:
        """`` (tied: also transformer.wte.weight)`` for a tied parameter or shared module, else ""."""
        others = self._run.aliases().get(name) if hasattr(self._run, "aliases") else None
        return f" (tied: also {', '.join(others)})" if others else ""

    # -- steps ---------------------------------------------------------------------------------------

    def jump(self, first: int, last: int, pad: int = 10) -> tuple[int, int]:
        return max(self.first_step, first - pad), min(self.last_step, last + pad)

    def finding(self, id: str, severity: str, title: str, first: int, last: int, evidence: str, advice: str,
                jump: Optional[tuple[int, int]] = None) -> Finding:
        """A :class:`Finding` whose UI jump defaults to its steps with a little context."""
        return Finding(id, severity, title, (int(first), int(last)), evidence, advice,
                       jump or self.jump(int(first), int(last)))

    @cached_property
    def _scale(self) -> pd.Series:
        return self.steps.set_index("step")["loss_scale"].astype(float)

    def scale_at(self) -> pd.Series:
        """The loss scale each step's gradients carried, indexed by step."""
        return self._scale

    def scales(self, steps: np.ndarray) -> np.ndarray:
        """The loss scale at each of ``steps`` (NaN where the step has no row)."""
        all_steps = self.steps["step"].to_numpy()
        steps = np.asarray(steps, dtype=np.int64)
        if not len(all_steps):
            return np.full(len(steps), np.nan)
        i = np.clip(np.searchsorted(all_steps, steps), 0, len(all_steps) - 1)
        return np.where(all_steps[i] == steps, self.steps["loss_scale"].to_numpy(dtype=float)[i], np.nan)

    def unlocalized(self, step: int) -> Optional[str]:
        """Why the module where step ``step``'s non-finite values were born is unknown, or None
        when the step was localized (its module values were recorded)."""
        if not self.info.get("localize"):
            return "recorded with localize=False"
        n = self.notices
        if len(n) and ((n["code"] == "replay-not-reproduced") & (n["step"] == step)).any():
            return "the replay of this skipped step did not localize it (notice replay-not-reproduced)"
        if self._conn.execute("SELECT 1 FROM modules WHERE step = ? LIMIT 1", (step,)).fetchone() is None:
            return "no module values were recorded at it"
        return None

    def last_good_step(self, before: int) -> Optional[int]:
        """The last step before ``before`` whose loss was finite and whose update was applied (not
        skipped): the latest state known to have trained normally. None when no step qualifies or
        the loss was not logged."""
        if not self.has_loss:
            return None
        s = self.steps
        ok = s[(s["step"] < before) & ~s["skipped"] & np.isfinite(s["loss"].to_numpy(dtype=float))]
        return int(ok["step"].iloc[-1]) if len(ok) else None

    def after_warmup(self) -> pd.DataFrame:
        """Steps after the warm-up and before a diverged tail: where health is judged."""
        start = self.warmup.last + 1 if self.warmup else self.first_step
        s = self.steps
        return s[(s["step"] >= start) & (s["step"] <= self.healthy_end)]

    def origins(self, steps: Any) -> pd.DataFrame:
        """Where the non-finite values at ``steps`` were born, per (module, phase), most frequent first.

        A non-finite loss counts only on steps without a module origin (it is usually their effect);
        without localization, the parameters with non-finite gradients stand in."""
        ev = self.events
        if not len(ev):
            return pd.DataFrame(columns=["module", "phase", "n", "first"])
        ev = ev[ev["step"].isin(set(steps))]
        born = ev[ev["origin"]]
        loss = ev[(ev["phase"] == "loss") & ~ev["step"].isin(set(born["step"]))]
        picked = pd.concat([born, loss]) if len(loss) else born
        if not len(picked):
            picked = ev[ev["phase"] == "param_grad"]
        g = picked.groupby(["module", "phase"])["step"].agg(n="nunique", first="min").reset_index()
        return g.sort_values(["n", "first"], ascending=[False, True]).reset_index(drop=True)

    # -- the detail tables, one narrow query per question ---------------------------------------------

    def scaled_grad_max(self, first: int, last: int, stop_above: Optional[float] = None) -> Optional[float]:
        """Largest finite scaled gradient value in steps ``[first, last]``: each parameter gradient's
        max |element| times its step's loss scale, and each module's backward max (recorded scaled).
        None when nothing finite was recorded there.

        With ``stop_above``, the first value found above it is returned instead of the maximum: a
        caller that only needs "is it above?" then reads a few rows rather than the whole span."""
        if stop_above is not None:
            found = self._conn.execute(
                f"SELECT l.grad_amax * s.loss_scale FROM layers l JOIN steps s ON s.step = l.step"
                f" WHERE l.step BETWEEN ? AND ? AND (l.nan_mask & ?) = 0 AND l.grad_amax * s.loss_scale > ?"
                f" AND l.param_id IN (SELECT id FROM tensors)"
                f" AND l.grad_amax * s.loss_scale {_FINITE} LIMIT 1",
                (first, last, LAYER_NAN_BITS["grad_amax"], stop_above)).fetchone() or self._conn.execute(
                f"SELECT amax FROM modules WHERE step BETWEEN ? AND ? AND phase = 1 AND amax > ? AND amax {_FINITE}"
                f" AND module_id IN (SELECT id FROM tensors) LIMIT 1", (first, last, stop_above)).fetchone()
            if found:
                return float(found[0])
        values = []
        # One positive scale per step: the step's largest gradient gives its largest product.
        per_step = self._query(f"SELECT step, MAX(grad_amax) AS amax FROM layers WHERE step BETWEEN ? AND ?"
                               f" AND (nan_mask & ?) = 0 AND grad_amax {_FINITE}"
                               f" AND param_id IN (SELECT id FROM tensors) GROUP BY step",
                               (first, last, LAYER_NAN_BITS["grad_amax"]))
        scaled = per_step["amax"].to_numpy(dtype=float) * self.scales(per_step["step"].to_numpy())
        scaled = scaled[np.isfinite(scaled)]
        if len(scaled):
            values.append(float(scaled.max()))
        back, = self._conn.execute(f"SELECT MAX(amax) FROM modules WHERE step BETWEEN ? AND ? AND phase = 1"
                                   f" AND amax {_FINITE} AND module_id IN (SELECT id FROM tensors)",
                                   (first, last)).fetchone()
        if back is not None:
            values.append(float(back))
        return max(values) if values else None

    def measured_grads(self, first: Optional[int], last: int, names: Iterable[str],
                       min_zero_frac: Optional[float] = None) -> pd.DataFrame:
        """Rows of parameters ``names`` in steps ``[first, last]`` (``first`` None: from the start)
        with a finite gradient max and a measured zero fraction, in step order: name, step,
        grad_amax, grad_zero_frac. ``min_zero_frac`` keeps only rows with at least that fraction."""
        # SQLite tests the terms in the order written: the rare one first, the id list last.
        rare, rare_params = ("grad_zero_frac >= ? AND ", (min_zero_frac,)) if min_zero_frac is not None else ("", ())
        sql = (f"SELECT param_id, step, grad_amax, grad_zero_frac FROM layers"
               f" WHERE {rare}step BETWEEN ? AND ? AND (nan_mask & ?) = 0 AND grad_amax {_FINITE} AND grad_zero_frac IS NOT NULL"
               f" AND param_id IN (SELECT value FROM json_each(?)) ORDER BY step, param_id")
        ids = self._ids(names)
        df = self._spread(lambda lo, hi: (sql, rare_params + (lo, hi, LAYER_NAN_BITS["grad_amax"], ids)),
                          first, last)
        df[["grad_amax", "grad_zero_frac"]] = df[["grad_amax", "grad_zero_frac"]].astype(float)
        return self._named(df, "param_id", "name")

    def modules_reaching(self, amax: float, last: int, names: Iterable[str]) -> dict[str, int]:
        """How many finite forward rows of modules ``names`` up to step ``last`` reach ``amax``, by name."""
        ids = self._ids(names)
        df = self._spread(lambda lo, hi: ("SELECT module_id, COUNT(*) AS n FROM modules WHERE amax >= ? AND phase = 0"
                                          " AND nonfinite = 0 AND step BETWEEN ? AND ? AND module_id IN"
                                          " (SELECT value FROM json_each(?)) GROUP BY module_id", (amax, lo, hi, ids)),
                          None, last)
        counts = self._named(df, "module_id", "module").groupby("module")["n"].sum()
        return {str(k): int(v) for k, v in counts.items()}

    def forward_activations(self, last: int, names: Iterable[str], recent: Optional[int] = None) -> pd.DataFrame:
        """Forward rows of modules ``names`` up to step ``last`` without non-finite values, in step
        order: module, step, amax. ``recent``: of the last ``recent`` steps with forward rows only
        (found backwards on the primary key: a 1,000,000-step run's whole history is 7.5M rows)."""
        where = ""
        params: tuple = (last, self._ids(names))
        if recent is not None:
            steps = [r[0] for r in self._conn.execute(
                "SELECT DISTINCT step FROM modules WHERE phase = 0 AND step <= ? ORDER BY step DESC LIMIT ?",
                (last, recent))]
            where, params = " AND step IN (SELECT value FROM json_each(?))", params + (json.dumps(steps),)
        df = self._query("SELECT module_id, step, amax FROM modules WHERE phase = 0 AND nonfinite = 0"
                         " AND step <= ? AND module_id IN (SELECT value FROM json_each(?))" + where +
                         " ORDER BY step, module_id", params)
        df["amax"] = df["amax"].astype(float)
        return self._named(df, "module_id", "module")

    def param_numel(self, name: str) -> Optional[int]:
        """The element count recorded for parameter ``name``; None where it is not known."""
        t = self.tensors
        row = t[(t["kind"] == "param") & (t["name"] == name)]
        if not len(row) or pd.isna(row["numel"].iloc[0]):
            return None
        return int(row["numel"].iloc[0])

    def next_detail_step(self, step: int) -> Optional[int]:
        """The first step at or after ``step`` whose parameter norms were measured (a ``layer_every``
        step or a bad one), or None."""
        row = self._conn.execute("SELECT step FROM layers WHERE step >= ? AND grad_zero_frac IS NOT NULL "
                                 "ORDER BY step LIMIT 1", (step,)).fetchone()
        return None if row is None else int(row[0])

    def lr_sum(self, first: int, last: int) -> Optional[float]:
        """The sum of the learning rates recorded for steps ``first`` to ``last - 1``: the updates
        between a parameter norm measured before step ``first``'s update and one measured before step
        ``last``'s. None where a step of the range has no row or no finite learning rate."""
        n, known, total = self._conn.execute(
            "SELECT COUNT(*), COUNT(lr), SUM(lr) FROM steps WHERE step >= ? AND step < ?", (first, last)).fetchone()
        if n != last - first or known != n or total is None or not math.isfinite(total):
            return None
        return float(total)

    def gradient_reach(self, first: int, last: int, window: int = 100) -> Optional[float]:
        """An upper bound, before any margin, on how far gradient-proportional updates (SGD's lr x
        gradient) move a parameter between a norm measured before step ``first``'s update and one
        measured before step ``last``'s: the learning rates of the applied steps summed, times the
        largest finite gradient norm recorded on applied steps from ``window`` steps before ``first``
        (momentum carries earlier gradients; its 1/(1 - momentum) is left to the caller's margin).
        The global norm bounds every parameter's. Inf where an applied step's gradient was
        non-finite (its update makes anything); None where a step of the range has no row, learning
        rate or measured gradient norm."""
        nan_bit = STEP_NAN_BITS["grad_norm"]
        rows = self._conn.execute(
            "SELECT step, lr, grad_norm, nan_mask & ? FROM steps WHERE step >= ? AND step < ? "
            "AND skipped IS NOT 1", (nan_bit, first - window, last)).fetchall()
        steps_in = self._conn.execute("SELECT COUNT(*) FROM steps WHERE step >= ? AND step < ?",
                                      (first, last)).fetchone()[0]
        if steps_in != last - first:
            return None
        lr_total, largest = 0.0, 0.0
        for step, lr, norm, nan in rows:
            inside = step >= first
            if norm is None and not nan:
                if inside:
                    return None
                continue
            if nan or not math.isfinite(norm):
                if inside:
                    return math.inf
                continue
            largest = max(largest, float(norm))
            if inside:
                if lr is None or not math.isfinite(lr):
                    return None
                lr_total += float(lr)
        return lr_total * largest

    def layer_grad_growth(self, step: int, before: int = 10) -> list[tuple[str, float, float, float]]:
        """Each parameter's gradient norm at ``step`` against its median over the last ``before``
        recorded steps before it that were not skipped: (name, norm, median, share of the step's
        squared norm), the largest growth first. Empty where ``step`` has no layer rows (a healthy
        step between ``layer_every`` steps that did not spike) or nothing was recorded before."""
        df = self._query(
            "SELECT param_id, step, grad_norm FROM layers WHERE grad_norm IS NOT NULL AND (step = ? OR step IN "
            "(SELECT DISTINCT l.step FROM layers l JOIN steps s ON s.step = l.step WHERE l.step < ? AND NOT s.skipped "
            "ORDER BY l.step DESC LIMIT ?))", (step, step, before))
        now, past = df[df["step"] == step], df[df["step"] != step]
        if not len(now) or not len(past):
            return []
        median = past.groupby("param_id")["grad_norm"].median()
        norm = now.set_index("param_id")["grad_norm"].astype(float)
        total = float((norm ** 2).sum())
        out = []
        for pid, value in norm.items():
            m = float(median.get(pid, float("nan")))
            if m > 0 and math.isfinite(value):
                out.append((self._names.get(int(pid), str(pid)), float(value), m,
                            value * value / total if total > 0 else float("nan")))
        return sorted(out, key=lambda r: r[1] / r[2], reverse=True)

    def last_param_norms(self, prefix: str, step: int) -> dict[str, list[tuple[int, float]]]:
        """The last two recorded (step, parameter norm) of each parameter named ``prefix...`` up to
        ``step``, oldest first, by name; NaN for a non-finite norm.

        Reads backwards from ``step`` and stops once every parameter has two."""
        if (prefix, step) in self._norms:
            return self._norms[prefix, step]
        names = {n for n in self.tensors.loc[self.tensors["kind"] == "param", "name"] if n.startswith(prefix)}
        found: dict[str, list[tuple[int, float]]] = {}
        self._norms[prefix, step] = found
        if not names:
            return found
        # grad_zero_frac is present exactly when the step's detail (and so param_norm) was measured:
        # a missing norm must not read as a NaN one.
        cur = self._conn.execute("SELECT param_id, step, CASE WHEN nan_mask & ? THEN NULL ELSE param_norm END"
                                 " FROM layers WHERE param_id IN (SELECT value FROM json_each(?)) AND step <= ?"
                                 " AND grad_zero_frac IS NOT NULL ORDER BY step DESC, param_id DESC",
                                 (LAYER_NAN_BITS["param_norm"], self._ids(names), step))
        full = 0
        for pid, at, norm in cur:
            rows = found.setdefault(self._names[pid], [])
            if len(rows) < 2:
                rows.insert(0, (int(at), float("nan") if norm is None else float(norm)))
                full += len(rows) == 2
                if full == len(names):
                    break
        cur.close()
        return found

