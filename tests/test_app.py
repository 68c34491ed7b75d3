"""Every dashboard page in Streamlit's AppTest, against the sample runs and bad folders.

Numbers shown are compared with SQLite read directly; bad input must give a message, not a traceback.
"""
from __future__ import annotations

import base64
import importlib.util
import math
import os
import shutil
import socket
import sqlite3
import time
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.io
import pytest
from streamlit.testing.v1 import AppTest

import ampwatch
from ampwatch.store.writer import _INSERTS, create_run_file
from helpers.app_pages import open_page
from helpers.sqltruth import sql_frame as _sql

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app" / "streamlit_app.py")
SAMPLES = ROOT / "sample_runs"
SAMPLE_FILES = sorted(p.name for p in SAMPLES.glob("*.sqlite"))
PAGES = ("runs", "overview", "layers", "events", "inspector", "compare", "live")


_open = open_page


pytestmark = pytest.mark.usefixtures("restore_runs_env")


def _no_failure(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def _figure(at: AppTest, i: int = 0):
    """The i-th Plotly chart as a Figure (plotly encodes arrays as base64 in the JSON spec)."""
    return plotly.io.from_json(at.get("plotly_chart")[i].proto.spec)


def _trace(fig, name: str):
    return next(t for t in fig.data if (t.name or "").startswith(name))


def _values(v) -> list:
    """Trace data as a list: Plotly's JSON carries numpy arrays as {'dtype', 'bdata'} (base64)."""
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).tolist()
    return list(v)


def _frame(at: AppTest, column: str) -> pd.DataFrame:
    """The first dataframe shown with ``column`` (AppTest exposes keys only for selectable frames)."""
    return next(d.value for d in at.dataframe if column in d.value.columns)


def _walk(node):
    """The page's elements in the order they are drawn (containers filled later keep their place)."""
    for child in getattr(node, "children", {}).values():
        yield child
        yield from _walk(child)


def _metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("run", SAMPLE_FILES)
def test_every_page_on_every_sample_run(page, run):
    at = _open(SAMPLES, page, run)
    _no_failure(at)
    assert not at.error, [e.value for e in at.error]
    assert at.title, "page drew nothing"
    assert at.sidebar.selectbox(key="run").value == run


def test_runs_table_numbers_equal_sqlite():
    at = _open(SAMPLES)
    shown = at.dataframe(key="runs_table").value.set_index("file")
    assert sorted(shown.index) == SAMPLE_FILES
    for name in SAMPLE_FILES:
        steps = _sql(SAMPLES / name, "SELECT COUNT(*) n, SUM(skipped) k FROM steps").iloc[0]
        last = _sql(SAMPLES / name, "SELECT loss_scale FROM steps ORDER BY step DESC LIMIT 1").iloc[0]
        row = shown.loc[name]
        assert row["steps"] == steps["n"]
        assert row["skipped_pct"] == pytest.approx(100 * steps["k"] / steps["n"])
        scale = last["loss_scale"]  # as the overview's headline: 65536, 2^-53 (not 6.554e+04, 1.11e-16)
        assert row["final_scale"] == ("–" if pd.isna(scale) else f"{scale:g}" if 1 <= scale < 1e7
                                      else f"2^{int(math.log2(scale))}")
    assert shown.loc["diverged.sqlite", "final_scale"] == "2^-53"
    assert shown.loc["healthy_fp16.sqlite", "final_scale"] == "65536"
    at.text_input(key="runs_filter").input("storm").run()
    assert list(at.dataframe(key="runs_table").value["file"]) == ["overflow_storm.sqlite"]


@pytest.mark.parametrize("run", SAMPLE_FILES)
def test_overview_numbers_and_chart_equal_sqlite(run):
    at = _open(SAMPLES, "overview", run)
    t = _sql(SAMPLES / run, "SELECT step, loss, loss_scale, skipped FROM steps ORDER BY step")
    assert _metric(at, "steps") == f"{len(t):,}"
    k = int(t["skipped"].sum())
    assert _metric(at, f"skipped ({100 * k / len(t):.1f}%)") == f"{k:,}"
    scale = t["loss_scale"].iloc[-1]
    shown = _metric(at, "final loss scale")
    if pd.isna(scale):
        assert shown == "–"
    elif shown.startswith("2^"):  # tiny or huge powers of two, short enough for the headline
        assert 2.0 ** int(shown[2:]) == scale and not 1 <= scale < 1e7
    else:
        assert shown == f"{scale:g}" and len(shown) <= 9
    fig = _figure(at)
    assert _values(_trace(fig, "loss").x) == t["step"].tolist()  # a short run is drawn step by step
    skipped = [t_ for t_ in fig.data if (t_.name or "").startswith("skipped step")]
    assert (_values(skipped[0].x) if skipped else []) == t["step"][t["skipped"] == 1].tolist()


@pytest.mark.parametrize("run", SAMPLE_FILES)
def test_overview_draws_the_memory_the_run_read(run):
    at = _open(SAMPLES, "overview", run)
    _no_failure(at)
    truth = _sql(SAMPLES / run, "SELECT step, host_rss FROM memory ORDER BY step")
    charts = [plotly.io.from_json(c.proto.spec) for c in at.get("plotly_chart")]
    memory = next(f for f in charts if f.layout.yaxis.title.text == "MiB")
    host = _trace(memory, "host")
    assert _values(host.x) == truth["step"].tolist()
    assert _values(host.y) == pytest.approx((truth["host_rss"] / 2 ** 20).tolist())
    assert not any((t.name or "").startswith("device") for t in memory.data)  # a CPU run reads no device memory
    assert any(h.value == "Memory" for h in at.subheader)


def test_findings_lead_the_run_page_and_jump_to_their_steps():
    run = "overflow_storm.sqlite"
    findings = ampwatch.diagnose(ampwatch.load(SAMPLES / run))
    assert findings, "the doctor should have something to say about overflow_storm"
    at = _open(SAMPLES, "overview", run)
    text = " ".join(m.value for m in at.markdown)
    folded = " ".join(e.label for e in at.expander)
    for f in findings:  # root causes in the open, their consequences folded under them
        assert f.title in (folded if f.cause else text)
    assert any(f.cause for f in findings)  # overflow_storm: the collapse is the origin's consequence
    assert at.subheader[0].value == "Root causes"  # before the charts
    index = max(i for i, f in enumerate(findings) if f.cause is None)
    target = findings[index]
    last = int(_sql(SAMPLES / run, "SELECT MAX(step) s FROM steps")["s"].iloc[0])
    want = (max(0, target.jump[0]), min(last, target.jump[1]))  # the slider keeps it inside the run
    at.button(key=f"finding:{index}").click().run()
    _no_failure(at)
    assert at.sidebar.slider(key=f"range:{run}").value == want
    loss = _values(_trace(_figure(at), "loss").x)
    assert (loss[0], loss[-1]) == want
    assert at.session_state["_inspect"] == target.steps[0]
    at.switch_page("app_pages/layers.py").run()  # the place survives moving between pages
    assert at.sidebar.slider(key=f"range:{run}").value == want


def test_layers_views_equal_sqlite():
    run = "diverged.sqlite"
    at = _open(SAMPLES, "layers", run)
    heat = _figure(at).data[0]
    n_params = _sql(SAMPLES / run, "SELECT COUNT(*) n FROM tensors WHERE kind = 'param'")["n"].iloc[0]
    assert heat.type == "heatmap" and len(heat.y) == n_params
    at = _open(SAMPLES, "layers", run, state={"layers_view": "fp16 headroom"})
    _no_failure(at)
    shown = _frame(at, "headroom")
    truth = _sql(SAMPLES / run, "SELECT t.name module, CASE m.phase WHEN 0 THEN 'forward' ELSE 'backward' END phase,"
                                " MAX(m.amax) amax FROM modules m JOIN tensors t ON t.id = m.module_id GROUP BY 1, 2")
    merged = shown.merge(truth, on=["module", "phase"], suffixes=("", "_t"))
    assert len(merged) == len(truth) and np.allclose(merged["amax"], merged["amax_t"], equal_nan=True)
    at = _open(SAMPLES, "layers", run, state={"layers_view": "Zero gradients"})
    _no_failure(at)
    zero = _frame(at, "zero_frac_mean").set_index("layer")
    zt = _sql(SAMPLES / run, "SELECT t.name, AVG(grad_zero_frac) m FROM layers l JOIN tensors t ON t.id = l.param_id"
                             " GROUP BY t.name").set_index("name")
    assert np.allclose(zero.loc[zt.index, "zero_frac_mean"], zt["m"])


def test_events_page_origin_first_and_inspector():
    run = "diverged.sqlite"
    truth = _sql(SAMPLES / run, "SELECT step, module, phase, origin FROM events ORDER BY step, origin DESC, id")
    at = _open(SAMPLES, "events", run)
    shown = at.dataframe(key="events_table").value
    assert len(shown) == len(truth) and list(shown["step"]) == list(truth["step"])
    origin = truth[truth["origin"] == 1].iloc[0]
    assert origin["module"] in at.warning[0].value and str(origin["step"]) in at.warning[0].value
    step = int(origin["step"])
    at = _open(SAMPLES, "events", run, state={"_inspect": step})
    layers = _frame(at, "grad_zero_frac")
    assert len(layers) == len(_sql(SAMPLES / run, "SELECT 1 FROM layers WHERE step = ?", (step,)))
    step_events = [d.value for d in at.dataframe if "origin" in d.value.columns][1]  # after the events table
    assert len(step_events) == int((truth["step"] == step).sum())


def test_inspector_shows_every_layer_at_the_step():
    run = "overflow_storm.sqlite"
    t = _sql(SAMPLES / run, "SELECT l.step, t.name, l.grad_norm FROM layers l JOIN tensors t ON t.id = l.param_id"
                            " WHERE l.step = (SELECT MAX(step) FROM layers) ORDER BY l.param_id")
    step = int(t["step"].iloc[0])
    at = _open(SAMPLES, "inspector", run, state={"_inspect": step})
    _no_failure(at)
    assert at.number_input(key="inspect_step").value == step
    shown = _frame(at, "grad_zero_frac")
    assert list(shown["layer"]) == list(t["name"])
    assert np.allclose(shown["grad_norm"], t["grad_norm"], equal_nan=True)


def test_compare_overlays_the_picked_runs():
    picked = SAMPLE_FILES[:3]
    at = _open(SAMPLES, "compare", SAMPLE_FILES[0], state={"compare": picked})
    _no_failure(at)
    legend = [t.name for t in _figure(at).data if t.showlegend]
    assert legend == [p.rsplit(".", 1)[0] for p in picked]


def test_compare_says_where_two_runs_part():
    """Two runs picked: the page shows ampwatch diff's answer, the same as the library's."""
    from ampwatch.doctor.diff import diff_runs
    picked = ["healthy_fp16.sqlite", "diverged.sqlite"]
    at = _open(SAMPLES, "compare", picked[0], state={"compare": picked, "compare_pick": picked})
    _no_failure(at)
    truth = diff_runs(SAMPLES / picked[0], SAMPLES / picked[1])
    assert truth.parted
    text = " ".join(w.value for w in at.warning)
    assert f"part at step **{truth.parting_step}**" in text
    assert all(field in text for field, _, _ in truth.settings[:6])
    # worked out after the charts (two long runs take seconds), shown above them
    order = [type(n).__name__ if type(n).__name__ == "Warning" else getattr(n, "type", "") for n in _walk(at.main)]
    assert order.index("Warning") < order.index("plotly_chart"), order


def _make_run(path: Path, losses: list, status: str = "finished", **info) -> Path:
    row = {"name": path.stem, "status": status, "started_at": time.time(), "heartbeat_at": time.time(),
           "pid": os.getpid(), "hostname": socket.gethostname(), "amp_dtype": "float16", "layer_every": 20,
           "schema_version": 1, **info}
    create_run_file(str(path), row, [])
    _append(path, 0, losses)
    return path


def _append(path: Path, start: int, losses: list) -> None:
    conn = sqlite3.connect(path)
    with conn:
        conn.executemany(_INSERTS["steps"], [
            (start + i, time.time(), 0.1, None if math.isnan(v) else v, 1024.0, int(math.isnan(v)), 1.0, 1e-3, 1,
             1 if math.isnan(v) else 0) for i, v in enumerate(losses)])
        conn.execute("UPDATE run SET heartbeat_at = ?", (time.time(),))
    conn.close()


def test_live_page_follows_a_running_run(tmp_path):
    path = _make_run(tmp_path / "live.sqlite", [1.0, 0.9, 0.8], status="running")
    at = _open(tmp_path, "live", path.name)
    _no_failure(at)
    assert _metric(at, "status") == "running" and _metric(at, "steps") == "3"
    assert any("redrawing every" in c.value for c in at.caption)
    _append(path, 3, [0.7, 0.6])
    at.run()
    assert _metric(at, "steps") == "5"
    fig = _figure(at)
    assert _values(_trace(fig, "loss").x) == [0, 1, 2, 3, 4]
    assert fig.layout.uirevision  # Plotly keeps the zoom across refreshes


def test_live_page_draws_the_memory_of_a_running_run(tmp_path):
    """A leak is worth seeing while the run can still be saved: the live page draws the memory
    readings (here written as the writer thread would, one per commit) under the step chart."""
    path = _make_run(tmp_path / "live.sqlite", [1.0, 0.9, 0.8, 0.7], status="running")
    conn = sqlite3.connect(path)
    conn.executemany("INSERT INTO memory (step, host_rss) VALUES (?, ?)", [(1, 400 * 2 ** 20), (3, 480 * 2 ** 20)])
    conn.commit()
    conn.close()
    at = _open(tmp_path, "live", path.name)
    _no_failure(at)
    memory = next(f for f in (plotly.io.from_json(c.proto.spec) for c in at.get("plotly_chart"))
                  if f.layout.yaxis.title.text == "MiB")
    host = _trace(memory, "host")
    assert _values(host.x) == [1, 3] and _values(host.y) == [400.0, 480.0]
    assert memory.layout.uirevision


def _bad_folder(kind: str, tmp_path: Path) -> tuple[Path, str]:
    folder = tmp_path / kind
    if kind == "missing":
        return folder, "does not exist"
    folder.mkdir()
    if kind == "empty":
        return folder, "No runs"
    if kind == "corrupt":
        (folder / "broken.sqlite").write_bytes(b"SQLite format 3\x00" + b"\x07" * 3000)
        return folder, "broken.sqlite"
    if kind == "not_sqlite":
        (folder / "notes.sqlite").write_text("hello")
        return folder, "not an ampwatch run"
    if kind == "foreign":
        conn = sqlite3.connect(folder / "other.sqlite")
        conn.execute("CREATE TABLE t (x)")
        conn.commit()
        conn.close()
        return folder, "another tool"
    if kind == "zero_steps":
        _make_run(folder / "zero.sqlite", [])
        return folder, "no steps"
    if kind == "all_nan":
        _make_run(folder / "nan.sqlite", [math.nan] * 5)
        return folder, "NaN"
    raise ValueError(kind)


BAD = ("missing", "empty", "corrupt", "not_sqlite", "foreign", "zero_steps", "all_nan")


@pytest.mark.parametrize("kind", BAD)
def test_bad_input_gives_a_message_on_every_page(kind, tmp_path):
    folder, expected = _bad_folder(kind, tmp_path)
    for page in PAGES:
        at = _open(folder, page)
        _no_failure(at)
        if page == "overview":
            said = " ".join(e.value for e in (*at.error, *at.info, *at.warning))
            assert expected in said, (page, said)


def test_names_from_the_url_cannot_escape_the_folder(tmp_path, monkeypatch):
    outside = tmp_path / "secret.sqlite"
    shutil.copy(SAMPLES / "healthy_fp16.sqlite", outside)
    folder = tmp_path / "runs"
    folder.mkdir()
    shutil.copy(SAMPLES / "diverged.sqlite", folder / "diverged.sqlite")
    (folder / "link.sqlite").symlink_to(outside)
    for name in ("../secret.sqlite", str(outside), "link.sqlite", "nope.sqlite"):
        at = _open(folder, "overview", name)
        _no_failure(at)
        assert not at.title and [e.value for e in at.error] == [f"Run {name!r} is not in {str(folder)!r}: "
                                                                "pick a run in the sidebar."]
        assert at.query_params["run"] == name  # the URL is not rewritten to another run
    monkeypatch.syspath_prepend(str(ROOT / "app"))  # as Streamlit runs the app: its modules are top-level
    state = importlib.import_module("state")
    assert state.safe_run_path(folder, "diverged.sqlite") == (folder / "diverged.sqlite").resolve()
    for name in ("../secret.sqlite", str(outside), "link.sqlite", "", None, "diverged.txt", ".", "sub/x.sqlite"):
        assert state.safe_run_path(folder, name) is None, name


def _warmup_end(run: Path) -> int:
    """First clean step (the scaler's warm-up is the leading skipped steps), from SQLite directly."""
    return int(_sql(run, "SELECT MIN(step) s FROM steps WHERE skipped = 0")["s"].iloc[0])


def test_events_lead_with_the_root_cause_and_label_the_warmup():
    run = "overflow_storm.sqlite"  # init_scale 2**24: gradient overflow events from step 0
    warm = _warmup_end(SAMPLES / run)
    truth = _sql(SAMPLES / run, "SELECT step, module, phase FROM events ORDER BY step, origin DESC, id")
    origin = next(f for f in ampwatch.diagnose(str(SAMPLES / run)) if f.id == "nonfinite-origin")
    at = _open(SAMPLES, "events", run)
    text = at.warning[0].value
    assert text.startswith(f"Root cause (doctor): **{origin.title}**") and "h.0.mlp.fc" in origin.title
    after = truth[(truth["step"] >= warm) | truth["phase"].isin(["forward", "loss"])].iloc[0]
    assert f"warm-up: **{after['module']}** ({after['phase']}" in text and f"at step {after['step']}" in text
    n_warm = int(((truth["step"] < warm) & ~truth["phase"].isin(["forward", "loss"])).sum())
    assert n_warm > 0 and f"{n_warm:,} gradient-overflow events at steps 0–{warm - 1}" in text
    shown = at.dataframe(key="events_table").value
    assert int(shown["warmup"].sum()) == n_warm
    nan_amax = _sql(SAMPLES / run, "SELECT COUNT(*) n FROM events WHERE amax IS NULL")["n"].iloc[0]
    assert "None" not in set(shown["amax"]) and (shown["amax"] == "NaN").sum() == nan_amax
    assert {"fp32_amax", "micro_batch", "flows_into"} <= set(shown.columns)
    healthy = _open(SAMPLES, "events", "healthy_fp16.sqlite")  # the doctor: ok -> no yellow box
    assert not healthy.warning and "expected" in healthy.info[0].value


def test_runs_page_has_a_health_column(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "app"))  # as Streamlit runs the app: its modules are top-level
    # every sample run read before the table is drawn, however slow this machine (test_runs_health.py
    # tests the table drawn first)
    monkeypatch.setattr(importlib.import_module("loaders"), "INLINE_DOCTOR_S", 600.0)
    at = _open(SAMPLES)
    shown = at.dataframe(key="runs_table").value.set_index("name")
    for path in sorted(SAMPLES.glob("*.sqlite")):
        findings = ampwatch.diagnose(str(path))
        serious = [f for f in findings if f.severity != "info"]
        want = "ok" if not serious else f"{serious[0].severity}: {serious[0].title}"
        assert shown.loc[path.stem, "health"] == want


def test_step_range_follows_a_growing_run_unless_narrowed(tmp_path):
    path = _make_run(tmp_path / "grow.sqlite", [1.0] * 10, status="running")
    at = _open(tmp_path, "overview", path.name)
    slider = f"range:{path.name}"
    assert at.sidebar.slider(key=slider).value == (0, 9)
    _append(path, 10, [0.9] * 8)
    at.run()
    assert _metric(at, "steps") == "18" and at.sidebar.slider(key=slider).value == (0, 17)
    assert _values(_trace(_figure(at), "loss").x)[-1] == 17
    at.switch_page("app_pages/layers.py").run()  # the same range on every page
    assert at.sidebar.slider(key=slider).value == (0, 17)
    at.sidebar.slider(key=slider).set_value((2, 12)).run()  # narrowed by the user: it stays
    _append(path, 18, [0.8] * 5)
    at.switch_page("app_pages/overview.py").run()
    assert _metric(at, "steps") == "23" and at.sidebar.slider(key=slider).value == (2, 12)


def test_live_page_keeps_zoom_and_stops_when_the_run_ends(tmp_path):
    path = _make_run(tmp_path / "live.sqlite", [1.0, 0.9, 0.8], status="running")
    at = _open(tmp_path, "live", path.name)
    rev = _figure(at).layout.uirevision
    _append(path, 3, [0.7, 0.6])
    at.run()
    assert _figure(at).layout.uirevision == rev == f"live:{path.name}"  # constant: Plotly keeps the zoom
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE run SET status = 'finished'")
    conn.close()
    at.run()
    _no_failure(at)
    captions = " ".join(c.value for c in at.caption)
    assert "redrawing" not in captions and "ended (finished)" in captions
    assert _metric(at, "status") == "finished"


def test_findings_show_their_severity_and_only_causes_are_root_causes():
    at = _open(SAMPLES, "overview", "overflow_storm.sqlite")
    found = ampwatch.diagnose(str(SAMPLES / "overflow_storm.sqlite"))
    cards = [m.value for m in at.markdown if "**" in m.value and "· steps" in m.value]
    shown = [f for f in found if f.cause is None]
    assert len(cards) == len(shown)
    for f, card in zip(shown, cards):
        assert f"{f.severity.upper()}]" in card and f.title in card  # a coloured ERROR/WARNING/INFO badge
    assert at.subheader[0].value == "Root causes"
    # the doctor runs after the charts (a long run's charts need not wait for it), into a box above them
    order = [getattr(n, "type", "") for n in _walk(at.main)]
    assert order.index("subheader") < order.index("metric") < order.index("plotly_chart")
    origin = next(f for f in found if f.id == "nonfinite-origin")  # not the warm-up or a handled skip
    assert _metric(at, "NaN/inf born at step") == str(origin.steps[0]) and "step 120" in origin.title
    healthy = _open(SAMPLES, "overview", "healthy_fp16.sqlite")  # only "nothing to fix" notes
    assert all(f.severity == "info" for f in ampwatch.diagnose(str(SAMPLES / "healthy_fp16.sqlite")))
    assert healthy.subheader[0].value == "Notes from the doctor (nothing to fix)"


def test_folder_and_run_choice_say_what_is_wrong(tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    (folder / "a_broken.sqlite").write_text("not a run")  # sorts first
    shutil.copy(SAMPLES / "healthy_fp16.sqlite", folder / "b_ok.sqlite")
    at = _open(folder, "overview")
    _no_failure(at)
    assert at.sidebar.selectbox(key="run").value == "b_ok.sqlite" and not at.error  # the first readable run
    at = _open(folder / "b_ok.sqlite", "overview")  # a run file typed as the folder opens it in its folder
    assert at.sidebar.selectbox(key="run").value == "b_ok.sqlite" and at.title[0].value == "healthy_fp16"
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    at = _open(notes, "overview")
    assert [e.value for e in at.error] == [f"{str(notes)!r} is a file, not a folder: type the folder that holds "
                                           "the .sqlite runs."]
    empty = tmp_path / "empty"
    empty.mkdir()
    for page in ("runs", "overview"):  # every page: the same info, not an error on one of them
        at = _open(empty, page)
        assert not at.error and at.info[0].value.startswith(f"No runs in {str(empty)!r} yet")


def test_page_icon_is_local():
    # A :material/ favicon is fetched from fonts.gstatic.com on every page load: the dashboard stays local.
    assert 'page_icon=":material' not in Path(APP).read_text()


def test_live_page_keeps_a_narrowed_step_range_and_follows_a_full_one(tmp_path):
    path = _make_run(tmp_path / "live.sqlite", [1.0] * 10, status="running")
    at = _open(tmp_path, "live", path.name)
    assert _values(_trace(_figure(at), "loss").x) == list(range(10))
    _append(path, 10, [0.9] * 5)
    at.run()
    assert _values(_trace(_figure(at), "loss").x) == list(range(15))  # the whole run follows its end
    at.sidebar.slider(key=f"range:{path.name}").set_value((3, 8)).run()
    _append(path, 15, [0.8] * 5)
    at.run()
    assert _metric(at, "steps") == "20" and _values(_trace(_figure(at), "loss").x) == list(range(3, 9))


def test_widgets_keep_their_value_across_pages():
    """Streamlit forgets a widget's state on a page that does not draw it: a log axis turned off, a
    layer figure or 'origins only' picked must still be so after a visit to another page."""
    at = _open(SAMPLES, "overview", "overflow_storm.sqlite")
    at.toggle(key="log_loss").set_value(False).run()
    at.switch_page("app_pages/layers.py").run()
    at.selectbox(key="layers_metric").set_value("param_norm").run()
    at.toggle(key="layers_log:param_norm").set_value(False).run()
    at.switch_page("app_pages/events.py").run()
    at.toggle(key="events_origin_only").set_value(True).run()
    at.switch_page("app_pages/overview.py").run()
    _no_failure(at)
    assert at.toggle(key="log_loss").value is False
    assert _figure(at).layout.yaxis.type == "linear"
    at.switch_page("app_pages/layers.py").run()
    assert at.selectbox(key="layers_metric").value == "param_norm"
    assert at.toggle(key="layers_log:param_norm").value is False
    at.switch_page("app_pages/events.py").run()
    assert at.toggle(key="events_origin_only").value is True
    assert at.dataframe(key="events_table").value["origin"].all()


def test_compare_starts_from_the_open_run_and_keeps_the_picks():
    """Compare used to open on the folder's first four runs, leaving out the run the user was on."""
    run = SAMPLE_FILES[-1]  # overflow_storm: fifth of five
    at = _open(SAMPLES, "compare", run)
    _no_failure(at)
    assert at.multiselect(key="compare_pick").value[0] == run
    legend = [t.name for t in _figure(at).data if t.showlegend]
    assert legend[0] == run.rsplit(".", 1)[0] and len(legend) == 4
    picked = [run, SAMPLE_FILES[0]]
    at.multiselect(key="compare_pick").set_value(picked).run()
    at.switch_page("app_pages/overview.py").run()
    at.switch_page("app_pages/compare.py").run()
    assert at.multiselect(key="compare_pick").value == picked  # kept across pages


def test_inspector_opens_on_the_step_the_doctor_names():
    """The overview says 'NaN/inf born at step 120' on overflow_storm; the inspector opened on step 6
    (an isolated gradient overflow the scaler handled)."""
    run = "overflow_storm.sqlite"
    origin = next(f for f in ampwatch.diagnose(ampwatch.load(SAMPLES / run))
                  if f.id == "nonfinite-origin" and not f.cause)
    at = _open(SAMPLES, "inspector", run)
    _no_failure(at)
    assert at.number_input(key="inspect_step").value == origin.steps[0] == 120
    assert _metric(_open(SAMPLES, "overview", run), "NaN/inf born at step") == "120"
    at = _open(SAMPLES, "inspector", "healthy_fp16.sqlite")  # no origin named: the first after warm-up
    first = _sql(SAMPLES / "healthy_fp16.sqlite", "SELECT MIN(step) s FROM steps WHERE step > 0 AND skipped")
    assert at.number_input(key="inspect_step").value == int(first["s"].iloc[0])


def test_headroom_warning_counts_and_says_how_many_it_leaves_out():
    """overflow_storm: '9 module/phase pairs came within 4x' named 8 and dropped the ninth silently;
    one pair read '1 module/phase pairs'."""
    run = "overflow_storm.sqlite"
    truth = _sql(SAMPLES / run, "SELECT m.module_id, m.phase FROM modules m GROUP BY 1, 2"
                                " HAVING MAX(m.amax) >= 65504.0 / 4")
    assert len(truth) == 9
    at = _open(SAMPLES, "layers", run, state={"layers_view": "fp16 headroom"})
    _no_failure(at)
    text = at.warning[0].value
    assert text.startswith("9 module/phase pairs came within 4x of the 65504 limit: ")
    assert text.endswith(" (+1 more in the table)") and text.count(" (") == 8 + 1


def test_a_finding_on_one_step_says_step_not_a_range():
    """lightning_fp16's scale-probing finding is on step 175 alone: its heading read 'steps 175–175'."""
    run = "lightning_fp16.sqlite"
    one = [f for f in ampwatch.diagnose(ampwatch.load(SAMPLES / run)) if f.steps[0] == f.steps[1] and not f.cause]
    assert one
    at = _open(SAMPLES, "overview", run)
    text = " ".join(m.value for m in at.markdown)
    for f in one:
        assert f"**{f.title}** · step {f.steps[0]}" in text
    assert "steps 175–175" not in text


def test_heatmap_caption_counts_read_as_the_other_counts():
    """diverged's caption read '1960 cells hold' beside '3,990 events' on the Events page."""
    run = "diverged.sqlite"
    bad = _sql(SAMPLES / run, "SELECT COUNT(*) n FROM layers WHERE (nan_mask & 1) OR grad_nonfinite > 0"
                              " OR abs(grad_norm) > 1.7976931348623157e308")["n"].iloc[0]
    at = _open(SAMPLES, "layers", run)
    _no_failure(at)
    caption = next(c.value for c in at.caption if "cells hold" in c.value)
    assert bad == 1960 and "1,960 cells hold a NaN/inf gradient" in caption
    assert caption.startswith("28 layers × 79 columns of 1 step:")


def test_compare_and_ranks_tables_name_their_columns_as_the_runs_page(tmp_path):
    """Compare's table was headed final_scale, first_nonfinite_step, last_loss (the Runs page: 'final
    loss scale', 'first NaN/inf step', 'last loss'); the Ranks table's first NaN/inf counts the warm-up."""
    import json
    from helpers.synthetic_job import bad_batch_job
    runs = json.loads(_open(SAMPLES).dataframe(key="runs_table").proto.columns)
    at = _open(SAMPLES, "compare", SAMPLE_FILES[0])
    _no_failure(at)
    shown = next(d for d in at.dataframe if "final_scale" in d.value.columns)
    compare = json.loads(shown.proto.columns)
    for col in ("final_scale", "first_nonfinite_step", "last_loss", "skipped_pct"):
        assert compare[col]["label"] == runs[col]["label"] != col
    bad_batch_job(tmp_path, world=2, bad_rank=1, bad_step=5)
    at = _open(tmp_path, "ranks", "job.rank0.sqlite")
    _no_failure(at)
    ranks = json.loads(next(d for d in at.dataframe if "first_nonfinite_step" in d.value.columns).proto.columns)
    assert ranks["first_nonfinite_step"]["label"] == "first NaN/inf step"
    assert "warm-up included" in ranks["first_nonfinite_step"]["help"]


def test_runs_table_says_a_dash_where_nothing_went_non_finite():
    """The Runs table showed 'None' as the first NaN/inf step of a run where nothing went non-finite
    (bf16 without a scaler; an fp16 run whose only overflow was the scaler's warm-up), where its
    other columns say '–'; then, made text, the column sorted 180 before 25. It is a number column
    now, missing cells drawn with the table's placeholder '–'. Compared with the doctor's headline
    figures, computed from the run's frames rather than the table's SQL."""
    import json
    from ampwatch.doctor.summary import summarize
    at = _open(SAMPLES)
    _no_failure(at)
    runs = at.dataframe(key="runs_table")
    shown = runs.value.set_index("file")
    assert str(shown["first_nonfinite_step"].dtype) == "Int64"  # sorts as a number in the browser
    assert json.loads(runs.proto.columns)["first_nonfinite_step"]["type_config"]["type"] == "number"
    assert runs.proto.placeholder == "–"  # what a missing cell reads, not 'None'
    for name in SAMPLE_FILES:
        first = summarize(ampwatch.load(SAMPLES / name))["first_nonfinite_step"]
        got = shown.loc[name, "first_nonfinite_step"]
        assert (got is pd.NA) if first is None else got == first, name
    assert shown.loc["bf16_noscaler.sqlite", "first_nonfinite_step"] is pd.NA
    assert shown.loc["diverged.sqlite", "first_nonfinite_step"] == 180
    compare = _open(SAMPLES, "compare", "bf16_noscaler.sqlite")
    _no_failure(compare)
    table = next(d for d in compare.dataframe if "first_nonfinite_step" in d.value.columns)
    assert table.proto.placeholder == "–" and str(table.value["first_nonfinite_step"].dtype) == "Int64"
