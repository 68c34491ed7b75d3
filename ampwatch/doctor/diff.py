"""Where two recorded runs part: the first step, layer and module whose recorded figures differ
beyond a tolerance, and the run settings that differ. Reads both runs read-only; prints nothing.

Steps are aligned by step number and compared only where both runs recorded them (layers and
modules on the steps both recorded detail for), so runs of different lengths, dtypes or compile
modes are compared on what they share. The rules, measured, are in docs/doctor.md ("Where two runs
part").

>>> d = diff_runs("runs/eager.sqlite", "runs/compiled.sqlite")
>>> d.parted, d.first_step, d.first_layer, d.first_module, d.settings
"""
from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import pandas as pd

from ..store.reader import Run, paired
from ..store.schema import MODULE_PHASES
from .diff_detail import Compared

# Run-row fields whose difference can explain why two runs' numbers differ (times, pid, status and
# the run's name cannot).
RUN_FIELDS = ("amp_dtype", "scaler_enabled", "init_scale", "growth_factor", "backoff_factor", "growth_interval",
              "loss_definition", "clip_max_norm", "optimizer", "param_count", "torch_version", "ampwatch_version",
              "device", "hostname", "world_size", "grad_sharding", "framework", "layer_every", "localize",
              "fp8_recipe", "fp8_casts", "fp8_layers")

# Explicit mantissa bits of the dtypes a run can compute in. The default tolerance is ULPS units in
# the last place of the coarser dtype of the two runs: one step of rounding in float16 or bfloat16
# moves the figures compared here by a few units (measured: at most 1e-3 apart for float16 vs
# float32 and 3.5e-2 for bfloat16 vs float32 over a tiny MLP's first steps), so ten keep that noise
# out until it grows. An fp8 run's ``amp_dtype`` is "float8": its forward format, e4m3. A float name
# not listed is taken as bfloat16-coarse.
MANTISSA_BITS = {"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7, "float8": 3, "float8_e4m3fn": 3,
                 "float8_e4m3fnuz": 3, "float8_e5m2": 2, "float8_e5m2fnuz": 2}
ULPS = 10
# A long float32 sum taken in another order (torch.compile, another torch, another device) can
# move by more than ten float32 units: the floor keeps that out (a choice, not a measurement).
RTOL_FLOOR = 1e-4
RTOL_CAP = 0.5

ROOT_MODULE = "<model>"


@dataclass(frozen=True)
class Gap:
    """One recorded figure that differs between run a and run b at one step.

    ``table``: steps, layers or modules; ``figure``: the column (loss, grad_norm, loss_scale,
    skipped, param_norm, amax); ``rel``: ``|a - b| / max(|a|, |b|)``, inf when only one is finite,
    None for ``skipped``; ``where``: the layer (parameter) or module; ``phase``: a module's forward
    or backward (backward maxima divided by each run's loss scale of the step); ``others``: how
    many other layers or modules part at the same step."""
    table: str
    figure: str
    step: int
    a: Any
    b: Any
    rel: Optional[float]
    where: Optional[str] = None
    phase: Optional[str] = None
    others: int = 0

    @property
    def ratio(self) -> Optional[float]:
        """b / a, when both are finite numbers and a is not 0."""
        if isinstance(self.a, bool) or not _finite(self.a) or not _finite(self.b) or self.a == 0:
            return None
        return float(self.b) / float(self.a)

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.table, "figure": self.figure, "step": self.step, "where": self.where,
                "phase": self.phase, "a": _plain(self.a), "b": _plain(self.b), "rel": _plain(self.rel),
                "ratio": _plain(self.ratio), "others": self.others}


@dataclass
class RunDiff:
    """What :func:`diff_runs` found. ``parted``: some recorded figure differs beyond tolerance."""
    names: tuple[str, str]
    paths: tuple[str, str]
    rtol: float
    rtol_source: str  # "given", or the dtype the default came from
    settings: list[tuple[str, Any, Any]]
    steps_shared: int
    steps_only: tuple[list[int], list[int]]  # [count, first, last] of the steps one run alone recorded
    detail_steps: dict[str, int]  # layers/modules: steps both runs recorded that table on
    names_only: dict[str, tuple[int, int]]  # layers/modules: names only a, only b has
    not_compared: list[str]  # step figures one run never recorded
    first_step: list[Gap] = field(default_factory=list)
    first_layer: Optional[Gap] = None
    first_module: Optional[Gap] = None
    largest: list[Gap] = field(default_factory=list)

    @property
    def parted(self) -> bool:
        return self.parting_step is not None

    @property
    def parting_step(self) -> Optional[int]:
        """The first step at which any compared figure parts (steps, layers or modules), or None."""
        steps = [g.step for g in (self.first_step[:1] + [self.first_layer, self.first_module]) if g is not None]
        return min(steps) if steps else None

    def to_dict(self) -> dict[str, Any]:
        return {"a": {"name": self.names[0], "path": self.paths[0]},
                "b": {"name": self.names[1], "path": self.paths[1]},
                "parted": self.parted, "parting_step": self.parting_step,
                "rtol": self.rtol, "rtol_source": self.rtol_source,
                "settings": [{"field": f, "a": _plain(a), "b": _plain(b)} for f, a, b in self.settings],
                "steps_shared": self.steps_shared,
                "steps_only_a": self.steps_only[0], "steps_only_b": self.steps_only[1],
                "detail_steps": self.detail_steps, "names_only": self.names_only, "not_compared": self.not_compared,
                "first_step": [g.to_dict() for g in self.first_step],
                "first_layer": self.first_layer.to_dict() if self.first_layer else None,
                "first_module": self.first_module.to_dict() if self.first_module else None,
                "largest": [g.to_dict() for g in self.largest]}


def diff_runs(a: Any, b: Any, rtol: Optional[float] = None) -> RunDiff:
    """Compare two runs (:class:`ampwatch.Run` objects or run file paths).

    :param rtol: relative tolerance for float figures (loss, grad norms, parameter norms, module
        maxima); default: :func:`default_rtol`. ``skipped`` and the loss scale compare exactly.

    Reads the steps and tensors tables of both runs into pandas; the layers and modules tables
    are matched and reduced in SQLite (:mod:`ampwatch.doctor.diff_detail`).
    """
    run_a, run_b = _run(a), _run(b)
    if rtol is not None:
        tol, source = float(rtol), "given"
    else:
        tol, dtype = default_rtol(run_a, run_b)
        source = dtype or "float32"
    # the detail tables, each matched and reduced in SQLite on a connection and thread of its own
    # (SQLite lets go of the GIL while it steps), while this thread reads and compares the steps
    run_a.tensors, run_b.tensors  # read once, before the threads share the runs' caches
    with ThreadPoolExecutor(2) as pool:
        details = {table: pool.submit(_compare_detail, table, run_a.path, run_b.path, run_a, run_b, tol)
                   for table in ("layers", "modules")}
        sa, sb = run_a.steps, run_b.steps
        only_a, only_b = sorted(set(sa["step"]) - set(sb["step"])), sorted(set(sb["step"]) - set(sa["step"]))
        d = RunDiff(names=(run_a.name, run_b.name), paths=(str(run_a.path), str(run_b.path)), rtol=tol,
                    rtol_source=source, settings=run_settings(run_a.info, run_b.info),
                    steps_shared=len(set(sa["step"]) & set(sb["step"])), steps_only=(_span(only_a), _span(only_b)),
                    detail_steps={}, names_only={}, not_compared=[])
        both_scaled = bool(run_a.info.get("scaler_enabled")) and bool(run_b.info.get("scaler_enabled"))
        _compare_steps(d, sa, sb, both_scaled)
        for table, job in details.items():
            got = job.result()
            d.names_only[table], d.detail_steps[table] = got.names_only, got.steps
            d.largest += got.largest
            if table == "layers":
                d.first_layer = got.first
            else:
                d.first_module = got.first
    return d


def default_rtol(run_a: Run, run_b: Run) -> tuple[float, Optional[str]]:
    """(tolerance, the dtype it came from): ULPS units in the last place of the coarsest dtype either
    run computed in (its autocast dtype and its parameters' dtypes), within [RTOL_FLOOR, RTOL_CAP]."""
    names = set()
    for run in (run_a, run_b):
        names.add(run.info.get("amp_dtype") or "float32")
        tensors = run.tensors
        names.update(str(t) for t in tensors.loc[tensors["kind"] == "param", "type"].dropna())
    floats = [n for n in names if "float" in n]
    if not floats:
        return RTOL_FLOOR, None
    coarse = min(floats, key=lambda n: MANTISSA_BITS.get(n, MANTISSA_BITS["bfloat16"]))
    bits = MANTISSA_BITS.get(coarse, MANTISSA_BITS["bfloat16"])
    return float(min(RTOL_CAP, max(RTOL_FLOOR, ULPS * 2.0 ** -bits))), coarse


def run_settings(info_a: dict[str, Any], info_b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, a, b) for each run-row field and ``config.<key>`` that differs."""
    out = [(f, info_a.get(f), info_b.get(f)) for f in RUN_FIELDS if not _same(info_a.get(f), info_b.get(f))]
    ca, cb = info_a.get("config") or {}, info_b.get("config") or {}
    for key in sorted(set(ca) | set(cb), key=str):
        va, vb = ca.get(key), cb.get(key)
        if json.dumps(va, sort_keys=True, default=str) != json.dumps(vb, sort_keys=True, default=str):
            out.append((f"config.{key}", va, vb))
    return out


def rel_diff(a: Any, b: Any, floor: Any = None) -> np.ndarray:
    """``|a - b| / max(|a|, |b|, floor)`` elementwise: 0 where equal (both NaN, the same infinity,
    both 0 included), inf where only one is finite or they are infinities of opposite sign. A NaN
    ``floor`` is ignored."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    finite = np.isfinite(a) & np.isfinite(b)
    scale = np.maximum(np.abs(a), np.abs(b))
    if floor is not None:
        scale = np.fmax(scale, np.abs(np.asarray(floor, dtype=float)))
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.abs(a - b) / scale
    return np.where(same, 0.0, np.where(finite, rel, math.inf))


def parting(frame: pd.DataFrame, rel: np.ndarray, rtol: float, keys: tuple = ()) -> np.ndarray:
    """Rows where a figure parts: beyond ``rtol`` there and still beyond it at the next step both
    runs recorded it (the same ``keys``: layer, module and phase), or at its last such step; or
    finite in one run only. A difference beyond tolerance for one step that comes back is rounding
    meeting a threshold (a ReLU flipping, a sum that nearly cancels); a difference that has grown
    stays, and so does one in the weights."""
    df = frame[list(keys) + ["step"]].assign(beyond=rel > rtol).sort_values(list(keys) + ["step"])
    nxt = df.groupby(list(keys), sort=False)["beyond"].shift(-1) if keys else df["beyond"].shift(-1)
    held = df["beyond"] & nxt.astype(object).where(nxt.notna(), True).astype(bool)
    return held.reindex(frame.index).to_numpy() | np.isinf(rel)


def _compare_steps(d: RunDiff, sa: pd.DataFrame, sb: pd.DataFrame, both_scaled: bool) -> None:
    m = sa.merge(sb, on="step", suffixes=("_a", "_b"))
    parts: dict[str, np.ndarray] = {}
    rels: dict[str, np.ndarray] = {}
    for fig in ("loss", "grad_norm"):
        if sa[fig].isna().all() or sb[fig].isna().all():  # one run never recorded it
            d.not_compared.append(fig)
            continue
        rels[fig] = rel_diff(m[f"{fig}_a"], m[f"{fig}_b"])
        parts[fig] = parting(m, rels[fig], d.rtol)
        _keep_largest_step(d, m, rels[fig], fig)
    if both_scaled:  # exact: a scale is a power of two moved by the scaler's own rule
        rels["loss_scale"] = rel_diff(m["loss_scale_a"], m["loss_scale_b"])
        parts["loss_scale"] = rels["loss_scale"] > 0
    parts["skipped"] = (m["skipped_a"] != m["skipped_b"]).to_numpy()
    hit = np.logical_or.reduce(list(parts.values())) if len(m) else np.zeros(0, bool)
    if not hit.any():
        return
    i = int(np.argmax(hit))
    row = m.iloc[i]
    for fig, part in parts.items():
        if part[i]:
            d.first_step.append(Gap("steps", fig, int(row["step"]), _value(row[f"{fig}_a"]), _value(row[f"{fig}_b"]),
                                    None if fig == "skipped" else float(rels[fig][i])))


@dataclass
class _Detail:
    """What one detail table of the pair says (its part of a RunDiff)."""
    names_only: tuple[int, int] = (0, 0)
    steps: int = 0
    largest: list[Gap] = field(default_factory=list)
    first: Optional[Gap] = None


def _compare_detail(table: str, path_a: Any, path_b: Any, run_a: Run, run_b: Run, rtol: float) -> _Detail:
    """Layers or modules, on a connection of their own (the two run on two threads)."""
    kind = "param" if table == "layers" else "module"
    names_a, names_b = _names(run_a, kind), _names(run_b, kind)
    out = _Detail()
    with paired(path_a, path_b) as conn:  # matched and reduced in SQLite
        c = Compared(conn, table, _pairs(names_a, names_b), rtol)
        in_a = {names_a[i] for i in c.ids_in("main") if i in names_a}
        in_b = {names_b[i] for i in c.ids_in("b") if i in names_b}
        out.names_only = (len(in_a - in_b), len(in_b - in_a))
        out.steps, largest = c.largest()
        if not out.steps:
            return out
        out.largest = [Gap(table, fig, row.step, *row.values[fig], where=names_a[row.id],
                           phase=None if phase is None else MODULE_PHASES[phase])
                       for (fig, phase), row in largest.items()]
        # no row beyond the tolerance (the largest difference within it): nothing parts, no scan
        beyond = any(row.values[fig][2] > rtol for (fig, _), row in largest.items())
        found = c.first_parting() if beyond else None
    if found is not None:
        out.first = (_first_layer if table == "layers" else _first_module)(*found, names_a)
    return out


def _first_layer(step: int, marked: list, names: dict[int, str]) -> Gap:
    # Parameter norms are taken before the step's update: one that differs is a weight the runs
    # entered the step with differently, the cause rather than a consequence. Otherwise the layer
    # where backward parted: gradients run from the loss back, so a difference entering at one
    # layer reaches every layer before it, and the last parting layer in model order is first
    # (run a's ids follow named_parameters).
    weights = [row for row, parts in marked if parts["param_norm"]]
    if weights:
        fig, row = "param_norm", min(weights, key=lambda r: r.id)
    else:
        fig, row = "grad_norm", max((r for r, parts in marked if parts["grad_norm"]), key=lambda r: r.id)
    return Gap("layers", fig, step, *row.values[fig], where=names[row.id],
               others=sum(any(parts.values()) for _, parts in marked) - 1)


def _first_module(step: int, marked: list, names: dict[int, str]) -> Optional[Gap]:
    # Module maxima: backward ones divided by each run's loss scale of the step (recorded scaled,
    # as they overflow), so runs with different scales, or none, compare (diff_detail.py). Forward
    # runs before backward. A container's maximum parts whenever a child's does, so the innermost
    # parting modules are the candidates: in forward the first in model order, in backward (which
    # runs the model in reverse) the last.
    at = [row for row, parts in marked if parts["amax"]]
    for phase, first in ((0, True), (1, False)):
        rows = [r for r in at if r.phase == phase]
        if not rows:
            continue
        inside = {names[r.id] for r in rows}
        inner = [r for r in rows if not any(_inside(o, names[r.id]) for o in inside)]
        row = min(inner, key=lambda r: r.id) if first else max(inner, key=lambda r: r.id)
        return Gap("modules", "amax", step, *row.values["amax"], where=names[row.id], phase=MODULE_PHASES[phase],
                   others=len(at) - 1)
    return None


def _keep_largest_step(d: RunDiff, m: pd.DataFrame, rel: np.ndarray, fig: str) -> None:
    """Remember the largest difference of a step figure over the shared steps (none if all are equal)."""
    if not len(rel) or not (rel > 0).any():
        return
    i = int(np.argmax(rel))
    row = m.iloc[i]
    d.largest.append(Gap("steps", fig, int(row["step"]), _value(row[f"{fig}_a"]), _value(row[f"{fig}_b"]),
                         float(rel[i])))


def _names(run: Run, kind: str) -> dict[int, str]:
    """Run's ids -> names of one kind of tensor (param or module)."""
    t = run.tensors
    t = t[t["kind"] == kind]
    return dict(zip(t["id"].astype(int), t["name"]))


def _pairs(names_a: dict[int, str], names_b: dict[int, str]) -> list[tuple[int, int]]:
    """(run a's id, run b's id) of each name both runs have."""
    ids_b = {name: i for i, name in names_b.items()}
    return [(i, ids_b[name]) for i, name in names_a.items() if name in ids_b]


def _inside(child: str, parent: str) -> bool:
    if child == parent:
        return False
    return parent == ROOT_MODULE or child.startswith(parent + ".")


def _run(x: Any) -> Run:
    return Run(x) if isinstance(x, (str, bytes, os.PathLike)) else x


def _span(steps: list) -> list[int]:
    return [len(steps), int(steps[0]), int(steps[-1])] if steps else [0, 0, 0]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float, np.floating, np.integer)) and math.isfinite(float(x))


def _value(x: Any) -> Any:
    """A pandas/numpy cell as a plain Python value."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x)
    return None if x is None or x is pd.NA else x


def _plain(x: Any) -> Any:
    """JSON-safe: NaN and infinities as the strings 'nan', 'inf', '-inf'."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


__all__ = ["diff_runs", "default_rtol", "run_settings", "rel_diff", "parting", "RunDiff", "Gap", "MANTISSA_BITS",
           "ULPS", "RTOL_FLOOR", "RTOL_CAP"]
