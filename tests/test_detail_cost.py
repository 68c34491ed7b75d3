"""What the per-layer detail steps cost, read from a run's own step times (doctor/cost.py): the
summary's ``recorder`` line and the doctor's ``detail-cost`` finding. Ground truth: a delay the
loop itself adds on every ``layer_every``-th step (a forward pre-hook of the user's that sleeps),
against a loop that sleeps alike on every step."""
from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

import ampwatch
from ampwatch.cli.main import cli
from ampwatch.doctor.cost import SHARE_NOTE, detail_cost
from helpers.loops import amp_step

EVERY = 5
BASE_S = 0.010
EXTRA_S = 0.020


def _run(path, *, extra_s: float, steps: int = 60, base_s: float = BASE_S) -> None:
    """fp16 + GradScaler on a tiny MLP; every step sleeps ``base_s``, every EVERY-th ``extra_s``
    more, by the loop's own count."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    at = {"step": 0}
    model.register_forward_pre_hook(
        lambda m, a: time.sleep(base_s + (extra_s if at["step"] % EVERY == 0 else 0.0)))
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    with ampwatch.attach(model, opt, scaler, path=path, layer_every=EVERY):
        for step in range(steps):
            at["step"] = step
            amp_step(model, opt, scaler, x, y)


def test_a_slow_detail_step_is_measured_and_a_layer_every_proposed(tmp_path, restore_runs_env):
    path = tmp_path / "slow.sqlite"
    _run(path, extra_s=EXTRA_S)
    run = ampwatch.load(path)
    cost = detail_cost(run.steps, run.info["layer_every"])
    assert cost is not None and cost.measurable and cost.n_observed == 11  # steps 5..55, past the first block
    # the 20 ms the loop added, plus what the detail itself costs this tiny model (about half a
    # millisecond), give or take what a busy machine does to two medians
    lo, hi = 0.7 * EXTRA_S, EXTRA_S + 0.010
    assert lo < cost.extra_s < hi
    assert BASE_S < cost.between_s < BASE_S + 0.015
    found = [f for f in ampwatch.diagnose(run) if f.id == "detail-cost"]
    assert len(found) == 1 and found[0].severity == "info"
    every = cost.every_for(SHARE_NOTE)
    # the layer_every that brings the share under 1%, bounded from the injected delay
    assert int(np.ceil(lo / (SHARE_NOTE * (BASE_S + 0.015)))) <= every <= int(np.ceil(hi / (SHARE_NOTE * BASE_S)))
    assert f"attach with layer_every={every:,}" in found[0].advice
    assert f"costs {cost.share:.1%} of this run's time" in found[0].title and cost.share > 0.2
    out = CliRunner().invoke(cli, ["summary", str(path)])
    assert out.exit_code == 0
    line = f"{cost.extra_s * 1e3:+,.2f} ms on every 5th step (per-layer detail, {cost.ratio:.3f}x)"
    assert f"recorder {line}" in out.output
    from helpers.app_pages import open_page  # and the dashboard's overview says the same
    at = open_page(tmp_path, "overview", run="slow.sqlite")
    assert not at.exception, [e.value for e in at.exception]
    assert any(c.value.startswith(f"ampwatch: {line}") for c in at.caption), [c.value for c in at.caption]


def test_a_detail_step_that_costs_little_is_not_a_finding(tmp_path):
    """Steps of 40 ms, alike: the tiny MLP's own detail (about half a millisecond here) is well
    under 1% of them, one step in five."""
    path = tmp_path / "even.sqlite"
    _run(path, extra_s=0.0, base_s=0.040)
    run = ampwatch.load(path)
    cost = detail_cost(run.steps, run.info["layer_every"])
    assert cost is not None and abs(cost.extra_s) < 0.005 and 0.040 < cost.between_s < 0.055
    assert cost.share < SHARE_NOTE
    assert not [f for f in ampwatch.diagnose(run) if f.id == "detail-cost"]
    out = CliRunner().invoke(cli, ["summary", str(path)])
    assert out.exit_code == 0 and "every 5th step" in out.output.split("recorder ")[1]


def _steps(durations, every=EVERY, skipped=()):
    n = len(durations)
    return pd.DataFrame({"step": np.arange(n), "duration_s": durations,
                         "skipped": [i in skipped for i in range(n)]})


def test_the_figure_leaves_out_the_first_block_and_skipped_steps_and_needs_enough_steps():
    d = np.full(100, 0.010)
    d[::EVERY] = 0.012
    d[:EVERY] = 5.0      # compiling
    d[50] = 9.0          # a skipped step's replay (50 is a detail step)
    cost = detail_cost(_steps(d, skipped={50}), EVERY)
    assert cost is not None and cost.extra_s == pytest.approx(0.002) and cost.n_observed == 18
    assert cost.share == pytest.approx(0.002 / (EVERY * 0.010))
    assert cost.every_for(0.01) == 20 and cost.every_for(0.5) == EVERY  # never below what it is
    assert detail_cost(_steps(d[:3 * EVERY]), EVERY) is None  # two detail steps past the first block
    assert detail_cost(_steps(d), 1) is None and detail_cost(_steps(d), None) is None
