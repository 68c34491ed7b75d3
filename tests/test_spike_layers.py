"""A step whose gradient norm spikes gets its per-layer gradient norms written (they come with
every step's pack), so the doctor names the layer that grew, on a step between ``layer_every``
steps. Ground truth: the one parameter whose gradient the loop itself multiplied at that step."""
from __future__ import annotations

import pytest
import torch

import ampwatch
from ampwatch.record.spikes import MAX_STEPS, MIN_HISTORY, SpikeWatch

EVERY = 10
SPIKE = 47
FACTOR = 300.0


def _run(path, *, spike_at=SPIKE, steps=60):
    """bf16 autocast, AdamW, no scaler: a gradient multiplied FACTOR times stays finite."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    at = {"step": 0}
    model[2].weight.register_hook(lambda g: g * FACTOR if at["step"] == spike_at else g)
    g = torch.Generator().manual_seed(0)
    norms = []
    with ampwatch.attach(model, opt, path=path, layer_every=EVERY) as watch:
        for step in range(steps):
            at["step"] = step
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            watch.log(loss=loss)
            norms.append({n: p.grad.norm().item() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
    return norms


def test_a_gradient_spike_between_layer_every_steps_names_the_layer_that_grew(tmp_path, record_path):
    path = tmp_path / "spike.sqlite"
    truth = _run(path)
    run = ampwatch.load(path)
    layers = run.layers
    # detail steps, and the spike: no other healthy step got rows
    assert set(layers["step"]) == {0, 10, 20, 30, 40, 50, SPIKE}
    at = layers[layers["step"] == SPIKE].set_index("name")
    assert dict(at["grad_norm"]) == pytest.approx(truth[SPIKE], rel=1e-4)
    assert at["grad_amax"].isna().all() and at["grad_zero_frac"].isna().all()  # only what the pack brought
    found = [f for f in ampwatch.diagnose(run) if f.id == "grad-norm-explosion"]
    assert len(found) == 1 and found[0].steps[0] == SPIKE
    assert f"at step {SPIKE} the gradient grew most in 2.weight " in found[0].evidence
    named = found[0].evidence.split("grew most in ")[1]
    assert "0.weight" not in named and "4.weight" not in named  # the others did not grow 3x


def test_no_spike_no_extra_rows(tmp_path):
    path = tmp_path / "calm.sqlite"
    _run(path, spike_at=-1)
    assert set(ampwatch.load(path).layers["step"]) == {0, 10, 20, 30, 40, 50}


def test_the_spike_watch_needs_history_compares_with_the_window_maximum_and_stops_at_its_cap():
    watch = SpikeWatch()
    assert not any(watch.spiked(1.0, 2.0) for _ in range(MIN_HISTORY - 1))
    assert not watch.spiked(100.0, 2.0)  # one value short of a judgement; it joins the window
    assert not watch.spiked(250.0, 2.0)  # 2.5x the window's maximum (100): under 3x
    assert watch.spiked(800.0, 2.0)      # 3.2x it
    assert watch.spiked(None, 2.0 * 2.0)  # the loss: 2x the largest loss before
    assert not watch.spiked(float("inf"), float("nan"))  # non-finite values are the events' business
    watch.steps = MAX_STEPS
    assert not watch.spiked(1e9, None)
