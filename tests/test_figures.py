"""Figure builders: the traces carry exactly the data given (no browser, no Streamlit)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ampwatch.dashboard import rundata

from ampwatch.dashboard import figures

from ampwatch.dashboard import layerdata

SAMPLES = Path(__file__).resolve().parent.parent / "sample_runs"


def _trace(fig, name_start: str):
    found = [t for t in fig.data if (t.name or "").startswith(name_start)]
    assert found, f"no trace named {name_start!r}: {[t.name for t in fig.data]}"
    return found[0]


@pytest.fixture(scope="module")
def storm():
    return rundata.overview_data(SAMPLES / "overflow_storm.sqlite")


def test_overview_traces_carry_the_data(storm):
    fig = figures.overview_figure(storm, log_loss=True)
    loss = _trace(fig, "loss")
    assert list(loss.x) == list(storm.steps["step"])
    assert np.allclose(np.asarray(loss.y, dtype=float), storm.steps["loss"], equal_nan=True)
    skipped = _trace(fig, "skipped step")
    assert list(skipped.x) == list(storm.skipped_steps) and len(storm.skipped_steps) > 0
    assert skipped.name == f"skipped step ({len(storm.skipped_steps)})"
    backoff = _trace(fig, "scale backoff")
    changes = storm.scale_changes
    assert list(backoff.x) == list(changes["step"][changes["kind"] == "backoff"])
    # one shared step axis: every row's x axis follows the bottom one
    assert fig.layout.xaxis.matches == "x4" and fig.layout.xaxis2.matches == "x4"
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log" and fig.layout.yaxis3.type == "log"
    assert all(t.startswith("2^") for t in fig.layout.yaxis2.ticktext)
    assert [2.0 ** int(t[2:]) for t in fig.layout.yaxis2.ticktext] == list(fig.layout.yaxis2.tickvals)
    assert figures.overview_figure(storm, log_loss=False).layout.yaxis.type == "linear"


def test_skipped_crosses_are_drawn_over_the_nan_diamonds(storm):
    """overflow_storm's every skip overflowed (grad norm inf): drawn under the diamonds, no cross showed."""
    fig = figures.overview_figure(storm)
    names = [t.name or "" for t in fig.data]
    skipped = next(i for i, n in enumerate(names) if n.startswith("skipped step"))
    nan = next(i for i, n in enumerate(names) if n.startswith("NaN/inf step"))
    assert set(storm.skipped_steps) <= set(storm.nonfinite_steps)  # they coincide on this run
    assert skipped > nan  # later traces are drawn on top


def test_clip_threshold_line_only_when_known(storm):
    fig = figures.overview_figure(storm)
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    assert storm.clip_threshold == 1.0 and [s.y0 for s in lines] == [1.0]
    assert _trace(fig, "clip threshold 1").line.dash == "dash"  # named in the legend
    # a text anchored to the grad-norm axis widens its autorange (to 16 for norms of 0.5-2)
    assert all(a.yref == "paper" or a.yref.endswith("domain") for a in fig.layout.annotations)
    storm_no_clip = rundata.Overview(storm.steps, storm.skipped_steps, storm.nonfinite_steps,
                                      storm.scale_changes, 1, 0, 299, info={"config": {}})
    assert not [s for s in figures.overview_figure(storm_no_clip).layout.shapes if s.type == "line"]


def test_markers_for_nan_steps_sit_on_the_plot():
    ov = rundata.overview_data(SAMPLES / "diverged.sqlite")
    fig = figures.overview_figure(ov, log_loss=True)
    nan = _trace(fig, "NaN/inf step")
    assert list(nan.x) == list(ov.nonfinite_steps) and len(nan.x) > 0
    assert np.isfinite(np.asarray(nan.y, dtype=float)).all()  # NaN loss: drawn at the bottom, not dropped


def test_heatmap_log_colour_and_nonfinite_marks():
    grid = layerdata.LayerGrid(names=["a", "b"], metric="grad_norm", bucket_starts=np.array([0, 10, 20]), width=10,
                              values=np.array([[1.0, 10.0, np.nan], [100.0, np.nan, 0.001]]),
                              nonfinite=np.array([[False, False, True], [False, False, False]]))
    fig = figures.heatmap_figure(grid)
    heat = fig.data[0]
    assert np.allclose(np.asarray(heat.z, dtype=float), [[0, 1, np.nan], [2, np.nan, -3]], equal_nan=True)
    marks = _trace(fig, "NaN/inf gradient")
    assert marks.name == "NaN/inf gradient (1 cells)"
    assert np.array_equal(np.isfinite(np.asarray(marks.z, dtype=float)), grid.nonfinite)
    linear = figures.heatmap_figure(grid, log_color=False).data[0]
    assert np.allclose(np.asarray(linear.z, dtype=float), grid.values, equal_nan=True)


def test_headroom_marks_modules_near_the_limit_red():
    df = pd.DataFrame({"module": ["fc", "proj"], "type": ["Linear"] * 2, "phase": ["forward"] * 2,
                       "amax": [30000.0, 10.0], "nonfinite_steps": [0, 0], "limit": [65504.0] * 2,
                       "headroom": [65504 / 30000, 6550.4]})
    fig = figures.headroom_figure(df)
    bars = fig.data[0]
    assert list(bars.y) == ["fc", "proj"] and list(bars.x) == [30000.0, 10.0]
    assert list(bars.marker.color) == [figures.SKIP_COLOR, "#1f77b4"]
    assert fig.layout.xaxis.type == "log" and fig.layout.shapes[0].x0 == 65504.0


def test_zero_grad_and_compare_figures():
    zero = layerdata.zero_grad_fraction(SAMPLES / "healthy_fp16.sqlite")
    fig = figures.zero_grad_figure(zero)
    # a tied weight is drawn under all its names: TinyGPT ties lm_head to wte
    assert list(fig.data[0].y) == [layerdata.alias_label(n, a) for n, a in zip(zero["layer"], zero["aliases"])]
    assert "wte.weight = lm_head.weight" in list(fig.data[0].y)
    runs = {p.stem: rundata.overview_data(p) for p in sorted(SAMPLES.glob("*.sqlite"))[:3]}
    rates = {name: rundata.skip_rate(SAMPLES / f"{name}.sqlite") for name in runs}
    fig = figures.compare_figure(runs, rates)
    legend = [t.name for t in fig.data if t.showlegend]
    assert legend == list(runs)
    for name, rate in rates.items():
        tr = [t for t in fig.data if t.name == name and t.yaxis == "y4"][0]
        assert np.allclose(np.asarray(tr.y, dtype=float), rate["rate"])


def test_figures_import_neither_streamlit_nor_torch():
    code = ("import sys, ampwatch.dashboard.figures, ampwatch.dashboard.rundata, ampwatch.dashboard.layerdata; "
            "bad = [m for m in ('torch', 'streamlit') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_constant_lr_is_visible_not_flattened_onto_zero():
    fig = figures.overview_figure(rundata.overview_data(SAMPLES / "healthy_fp16.sqlite"))
    lo, hi = fig.layout.yaxis4.range
    assert lo == 0 and 0.003 < hi < 0.0035  # the sample trains at a constant lr of 3e-3


def _log_axes(fig):
    return [(name, ax) for name, ax in fig.layout.to_plotly_json().items()
            if name.startswith(("xaxis", "yaxis")) and ax.get("type") == "log"]


def test_every_log_axis_labels_full_numbers(storm):
    # Plotly's default minor labels on a short log axis are bare digits ("5" for 0.5)
    runs = {"a": storm}
    head = layerdata.module_headroom(SAMPLES / "diverged.sqlite")
    for fig in (figures.overview_figure(storm), figures.compare_figure(runs, {}), figures.headroom_figure(head)):
        axes = _log_axes(fig)
        assert axes
        for name, ax in axes:  # a full-number format, or explicit labels (the loss scale's 2^k)
            assert ax.get("tickformat") == ".3~g" or ax.get("ticktext"), (name, ax)


def test_headroom_draws_an_overflowed_module_past_the_limit():
    df = layerdata.module_headroom(SAMPLES / "diverged.sqlite")
    bad = df[~np.isfinite(df["amax"])]
    assert ("h.1.mlp.fc", "forward") in set(zip(bad["module"], bad["phase"]))  # the sample's overflow
    fig = figures.headroom_figure(df)
    fwd = next(t for t in fig.data if t.name == "forward max |value|" and t.showlegend is False)
    i = list(fwd.y).index("h.1.mlp.fc")
    assert fwd.x[i] > 65504 and fwd.text[i] == "inf" and fwd.marker.color[i] == figures.SKIP_COLOR
    assert fwd.marker.pattern.shape[i] == "x"
    legend = {t.name: t.marker.color for t in fig.data if t.showlegend is not False}
    assert legend["forward max |value|"] == figures.PHASE_COLOR["forward"]  # not the red of an overflowed bar
    assert legend["backward max |value|"] == figures.PHASE_COLOR["backward"]
    assert any(a.text == "dtype max 65504" and a.yref == "paper" for a in fig.layout.annotations)


def test_scale_panel_says_why_it_is_empty_or_broken():
    bf16 = rundata.overview_data(SAMPLES / "bf16_noscaler.sqlite")
    fig = figures.overview_figure(bf16)
    note = next(a for a in fig.layout.annotations if "no loss scale recorded" in a.text)
    # on the page, inside the scale panel: with no trace there Plotly drops its axes, and a note
    # anchored to them landed in the loss panel and stretched the step axis to -70
    assert note.xref == note.yref == "paper"
    assert fig.layout.yaxis2.domain[0] < note.y < fig.layout.yaxis2.domain[1]
    steps = pd.DataFrame({"step": [0, 1, 2, 3], "loss_scale": [4.0, 0.0, 0.0, 2.0]})
    assert figures.scale_note(steps) == "scale 0 at 2 steps (1–2): not drawable on a log axis, a gap"
    assert figures.scale_note(steps.assign(loss_scale=[4.0, 0.0, 1.0, 2.0])) == \
        "scale 0 at step 1: not drawable on a log axis, a gap"
    assert figures.scale_note(steps.assign(loss_scale=[4.0, 2.0, 1.0, 0.5])) is None


def test_heatmap_single_steps_start_where_they_happened_on_a_step_axis():
    # layer_every=10 plus one skipped step at 23: given as centres, its cell would span 21.5..26.5 and
    # the one at 20 would start at 15; as edges each cell runs from its step to the next recorded one
    grid = layerdata.LayerGrid(names=["a"], metric="grad_norm", bucket_starts=np.array([0, 10, 20, 23, 30]), width=1,
                              values=np.ones((1, 5)), nonfinite=np.zeros((1, 5), dtype=bool))
    fig = figures.heatmap_figure(grid)
    assert fig.layout.xaxis.type == "linear" and list(fig.data[0].x) == [0, 10, 20, 23, 30, 31]
    assert np.asarray(fig.data[0].text).tolist() == [[0, 10, 20, 23, 30]]  # hover names the step
    wide = layerdata.LayerGrid(names=["a"], metric="grad_norm", bucket_starts=np.array([0, 10, 20]), width=10,
                              values=np.ones((1, 3)), nonfinite=np.zeros((1, 3), dtype=bool))
    assert list(figures.heatmap_figure(wide).data[0].x) == [0, 10, 20]  # buckets: their starts


def test_a_log_axis_of_one_or_two_decades_is_labelled_at_1_2_5():
    """diverged's loss runs 0.32-4.2: Plotly labelled every digit in full (0.3 0.4 ... 0.9 1 2 3 4),
    nine labels stacked into the bottom of a 175-pixel panel."""
    fig = figures.overview_figure(rundata.overview_data(SAMPLES / "diverged.sqlite"))
    ticks = np.asarray(fig.layout.yaxis.tickvals, dtype=float)
    assert fig.layout.yaxis.tickmode == "array" and len(ticks)
    assert {round(t / 10.0 ** np.floor(np.log10(t) + 1e-9)) for t in ticks} == {1, 2, 5}
    shown = ticks[(ticks >= 0.32) & (ticks <= 4.2)]
    assert shown.tolist() == pytest.approx([0.5, 1, 2])
    wide = figures.overview_figure(rundata.overview_data(SAMPLES / "healthy_fp16.sqlite"), log_loss=False)
    assert wide.layout.yaxis.type == "linear" and wide.layout.yaxis.tickvals is None


def test_loss_scale_axis_labels_the_first_and_the_lowest_scale():
    """diverged's scale runs 2^16 -> 2^-53: ticks every 10 from 2^-53 stopped at 2^7, so the scale the
    run held for 180 steps (2^16) had no label; overflow_storm's 2^24 start had none either."""
    for run, ends in (("diverged.sqlite", ("2^16", "2^-53")), ("overflow_storm.sqlite", ("2^24", "2^-11"))):
        fig = figures.overview_figure(rundata.overview_data(SAMPLES / run))
        text = list(fig.layout.yaxis2.ticktext)
        assert ends[0] in text and ends[1] in text, (run, text)
        ks = sorted(int(t[2:]) for t in text)
        assert 4 <= len(ks) <= 8 and min(b - a for a, b in zip(ks, ks[1:])) >= (ks[-1] - ks[0]) / 14
