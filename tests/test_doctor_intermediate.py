"""Overflows inside a module's own code, on real HF models with random weights (nothing downloaded):
fp16 autocast on the CPU with a real GradScaler, the ground truth computed here without ampwatch.

* GPT-2 with eager attention whose block-1 q/k projections are 1000x too large: the logits Q·Kᵀ,
  computed in ``GPT2Attention``'s own code, pass 65,504 while the module's fp32 output is finite.
  The fp32 recompute is finite, the re-run in float16 is not: "an intermediate inside the module
  overflows float16", with the attention advice.
* T5 whose block-0 feed-forward output projection ``wo`` is too large: the Linear's own output is
  beyond fp16 in fp32 too, so today's fp32 verdict ("float16's range is the problem") stays.
"""
from __future__ import annotations

import math

import pytest
import torch

import ampwatch
from ampwatch.doctor import diagnose

transformers = pytest.importorskip("transformers")

FP16_MAX = 65504.0
STEPS = 3


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # q and k columns of block 1's fused projection (n_embd, 3 * n_embd): q | k | v
        model.transformer.h[1].attn.c_attn.weight[:, :64] *= 1000.0
    return model


def _t5() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1,
                                num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)
    with torch.no_grad():
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight *= 1e5
    return model


def _ids(step: int) -> torch.Tensor:
    return torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(step))


def _loss(arch: str, model, ids):
    if arch == "gpt2":
        return model(input_ids=ids, labels=ids).loss
    return model(input_ids=ids, labels=ids[:, :8].contiguous()).loss


def _truth_gpt2() -> dict:
    """Without ampwatch, in fp32: block 1's attention logits (Q·Kᵀ before the 1/sqrt(d) scaling, as
    GPT-2's eager attention computes them) and whether the attention module's output is finite."""
    model = _gpt2()
    attn, seen = model.transformer.h[1].attn, {}
    hooks = [attn.c_attn.register_forward_hook(lambda m, a, o: seen.update(qkv=o.detach())),
             attn.register_forward_hook(lambda m, a, o: seen.update(out=o[0].detach()))]
    with torch.no_grad():
        model(input_ids=_ids(0))
    for h in hooks:
        h.remove()
    q, k, _ = seen["qkv"].float().split(32, dim=-1)
    q, k = (t.view(4, 16, 2, 16).transpose(1, 2) for t in (q, k))
    logits = float((q @ k.transpose(-1, -2)).abs().max())
    return {"logits": logits, "out_finite": bool(torch.isfinite(seen["out"]).all())}


def _truth_t5() -> float:
    """Without ampwatch, in fp32: max |output| of the feed-forward's wo on the first batch."""
    model = _t5()
    wo, seen = model.encoder.block[0].layer[1].DenseReluDense.wo, {}
    h = wo.register_forward_hook(lambda m, a, o: seen.update(out=o.detach()))
    with torch.no_grad():
        _loss("t5", model, _ids(0))
    h.remove()
    return float(seen["out"].abs().max())


def _train(path, arch: str) -> ampwatch.Run:
    model = _gpt2() if arch == "gpt2" else _t5()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.attach(model, opt, scaler, path=str(path)) as watch:
        for step in range(STEPS):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _loss(arch, model, _ids(step))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return ampwatch.load(watch.path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("intermediate")
    return {arch: _train(folder / f"{arch}.sqlite", arch) for arch in ("gpt2", "t5")}


def _root(findings):
    return next(f for f in findings if f.cause is None and f.severity == "error")


def test_attention_logits_beyond_fp16_are_an_intermediate_overflow(runs):
    truth = _truth_gpt2()
    assert truth["logits"] > FP16_MAX and truth["out_finite"]
    run = runs["gpt2"]
    ev = run.events
    origin = ev[ev["origin"] & (ev["phase"] == "forward") & (ev["step"] == 0)].iloc[0]
    assert origin["module"] == "transformer.h.1.attn"
    assert math.isfinite(origin["fp32_amax"]) and origin["fp32_amax"] < FP16_MAX  # the softmax-weighted values
    assert isinstance(origin["lowp_amax"], float) and not math.isfinite(origin["lowp_amax"])
    root = _root(diagnose(run))
    assert root.id == "nonfinite-origin" and "transformer.h.1.attn" in root.title and root.steps[0] == 0
    assert "an intermediate inside the module overflows float16" in root.evidence, root.evidence
    assert "logits" in root.advice and "scaled_dot_product_attention" in root.advice and "bf16" in root.advice
    assert "Cause undetermined" not in root.advice and "no fp32 verdict" not in root.evidence


def test_a_t5_feed_forward_overflow_keeps_the_fp32_verdict(runs):
    truth = _truth_t5()
    assert truth > FP16_MAX and math.isfinite(truth)
    run = runs["t5"]
    ev = run.events
    origin = ev[ev["origin"] & (ev["phase"] == "forward") & (ev["step"] == 0)].iloc[0]
    assert origin["module"] == "encoder.block.0.layer.1.DenseReluDense.wo"
    assert origin["fp32_amax"] == pytest.approx(truth, rel=1e-2)
    assert not math.isfinite(origin["lowp_amax"])  # re-run in float16 it overflows again
    root = _root(diagnose(run))
    assert "DenseReluDense.wo" in root.title
    assert "range is the problem" in root.evidence and "intermediate" not in root.evidence
