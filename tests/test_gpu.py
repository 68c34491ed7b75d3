"""The recorder on CUDA: the transfer/event path, fused AdamW, a real fp16 overflow. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampwatch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).cuda()


def _train(tmp_path, model, opt, steps, fault_step=None, compiled=False, layer_every=1):
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10, growth_interval=1000)
    g = torch.Generator(device="cuda").manual_seed(0)
    truth = []
    torch._dynamo.reset()
    mode = compiled if isinstance(compiled, str) else "default"
    net = torch.compile(model, mode=mode) if compiled else model
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite"),
                        layer_every=layer_every) as watch:
        for step in range(steps):
            if step == fault_step:
                with torch.no_grad():
                    model[2].weight.mul_(1e6)  # fp16 output of module "2" > 65504
            x = torch.randn(16, 32, device="cuda", generator=g)
            y = torch.randn(16, 8, device="cuda", generator=g)
            with torch.autocast("cuda", dtype=torch.float16):
                out = net(x)
            loss = F.mse_loss(out.float(), y)
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()]))
            truth.append((float(loss), scale, float(norm) / scale))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return ampwatch.load(watch.path), truth


def test_cuda_transfer_path_records_the_true_values(tmp_path):
    model = _net()
    run, truth = _train(tmp_path, model, torch.optim.SGD(model.parameters(), lr=1e-2), 5)
    steps = run.steps
    assert list(steps["step"]) == list(range(5))
    assert steps["loss"].tolist() == pytest.approx([t[0] for t in truth], rel=1e-5)
    assert steps["loss_scale"].tolist() == [t[1] for t in truth]
    assert steps["grad_norm"].tolist() == pytest.approx([t[2] for t in truth], rel=1e-3)
    assert not steps["skipped"].any() and run.events.empty


def test_fused_adamw_on_cuda_skip_is_recorded(tmp_path):
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    run, truth = _train(tmp_path, model, opt, 4, fault_step=2)
    steps = run.steps.set_index("step")
    assert steps.loc[2, "skipped"] and not steps.loc[[0, 1], "skipped"].any()
    assert steps.loc[3, "loss_scale"] == steps.loc[2, "loss_scale"] / 2


@pytest.mark.parametrize("layer_every", [1, 20], ids=["live", "replayed"])
@pytest.mark.parametrize("compiled", [False, True, "reduce-overhead"], ids=["eager", "compiled", "cudagraphs"])
def test_real_fp16_overflow_on_cuda_is_localized(tmp_path, compiled, layer_every):
    """layer_every=1 observes every step live; at 20 steps 2 and 3 are replayed (record/replay.py),
    with the CUDA RNG state put back. With CUDA graphs ('reduce-overhead') the op must run on every
    step, not only when the graph was captured: module rows on every live step, each step's own."""
    model = _net()
    run, _ = _train(tmp_path, model, torch.optim.SGD(model.parameters(), lr=1e-2), 4, fault_step=2,
                    compiled=compiled, layer_every=layer_every)
    ev = run.events
    origin = ev[ev.origin & (ev.phase == "forward")]
    # the scaled weights stay scaled (the skipped step does not update them): every later step
    # overflows again, in the same module
    assert set(origin["module"]) == {"2"} and list(origin["step"]) == [2, 3]
    assert origin["dtype"].iloc[0] == "float16" and origin["count"].isna().all()  # counts: not paid on CUDA
    assert run.steps.set_index("step").loc[2, "skipped"]
    if layer_every == 1:
        first = run.modules[(run.modules.module == "0") & (run.modules.phase == "forward")]
        assert list(first["step"]) == [0, 1, 2, 3] and first["amax"].nunique() > 1  # not one capture's value
