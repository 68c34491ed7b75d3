"""The layers and modules of two runs compared in SQLite (ampwatch/doctor/diff_detail.py) say what
the rules say when worked out in pandas, row by row, over the whole tables: the oracle below is
the rules of docs/doctor.md ("Where two runs part") written the plain way (every row read, merged by
name), as diff.py did before the tables moved into SQLite.

The runs are real run files with the real schema, written with the writer's own INSERTs, then
changed by SQL in the ways runs differ: a layer's gradient from some step on, a blip that comes back,
a weight, NaN and inf values, a row missing in one run, another loss scale (0 and NULL too), names
only one run has."""
from __future__ import annotations

import math
import shutil
import sqlite3

import numpy as np
import pandas as pd
import pytest

import ampwatch
from ampwatch.doctor.diff import diff_runs, parting, rel_diff
from ampwatch.store.writer import _INSERTS, create_run_file

STEPS, EVERY, PARAMS, MODULES = 400, 10, 12, 8


def _build(path):
    rng = np.random.default_rng(0)
    tensors = [{"id": i, "kind": "param", "name": f"b{i // 4}.w{i % 4}", "type": "float32", "shape": "4x4",
                "numel": 16, "trainable": 1} for i in range(PARAMS)]
    names = ["<model>", "b0", "b0.fc", "b0.act", "b1", "b1.fc", "b1.act", "head"]
    tensors += [{"id": PARAMS + m, "kind": "module", "name": n, "type": "Linear"} for m, n in enumerate(names)]
    info = {"name": path.stem, "status": "finished", "started_at": 0.0, "amp_dtype": "float16", "scaler_enabled": 1,
            "layer_every": EVERY, "localize": 1, "schema_version": 1}
    create_run_file(str(path), info, tensors)
    conn = sqlite3.connect(path)
    with conn:
        conn.executemany(_INSERTS["steps"], [(s, 0.0, 0.1, float(rng.random()), 1024.0, 0, float(rng.random()) + 1,
                                              1e-3, 1, 0) for s in range(STEPS)])
        detail = range(0, STEPS, EVERY)
        conn.executemany(_INSERTS["layers"], [(p, s, float(rng.random()), float(rng.random()), float(rng.random()) + 1,
                                               0, 0.0, 0) for s in detail for p in range(PARAMS)])
        conn.executemany(_INSERTS["modules"], [(PARAMS + m, ph, s, float(rng.random()) * 100, 0)
                                               for s in detail for m in range(len(names)) for ph in (0, 1)])
        # a frozen parameter: no gradient in either run (NULL, not NaN: equal, not apart)
        conn.execute("UPDATE layers SET grad_norm = NULL, grad_amax = NULL WHERE param_id = ?", (PARAMS - 1,))
    conn.close()


VARIANTS = {
    "same": [],
    "grad": ["UPDATE layers SET grad_norm = grad_norm * 2 WHERE step >= 200 AND param_id = 7",
             "UPDATE layers SET grad_norm = grad_norm * 1.5 WHERE step >= 200 AND param_id = 3"],
    "blip": ["UPDATE layers SET grad_norm = grad_norm * 3 WHERE step = 50 AND param_id = 5",
             "UPDATE layers SET param_norm = param_norm * 3 WHERE step = 100",
             "UPDATE layers SET param_norm = param_norm * 3 WHERE step >= 300 AND param_id IN (10, 2)"],
    "nan": ["UPDATE layers SET grad_norm = NULL, nan_mask = 1 WHERE step = 120 AND param_id = 4",
            "UPDATE modules SET amax = 9e999, nonfinite = 1 WHERE step = 120 AND phase = 1 AND module_id = 15",
            "UPDATE modules SET amax = amax * 10 WHERE step >= 250 AND phase = 0 AND module_id IN (14, 17)",
            "UPDATE steps SET loss_scale = loss_scale * 2 WHERE step >= 330"],
    "gaps": ["DELETE FROM layers WHERE step = 40 AND param_id = 6",
             "DELETE FROM modules WHERE step >= 390 AND module_id = 13",
             "UPDATE layers SET grad_norm = 9e999 WHERE step = 260 AND param_id = 1",
             "UPDATE steps SET grad_norm = NULL, nan_mask = 2 WHERE step = 260",
             "UPDATE modules SET amax = amax * 1.01 WHERE step >= 280"],
    "scale": ["UPDATE steps SET loss_scale = 0 WHERE step = 180", "UPDATE steps SET loss_scale = NULL WHERE step = 190",
              "UPDATE modules SET amax = 0 WHERE step = 180 AND module_id = 14"],
    "names": ["UPDATE layers SET grad_norm = grad_norm * 2 WHERE step >= 200 AND param_id = 7",
              "UPDATE tensors SET name = 'zz.w' WHERE id = 7", "UPDATE tensors SET name = 'b1.w0' WHERE id = 0",
              "UPDATE tensors SET name = 'b9.w9' WHERE id = 4", "UPDATE tensors SET name = 'mod_x' WHERE id = 15"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pairs")
    _build(folder / "a.sqlite")
    for name, sqls in VARIANTS.items():
        shutil.copy(folder / "a.sqlite", folder / f"{name}.sqlite")
        conn = sqlite3.connect(folder / f"{name}.sqlite")
        with conn:
            for sql in sqls:
                conn.execute(sql)
        conn.close()
    return folder


def _oracle(path_a, path_b, rtol):
    """(names_only, detail_steps, largest, first_layer, first_module) by the rules, in pandas."""
    ra, rb = ampwatch.load(str(path_a)), ampwatch.load(str(path_b))
    sa, sb = ra.steps, rb.steps
    out = {"names_only": {}, "detail_steps": {}, "largest": [], "first_layer": None, "first_module": None}
    la, lb = ra.layers, rb.layers
    out["names_only"]["layers"] = [len(set(la["name"]) - set(lb["name"])), len(set(lb["name"]) - set(la["name"]))]
    m = la.merge(lb, on=["step", "name"], suffixes=("_a", "_b"))
    out["detail_steps"]["layers"] = int(m["step"].nunique())
    order = {n: i for i, n in zip(ra.tensors["id"], ra.tensors["name"])}
    if len(m):
        whole = np.fmax(m["step"].map(sa.set_index("step")["grad_norm"]).abs(),
                        m["step"].map(sb.set_index("step")["grad_norm"]).abs()).where(lambda g: np.isfinite(g))
        rels = {"param_norm": rel_diff(m["param_norm_a"], m["param_norm_b"]),
                "grad_norm": rel_diff(m["grad_norm_a"], m["grad_norm_b"], floor=whole)}
        for f, rel in rels.items():
            if (rel > 0).any():
                i = int(np.argmax(rel))
                out["largest"].append(("layers", f, int(m["step"].iloc[i]), m["name"].iloc[i], None, float(rel[i])))
        parts = {f: parting(m, rel, rtol, ("name",)) for f, rel in rels.items()}
        hit = parts["param_norm"] | parts["grad_norm"]
        if hit.any():
            step = int(m.loc[hit, "step"].min())
            at = (m["step"] == step).to_numpy()
            fig = "param_norm" if (parts["param_norm"] & at).any() else "grad_norm"
            rows = m[parts[fig] & at]
            key = rows["name"].map(order)
            name = rows["name"].iloc[int(np.argmin(key) if fig == "param_norm" else np.argmax(key))]
            i = int(np.flatnonzero((m["name"] == name).to_numpy() & at)[0])
            out["first_layer"] = (fig, step, name, float(rels[fig][i]), int((hit & at).sum()) - 1)
    ma, mb = ra.modules, rb.modules
    for mod, steps in ((ma, sa), (mb, sb)):
        scale = mod["step"].map(steps.set_index("step")["loss_scale"]).fillna(1.0).to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            mod["amax"] = np.where(mod["phase"] == "backward", mod["amax"].to_numpy() / scale, mod["amax"].to_numpy())
    out["names_only"]["modules"] = [len(set(ma["module"]) - set(mb["module"])), len(set(mb["module"]) - set(ma["module"]))]
    m = ma.merge(mb, on=["step", "module", "phase"], suffixes=("_a", "_b"))
    out["detail_steps"]["modules"] = int(m["step"].nunique())
    if len(m):
        rel = rel_diff(m["amax_a"], m["amax_b"])
        rel = np.where(m["nonfinite_a"].to_numpy() != m["nonfinite_b"].to_numpy(), math.inf, rel)
        for phase in ("forward", "backward"):
            only = np.where(m["phase"] == phase, rel, 0.0)
            if (only > 0).any():
                i = int(np.argmax(only))
                out["largest"].append(("modules", "amax", int(m["step"].iloc[i]), m["module"].iloc[i], phase,
                                       float(only[i])))
        hit = parting(m, rel, rtol, ("module", "phase"))
        if hit.any():
            step = int(m.loc[hit, "step"].min())
            at = hit & (m["step"] == step).to_numpy()
            for phase, first in (("forward", True), ("backward", False)):
                rows = m[at & (m["phase"] == phase).to_numpy()]
                if rows.empty:
                    continue
                names = set(rows["module"])
                # innermost: no other parting module lies inside it (everything lies inside the root)
                inner = [n for n in rows["module"]
                         if not any(o != n and (n == "<model>" or o.startswith(n + ".")) for o in names)]
                name = sorted(inner, key=order.get, reverse=not first)[0]
                out["first_module"] = (phase, step, name, int(at.sum()) - 1)
                break
    return out


def _said(d):
    """The same items from what diff_runs returned."""
    fl, fm = d.first_layer, d.first_module
    return {"names_only": {k: list(v) for k, v in d.names_only.items()}, "detail_steps": d.detail_steps,
            "largest": [(g.table, g.figure, g.step, g.where, g.phase, g.rel) for g in d.largest if g.table != "steps"],
            "first_layer": fl and (fl.figure, fl.step, fl.where, fl.rel, fl.others),
            "first_module": fm and (fm.phase, fm.step, fm.where, fm.others)}


@pytest.mark.parametrize("rtol", [1e-9, 0.2])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_sqlite_says_what_the_rules_say_in_pandas(runs, variant, rtol):
    for a, b in ((runs / "a.sqlite", runs / f"{variant}.sqlite"), (runs / f"{variant}.sqlite", runs / "a.sqlite")):
        assert _said(diff_runs(a, b, rtol=rtol)) == _oracle(a, b, rtol), (a.name, b.name)


def test_the_variants_cover_what_they_are_for(runs):
    """Not vacuous: the variants part where they were changed, come back where they blipped, and
    name what only one run has."""
    grad = diff_runs(runs / "a.sqlite", runs / "grad.sqlite", rtol=1e-9)
    assert grad.first_layer.step == 200 and grad.first_layer.where == "b1.w3"  # the last parting layer
    blip = diff_runs(runs / "a.sqlite", runs / "blip.sqlite", rtol=0.2)
    assert blip.first_layer.step == 300 and blip.first_layer.figure == "param_norm"  # 50 and 100 came back
    nan = diff_runs(runs / "a.sqlite", runs / "nan.sqlite", rtol=0.2)
    assert nan.first_module.step == 120 and nan.first_module.phase == "backward" and math.isinf(nan.first_module.rel)
    assert diff_runs(runs / "a.sqlite", runs / "names.sqlite").names_only == {"layers": (2, 2), "modules": (1, 1)}
    assert not diff_runs(runs / "a.sqlite", runs / "same.sqlite").parted
    scale = diff_runs(runs / "a.sqlite", runs / "scale.sqlite", rtol=0.2)
    assert scale.first_module.step == 180
