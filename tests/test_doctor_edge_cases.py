"""Defects a user review found in the doctor, each on a real run: fp16 autocast on the CPU with a real
GradScaler, a fault with a known ground truth (computed here, from the training loop's side), and
the doctor's words checked against it.

* the fp32 verdict says "fp16's range" only when the fp32 recompute is beyond fp16's range;
* the recompute runs on the inputs the module actually received (a user's pre-hook that replaces
  them; on the accelerator path, not the last micro-batch's inputs when an earlier one overflowed);
* NaN born in a Linear without an fp32 verdict is "undetermined, likely an overflow", not "add an eps";
* an overwritten weight's advice names a checkpoint the run had (the last good step), and a weight
  that SGD's own updates blew up is not called overwritten;
* clipping before unscale_ is reported on every affected step;
* a step a replay could not localize does not make the loss its root cause (in tests/test_replay.py);
* gradient underflow counts every parameter it names and says "1 recorded step", not "steps";
  gradients that are all zero because their units died are not underflow, and its advice never
  asks for an init_scale the run already had;
* a run that ended with no step recorded is a warning (not "ok"), and its advice says where steps are
  counted (a disabled GradScaler counts them at optimizer.step(), as no scaler does).
"""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampwatch
from ampwatch.doctor import diagnose
from helpers.loops import amp_step, data, train

FP16_MAX = 65504.0


def _origin(findings):
    return next(f for f in findings if f.id == "nonfinite-origin")


def _origin_event(run):
    ev = run.events
    return ev[ev["origin"] & (ev["phase"] == "forward")].iloc[0]


def _train(path, model, steps, *, before_step=None, accum=1, clip_scaled_until=-1, **options):
    """fp16 autocast + GradScaler("cpu") over ``steps``; ``before_step(step)`` runs first each step.
    ``clip_scaled_until``: clip the still-scaled gradients (no unscale_) on steps up to it."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    with ampwatch.attach(model, opt, scaler, path=str(path), **options) as watch:
        for step in range(steps):
            if before_step is not None:
                before_step(step)
            x, y = data(step, 8 * accum)
            if step <= clip_scaled_until:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # still scaled: the misuse
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            else:
                amp_step(model, opt, scaler, x, y, accum=accum)
    return ampwatch.load(watch.path)


# -- 1. the fp32 verdict and the inputs it is recomputed on --------------------------------------------

def test_a_recompute_that_fits_fp16_is_not_called_fp16s_range(tmp_path):
    """A user forward hook multiplies fc's output by 1e5 at step 3 (as the overflow_storm sample
    does): fc's own forward, recomputed in fp32, is small, so the overflow is not reproduced."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    state, seen = {"step": -1}, {}

    def amplify(module, args, output):
        if state["step"] == 3:
            with torch.no_grad(), torch.autocast("cpu", enabled=False):  # the truth: fc in fp32
                seen["fp32"] = float(F.linear(args[0].float(), module.weight.float(), module.bias.float()).abs().max())
            return output * 1e5

    model[0].register_forward_hook(amplify, prepend=True)  # before ampwatch's: the recording sees it
    run = _train(tmp_path / "hook.sqlite", model, 5, before_step=lambda s: state.update(step=s))
    e = _origin_event(run)
    assert (e["step"], e["module"]) == (3, "0")
    assert e["fp32_amax"] == pytest.approx(seen["fp32"], rel=1e-3) and seen["fp32"] < FP16_MAX
    origin = _origin(diagnose(run))
    assert "range is the problem" not in origin.evidence
    assert "did not reproduce it" in origin.evidence and "no fp32 verdict" in origin.evidence
    assert "only float16 cannot hold them" not in origin.advice
    assert "did not reproduce" in origin.advice and "forward hook" in origin.advice


class Root(nn.Module):
    """Makes its overflow in its own code: fc's output times 1e4 (fp16 holds it while |fc| < 6.5)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x) * 1e4


def test_the_recompute_uses_the_inputs_a_users_pre_hook_gave_the_module(tmp_path):
    """The root has ampwatch's own pre-hook; a user's pre-hook, registered after attach, replaces
    its input (x100) at step 2. The recompute must see the replaced input: beyond fp16 in fp32."""
    model, state, seen = Root(), {"step": -1}, {}

    def scale_input(module, args):
        if state["step"] == 2:
            x = args[0] * 100
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                seen["fp32"] = float((F.linear(x.float(), module.fc.weight, module.fc.bias) * 1e4).abs().max())
            return (x,)

    def before(step):
        state["step"] = step
        if step == 0:  # attach has registered its hooks by now: ours runs after them
            model.register_forward_pre_hook(scale_input)

    run = _train(tmp_path / "pre.sqlite", model, 4, before_step=before)
    e = _origin_event(run)
    assert (e["step"], e["module"]) == (2, "<model>")
    assert seen["fp32"] > FP16_MAX
    assert e["fp32_amax"] == pytest.approx(seen["fp32"], rel=1e-3)  # before the fix: ~1/100 of it
    origin = _origin(diagnose(run))
    assert "range is the problem" in origin.evidence and "beyond float16's 65,504" in origin.evidence


class PreScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


@pytest.mark.parametrize("path", ["host", "accelerator"])
def test_an_overflow_in_an_earlier_micro_batch_is_recomputed_on_its_inputs_or_not_at_all(tmp_path, monkeypatch, path):
    """3 micro-batches, fc1's input x1e5 in micro-batch 1 of step 2 (a user pre-hook on fc1). On
    the host path the kept inputs are that call's: the fp32 recompute is beyond fp16. On the
    accelerator path (no free reads) only the last micro-batch's inputs are kept: no recompute,
    where it used to recompute the clean micro-batch 2 and call it fp16's range."""
    if path == "accelerator":
        monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    else:
        monkeypatch.delenv("AMPWATCH_CPU_AS_ACCELERATOR", raising=False)
    model, state, seen = PreScaled(), {"step": -1, "call": 0}, {}

    def pre(module, args):
        state["call"] += 1
        if state["step"] == 2 and state["call"] == 2:  # micro-batch 1
            x = args[0] * 1e5
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                seen["fp32"] = float(F.linear(x.float(), module.weight, module.bias).abs().max())
            return (x,)

    model.fc1.register_forward_pre_hook(pre)
    run = _train(tmp_path / f"mb_{path}.sqlite", model, 4, accum=3, replay=False,
                 before_step=lambda s: state.update(step=s, call=0))
    e = _origin_event(run)
    assert (e["step"], e["module"], e["micro_batch"]) == (2, "fc1", 1)
    origin = _origin(diagnose(run))
    if path == "host":
        assert e["fp32_amax"] == pytest.approx(seen["fp32"], rel=1e-3) and seen["fp32"] > FP16_MAX
        assert "range is the problem" in origin.evidence
    else:
        assert e["fp32_amax"] is None
        assert "range is the problem" not in origin.evidence and "recomputed" not in origin.evidence


# -- 2. NaN in a Linear without a verdict -----------------------------------------------------------

def test_nan_in_a_linear_without_an_fp32_verdict_names_overflow_not_an_eps(tmp_path):
    """An input row x1e5 at step 3: finite in fp32, inf once autocast casts it to fp16 inside fc1,
    whose sums then make inf - inf = NaN. fp32_check=False: no verdict."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    state = {"step": -1}

    def outlier(module, args):
        if state["step"] == 3:
            x = args[0].clone()
            x[0] *= 1e7  # every element of the row beyond 65504: each sum is inf - inf
            return (x,)

    model.register_forward_pre_hook(outlier)
    run = _train(tmp_path / "nan.sqlite", model, 5, fp32_check=False, before_step=lambda s: state.update(step=s))
    e = _origin_event(run)
    assert (e["step"], e["module"], e["kind"]) == (3, "0", "nan") and e["fp32_amax"] is None
    origin = _origin(diagnose(run))
    assert origin.advice.startswith("Cause undetermined")
    assert "0 is a Linear, so the likely cause is an overflow" in origin.advice
    assert "An operation inside" not in origin.advice


# -- 3. the checkpoint to restore an overwritten weight from -------------------------------------------

def test_an_overwritten_weight_is_restored_from_the_last_good_step(tmp_path):
    """fc1's weight x1e6 before step 13's forward; layer rows every 10 steps (0, 10, ...): the
    last step with a finite loss and an applied update is 12, the last normal norm is step 10."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def corrupt(step):
        if step == 13:
            with torch.no_grad():
                model[0].weight.mul_(1e6)

    run = _train(tmp_path / "w.sqlite", model, 16, layer_every=10, before_step=corrupt)
    s = run.steps
    ok = s[(s["step"] < 13) & ~s["skipped"].astype(bool) & s["loss"].notna()]
    assert int(ok["step"].max()) == 12  # the truth, from the steps the run recorded
    origin = _origin(diagnose(run))
    assert origin.steps[0] == 13 and "0.weight" in origin.advice
    assert "saved by the end of step 12" in origin.advice and "measured normal at step 10" in origin.advice
    assert "before step 0" not in origin.advice


# -- 4. clipping still-scaled gradients: every affected step -----------------------------------------

@pytest.mark.parametrize("until", [11, 4])
def test_clip_before_unscale_covers_every_step_it_happened(tmp_path, until):
    """The loop clips before unscale_ on steps 0..until, then unscales first; the recorder checks
    on layer_every=2 steps. 11 (every step of 12): from step 0 on, every step, to step 11."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    run = _train(tmp_path / f"clip{until}.sqlite", model, 12, layer_every=2, clip_scaled_until=until)
    noticed = sorted(int(x) for x in run.notices.loc[run.notices["code"] == "clip-before-unscale", "step"])
    assert noticed == [s for s in range(0, until + 1, 2)]
    f = next(f for f in diagnose(run) if f.id == "misuse-clip-before-unscale")
    if until == 11:
        assert f.steps == (0, 11) and "on every step it checked from step 0 on (6 checks" in f.evidence
    else:
        assert f.steps == (0, 4) and "at 3 steps of 6 checked" in f.evidence


# -- 5. gradient underflow: its words agree with its counts ------------------------------------------

def _underflow_run(path, steps, *, init_scale, lr, layer_every):
    """fp16 + GradScaler (no growth) on the MLP of :mod:`helpers.loops` fitting a tanh teacher."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=10 ** 6)
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(16, 4, generator=g) / 4
    with ampwatch.attach(model, opt, scaler, path=str(path), layer_every=layer_every) as watch:
        for _ in range(steps):
            x = torch.randn(32, 16, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), torch.tanh(x @ teacher))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return ampwatch.load(watch.path)


def test_underflow_names_or_counts_every_parameter_and_says_step_once(tmp_path):
    """At a scale of 2**-20 every gradient element of every parameter flushes to zero on the one
    detail step (step 0): six parameters, one recorded step."""
    run = _underflow_run(tmp_path / "u.sqlite", 3, init_scale=2.0 ** -20, lr=0.05, layer_every=10)
    zero = run.layers[run.layers["grad_zero_frac"] >= 0.25]
    assert sorted(set(zero["step"])) == [0] and zero["name"].nunique() == 6  # the truth, from the file
    f = next(f for f in diagnose(run) if f.id == "grad-underflow")
    assert "(6 parameters, worst " in f.title
    assert "median over 1 recorded step," in f.evidence
    named = f.evidence.split("; also ", 1)[1]
    assert named.count(",") == 2 and named.endswith(" (+2 more)")  # 1 worst + 3 named + 2 counted = 6


def test_units_that_died_are_not_called_underflow(tmp_path):
    """lr=5 blows the MLP up: after step 8 its ReLUs are dead and every gradient but the last bias's
    is exactly zero, at a scale of 2**14, where the same tensors' gradients had maxima far above
    what flushes to zero. A scale that low flushes nothing of that size: not underflow."""
    def attach(model, opt, scaler):
        return ampwatch.attach(model, opt, scaler, path=str(tmp_path / "dead.sqlite"), layer_every=20)

    _, watch, _ = train(60, lr=5.0, scaler_factory=lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 16),
                        attach=attach)
    run = ampwatch.load(watch.path)
    lay = run.layers.merge(run.steps[["step", "loss_scale"]], on="step")
    dead = lay[(lay["grad_amax"] == 0) & (lay["loss_scale"] >= 2.0 ** 14)]
    assert {"0.weight", "2.weight"} <= set(dead["name"])  # the truth, from the file
    alive = lay[(lay["name"] == "0.weight") & (lay["grad_amax"] > 0)]
    assert (alive["grad_amax"] * dead["loss_scale"].min() > 1).all()  # far from fp16's flush
    assert "grad-underflow" not in {f.id for f in diagnose(run)}


class _Shrink(torch.autograd.Function):
    """Identity forward; the gradient flowing back, in the output's fp16, times ``k``: one that
    really underflows."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.k, None


class _ShrinkGrad(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x):
        return _Shrink.apply(x, self.k)


@pytest.mark.parametrize("init_scale, k", [(2.0 ** 16, 3e-11), (2.0 ** 24, 3e-13)])
def test_underflow_advice_never_asks_for_a_scale_the_run_already_had(tmp_path, init_scale, k):
    """0.weight's gradient is shrunk below fp16's range: at 2**16 (the run's own start, where the
    old advice said init_scale=2**16) and at 2**19 after a warm-up from 2**24 (where it said to
    lower init_scale to 2**16 and call it raising)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), _ShrinkGrad(k), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "u.sqlite"), layer_every=5) as watch:
        for step in range(12):
            x, y = data(step)
            amp_step(model, opt, scaler, x, y)
    run = ampwatch.load(watch.path)
    f = next(f for f in diagnose(run) if f.id == "grad-underflow")
    assert "worst 0.weight" in f.title and "init_scale=2**16" not in f.advice
    scale = run.steps.set_index("step")["loss_scale"][f.steps[0]]
    if scale == init_scale:
        assert scale == 2.0 ** 16 and "init_scale=2**24" in f.advice
    else:
        assert scale < init_scale and "A larger init_scale would not help" in f.advice
    assert "keep the layers that produce 0.weight's gradient in fp32" in f.advice.lower()


# -- 6. a run that ended with no step recorded is not "ok" ------------------------------------------

def test_a_run_that_ended_without_a_step_is_a_warning_whose_advice_holds(tmp_path):
    """fp16 with an enabled GradScaler handed to attach, and a loop that calls optimizer.step()
    itself (scaler.step() and update() forgotten): nothing counts a step. While the run is open
    that is "not yet" (info); once it ended, a warning whose advice names where steps are counted.
    The same loop with GradScaler(enabled=False) does record its steps (at optimizer.step()),
    as the advice says."""
    import sqlite3
    from click.testing import CliRunner
    from ampwatch.cli.main import cli
    counts = {}
    for enabled in (True, False):
        model = nn.Sequential(nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", enabled=enabled)
        path = tmp_path / ("enabled" if enabled else "disabled") / "n.sqlite"
        watch = ampwatch.attach(model, opt, scaler, path=str(path))
        try:
            if enabled:
                opened = next(f for f in diagnose(ampwatch.load(watch.path)) if f.id == "no-steps")
            for step in range(3):
                x, y = data(step)
                with torch.autocast("cpu", dtype=torch.float16 if enabled else torch.bfloat16):
                    loss = F.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                opt.step()
                opt.zero_grad()
        finally:
            watch.close()
        conn = sqlite3.connect(f"file:{watch.path}?mode=ro", uri=True)
        counts[enabled] = conn.execute("SELECT COUNT(*) FROM steps").fetchone()[0]  # the truth, from the file
        assert conn.execute("SELECT status FROM run").fetchone()[0] == "finished"
        conn.close()
        findings = diagnose(ampwatch.load(watch.path))
        if enabled:
            assert opened.severity == "info" and "has started" in opened.advice
            f = next(f for f in findings if f.id == "no-steps")
            assert f.severity == "warning" and "finished" in f.evidence
            assert "With an enabled GradScaler a step is counted at scaler.update()" in f.advice
            assert "with GradScaler(enabled=False), at optimizer.step()" in f.advice
            listed = CliRunner().invoke(cli, ["ls", str(path.parent)])
            assert listed.exit_code == 0 and listed.output.splitlines()[1].endswith(
                "warning: No optimizer steps were recorded")
        else:
            assert not any(f.id == "no-steps" for f in findings)
    assert counts == {True: 0, False: 3}


# -- 7. a weight blown up by the optimizer's own updates is not "overwritten" ----------------------------

def test_a_weight_blown_up_by_sgd_updates_is_not_called_overwritten(tmp_path):
    """SGD at lr=0.5 (momentum 0.9) on a regression whose gradients grow: an applied update of lr x a
    gradient norm in the tens of thousands moves a bias 100x, and the next forward overflows fp16.
    The doctor used to say "something overwrote it, restore a checkpoint". The truth, from the loop:
    nothing but optimizer.step() wrote the weights, and it moved the named one at least as far as its
    norm grew. So the advice is the learning rate or clipping, and the evidence bounds the jump by
    SGD's reach."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=gen)
    y = (x ** 2).sum(1, keepdim=True)
    names = dict(model.named_parameters())
    norms, moved = [], []  # per step, before its update: every parameter's norm; and how far step() moved it
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "sgd.sqlite"), layer_every=5) as watch:
        for _ in range(40):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            before = {n: p.detach().clone() for n, p in names.items()}
            norms.append({n: float(p.norm()) for n, p in before.items()})
            scaler.step(opt)
            scaler.update()
            moved.append({n: float((p.detach() - before[n]).norm()) for n, p in names.items()})
    origin = _origin(diagnose(ampwatch.load(watch.path)))
    assert "overwrote" not in origin.advice and "Restore it" not in origin.advice
    assert "lower the learning rate, or clip the gradients" in origin.advice
    assert "after scaler.unscale_(optimizer)" in origin.advice
    m = re.search(r"the norm of (\S+) jumped [\d.,]+x between steps (\d+) and (\d+) \(([\d.,]+) -> ([\d.,]+)\): no "
                  r"farther than SGD moves it in \d+ steps? at the recorded learning rates and gradient norms", origin.evidence)
    assert m, origin.evidence
    name, s0, s1 = m.group(1), int(m.group(2)), int(m.group(3))
    module = origin.title.split(" born in ")[1].split(" (")[0]
    assert name.rsplit(".", 1)[0] == module  # a parameter of the origin's module
    before, after = norms[s0][name], norms[s1][name]
    assert after >= 10 * before  # the jump, measured by the loop
    assert float(m.group(5).replace(",", "")) == pytest.approx(after, rel=0.01)
    assert sum(moved[s][name] for s in range(s0, s1)) >= 0.99 * (after - before)  # optimizer.step() moved it there


@pytest.mark.parametrize("logged", [False, True])
def test_a_run_without_a_loss_says_so_and_how_to_record_it(tmp_path, logged, restore_runs_env):
    """bf16 without a scaler: the loss arrives only through watch.log. A loop that never calls it
    gets an info finding and a summary line that say so, not 'the loss stayed finite'; a NaN fed at
    step 5 is still placed (the model's input), as the module values need no loss."""
    from click.testing import CliRunner
    from ampwatch.cli.main import cli
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = tmp_path / "run.sqlite"
    with ampwatch.attach(model, opt, path=path, layer_every=4) as watch:
        for step in range(8):
            x = torch.randn(4, 8)
            if step == 5:
                x[0, 0] = float("nan")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            if logged:
                watch.log(loss=loss)
            opt.step()
            opt.zero_grad()
    run = ampwatch.load(path)
    assert run.steps["loss"].notna().any() == logged  # the premise
    found = {f.id: f for f in diagnose(run)}
    assert found["nonfinite-origin"].title == "NaN in the model's input batch at step 5"
    summary = CliRunner().invoke(cli, ["summary", str(path)]).output
    if logged:
        assert "no-loss" not in found
        assert "(loss first NaN/inf at step 5)" in summary
    else:
        f = found["no-loss"]
        assert f.severity == "info" and f.title == "No loss was recorded"
        assert "8 steps, none with a loss" in f.evidence and "watch.log(loss=loss)" in f.advice
        assert "(no loss recorded: watch.log(loss=loss) records it)" in summary
        assert "stayed finite" not in summary
    from helpers.app_pages import open_page
    at = open_page(tmp_path, "overview", run="run.sqlite")
    assert not at.exception, [e.value for e in at.exception]
    infos = " ".join(i.value for i in at.info)
    assert ("No loss was recorded" in infos) == (not logged), infos
