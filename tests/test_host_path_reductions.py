"""The CPU (host) path: module values are reduced only on steps that need them.

Where reads are free, a step's queued module tensors are reduced when its backward ends, and only
when the loss or a gradient is non-finite, on ``layer_every`` steps, or while the observer learns
the model's structure. The ground truths here are the dispatched ``aminmax`` ops (counted with a
real TorchDispatchMode) and a module that writes -inf where a ReLU masks it.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampwatch
from ampwatch.record.watch import _AutocastProbe
from helpers.loops import amp_step, data, mlp


class CountReductions(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.aminmax:
            self.count += 1
        return func(*args, **(kwargs or {}))


def reductions_per_step(model: nn.Module, steps: int, path) -> tuple[list[int], "ampwatch.Run"]:
    """Trains ``steps`` healthy CPU-path steps at ``layer_every=4``; the ``aminmax`` ops of each."""
    x, y = data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    per_step = []
    with ampwatch.attach(model, opt, scaler, path=str(path), layer_every=4) as watch:
        for _ in range(steps):
            with CountReductions() as counter:
                amp_step(model, opt, scaler, x, y)
            per_step.append(counter.count)
    run = ampwatch.load(watch.path)
    assert not run.steps["skipped"].any() and run.events.empty
    return per_step, run


def test_healthy_steps_between_layer_every_steps_reduce_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("AMPWATCH_CPU_AS_ACCELERATOR", raising=False)
    per_step, run = reductions_per_step(mlp(), 9, tmp_path / "r.sqlite")
    # module values: the input, 5 module outputs and 5 output gradients; per-parameter detail: 6
    assert per_step[0] == per_step[4] == per_step[8] == 11 + 6
    assert [per_step[i] for i in (1, 2, 3, 5, 6, 7)] == [0] * 6
    assert sorted(set(run.modules["step"])) == [0, 4, 8]  # module rows on layer_every steps, as before


def test_a_deep_model_reduces_nothing_between_layer_every_steps(tmp_path, monkeypatch):
    """~80 observed tensors a step (40 modules, outputs and their gradients): more than the
    accelerator path's 64-tensor chunk, which the host queue once used as its bound too, making
    every step of any model beyond ~30 modules reduce everything."""
    monkeypatch.delenv("AMPWATCH_CPU_AS_ACCELERATOR", raising=False)
    torch.manual_seed(0)
    layers = []
    for _ in range(20):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    per_step, run = reductions_per_step(nn.Sequential(*layers, nn.Linear(16, 4)), 6, tmp_path / "r.sqlite")
    # the input, 41 module outputs and their 41 gradients, and per-parameter detail for 42 tensors
    assert per_step[0] == per_step[4] == 1 + 41 + 41 + 42
    assert [per_step[i] for i in (1, 2, 3, 5)] == [0] * 4
    assert sorted(set(run.modules["step"])) == [0, 4]


class WriteMinusInf(nn.Module):
    """A forward value that overflows to -inf and never reaches the loss or a gradient: the ReLU
    after it turns -inf into 0 and passes no gradient back through that element."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        out[0, 0] = -float("inf")
        return out


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "live"])
def test_a_masked_nonfinite_value_is_seen_on_layer_every_steps_on_the_cpu_path(tmp_path, record_path, replay):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), WriteMinusInf(), nn.ReLU(), nn.Linear(32, 4))
    x, y = data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite"), layer_every=4, replay=replay) as watch:
        for _ in range(9):
            amp_step(model, opt, scaler, x, y)
    run = ampwatch.load(watch.path)
    assert not run.steps["skipped"].any()  # the loss and every gradient stayed finite
    origin = run.events[run.events.origin]
    assert set(origin["module"]) == {"1"} and set(origin["phase"]) == {"forward"}
    # the accelerator path observing live reduces every step; the CPU path only where the values are
    # needed, and the accelerator path with replay (the default) observes layer_every steps only
    expected = set(range(9)) if record_path == "accelerator" and not replay else {0, 4, 8}
    assert set(origin["step"]) == expected


def test_autocast_probes_leave_an_eager_model_after_the_first_step(tmp_path):
    model, (x, y) = mlp(), data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")

    def probes() -> int:
        return sum(isinstance(h, _AutocastProbe) for m in model.modules() for h in m._forward_pre_hooks.values())

    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite")) as watch:
        assert probes() == 1 + len(list(model.children()))
        amp_step(model, opt, scaler, x, y)
        assert probes() == 0
        amp_step(model, opt, scaler, x, y)
    assert ampwatch.load(watch.path).info["amp_dtype"] == "float16"  # what they were there to see


class FirstParameterSometimes(nn.Module):
    """The first trainable parameter gets a gradient on some steps only (``use_gate``): on the others
    the backward end's parameter trigger (backward.py) does not fire, so the watch must notice the
    first miss and keep the output trigger on from then on."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 16)
        self.net = mlp()
        self.use_gate = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.gate(x) if self.use_gate else x)


def test_gradients_are_measured_before_clipping_when_the_first_parameter_stops_getting_one(tmp_path):
    model, (x, y) = FirstParameterSometimes(), data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    truth = []
    with ampwatch.attach(model, opt, path=str(tmp_path / "r.sqlite")) as watch:
        for step in range(7):
            model.use_gate = step in (0, 1, 3, 5)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            watch.log(loss=loss)
            truth.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)))  # clips
            opt.step()
            opt.zero_grad(set_to_none=True)
    norms = ampwatch.load(watch.path).steps["grad_norm"].tolist()
    assert min(truth) > 1e-2
    # step 2 is the one the parameter trigger missed: its gradients are measured when the optimizer
    # steps, after the clip; from step 3 on the output trigger is on for good, as on steps 0 and 1
    kept = [0, 1, 3, 4, 5, 6]
    assert [norms[i] for i in kept] == pytest.approx([truth[i] for i in kept], rel=1e-5)
    assert norms[2] == pytest.approx(1e-3, rel=1e-3)
