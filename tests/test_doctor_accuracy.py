"""The doctor's accuracy on real recorded runs: injected faults × architectures, each
checked against a ground truth this test computes itself, without ampwatch; healthy runs of four
architectures at the default scale and at init_scale=2**24; the fp32 recompute changes nothing.

Faults are real mechanisms inside the model: a module whose output leaves fp16's range (finite in
fp32), an operation that makes NaN, a gradient that overflows in backward only (once in a while, or
for many steps in a row), clipping still-scaled gradients, NaN written into a weight under bf16.
Tiny GPT-2 and BERT come from ``transformers`` configs with random weights (nothing downloaded).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampwatch
from ampwatch.doctor.finding import num
from ampwatch.record import torch_access

transformers = pytest.importorskip("transformers")

STEPS = 30
FAULT_AT = 12


# -- architectures: (model, batch maker, loss, names of the modules faults go into) ---------------------

class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.act1 = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()
        self.conv2, self.act2 = nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act2(self.conv2(self.act1(self.conv1(x))))
        return self.head(x.mean(dim=(2, 3)))


class MLP(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _bert() -> nn.Module:
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


ARCH = {
    # name: (factory, activation module to wrap, weight-carrying module)
    "gpt2": (_gpt2, "transformer.h.0.mlp.act", "transformer.h.1.mlp.c_fc"),
    "bert": (_bert, "bert.encoder.layer.0.intermediate.intermediate_act_fn", "bert.encoder.layer.1.intermediate.dense"),
    "cnn": (CNN, "act1", "conv2"),
    "mlp": (MLP, "1", "2"),
}


def batch(arch: str, step: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    if arch in ("gpt2", "bert"):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        return ids, ids
    if arch == "cnn":
        return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    x = torch.randn(16, 16, generator=g)
    return x, (x[:, :4] > 0).long().argmax(1)


def loss_of(arch: str, model: nn.Module, x, y) -> torch.Tensor:
    if arch in ("gpt2", "bert"):
        return model(input_ids=x, labels=y).loss
    return F.cross_entropy(model(x).float(), y)


# -- faults: modules that misbehave on given steps, and record the truth themselves -------------------

class Truth:
    """What actually happened, seen from inside the model (no ampwatch involved)."""

    def __init__(self) -> None:
        self.step = -1
        self.forward_bad: list[int] = []   # steps the fault module's output was non-finite (inputs finite)
        self.fp32_finite: Optional[bool] = None  # the same computation in fp32, done by the fault itself
        self.backward_bad: list[int] = []  # steps the gradient the fault passes back was non-finite


class Faulty(nn.Module):
    """Wraps ``inner``; on ``steps`` does ``kind`` to its output (forward) or to its gradient (backward)."""

    def __init__(self, inner: nn.Module, kind: str, steps: set, truth: Truth) -> None:
        super().__init__()
        self.inner, self.kind, self.steps, self.truth = inner, kind, steps, truth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if self.truth.step not in self.steps or not torch.is_grad_enabled() and self.kind.startswith("grad"):
            return out
        if self.kind == "overflow":  # values fp16 cannot hold, an fp32 tensor can
            bad = out * 1e6
            if torch.is_grad_enabled():
                self.truth.fp32_finite = bool(torch.isfinite(out.float() * 1e6).all())
        elif self.kind == "nan":  # an operation that makes NaN from finite values, at any precision
            bad = out + torch.log(-out.abs() - 1.0)
            if torch.is_grad_enabled():
                self.truth.fp32_finite = bool(torch.isfinite(out.float() + torch.log(-out.float().abs() - 1)).all())
        else:
            return _Boom.apply(out, self.truth)
        if torch.is_grad_enabled() and torch.isfinite(x).all() and not torch.isfinite(bad).all():
            self.truth.forward_bad.append(self.truth.step)
        return bad


class _Boom(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by 1e30 (inf in fp16 at any loss scale)."""

    @staticmethod
    def forward(ctx, x, truth):
        ctx.truth = truth
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        out = grad * 1e30
        if not torch.isfinite(out).all():
            ctx.truth.backward_bad.append(ctx.truth.step)
        return out, None


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def train(path: Path, arch: str, *, fault: Optional[str] = None, steps_bad: set = frozenset(),
          scaler: Optional[dict] = None, dtype=torch.float16, clip_before_unscale: bool = False,
          nan_weight_at: Optional[int] = None, steps: int = STEPS, fp32_check: bool = True,
          seed: int = 0) -> tuple[ampwatch.Run, Truth]:
    torch.manual_seed(seed)
    factory, act, weighted = ARCH[arch]
    model, truth = factory(), Truth()
    if fault:
        _set(model, act, Faulty(model.get_submodule(act), fault, set(steps_bad), truth))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gs = torch.amp.GradScaler("cpu", **scaler) if scaler is not None else None
    with ampwatch.attach(model, opt, gs, path=str(path), layer_every=10, fp32_check=fp32_check) as watch:
        for step in range(steps):
            truth.step = step
            if step == nan_weight_at:
                with torch.no_grad():
                    model.get_submodule(weighted).weight[0, 0] = math.nan
            x, y = batch(arch, step, seed)
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_of(arch, model, x, y)
            if gs is None:
                loss.backward()
                watch.log(loss=loss)
                opt.step()
            else:
                gs.scale(loss).backward()
                if clip_before_unscale:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                gs.step(opt)
                gs.update()
            opt.zero_grad(set_to_none=True)
    return ampwatch.load(watch.path), truth


def roots(findings) -> list:
    return [f for f in findings if f.cause is None and f.severity != "info"]


def serious(findings) -> list[str]:
    return [f"{f.severity} {f.id}: {f.title}" for f in findings if f.severity != "info"]


# -- the fault table ----------------------------------------------------------------------------------

FAULTS = {
    # name: (train kwargs, expected root id, phase named, fp32 verdict or None, consequence ids)
    "forward-overflow": (dict(fault="overflow", steps_bad={FAULT_AT}, scaler={}),
                         "nonfinite-origin", "forward", "finite", ()),
    "op-makes-nan": (dict(fault="nan", steps_bad={FAULT_AT}, scaler={}), "nonfinite-origin", "forward", "NaN", ()),
    "backward-only-overflow": (dict(fault="grad", steps_bad=set(range(FAULT_AT, FAULT_AT + 6)), scaler={}),
                               "recurring-overflow", "backward", None, ()),
    "recurring-after-clean": (dict(fault="grad", steps_bad=set(range(FAULT_AT, STEPS, 3)), scaler={}),
                              "recurring-overflow", "backward", None, ()),
    "scale-collapse": (dict(fault="grad", steps_bad=set(range(FAULT_AT, FAULT_AT + 12)), scaler={}),
                       "recurring-overflow", "backward", None, ("scale-collapse",)),
    "clip-before-unscale": (dict(clip_before_unscale=True, scaler={}), "misuse-clip-before-unscale", None, None, ()),
    "bf16-nan-weight": (dict(nan_weight_at=FAULT_AT, dtype=torch.bfloat16), "nonfinite-origin", "forward", "NaN",
                        ("divergence",)),
}
FAULT_ARCHS = {"forward-overflow": ("gpt2", "bert", "cnn"), "op-makes-nan": ("gpt2", "cnn"),
               "backward-only-overflow": ("bert", "cnn"), "recurring-after-clean": ("gpt2", "cnn"),
               "scale-collapse": ("gpt2", "bert"), "clip-before-unscale": ("bert", "cnn"),
               "bf16-nan-weight": ("gpt2", "bert")}
CASES = [(f, a) for f, archs in FAULT_ARCHS.items() for a in archs]


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory):
    """Every (fault, architecture) run, recorded once for the whole module."""
    folder = tmp_path_factory.mktemp("faults")
    return {(f, a): train(folder / f"{f}-{a}.sqlite", a, **FAULTS[f][0]) for f, a in CASES}


def _where(fault: str, arch: str, run) -> tuple[str, int]:
    """The module and first step the ground truth says, from what the faulty model saw."""
    _, act, weighted = ARCH[arch]
    return (weighted, FAULT_AT) if fault == "bf16-nan-weight" else (act, FAULT_AT)


@pytest.mark.parametrize("fault, arch", CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_fault_gets_the_right_root_cause(fault_runs, fault, arch):
    run, truth = fault_runs[fault, arch]
    _, root_id, phase, verdict, consequences = FAULTS[fault]
    findings = ampwatch.diagnose(run)
    top = roots(findings)
    assert top, serious(findings)
    root = top[0]
    assert root.id == root_id, serious(findings)
    module, step = _where(fault, arch, run)
    # the ground truth, seen from inside the model
    if fault in ("forward-overflow", "op-makes-nan"):
        assert truth.forward_bad == [FAULT_AT]
        assert truth.fp32_finite is (verdict == "finite")
    elif phase == "backward":
        assert truth.backward_bad and truth.backward_bad[0] == FAULT_AT
        step = truth.backward_bad[0]
    if phase is not None:
        assert module in root.title and phase in root.title, root.title
        assert root.steps[0] == step, (root.steps, step)
    if fault == "clip-before-unscale":
        assert root.steps[0] == 0
    if fault == "scale-collapse":  # a backward overflow: the advice cites the lowest scale it still overflowed at
        collapse = next(f for f in findings if f.id == "scale-collapse")
        s = run.steps
        lowest = float(s.loc[s["skipped"].astype(bool) & s["step"].between(*collapse.steps), "loss_scale"].min())
        assert f"It still overflowed at a scale of {num(lowest)}" in collapse.advice, collapse.advice
    if verdict == "finite":
        assert "finite (max" in root.evidence and "range is the problem" in root.evidence
    elif verdict == "NaN":
        assert "NaN too" in root.evidence
        # the overwritten weight, where its recorded norms show it, is the more specific advice
        assert "Not a precision problem" in root.advice or "something overwrote it" in root.advice, root.advice
    for c in consequences:
        assert any(f.id == c and f.cause == root.id for f in findings), [(f.id, f.cause) for f in findings]
    # one root leads the report; nothing else above info stands on its own
    assert len(top) == 1, serious(findings)


@pytest.mark.parametrize("fault, arch", [c for c in CASES if FAULTS[c[0]][3]], ids=lambda v: str(v))
def test_fp32_amax_is_stored_on_the_forward_origin(fault_runs, fault, arch):
    run, truth = fault_runs[fault, arch]
    ev = run.events
    module, step = _where(fault, arch, run)
    origin = ev[(ev["phase"] == "forward") & ev["origin"] & (ev["step"] == step)]
    assert list(origin["module"]) == [module]
    value = origin["fp32_amax"].iloc[0]
    if FAULTS[fault][3] == "finite":
        assert isinstance(value, float) and math.isfinite(value) and value > 65504
    else:
        assert isinstance(value, float) and math.isnan(value)
    # rows that are not a forward origin carry no recompute: None, not NaN
    assert all(v is None for v in ev.loc[~(ev["origin"] & (ev["phase"] == "forward")), "fp32_amax"])


# -- healthy runs: no warning or error, warm-up as info -------------------------------------------------

HEALTHY = [(a, s) for a in ("mlp", "cnn", "gpt2", "bert") for s in ("default", "2**24")]


@pytest.fixture(scope="module")
def healthy_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("healthy")
    return {(a, s): train(folder / f"{a}-{s}.sqlite", a, scaler={} if s == "default" else {"init_scale": 2.0 ** 24},
                          steps=40)[0] for a, s in HEALTHY}


@pytest.mark.parametrize("arch, scale", HEALTHY, ids=[f"{a}-{s}" for a, s in HEALTHY])
def test_healthy_runs_have_no_warning(healthy_runs, arch, scale):
    run = healthy_runs[arch, scale]
    findings = ampwatch.diagnose(run)
    assert serious(findings) == []
    steps = run.steps
    lead = 0
    while lead < len(steps) and steps["skipped"].iloc[lead]:
        lead += 1
    warm = [f for f in findings if f.id == "warmup-skips"]
    if lead:  # the truth: the leading back-to-back skips are the warm-up, reported as info
        assert warm and warm[0].severity == "info" and warm[0].steps == (0, lead - 1)
    else:
        assert not warm


# -- the fp32 recompute changes nothing training sees ---------------------------------------------------

class DropNorm(nn.Module):
    """Dropout (consumes RNG) and BatchNorm (updates buffers) inside the module that overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.drop = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.3)
        self.boost = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.bn(self.lin(x))) * self.boost


def _train_dropnorm(path: Path, fp32_check: bool, steps: int = 6, layer_every: int = 20) -> tuple[dict, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), DropNorm(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gs = torch.amp.GradScaler("cpu")
    with ampwatch.attach(model, opt, gs, path=str(path), fp32_check=fp32_check, layer_every=layer_every):
        for step in range(steps):
            model[1].boost = 1e6 if step in (2, 4) else 1.0
            x = torch.randn(16, 8)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            gs.scale(loss).backward()
            gs.step(opt)
            gs.update()
            opt.zero_grad(set_to_none=True)
    return model.state_dict(), torch.get_rng_state()


@pytest.mark.parametrize("accelerator_path,layer_every", [(False, 20), (True, 20), (True, 2)],
                         ids=["host-reads", "device-stats-replayed", "device-stats-observed-live"])
def test_fp32_recompute_changes_nothing(tmp_path, monkeypatch, accelerator_path, layer_every):
    """Steps 2 and 4 overflow. On the device path they are replayed (observed, inputs kept, between
    layer_every steps) or, with layer_every=2, observed live: then no input was kept, and the
    origin's are fetched by running its forward again (dropout's RNG and BatchNorm's running stats
    restored after)."""
    if accelerator_path:  # stats stay on the device; the skip (free to know) triggers the recompute
        monkeypatch.setattr(torch_access, "reads_are_free", lambda device: False)
    with_state, with_rng = _train_dropnorm(tmp_path / "with.sqlite", True, layer_every=layer_every)
    without_state, without_rng = _train_dropnorm(tmp_path / "without.sqlite", False, layer_every=layer_every)
    assert with_state.keys() == without_state.keys()
    for k in with_state:  # parameters and buffers (BatchNorm running stats, num_batches_tracked)
        assert torch.equal(with_state[k], without_state[k]), k
    assert torch.equal(with_rng, without_rng)
    ev = ampwatch.load(tmp_path / "with.sqlite").events
    origin = ev[ev["origin"] & (ev["phase"] == "forward")]
    assert sorted(origin["step"]) == [2, 4] and set(origin["module"]) == {"1"}
    assert all(isinstance(v, float) and math.isfinite(v) and v > 65504 for v in origin["fp32_amax"])
    off = ampwatch.load(tmp_path / "without.sqlite").events
    assert all(v is None for v in off["fp32_amax"])


# -- skips: warm-up, probing, lone skips, every skip explained ------------------------------------------

SKIP_CASES = {
    # name: train kwargs for the MLP
    "late-single-skip": dict(fault="grad", steps_bad={FAULT_AT}, scaler={}),
    "warmup-then-burst": dict(fault="overflow", steps_bad={FAULT_AT, FAULT_AT + 1, FAULT_AT + 2},
                              scaler={"init_scale": 2.0 ** 24}),
    "short-growth-interval": dict(scaler={"init_scale": 2.0 ** 24, "growth_interval": 2}),
}


@pytest.fixture(scope="module")
def skip_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("skips")
    return {k: train(folder / f"{k}.sqlite", "mlp", **kw)[0] for k, kw in SKIP_CASES.items()}


def _explained(findings, steps: list[int]) -> list[int]:
    """Skipped steps not inside any finding's step range."""
    return [s for s in steps if not any(f.steps[0] <= s <= f.steps[1] for f in findings)]


def test_a_late_single_skip_is_info_and_named(skip_runs):
    run = skip_runs["late-single-skip"]
    findings = ampwatch.diagnose(run)
    assert serious(findings) == []
    late = [f for f in findings if f.id == "late-skips"]
    assert late and late[0].steps == (FAULT_AT, FAULT_AT) and "1 (backward)" not in late[0].evidence
    assert f"{ARCH['mlp'][1]}'s own code (backward)" in late[0].evidence  # the wrapper's own code, named


def test_warmup_then_a_real_burst(skip_runs):
    run = skip_runs["warmup-then-burst"]
    findings = ampwatch.diagnose(run)
    s = run.steps
    lead = int((~s["skipped"]).to_numpy().argmax())  # the leading skipped steps, counted here
    warm = [f for f in findings if f.id == "warmup-skips"]
    assert lead > 0 and warm and warm[0].steps == (0, lead - 1) and warm[0].severity == "info"
    root = roots(findings)[0]
    assert root.id == "nonfinite-origin" and root.steps[0] == FAULT_AT and "finite (max" in root.evidence
    assert _explained(findings, [int(x) for x in s.loc[s["skipped"], "step"]]) == []


def test_short_growth_interval_probing_is_a_warning(skip_runs):
    run = skip_runs["short-growth-interval"]
    findings = ampwatch.diagnose(run)
    s = run.steps
    scale = s["loss_scale"].to_numpy()
    skipped = s["skipped"].to_numpy()
    # the truth: skips after warm-up carrying a larger scale than the step after the previous backoff
    after_warm = int((~skipped).argmax())
    probes_truth, base = [], scale[after_warm]
    for i in range(after_warm, len(s)):
        if skipped[i]:
            if scale[i] > base:
                probes_truth.append(int(s["step"].iloc[i]))
            base = scale[min(i + 1, len(s) - 1)]
    probe = [f for f in findings if f.id == "scale-probing"]
    assert probes_truth and probe and probe[0].severity == "warning" and "growth_interval=2" in probe[0].title
    assert probe[0].steps[0] == probes_truth[0]
    # the scales the probes carried: one value when they all read the same, else "low to high"
    from ampwatch.doctor.finding import num
    at_probes = [float(scale[int(np.flatnonzero(s["step"].to_numpy() == p)[0])]) for p in probes_truth]
    low, high = num(min(at_probes)), num(max(at_probes))
    told = low if low == high else f"{low} to {high}"
    assert f"scale at those skips {told}" in probe[0].evidence and ")-" not in probe[0].evidence
    assert _explained(findings, [int(x) for x in s.loc[s["skipped"], "step"]]) == []


# -- crashed runs ---------------------------------------------------------------------------------------

def test_a_crashed_run_is_an_error_with_its_last_line(tmp_path):
    from click.testing import CliRunner
    from ampwatch.cli.main import cli
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(ValueError):
        with ampwatch.attach(model, opt, None, path=str(tmp_path / "crash.sqlite")) as watch:
            for step in range(5):
                if step == 3:
                    raise ValueError("bad batch 3: shape mismatch")
                x, y = batch("mlp", step)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                watch.log(loss=loss)
                opt.step()
                opt.zero_grad()
    findings = ampwatch.diagnose(str(tmp_path / "crash.sqlite"))
    crash = findings[0]
    assert crash.id == "run-crashed" and crash.severity == "error" and crash.cause is None
    assert "ValueError: bad batch 3: shape mismatch" in crash.title and crash.steps == (3, 3)
    runner = CliRunner()
    assert runner.invoke(cli, ["doctor", str(tmp_path / "crash.sqlite")]).exit_code == 1
    out = runner.invoke(cli, ["summary", str(tmp_path / "crash.sqlite")]).output
    assert "crashed" in out and "ValueError: bad batch 3: shape mismatch" in out.splitlines()[-1]
    ls = runner.invoke(cli, ["ls", str(tmp_path)]).output
    assert "error: The run crashed at step 3: ValueError" in ls


def test_a_live_observed_step_recomputes_the_micro_batch_its_origin_was_born_in(tmp_path, monkeypatch):
    """Device path, layer_every=2: step 2 is observed live and the first of its two micro-batches
    overflows the first Linear (inputs of 1e5). Its inputs were not kept (nothing is, on a live
    step where a replay is possible): that micro-batch's forward runs again for them, so the
    recompute is of the call that overflowed, where keeping the latest call's inputs gave none
    (they were the second micro-batch's)."""
    monkeypatch.setattr(torch_access, "reads_are_free", lambda device: False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gs = torch.amp.GradScaler("cpu")
    truth = {}
    with ampwatch.attach(model, opt, gs, path=str(tmp_path / "run.sqlite"), layer_every=2) as watch:
        for step in range(4):
            for micro in range(2):
                x = torch.randn(16, 8) * (1e5 if (step, micro) == (2, 0) else 1.0)
                if (step, micro) == (2, 0):
                    with torch.no_grad():
                        truth["fp32"] = float(model[0](x).abs().max())
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(x).float().pow(2).mean() / 2
                gs.scale(loss).backward()
            assert watch.observer.observing == (step % 2 == 0)
            gs.step(opt)
            gs.update()
            opt.zero_grad(set_to_none=True)
    ev = ampwatch.load(tmp_path / "run.sqlite").events
    origin = ev[ev["origin"] & (ev["phase"] == "forward")]
    assert origin[["step", "module", "micro_batch"]].values.tolist() == [[2, "0", 0]]
    assert truth["fp32"] > 65504
    assert origin["fp32_amax"].iloc[0] == pytest.approx(truth["fp32"], rel=1e-3)
