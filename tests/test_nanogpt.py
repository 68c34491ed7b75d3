"""nanoGPT's loop (examples/nanogpt_loop.py) recorded with one line; every column is checked
against the numbers the loop computes itself, including the loss nanoGPT prints."""
from __future__ import annotations

import importlib.util
import math
import re
import sqlite3
import sys
from pathlib import Path

import pytest
import torch

import ampwatch
from ampwatch.dashboard import figures
from ampwatch.dashboard import layerdata

_spec = importlib.util.spec_from_file_location(
    "nanogpt_loop", Path(__file__).resolve().parents[1] / "examples" / "nanogpt_loop.py")
ng = importlib.util.module_from_spec(_spec)
sys.modules["nanogpt_loop"] = ng  # dataclasses look their module up
_spec.loader.exec_module(ng)

ITERS = 8


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    # init_scale 2^24: the first steps overflow and are skipped inside the fused AdamW kernel
    out = tmp_path_factory.mktemp("nanogpt") / "nanogpt.sqlite"
    return ng.train(str(out), max_iters=ITERS, init_scale=2.0 ** 24, verbose=False)


def test_every_column_matches_the_loops_own_numbers(recorded):
    truth, run = recorded["truth"], ampwatch.load(recorded["path"])
    s = run.steps
    assert list(s["step"]) == list(range(ITERS))
    assert list(s["skipped"]) == truth["skipped"] and any(truth["skipped"]) and not all(truth["skipped"])
    assert list(s["loss_scale"]) == truth["scale"]
    assert list(s["lr"]) == pytest.approx(truth["lr"], rel=1e-12)
    assert set(s["micro_batches"]) == {4}
    ok = [not k for k in truth["skipped"]]
    assert list(s["grad_norm"][ok]) == pytest.approx([g for g, k in zip(truth["grad_norm"], ok) if k], rel=1e-4)
    assert not any(math.isfinite(g) for g, k in zip(s["grad_norm"], ok) if not k)  # overflowed steps
    # the loss is the objective of the step (sum of loss / 4 = mean micro-batch loss) ...
    assert list(s["loss"]) == pytest.approx(truth["loss"], rel=1e-5)
    # ... on the scale of what nanoGPT prints (its last micro-batch x 4), not a quarter of it
    assert list(s["loss"]) == pytest.approx(truth["printed"], rel=0.05)
    info = run.info
    assert info["loss_definition"] == "scaled-sum" and info["clip_max_norm"] == recorded["grad_clip"]
    assert info["optimizer"] == "AdamW" and info["scaler_enabled"] and info["amp_dtype"] == "float16"
    model = recorded["model"]
    assert info["param_count"] == sum(p.numel() for p in model.parameters())  # the tied weight once
    t = run.tensors.set_index("name")
    assert t.loc["transformer.wte.weight", "aliases"] == "lm_head.weight"
    assert "lm_head.weight" not in t.index
    grid = layerdata.layer_heatmap(recorded["path"])  # the Layers page names the tensor by both names
    assert "transformer.wte.weight = lm_head.weight" in grid.labels
    assert "transformer.wte.weight = lm_head.weight" in list(figures.heatmap_figure(grid).data[0].y)


def test_attaching_changes_no_number(recorded, tmp_path):
    plain = ng.train(None, max_iters=ITERS, init_scale=2.0 ** 24, verbose=False)
    for (name, a), b in zip(plain["model"].named_parameters(), recorded["model"].parameters()):
        assert torch.equal(a, b), name
    assert repr(plain["truth"]) == repr(recorded["truth"])  # repr: NaN norms of skipped steps compare equal


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    """ln_f's bias +100 on each element before iteration 3: a weight overwritten outside training."""
    return ng.train(str(tmp_path_factory.mktemp("fault") / "fault.sqlite"), max_iters=5, fault=(3, 100.0),
                    verbose=False)


def test_a_weight_gradient_overflow_in_lm_head_is_named_lm_head(faulted):
    """ln_f's bias +100: lm_head's fp16 weight gradient overflows while every activation gradient
    stays finite. The tied tensor is first named transformer.wte.weight, but the embedding runs in
    fp32 and cannot overflow: the event names lm_head.weight, with the embedding as its alias."""
    result = faulted
    run = ampwatch.load(result["path"])
    assert result["truth"]["skipped"][3]
    tied = run.events[run.events["aliases"] != ""]
    assert len(tied) and set(tied["module"]) == {"lm_head.weight"} and set(tied["phase"]) == {"param_grad"}
    assert set(tied["aliases"]) == {"transformer.wte.weight"} and set(tied["step"]) >= {3}


def test_the_doctor_says_the_bias_was_overwritten_instead_of_nothing_to_fix(faulted, recorded):
    """ln_f's bias starts at zero, so no ratio of its recorded norms can show it jumped, and the
    overflow shows in another module (lm_head's weight gradient). AdamW moves each element by about
    its learning rate a step; this bias moved by 100 an element in one step. Two rare skips would
    otherwise read "nothing to fix"."""
    name = "transformer.ln_f.bias"
    with sqlite3.connect(f"file:{faulted['path']}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT l.step, l.param_norm FROM layers l JOIN tensors t ON t.id = l.param_id "
                            "WHERE t.name = ? AND l.grad_zero_frac IS NOT NULL AND l.step <= 3 ORDER BY l.step",
                            (name,)).fetchall()
    (s0, before), (s1, after) = rows[-2:]
    # the ground truth, from the loop: zeros at init, then +100 on each of its 32 elements at step 3
    assert (s0, s1) == (0, 3) and before == 0.0 and after == pytest.approx(100 * math.sqrt(32), rel=1e-3)
    reach = math.sqrt(32) * sum(faulted["truth"]["lr"][s0:s1])  # ~lr per element a step
    findings = ampwatch.diagnose(faulted["path"])
    hit = [f for f in findings if "something overwrote it" in f.advice]
    assert len(hit) == 1 and hit[0].advice.startswith(name), [(f.id, f.advice) for f in findings]
    f = hit[0]
    assert f.severity == "warning" and f.cause is None and f.steps[0] == 3
    m = re.search(rf"the norm of {re.escape(name)} went from 0 to ([\d,.]+) between steps 0 and 3, "
                  r"([\d,]+)x as far as AdamW moves it in 3 steps", f.evidence)
    assert m, f.evidence
    assert float(m.group(1).replace(",", "")) == pytest.approx(after, abs=0.5)
    assert float(m.group(2).replace(",", "")) == pytest.approx((after - before) / reach, rel=1e-3)
    assert "checkpoint saved by the end of step 2" in f.advice
    assert not any("Nothing to fix" in x.advice for x in findings)
    # the same loop without the fault (its first steps skipped at the start scale): no such claim
    assert not [x for x in ampwatch.diagnose(recorded["path"]) if "overwrote" in x.advice + x.evidence]


def test_a_bf16_loss_spike_is_traced_to_the_overwritten_bias(tmp_path):
    """bf16 without a scaler: nothing skips and nothing goes NaN when ln_f's bias is overwritten at
    iteration 30; the loss jumps ~6x and stays up. The spike is seen at step 30 (with 30 steps of
    history), and the norms measured at steps 20 and 40 show the bias moved far beyond AdamW's reach."""
    result = ng.train(str(tmp_path / "bf16.sqlite"), max_iters=42, dtype="bfloat16", fault=(30, 100.0), verbose=False)
    loss = result["truth"]["loss"]
    assert loss[30] > 4 * max(loss[:30])  # the ground truth: the fault's step
    findings = ampwatch.diagnose(result["path"])
    spike = next(f for f in findings if f.id == "loss-spike")
    assert spike.steps[0] == 30 and spike.evidence.startswith("step 30: ")
    assert spike.title.startswith("Loss spiked once: up to ")
    assert "of the previous 30 (" in spike.evidence  # not "of the previous 50": there were 30
    # the bias had moved off zero by step 20: its norm jumped by a ratio, and far beyond AdamW's reach
    assert re.search(r"the norm of transformer\.ln_f\.bias jumped [\d,.e+]+x between steps 20 and 40 \([\d.]+ -> [\d,]+\), "
                     r"[\d,]+x as far as AdamW moves it in 20 steps", spike.evidence), spike.evidence
    assert spike.advice.startswith("transformer.ln_f.bias changed far more than training moves weights")
    assert "checkpoint saved by the end of step 29" in spike.advice
    # the gradient norm exploded at the same step for the same reason: one root cause, not two
    burst = next(f for f in findings if f.id == "grad-norm-explosion")
    assert burst.steps[0] == 30 and burst.cause == "loss-spike" and spike.cause is None
    assert [f.id for f in findings if f.cause is None] == ["loss-spike"]


def test_the_doctor_names_the_tied_weight_by_the_module_that_overflowed(tmp_path):
    """Without a GradScaler (a hand-scaled fp16 loss) a weight-gradient overflow is an error finding."""
    torch.manual_seed(0)
    model = ng.GPT(ng.GPTConfig())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = (torch.randint(64, (4, 16), generator=torch.Generator().manual_seed(i)) for i in (0, 1))
    with torch.no_grad():
        model.transformer.ln_f.bias.add_(100.0)
    with ampwatch.attach(model, opt, path=str(tmp_path / "manual.sqlite")) as watch:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                _, loss = model(x, y)
            (loss * 2.0 ** 14).backward()
            watch.log(loss=loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
    origin = next(f for f in ampwatch.diagnose(ampwatch.load(watch.path)) if f.id == "nonfinite-origin")
    assert "born in lm_head.weight" in origin.title
    assert "lm_head.weight (tied: also transformer.wte.weight)" in origin.evidence


def test_a_shared_module_and_its_weight_keep_every_name(tmp_path):
    torch.manual_seed(0)
    block = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(block, torch.nn.ReLU(), block)  # one module, registered twice
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampwatch.attach(model, opt, path=str(tmp_path / "shared.sqlite")) as watch:
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        watch.log(loss=loss)
        opt.step()
    t = ampwatch.load(watch.path).tensors.set_index("name")
    assert t.loc["0.weight", "aliases"] == "2.weight" and t.loc["0.bias", "aliases"] == "2.bias"
    assert t.loc["0", "aliases"] == "2" and "2" not in t.index
