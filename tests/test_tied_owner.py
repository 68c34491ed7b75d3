"""The owner of a tied weight's non-finite gradient, on HF GPT-2 (``lm_head.weight`` is
``transformer.wte.weight``): fp16 autocast on the CPU with a real GradScaler, the truth computed
here from hooks of the test's own, without ampwatch.

* An overflow entering through the embedding: block 0's MLP activation multiplies the gradient
  flowing back by 1e30 (backward only). The embedding, in fp32, is handed the inf and scatters it
  into the tied weight; the head's own weight gradient stays finite. The event names
  ``transformer.wte.weight`` (it used to name the head: "the only owner in fp16").
* One entering through the head: ln_f's output +300 on one step (its gradient unchanged) makes the
  head's fp16 weight gradient (gradᵀ·h summed over tokens) overflow while every gradient handed
  back stays finite.
"""
from __future__ import annotations

import pytest
import torch

import ampwatch

transformers = pytest.importorskip("transformers")

FAULT = 2
STEPS = 4


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e30


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


class Truth:
    """Per step: whether each owner's contribution to the tied weight's gradient was finite."""

    def __init__(self, model) -> None:
        self.step, self.wte_finite, self.head_finite = -1, {}, {}
        self.seen: dict = {}
        model.transformer.wte.register_forward_hook(self._embedding)
        model.lm_head.register_forward_hook(self._head)

    def _embedding(self, module, args, out):
        step = self.step  # the embedding's contribution: its received gradient, scattered (fp32)
        out.register_hook(lambda g: self.wte_finite.__setitem__(step, bool(torch.isfinite(g).all())))

    def _head(self, module, args, out):
        step, h = self.step, args[0].detach()

        def weight_grad(g):  # the head's contribution, computed as autocast does: fp16 gᵀ·h
            w = g.reshape(-1, g.shape[-1]).half().t() @ h.reshape(-1, h.shape[-1]).half()
            self.head_finite[step] = bool(torch.isfinite(w).all())
        out.register_hook(weight_grad)


def _train(path, fault: str) -> tuple[ampwatch.Run, Truth]:
    model = _model()
    truth = Truth(model)
    if fault == "embedding":
        model.transformer.h[0].mlp.act.register_forward_hook(
            lambda m, a, out: _Boom.apply(out) if truth.step == FAULT else None)
    else:
        model.transformer.ln_f.register_forward_hook(lambda m, a, out: out + 300.0 if truth.step == FAULT else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.attach(model, opt, scaler, path=str(path)) as watch:
        for step in range(STEPS):
            truth.step = step
            ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(input_ids=ids, labels=ids).loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return ampwatch.load(watch.path), truth


def _tied_events(run):
    ev = run.events
    return ev[(ev["phase"] == "param_grad") & ev["module"].isin(["lm_head.weight", "transformer.wte.weight"])]


@pytest.mark.parametrize("fault, owner, other", [("embedding", "transformer.wte.weight", "lm_head.weight"),
                                                 ("head", "lm_head.weight", "transformer.wte.weight")])
def test_a_tied_weights_gradient_is_named_after_the_owner_that_made_it(tmp_path, fault, owner, other):
    run, truth = _train(tmp_path / f"{fault}.sqlite", fault)
    # the truth: exactly the true owner's contribution is non-finite at the fault step
    wte_bad, head_bad = not truth.wte_finite[FAULT], not truth.head_finite[FAULT]
    assert (wte_bad, head_bad) == ((True, False) if fault == "embedding" else (False, True))
    assert run.steps.set_index("step")["skipped"][FAULT]
    tied = _tied_events(run)
    at = tied[tied["step"] == FAULT]
    assert list(at["module"]) == [owner], tied[["step", "module"]]
    assert at["aliases"].iloc[0] == other
