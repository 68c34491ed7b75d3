"""A skipped step whose replay comes out finite (the accelerator path, forced on the CPU): a one-shot
fault, as a bit flip would be, hits the forward of step 3 once; the replay runs the step again with
the same weights, inputs, RNG and autocast state and finds nothing. The doctor says what that rules
out and names a transient fault as a candidate."""
from __future__ import annotations

import torch
from torch import nn

import ampwatch
from loops import amp_step


class OneShot(nn.Module):
    """Identity, except that the first call at ``step`` writes an inf into its output (once)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.now, self.fired = step, -1, []

    def forward(self, x):
        if self.now == self.step and not self.fired:
            self.fired.append(self.now)
            x = x.clone()
            x.view(-1)[0] = float("inf")
        return x


def test_a_step_that_does_not_reproduce_names_a_transient_fault(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")  # the path a GPU takes: replay skipped steps
    torch.manual_seed(0)
    flip = OneShot(step=3)
    model = nn.Sequential(nn.Linear(16, 32), flip, nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", growth_interval=1000)
    g = torch.Generator().manual_seed(0)
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "flip.sqlite")) as watch:
        for step in range(6):
            flip.now = step
            amp_step(model, opt, scaler, torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
    run = ampwatch.load(watch.path)
    assert flip.fired == [3]  # the truth: one fault, at step 3, in the original forward only
    skipped = run.steps.loc[run.steps["skipped"], "step"].tolist()
    assert skipped == [3]
    assert run.notices[["step", "code"]].values.tolist() == [[3, "replay-not-reproduced"]]
    found = {f.id: f for f in ampwatch.diagnose(run)}
    f = found["step-not-reproduced"]
    assert f.severity == "warning" and f.steps == (3, 3)
    for ruled_out in ("weights", "inputs", "RNG", "autocast state"):
        assert ruled_out in f.evidence
    assert "transient fault" in f.evidence and "another device" in f.advice
