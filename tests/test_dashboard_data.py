"""Dashboard data access against SQLite read directly: downsampling never hides a spike, NaN or skip."""
from __future__ import annotations

import hashlib
import math
import sqlite3
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ampwatch.dashboard import rundata

from ampwatch.dashboard import layerdata
from ampwatch.errors import RunError
from ampwatch.store.schema import LAYER_NAN_BITS, STEP_NAN_BITS
from ampwatch.store.writer import _INSERTS, create_run_file
from helpers.sqltruth import sql_frame as _sql

SAMPLES = sorted(Path(__file__).resolve().parent.parent.glob("sample_runs/*.sqlite"))


def _truth_steps(path: Path) -> pd.DataFrame:
    df = _sql(path, "SELECT * FROM steps ORDER BY step")
    for col, bit in STEP_NAN_BITS.items():
        df[col] = df[col].astype(float).where((df["nan_mask"] & bit) == 0, math.nan)
    df["nonfinite"] = ~np.isfinite(df["loss"].fillna(0)) | ~np.isfinite(df["grad_norm"].fillna(0)) \
        | ((df["nan_mask"] & 3) != 0)
    return df


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """A real fp16 TinyGPT run: warm-up skips, then a burst of forward overflow (skips, NaN/inf events)."""
    from ampwatch.samples import demo
    path = tmp_path_factory.mktemp("real") / "burst.sqlite"
    demo.train(path, 80, init_scale=2.0 ** 24, growth_interval=10, layer_every=5,
               fault=demo._activation_burst("h.0.mlp.fc", 40, 46, 1e5))
    return path


def _synthetic(path: Path, steps: int, *, params: int = 0, layer_every: int = 20, spike: int = -1,
               nan_step: int = -1, skip_step: int = -1, layer_spike: tuple = (), layer_nan: tuple = ()) -> Path:
    """A run with the real schema (create_run_file) and rows written fast with executemany."""
    tensors = [{"id": i, "kind": "param", "name": f"layer{i}.weight", "type": "float32", "numel": 100,
                "trainable": 1} for i in range(params)]
    create_run_file(str(path), {"name": path.stem, "status": "finished", "started_at": time.time(),
                                "amp_dtype": "float16", "layer_every": layer_every, "schema_version": 1,
                                "config": {"max_grad_norm": 2.0}}, tensors)
    rng = np.random.default_rng(0)
    s = np.arange(steps)
    loss = (1.0 + 0.1 * rng.random(steps)).tolist()
    mask = [0] * steps
    skipped = [0] * steps
    if spike >= 0:
        loss[spike] = 1e6
    if nan_step >= 0:
        loss[nan_step], mask[nan_step], skipped[nan_step] = None, STEP_NAN_BITS["loss"], 1
    if skip_step >= 0:
        skipped[skip_step] = 1
    norms = (1 + rng.random(steps)).tolist()
    for st_, _ in layer_nan:  # as the writer does: a NaN layer norm makes the step's total norm NaN
        norms[st_], mask[st_], skipped[st_] = None, mask[st_] | STEP_NAN_BITS["grad_norm"], 1
    rows = list(zip(s.tolist(), s.tolist(), [0.1] * steps, loss, [65536.0] * steps, skipped,
                    norms, [1e-3] * steps, [1] * steps, mask))
    conn = sqlite3.connect(path)
    with conn:
        conn.executemany(_INSERTS["steps"], rows)
        if params:
            ls = np.arange(0, steps, layer_every)
            step_col, pid = np.repeat(ls, params), np.tile(np.arange(params), len(ls))
            norm = rng.random(len(step_col)).tolist()
            lmask = [0] * len(norm)
            for st_, p_, v in layer_spike:
                norm[int(np.flatnonzero((step_col == st_) & (pid == p_))[0])] = v
            for st_, p_ in layer_nan:
                i = int(np.flatnonzero((step_col == st_) & (pid == p_))[0])
                norm[i], lmask[i] = None, LAYER_NAN_BITS["grad_norm"]
            conn.executemany(_INSERTS["layers"], zip(pid.tolist(), step_col.tolist(), norm, norm, norm,
                                                     [0] * len(norm), [0.25] * len(norm), lmask))
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    return path


@pytest.fixture(scope="module")
def million(tmp_path_factory) -> Path:
    """1,000,000 steps with one loss spike, one NaN step and one lone skipped step."""
    return _synthetic(tmp_path_factory.mktemp("big") / "million.sqlite", 1_000_000,
                      spike=654_321, nan_step=400_003, skip_step=777_777)


def test_million_steps_keep_the_spike_the_nan_and_the_skip(million):
    ov = rundata.overview_data(million)
    s = ov.steps
    assert ov.bucket > 1 and len(s) < 20 * rundata.STEP_BUCKETS  # really downsampled
    assert s.loc[s["loss"].idxmax(), "step"] == 654_321 and s["loss"].max() == 1e6
    assert list(ov.nonfinite_steps) == [400_003]
    assert list(ov.skipped_steps) == [400_003, 777_777]
    truth = _sql(million, "SELECT MIN(loss) lo, MAX(grad_norm) gmax, MIN(grad_norm) gmin FROM steps").iloc[0]
    assert s["loss"].min() == truth["lo"] and s["grad_norm"].max() == truth["gmax"]
    assert s["grad_norm"].min() == truth["gmin"]
    assert s["step"].iloc[0] == 0 and s["step"].iloc[-1] == 999_999


def test_zoomed_range_is_exact(million):
    ov = rundata.overview_data(million, 654_000, 654_500)
    assert ov.bucket == 1 and list(ov.steps["step"]) == list(range(654_000, 654_501))


def test_real_run_downsampled_keeps_extremes_nans_and_skips(real_run):
    truth = _truth_steps(real_run)
    ov = rundata.overview_data(real_run, buckets=8)  # 80 steps in 8 buckets: forces downsampling
    assert ov.bucket == 10
    s = ov.steps.set_index("step")
    assert set(truth["step"][truth["skipped"] == 1]) == set(ov.skipped_steps) <= set(s.index)
    assert set(truth["step"][truth["nonfinite"]]) == set(ov.nonfinite_steps) <= set(s.index)
    assert truth["skipped"].sum() > 5 and truth["nonfinite"].sum() > 0  # the run really has both
    for col in ("loss", "grad_norm", "lr", "loss_scale"):
        finite = truth[np.isfinite(truth[col])]
        for pick in (finite[col].idxmin(), finite[col].idxmax()):
            step = int(truth.loc[pick, "step"])
            assert s.loc[step, col] == truth.loc[pick, col], (col, step)
    # every kept row carries its true values
    merged = ov.steps.merge(truth, on="step", suffixes=("", "_t"))
    assert np.allclose(merged["loss"], merged["loss_t"], equal_nan=True)


def test_too_many_marks_still_mark_every_bucket(real_run, monkeypatch):
    """Past EXACT_MARKS_LIMIT skipped steps, each bucket keeps its first and last one (a tiny limit forces it)."""
    monkeypatch.setattr(rundata, "EXACT_MARKS_LIMIT", 3)
    truth = _truth_steps(real_run)
    ov = rundata.overview_data(real_run, buckets=8)
    skipped = truth["step"][truth["skipped"] == 1].to_numpy()
    buckets = skipped // ov.bucket
    ends = {int(skipped[buckets == b].min()) for b in set(buckets)} | {int(skipped[buckets == b].max())
                                                                       for b in set(buckets)}
    assert ends <= set(ov.skipped_steps) <= set(skipped)
    assert {s // ov.bucket for s in ov.skipped_steps} == set(buckets)  # every bucket with a skip is marked
    assert len(ov.skipped_steps) < len(skipped)


def test_scale_changes_match_sqlite(real_run):
    truth = _truth_steps(real_run)
    prev = truth["loss_scale"].shift()
    changed = truth[(truth["loss_scale"] != prev) & prev.notna()]
    ov = rundata.overview_data(real_run)
    assert list(ov.scale_changes["step"]) == list(changed["step"])
    kinds = np.where(changed["loss_scale"] < prev[changed.index], "backoff", "growth")
    assert list(ov.scale_changes["kind"]) == list(kinds)
    assert "backoff" in kinds and "growth" in kinds
    assert ov.clip_threshold == 1.0  # demo.train's config max_grad_norm


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_run_row_matches_sqlite(path):
    row = rundata.run_row(path)
    t = _truth_steps(path)
    assert row["steps"] == len(t) and row["skipped"] == int(t["skipped"].sum())
    last = t.iloc[-1]
    assert row["final_scale"] == (None if pd.isna(last["loss_scale"]) else last["loss_scale"])
    assert (math.isnan(row["last_loss"]) and math.isnan(last["loss"])) or row["last_loss"] == last["loss"]
    # warm-up (the leading skipped steps) gradient overflow does not count; a NaN loss does
    clean = t["step"][~t["skipped"].astype(bool)]
    warm = int(clean.min()) if len(clean) else int(t["step"].min())
    ev = _sql(path, "SELECT MIN(step) s FROM events WHERE step >= ? OR phase IN ('forward', 'loss')",
              (warm,))["s"].iloc[0]
    nf = t["step"][t["nonfinite"] & ((t["step"] >= warm) | ~np.isfinite(t["loss"].astype(float)))].min()
    firsts = [int(x) for x in [nf, ev] if pd.notna(x)]
    assert row["first_nonfinite_step"] == (min(firsts) if firsts else None)


def test_runs_table_lists_unreadable_files_with_reason(tmp_path):
    import shutil
    shutil.copy(SAMPLES[0], tmp_path / SAMPLES[0].name)
    (tmp_path / "empty.sqlite").write_bytes(b"")
    (tmp_path / "text.sqlite").write_text("not a database")
    foreign = sqlite3.connect(tmp_path / "foreign.sqlite")
    foreign.execute("CREATE TABLE t (x)")
    foreign.commit()
    foreign.close()
    head = SAMPLES[0].read_bytes()
    (tmp_path / "truncated.sqlite").write_bytes(head[:4096])
    runs, bad = rundata.runs_table(tmp_path)
    assert list(runs["file"]) == [SAMPLES[0].name]
    reasons = dict(bad)
    assert set(reasons) == {"empty.sqlite", "text.sqlite", "foreign.sqlite", "truncated.sqlite"}
    assert "empty file" in reasons["empty.sqlite"] and "another tool" in reasons["foreign.sqlite"]
    with pytest.raises(RunError, match="no folder"):
        rundata.runs_table(tmp_path / "missing")


def test_zero_step_run(tmp_path):
    path = _synthetic(tmp_path / "zero.sqlite", 0)
    assert rundata.run_row(path)["steps"] == 0
    ov = rundata.overview_data(path)
    assert ov.steps.empty and ov.first is None
    assert layerdata.layer_heatmap(path).values.size == 0
    assert layerdata.module_headroom(path).empty


def test_heatmap_keeps_a_single_layer_spike_and_nan(tmp_path):
    path = _synthetic(tmp_path / "layers.sqlite", 200_000, params=12, layer_every=20,
                      layer_spike=((123_460, 7, 5e4),), layer_nan=((88_880, 3),))
    grid = layerdata.layer_heatmap(path, buckets=50)
    assert grid.values.shape == (12, 50) and grid.width == 4000
    r, c = np.unravel_index(np.nanargmax(grid.values), grid.values.shape)
    assert (grid.names[r], grid.bucket_starts[c]) == ("layer7.weight", 120_000) and grid.values[r, c] == 5e4
    assert list(zip(*np.nonzero(grid.nonfinite))) == [(3, 88_880 // 4000)]
    truth = _sql(path, "SELECT param_id, MAX(grad_norm) m FROM layers GROUP BY param_id")
    assert np.allclose(np.nanmax(grid.values, axis=1), truth["m"])


def test_layers_real_run_match_sqlite(real_run):
    grid = layerdata.layer_heatmap(real_run, "grad_norm", buckets=1000)
    assert grid.width == 1
    t = _sql(real_run, "SELECT l.step, t.name, l.grad_norm, l.nan_mask FROM layers l JOIN tensors t"
                       " ON t.id = l.param_id")
    cell = t.iloc[len(t) // 2]
    col = int(np.flatnonzero(grid.bucket_starts == cell["step"])[0])
    assert grid.values[grid.names.index(cell["name"]), col] == pytest.approx(cell["grad_norm"])
    bad = t[(t["nan_mask"] != 0) | ~np.isfinite(t["grad_norm"].fillna(0))]
    marked = {(grid.names[r], int(grid.bucket_starts[c])) for r, c in zip(*np.nonzero(grid.nonfinite))}
    assert marked == set(zip(bad["name"], bad["step"]))

    zero = layerdata.zero_grad_fraction(real_run).set_index("layer")
    zt = _sql(real_run, "SELECT t.name, AVG(grad_zero_frac) m, MAX(grad_zero_frac) x, COUNT(grad_zero_frac) n"
                        " FROM layers l JOIN tensors t ON t.id = l.param_id GROUP BY t.name").set_index("name")
    assert np.allclose(zero.loc[zt.index, "zero_frac_mean"], zt["m"])
    assert np.allclose(zero.loc[zt.index, "zero_frac_max"], zt["x"])
    assert (zero.loc[zt.index, "detail_steps"] == zt["n"]).all()


def test_param_norm_heatmap_shows_the_jump_where_gradients_overflow():
    # diverged: h.1.mlp.fc.weight's norm jumps 1e5x at step 180, where every gradient is NaN/inf
    run = Path(__file__).resolve().parent.parent / "sample_runs" / "diverged.sqlite"
    grid = layerdata.layer_heatmap(run, "param_norm")
    t = _sql(run, "SELECT l.step, l.param_norm FROM layers l JOIN tensors t ON t.id = l.param_id"
                  " WHERE t.name = 'h.1.mlp.fc.weight' ORDER BY l.step")
    assert grid.width == 1 and list(grid.bucket_starts) == t["step"].tolist()
    row = grid.names.index("h.1.mlp.fc.weight")
    assert np.allclose(grid.values[row], t["param_norm"]) and not grid.nonfinite.any()
    after = t["step"] >= 180
    assert t["param_norm"][after].min() > 1e4 * t["param_norm"][~after].iloc[-1]  # the jump is there to see
    assert layerdata.layer_heatmap(run, "grad_norm").nonfinite[:, grid.bucket_starts >= 180].all()


def test_headroom_matches_sqlite(real_run):
    df = layerdata.module_headroom(real_run, buckets=7)
    t = _sql(real_run, "SELECT t.name module, CASE m.phase WHEN 0 THEN 'forward' ELSE 'backward' END phase,"
                       " MAX(m.amax) amax, SUM(m.nonfinite) bad FROM modules m JOIN tensors t ON t.id = m.module_id"
                       " GROUP BY 1, 2")
    merged = df.merge(t, on=["module", "phase"], suffixes=("", "_t"))
    assert len(merged) == len(t) and np.allclose(merged["amax"], merged["amax_t"], equal_nan=True)
    assert (merged["nonfinite_steps"] == merged["bad"]).all() and merged["bad"].sum() > 0
    assert (df["limit"] == 65504.0).all()
    # the burst drove h.0.mlp.fc's forward past fp16's limit: no headroom left, listed first
    fc = df[(df["module"] == "h.0.mlp.fc") & (df["phase"] == "forward")].iloc[0]
    assert fc["headroom"] <= 1.0 and df["headroom"].iloc[0] <= 1.0


def test_events_origin_first_and_step_detail(real_run):
    ev = rundata.events(real_run)
    t = _sql(real_run, "SELECT step, origin FROM events ORDER BY step, origin DESC, id")
    assert len(ev) == len(t) > 0 and list(ev["step"]) == list(t["step"])
    with_origin = ev[ev.groupby("step")["origin"].transform("any")]
    assert len(with_origin) and with_origin.groupby("step").head(1)["origin"].all()  # origin listed first
    step = int(ev["step"].iloc[0])
    d = rundata.step_detail(real_run, step)
    assert len(d["events"]) == int((t["step"] == step).sum())
    assert len(d["layers"]) == len(_sql(real_run, "SELECT 1 FROM layers WHERE step = ?", (step,)))
    assert len(d["modules"]) == len(_sql(real_run, "SELECT 1 FROM modules WHERE step = ?", (step,)))
    assert bool(d["step"]["skipped"].iloc[0]) == bool(_sql(real_run, "SELECT skipped FROM steps WHERE step = ?",
                                                           (step,))["skipped"].iloc[0])
    epoch = _sql(real_run, "SELECT time FROM steps WHERE step = ?", (step,))["time"].iloc[0]
    assert d["step"]["time"].iloc[0] == pd.Timestamp(epoch, unit="s")  # a date, not raw epoch seconds
    assert d["events"]["origin"].dtype == bool and ev["origin"].dtype == bool
    assert {"fp32_amax", "micro_batch", "flows_into"} <= set(d["events"].columns) & set(ev.columns)


def test_reading_never_changes_the_file(real_run):
    before = hashlib.sha256(real_run.read_bytes()).hexdigest(), real_run.stat().st_mtime_ns
    rundata.overview_data(real_run, buckets=5)
    layerdata.layer_heatmap(real_run)
    layerdata.module_headroom(real_run)
    layerdata.zero_grad_fraction(real_run)
    rundata.step_detail(real_run, 3)
    rundata.runs_table(real_run.parent)
    assert (hashlib.sha256(real_run.read_bytes()).hexdigest(), real_run.stat().st_mtime_ns) == before


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_memory_readings_equal_sqlite_and_buckets_keep_each_lowest_and_highest(path):
    truth = _sql(path, "SELECT step, host_rss FROM memory ORDER BY step")
    assert len(truth) >= 4  # the samples were read at each commit (about once a second)
    every = rundata.memory_data(path)
    assert every["step"].tolist() == truth["step"].tolist()
    assert every["host_rss"].tolist() == truth["host_rss"].astype(float).tolist()
    assert every["device_allocated"].isna().all()  # recorded on a CPU
    first, last = int(truth["step"].iloc[1]), int(truth["step"].iloc[-2])
    few = rundata.memory_data(path, first, last, buckets=2)  # fewer buckets than readings inside
    inside = truth[truth["step"].between(first, last)]
    width = math.ceil((last - first + 1) / 2)
    groups = inside.groupby((inside["step"] - first) // width)["host_rss"]
    want = sorted(list(groups.min()) + list(groups.max()))
    assert len(few) == 2 * groups.ngroups and sorted(few["host_rss"].tolist()) == want
    assert few["step"].is_monotonic_increasing and few["step"].min() >= first
    empty = rundata.memory_data(path, last + 10 ** 6, last + 10 ** 6 + 5)
    assert len(empty) == 0 and list(empty.columns) == ["step", "host_rss", "device_allocated", "device_reserved"]


def test_headroom_of_an_fp8_run_is_not_against_float16(tmp_path):
    """An fp8 run (amp_dtype 'float8') was measured against float16's 65504: a bfloat16 model's
    backward at 2e4 read 'within 4x of the 65504 limit'."""
    import shutil
    healthy = next(p for p in SAMPLES if p.name == "healthy_fp16.sqlite")
    path = tmp_path / "fp8.sqlite"
    shutil.copy(healthy, path)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE run SET amp_dtype = 'float8'")
    conn.close()
    df = layerdata.module_headroom(path)
    assert len(df) and (df["limit"] == 3.3895313892515355e38).all()  # bfloat16's: torchao's lower high precision
    assert (layerdata.module_headroom(healthy)["limit"] == 65504.0).all()


def test_the_dashboard_bench_builds_a_run_of_any_length_with_its_faults_in_place(tmp_path):
    """``python bench/dashboard.py --steps N`` raised IndexError below 1,000,000 steps (its spike,
    NaN steps and skip burst lay at fixed steps past 400,000); they now lie at the same fractions
    of any length, exactly where they were at the default."""
    import subprocess
    import sys
    bench = Path(__file__).resolve().parent.parent / "bench" / "dashboard.py"
    done = subprocess.run([sys.executable, str(bench), "--steps", "2000", "--repeat", "1", "--params", "8",
                           "--modules", "4", "--keep", str(tmp_path / "small.sqlite")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| run overview data ready |" in done.stdout
    # the marks, placed by hand at the default's fractions of 2,000 steps
    nan_steps, spike, burst = [800, 1555], 1308, list(range(1000, 1050))
    truth = _truth_steps(tmp_path / "small.sqlite")
    assert len(truth) == 2000
    assert truth.loc[truth["nonfinite"], "step"].tolist() == nan_steps
    assert truth.loc[truth["loss"] > 100, "step"].tolist() == [spike]
    assert truth.loc[truth["skipped"] == 1, "step"].tolist() == sorted(burst + nan_steps)
    ov = rundata.overview_data(tmp_path / "small.sqlite")
    assert ov.nonfinite_steps.tolist() == nan_steps and ov.skipped_steps.tolist() == sorted(burst + nan_steps)
    done = subprocess.run([sys.executable, "-c", "import dashboard; m = dashboard.marks(1_000_000); "
                           "print(m.spike, m.nan_steps, m.skip_burst)"], cwd=bench.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[0] == "654321 (400003, 777777) (500000, 500050)", done.stderr[-2000:]


def test_spread_reads_return_what_one_connection_returns(real_run, million, tmp_path, monkeypatch):
    """The dashboard's bucket scans spread over several read-only connections (store/parallel.py):
    every reader count gives exactly the rows one connection gives (the truth tests above run on the
    machine's own count)."""
    from ampwatch.store import parallel
    layers = _synthetic(tmp_path / "layers.sqlite", 200_000, params=12, layer_every=20,
                        layer_spike=((123_460, 7, 5e4),), layer_nan=((88_880, 3),))
    reads = {"overview": lambda: rundata.overview_data(million),
             "overview, zoomed": lambda: rundata.overview_data(million, 399_000, 801_234),
             "overview, 8 buckets": lambda: rundata.overview_data(real_run, buckets=8),
             "heatmap": lambda: layerdata.layer_heatmap(layers, buckets=50),
             "heatmap, param_norm": lambda: layerdata.layer_heatmap(layers, "param_norm", buckets=50),
             "headroom": lambda: layerdata.module_headroom(real_run, buckets=200)}

    def read_all() -> dict:
        out = {}
        for name, read in reads.items():
            got = read()
            out[name] = (got.steps, got.skipped_steps.tolist(), got.nonfinite_steps.tolist(),
                         got.scale_changes, got.bucket) if name.startswith("overview") else \
                (got.values, got.nonfinite, got.bucket_starts) if name.startswith("heatmap") else got
        return out

    monkeypatch.setattr(parallel, "READERS", 1)
    one = read_all()
    assert one["heatmap"][0][7, 123_460 // 4000] == 5e4 and one["heatmap"][1][3, 88_880 // 4000]
    for readers in (2, 3, 4):
        monkeypatch.setattr(parallel, "READERS", readers)
        many = read_all()
        for name in reads:
            for a, b in zip(one[name] if isinstance(one[name], tuple) else (one[name],),
                            many[name] if isinstance(many[name], tuple) else (many[name],)):
                if isinstance(a, pd.DataFrame):
                    pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))
                else:
                    assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=np.asarray(a).dtype.kind == "f"), \
                        (name, readers)


def test_spread_read_keeps_order_uses_its_connections_and_says_one_line_for_a_bad_file(real_run, tmp_path, monkeypatch):
    import threading
    from ampwatch.store import parallel
    monkeypatch.setattr(parallel, "READERS", 3)
    seen = parallel.read_spread(real_run, lambda c, i: (i, threading.get_ident(), c,
                                                      c.execute("SELECT ?", (i,)).fetchone()[0]), range(100))
    assert [s[0] for s in seen] == list(range(100)) == [s[3] for s in seen]
    conns = [s[2] for s in seen]  # kept alive here, so each its own object: three, each on a contiguous slice
    assert len({id(c) for c in conns}) == 3
    assert [i for i in range(1, 100) if conns[i] is not conns[i - 1]] == [34, 68]
    assert {s[1] for s in seen} != {threading.get_ident()}  # read off the caller's thread
    assert set(parallel.read_spread(real_run, lambda c, i: threading.get_ident(), range(20))) == {threading.get_ident()}
    assert parallel.step_ranges(0, 9, 3) == [(0, 2), (3, 5), (6, 9)] and parallel.step_ranges(5, 5, 4) == [(5, 5)]
    bad = tmp_path / "notes.sqlite"
    bad.write_text("not a run\n" * 100)
    with pytest.raises(RunError) as err:
        parallel.read_spread(bad, lambda c, i: i, range(100))
    assert "notes.sqlite" in str(err.value) and "\n" not in str(err.value)


def test_a_zoom_into_a_gap_of_the_step_numbers_draws_nothing(tmp_path):
    """Steps 0-99 and 10,000-10,099 in one file: a range between them has no bucket with a step
    (every reader's part is empty), and reads as an empty overview, not an error."""
    path = _synthetic(tmp_path / "gap.sqlite", 100)
    conn = sqlite3.connect(path)
    with conn:
        conn.executemany(_INSERTS["steps"], [(s, s, 0.1, 1.0, 65536.0, 0, 1.0, 1e-3, 1, 0) for s in range(10_000, 10_100)])
    conn.close()
    ov = rundata.overview_data(path, 200, 9_000, buckets=100)
    assert ov.bucket > 1 and ov.steps.empty and len(ov.skipped_steps) == 0
    around = rundata.overview_data(path, 50, 10_049, buckets=100)  # both ends in view: their steps drawn
    assert around.steps["step"].min() == 50 and around.steps["step"].max() == 10_049
