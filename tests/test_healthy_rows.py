"""A healthy detail step's module rows come from a few tensor ops (record/healthy.py), not from the
per-slot origin analysis: on real packs of real training they must equal what that analysis gives,
aliases (residual stream, containers handing on their child's output), a shared module, and a
module output changed in place included; a step with a non-finite slot still goes the full way."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ampwatch
from ampwatch.record import origins, packing
from helpers.loops import amp_step

pytestmark = pytest.mark.usefixtures("record_path")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU()

    def forward(self, x):
        h = self.fc(x)
        h.mul_(0.5)  # in place, outside any module: fc's output is measured as changed once
        return x + self.act(h)  # the residual stream: x is its input and the previous block's output


class Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.shared = nn.Linear(width, width)  # called twice a step
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        h = self.blocks(self.inp(x))
        return self.head(self.shared(self.shared(h)))


def _captured(monkeypatch) -> tuple[list, object]:
    packs = []
    rows = packing.PackReader.rows

    def keep(reader, pack):  # our own writer-side function: the pack it converts, kept to check
        packs.append((reader, pack))
        return rows(reader, pack)
    monkeypatch.setattr(packing.PackReader, "rows", keep)
    return packs, rows


def _full_analysis_rows(reader, pack) -> list[tuple]:
    values, stats, _ = packing._Analysis(reader, pack).get(force=True)
    return [(reader.module_ids[m], 0 if phase == origins.FORWARD else 1, pack.step, None if s.amax != s.amax else s.amax, int(s.nonfinite))
            for (m, phase), s in stats.items() if phase != origins.INPUT]  # the batch's own: an event, no module row


def test_healthy_module_rows_equal_the_full_analysis(tmp_path, monkeypatch):
    packs, rows = _captured(monkeypatch)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(32, 8), torch.randn(32, 2)
    truth: dict = {}  # independent ground truth: per step, max |output| of the shared module's two calls
    step_of = [0]
    model.shared.register_forward_hook(lambda m, a, out: truth.__setitem__(
        step_of[0], max(truth.get(step_of[0], 0.0), out.detach().abs().max().item())))
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "run.sqlite"), layer_every=1) as watch:
        for step in range(6):
            step_of[0] = step
            xb = x.clone()
            if step == 4:
                xb[0, 0] = float("nan")  # a bad step: the full analysis, an event
            amp_step(model, opt, scaler, xb, y)
    checked = 0
    for reader, pack in packs:
        if not (pack.loc and pack.loc["observed"]):
            continue
        fast = rows(reader, pack).modules  # the reader as the writer runs it
        full = _full_analysis_rows(reader, pack)
        assert sorted(fast) == sorted(full), f"step {pack.step}"
        healthy = packing._Analysis(reader, pack).healthy_amax() is not None
        assert healthy == (pack.step != 4), f"step {pack.step}"
        checked += healthy
    assert checked >= 4
    assert any(p.loc["changed"] for _, p in packs if p.loc), "fc's output changed in place: the plan must leave it out"
    run = ampwatch.load(watch.path)
    assert set(run.modules["step"]) == set(range(6))
    assert run.modules[run.modules.step != 4]["nonfinite"].sum() == 0
    assert (run.events.step == 4).any() and set(run.events.step) == {4}
    shared = run.modules[(run.modules.module == "shared") & (run.modules.phase == "forward")].set_index("step")
    for step in (0, 1, 2, 3, 5):
        assert shared.amax[step] == pytest.approx(truth[step], rel=1e-6)
