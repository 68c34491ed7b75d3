"""Early warnings on real runs (fp16 autocast on the CPU, a real GradScaler): a module's maximum
growing toward 65,504 is named before the step it overflows; the committed sample runs get no
early warning where nothing grows toward a limit.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampwatch
from loops import data

FP16_MAX = 65504.0
GROWTH = 1.5
SAMPLES = Path(__file__).resolve().parents[1] / "sample_runs"


def _growing_run(path, steps: int = 40):
    """An MLP whose middle Linear's weights are multiplied by GROWTH before every step; also returns
    the truth: that Linear's fp16 output max per step (the test's own hook) and the first step at
    which it was non-finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    seen: dict[int, float] = {}
    state = {"step": -1}
    model[2].register_forward_hook(
        lambda m, a, out: seen.__setitem__(state["step"], float(out.detach().float().abs().max())))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.attach(model, opt, scaler, path=str(path), layer_every=2) as watch:
        for step in range(steps):
            state["step"] = step
            with torch.no_grad():
                model[2].weight.mul_(GROWTH)
            x, y = data(step, 16)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    overflow = next(s for s in sorted(seen) if not seen[s] < float("inf"))
    return ampwatch.load(watch.path), seen, overflow


def test_a_linear_growing_toward_fp16s_limit_is_named_before_it_overflows(tmp_path):
    run, seen, overflow = _growing_run(tmp_path / "grow.sqlite")
    assert overflow > 10  # the truth: it grows for a while, then overflows
    warn = [f for f in ampwatch.diagnose(run) if f.id == "activation-trend"]
    assert warn and warn[0].severity == "warning", [f.id for f in ampwatch.diagnose(run)]
    w = warn[0]
    assert "Activations of 2 " in w.title
    assert w.steps[1] < overflow  # said from steps before the overflow
    per_step = float(w.title.split(" grow ")[1].split("x")[0])
    assert per_step == pytest.approx(GROWTH, rel=0.05)
    projected = int(w.title.split("step ~")[1].split(" ")[0].replace(",", ""))
    assert abs(projected - overflow) <= 3, (projected, overflow)


@pytest.mark.parametrize("sample", sorted(p.name for p in SAMPLES.glob("*.sqlite")))
def test_no_early_warning_on_the_sample_runs(sample):
    findings = ampwatch.diagnose(SAMPLES / sample)
    ids = [f.id for f in findings]
    assert "activation-trend" not in ids
    # overflow_storm and diverged do keep backing off; the falling scale is then a consequence
    assert all(f.cause is not None for f in findings if f.id == "scale-falling"), [(f.id, f.cause) for f in findings]


def test_a_scale_that_keeps_backing_off_is_a_warning_explained_by_its_origin(tmp_path):
    """A backward-only overflow (x1e6) on every other step from step 10: the scaler backs off each
    time and never grows (growth_interval 1000). The truth, counted here from the steps: more
    backoffs than growths and the scale 8x+ lower."""
    from loops import Amplify
    torch.manual_seed(0)
    state = {"step": -1}
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    bad = set(range(10, 24, 2))
    model[1].register_forward_hook(lambda m, a, out: Amplify.apply(out) if state["step"] in bad else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", growth_interval=1000)
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "fall.sqlite")) as watch:
        for step in range(24):
            state["step"] = step
            x, y = data(step, 16)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    run = ampwatch.load(watch.path)
    scale = run.steps["loss_scale"].to_numpy()
    assert (scale[1:] < scale[:-1]).sum() >= 4 and scale[-1] * 8 <= scale[0]
    findings = ampwatch.diagnose(run)
    fall = [f for f in findings if f.id == "scale-falling"]
    assert fall and fall[0].severity == "warning" and fall[0].steps[0] == 10
    assert fall[0].cause is not None  # the recurring overflow that makes it
