"""Localizing skipped steps by replaying them (ampwatch/record/replay.py), on the accelerator path.

The ground truth is the live observation of every step (``replay=False``): the replayed step must
give the same events (module, phase, kind, origin, micro-batch, amax), and training must produce
the same numbers as without ampwatch.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ampwatch
from helpers.loops import Amplify, amp_step, bf16_fault_run

EVENT_COLS = ["step", "phase", "module", "kind", "origin", "micro_batch", "amax", "dtype"]


@pytest.fixture(autouse=True)
def accelerator(monkeypatch):
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")  # the path a GPU takes: no free reads


class Bomb(nn.Module):
    """Parameter-free: finite forward; multiplies the gradient flowing back by 1e6 while armed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x):
        return Amplify.apply(x) if self.armed else x


class Net(nn.Module):
    """Dropout (RNG) and BatchNorm (buffers): what a replay must put back as it found it."""

    def __init__(self, loss_inside: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.2)
        self.bomb = Bomb()
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        self.loss_inside = loss_inside

    def forward(self, x, y=None):
        logits = self.head(F.gelu(self.fc2(self.bomb(self.drop(self.norm(self.fc1(x)))))))
        if self.loss_inside:  # HF-style: (loss, logits), the loss computed from the logits
            return F.mse_loss(logits.float(), y), logits
        return logits


def train(tmp_path, name, *, watched=True, fault=None, fault_step=3, steps=6, accum=1, bad_batch=0,
          loss_inside=False, compiled=False, reuse_buffer=False, **options):
    """Train Net with fp16 autocast and a CPU GradScaler; ``fault`` at ``fault_step``: "forward"
    (fc2's weights x1e6), "backward" (the bomb armed) or "input" (micro-batch ``bad_batch``'s input
    x1e7); ``reuse_buffer``: every micro-batch is copied into one input tensor (a prefetching
    loop's pattern). Returns (run or None, losses, parameters, buffers)."""
    x_buf = torch.empty(8, 16)
    torch._dynamo.reset()
    model = Net(loss_inside)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / f"{name}.sqlite"), **options) if watched else None
    net = torch.compile(model, backend="aot_eager") if compiled else model
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        armed = step == fault_step
        saved = model.fc2.weight.detach().clone()
        if armed and fault == "forward":
            with torch.no_grad():
                model.fc2.weight.mul_(1e6)  # fp16 output > 65504 (for the whole step: a replay sees it too)
        model.bomb.armed = armed and fault == "backward"
        for k in range(accum):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            if armed and fault == "input" and k == bad_batch:
                x = x * 1e7  # finite in fp32, inf once autocast casts it to fp16 inside fc1
            if reuse_buffer:
                x = x_buf.copy_(x)
            with torch.autocast("cpu", dtype=torch.float16):
                out = net(x, y) if loss_inside else net(x)
            loss = (out[0] if loss_inside else F.mse_loss(out.float(), y)) / accum
            losses.append(loss.detach().clone())
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        model.bomb.armed = False
        if armed and fault == "forward":
            with torch.no_grad():
                model.fc2.weight.copy_(saved)  # the step was skipped: the weights are as before it
    params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.detach().clone() for b in model.buffers()]
    if watch is None:
        return None, losses, params, buffers
    watch.close()
    return ampwatch.load(watch.path), losses, params, buffers


def _same(xs, ys) -> bool:
    """Bitwise equal tensors, NaN where the other has NaN (the bad step's loss)."""
    return len(xs) == len(ys) and all(torch.equal(x.nan_to_num(nan=7.0), y.nan_to_num(nan=7.0))
                                      and torch.equal(x.isnan(), y.isnan()) for x, y in zip(xs, ys))


def _events(run):
    ev = run.events[run.events.phase.isin(["forward", "backward"])]
    return ev[EVENT_COLS].sort_values(EVENT_COLS[:3]).reset_index(drop=True)


@pytest.mark.parametrize("fault", ["forward", "backward"])
def test_a_replayed_step_is_localized_as_live_observation_localizes_it(tmp_path, fault):
    replayed, losses, params, buffers = train(tmp_path, "replay", fault=fault)
    live, live_losses, live_params, live_buffers = train(tmp_path, "live", fault=fault, replay=False)
    plain, plain_losses, plain_params, plain_buffers = train(tmp_path, "plain", watched=False, fault=fault)
    a, b = _events(replayed), _events(live)
    assert len(b) and a.equals(b)  # same modules, kinds, origins and amax values, bitwise
    origin = a[a.origin]
    assert origin[["step", "phase", "module"]].values.tolist() == [[3, fault, "fc2" if fault == "forward" else "bomb"]]
    assert replayed.steps.set_index("step").loc[3, "skipped"]
    # training is unchanged by the replay: losses, weights, BatchNorm's running stats, dropout's RNG
    for mine, theirs in ((losses, plain_losses), (params, plain_params), (buffers, plain_buffers),
                         (live_losses, plain_losses)):
        assert _same(mine, theirs)


def test_a_replay_names_the_micro_batch_that_overflowed(tmp_path):
    replayed = train(tmp_path, "replay", fault="input", accum=3, bad_batch=1)[0]
    live = train(tmp_path, "live", fault="input", accum=3, bad_batch=1, replay=False)[0]
    a, b = _events(replayed), _events(live)
    assert len(b) and a.equals(b)
    origin = a[a.origin & (a.phase == "forward")]
    assert origin[["module", "micro_batch"]].values.tolist() == [["fc1", 1]]
    assert replayed.steps.set_index("step").loc[3, "micro_batches"] == 3


@pytest.mark.parametrize("bad_batch", [0, 1])
def test_a_reused_input_buffer_is_not_replayed_with_the_wrong_data(tmp_path, bad_batch):
    """The loop copies each micro-batch into one tensor: by the step's end it holds the last one, so
    a replay would run every micro-batch on the last one's data (and name the wrong micro-batch, or
    miss the fault). The kept inputs' version counters tell: the step is not replayed, says why,
    and the run is observed live from then on; training is unchanged."""
    replayed, losses, params, _ = train(tmp_path, "replay", fault="input", accum=2, bad_batch=bad_batch,
                                        reuse_buffer=True)
    live = train(tmp_path, "live", fault="input", accum=2, bad_batch=bad_batch, reuse_buffer=True, replay=False)[0]
    _, plain_losses, plain_params, _ = train(tmp_path, "plain", watched=False, fault="input", accum=2,
                                             bad_batch=bad_batch, reuse_buffer=True)
    notices = replayed.notices
    assert notices[["step", "code"]].values.tolist() == [[3, "replay-not-reproduced"]]
    assert "changed in place after its forward" in notices["message"].iloc[0]
    assert _events(replayed).query("step == 3").empty  # nothing claimed from a replay on the wrong data
    truth = _events(live)
    assert truth[truth.origin & (truth.phase == "forward")][["module", "micro_batch"]].values.tolist() == [["fc1", bad_batch]]
    assert _same(losses, plain_losses) and _same(params, plain_params)


def test_a_loss_computed_inside_the_model_is_replayed_once(tmp_path):
    """(loss, logits): the logits' gradient comes from the model's own loss. Replaying from both
    would double every gradient inside the model; the backward amax values would then differ."""
    replayed = train(tmp_path, "replay", fault="backward", loss_inside=True)[0]
    live = train(tmp_path, "live", fault="backward", loss_inside=True, replay=False)[0]
    a, b = _events(replayed), _events(live)
    assert len(b[b.phase == "backward"]) and a.equals(b)


def test_healthy_steps_between_detail_steps_run_no_module_hook(tmp_path):
    """What replay buys: on a healthy step between layer_every steps torch calls every module as an
    unhooked one, and ampwatch adds the same device ops as with localize=False."""
    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    def ops_of_step(**options):
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        g = torch.Generator().manual_seed(1)
        counts, hooked = [], []
        with ampwatch.attach(model, opt, scaler, path=str(tmp_path / f"{sorted(options)}.sqlite"), **options):
            for step in range(3):
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
                hooked.append(any(m._forward_hooks or m._forward_pre_hooks for m in model.modules() if m is not model))
                with Count() as count:
                    amp_step(model, opt, scaler, x, y)
                counts.append(count.ops)
        return counts, hooked

    replay_ops, replay_hooked = ops_of_step()
    off_ops, _ = ops_of_step(localize=False)
    live_ops, live_hooked = ops_of_step(replay=False)
    assert replay_hooked == [True, False, False] and live_hooked == [True, True, True]
    assert replay_ops[1:] == off_ops[1:]  # steps 1 and 2: not detail steps (layer_every=20)
    assert live_ops[2] > replay_ops[2]


class Counted(nn.Module):
    """Overflows on its ``fault_call``-th call only: Python state a replay cannot reproduce."""

    def __init__(self, fault_call: int) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.calls, self.fault_call = 0, fault_call

    def forward(self, x):
        h = self.fc(x)
        if self.calls == self.fault_call:
            h = h * 1e6
        self.calls += 1
        return h


def test_a_step_the_replay_cannot_reproduce_says_so_and_later_steps_are_observed_live(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(Counted(2), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    g = torch.Generator().manual_seed(0)
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite")) as watch:
        for step in range(7):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            if step == 5:
                with torch.no_grad():
                    model[1].weight.mul_(1e6)
            amp_step(model, opt, scaler, x, y)
            if step == 5:
                with torch.no_grad():
                    model[1].weight.div_(1e6)
    run = ampwatch.load(watch.path)
    assert run.notices[["step", "code"]].values.tolist() == [[2, "replay-not-reproduced"]]
    skipped = run.steps[run.steps.skipped.astype(bool)]["step"].tolist()
    assert 2 in skipped and 5 in skipped
    ev = run.events
    origins = ev[ev.origin & (ev.phase == "forward")]
    assert origins[["step", "module"]].values.tolist() == [[5, "1"]]  # observed live after the notice
    assert ev[(ev.step == 2) & ev.phase.isin(["forward", "backward"])].empty  # the replay's values were dropped
    from ampwatch.doctor import diagnose
    findings = {f.id: f for f in diagnose(run)}
    assert findings["misuse-replay-not-reproduced"].severity == "info"
    # step 2 was not localized: the loss is where the run first sees it, not its root cause
    origin = findings["nonfinite-origin"]
    assert origin.steps[0] == 2 and origin.title.startswith("Loss became")
    assert "step 2 was not localized" in origin.evidence and "not localized" in origin.advice
    assert "Compute the loss in fp32" not in origin.advice


def test_compiled_training_replays_a_skipped_step_in_eager(tmp_path):
    from torch._dynamo.utils import counters
    counters.clear()
    plain, plain_losses, _, _ = train(tmp_path, "plain", watched=False, fault="forward", compiled=True)
    graphs = counters["stats"]["unique_graphs"]
    counters.clear()
    replayed, losses, _, _ = train(tmp_path, "replay", fault="forward", compiled=True)
    # one more graph, compiled once: the one observed steps and replays run (the unobserved steps
    # run a graph with no ampwatch op, the same as without ampwatch)
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == graphs + 1
    assert _same(losses, plain_losses)
    live = train(tmp_path, "live", fault="forward", replay=False)[0]
    a, b = _events(replayed), _events(live)
    cols = ["step", "phase", "module", "kind", "origin"]
    assert len(b) and a[cols].equals(b[cols])


@pytest.mark.parametrize("case", ["host-path", "option-off"])
def test_steps_that_cannot_be_replayed_are_observed_live(tmp_path, monkeypatch, case):
    """(A fused optimizer is replayed: its skip is read from the scaler's inf flag, test_fused_optimizers.py.)"""
    if case == "host-path":
        monkeypatch.delenv("AMPWATCH_CPU_AS_ACCELERATOR")
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    options = {"replay": False} if case == "option-off" else {}
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite"), **options) as watch:
        assert watch.replayer is None and watch.observer is not None
    other = Net()  # the same model and the defaults: replayed on the accelerator path
    with ampwatch.attach(other, torch.optim.SGD(other.parameters(), lr=0.1), torch.amp.GradScaler("cpu"),
                         path=str(tmp_path / "ok.sqlite")) as watch:
        assert (watch.replayer is not None) == (case != "host-path")


class Checkpointed(nn.Module):
    """Reentrant activation checkpointing: torch refuses ``autograd.grad`` through it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return self.head(checkpoint(self.inner, x, use_reentrant=True))


def test_a_model_that_cannot_be_replayed_is_observed_live_and_recording_goes_on(tmp_path):
    model = Checkpointed()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    g = torch.Generator().manual_seed(0)
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite")) as watch:
        for step in range(7):
            saved = model.inner[2].weight.detach().clone()
            if step in (2, 5):
                with torch.no_grad():
                    model.inner[2].weight.mul_(1e6)
            amp_step(model, opt, scaler, torch.randn(8, 16, generator=g, requires_grad=True), torch.zeros(8, 4))
            with torch.no_grad():
                model.inner[2].weight.copy_(saved)
    run = ampwatch.load(watch.path)
    assert len(run.steps) == 7 and run.info["status"] == "finished"  # recording did not stop
    notes = run.notices
    assert notes["step"].tolist() == [2] and "checkpoint" in notes["message"].iloc[0].lower()
    origins = run.events[run.events.origin & (run.events.phase == "forward")]
    assert origins[["step", "module"]].values.tolist() == [[5, "inner.2"]]  # live from step 3 on


def _bf16_run(path, fault_step, watched, **options):
    """bf16 autocast, no scaler, the loss through watch.log: one module's output is inf at one step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    return bf16_fault_run(model, path, fault_step, watched, steps=12, batch=8, **options)


class _Reads(TorchDispatchMode):
    """Where each host read (``_local_scalar_dense``) happens: ``where`` as the loop set it."""

    def __init__(self):
        super().__init__()
        self.reads: list = []
        self.where = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            self.reads.append(self.where)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fault", [7, 4], ids=["between", "before-layer-every"])
def test_without_a_scaler_a_bad_step_is_replayed_on_its_own_weights_a_step_late(tmp_path, record_path, fault):
    """bf16 has no skip to replay, and SGD cannot skip in its kernel: on a device path the weights
    are copied before each update, the check goes to the host, and the step is settled at the next
    step's optimizer step (or, before a layer_every step, at that step's end), where a bad step is
    replayed on its own weights. It must be localized as live observation of every step localizes
    it (the ground truth: replay=False), on its own step, with training unchanged, and with no
    notice that steps wait."""
    plain_losses, plain_params = _bf16_run(tmp_path / "plain.sqlite", fault, watched=False)
    losses, params = _bf16_run(tmp_path / "run.sqlite", fault, watched=True)
    _bf16_run(tmp_path / "live.sqlite", fault, watched=True, replay=False)
    assert all(torch.equal(a, b) or (a.isnan().all() and b.isnan().all()) for a, b in zip(losses, plain_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))  # training unchanged
    run, live = ampwatch.load(tmp_path / "run.sqlite"), ampwatch.load(tmp_path / "live.sqlite")
    origin = run.events[run.events["origin"]]
    assert origin[["step", "module", "phase"]].values.tolist() == [[fault, "2", "forward"]]
    a, b = _events(run), _events(live)
    assert len(b) and a.equals(b)  # the same modules, kinds, origins and amax values
    assert set(run.modules["step"]) == {0, 5, 10, fault}  # observed: layer_every steps and the bad one
    assert list(run.steps["step"]) == list(range(12))
    assert not {"replay-not-reproduced", "check-read-before-update"} & set(run.notices["code"])


def test_without_a_scaler_a_compiled_model_replays_a_bad_step_on_its_kept_weights_like_eager(tmp_path, monkeypatch):
    """The same under torch.compile: the held step is replayed eagerly, its kept weights swapped into
    the parameters the graph reads and swapped out again, with no graph break and no recompile
    (swapping storage changes nothing Dynamo guards on); origins as in eager, training unchanged."""
    from torch._dynamo.utils import counters
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    fault = 7
    torch._dynamo.reset()
    plain_losses, plain_params = _bf16_run(tmp_path / "plain.sqlite", fault, watched=False, compiled="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    losses, params = _bf16_run(tmp_path / "run.sqlite", fault, watched=True, compiled="aot_eager")
    breaks, frames = dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
    _bf16_run(tmp_path / "eager.sqlite", fault, watched=True)
    assert breaks == {}
    assert 1 <= frames <= 2  # the graph of healthy steps and that of observed ones, nothing recompiled since
    assert all(torch.equal(a, b) or (a.isnan().all() and b.isnan().all()) for a, b in zip(losses, plain_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    run, eager = ampwatch.load(tmp_path / "run.sqlite"), ampwatch.load(tmp_path / "eager.sqlite")
    cols = ["step", "phase", "module", "origin"]
    origins = run.events[run.events.origin][cols].reset_index(drop=True)
    assert origins.values.tolist() == [[fault, "forward", "2", True]]
    assert origins.equals(eager.events[eager.events.origin][cols].reset_index(drop=True))
    assert set(run.modules["step"]) == {0, 5, 10, fault}


def test_without_a_scaler_parameters_of_a_group_added_later_are_kept_too(tmp_path, monkeypatch):
    """A head trained only from step 3 on (``add_param_group``, a fine-tuning loop's unfreezing):
    its weights must be among those kept, or a fault in them is replayed on the weights the loop
    repaired after the bad step and not reproduced."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    model[4].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    watch = ampwatch.attach(model, opt, None, path=str(tmp_path / "r.sqlite"), layer_every=5)
    fault = 7
    g = torch.Generator().manual_seed(1)
    for i in range(10):
        if i == 3:
            model[4].requires_grad_(True)
            opt.add_param_group({"params": list(model[4].parameters())})
        if i == fault:
            saved = model[4].weight.detach().clone()
            with torch.no_grad():
                model[4].weight.fill_(3e38)  # rows of the output past bf16's max
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 16, generator=g)).float().pow(2).mean()
        loss.backward()
        watch.log(loss=loss)
        opt.step()
        opt.zero_grad()
        if i == fault:
            with torch.no_grad():
                model[4].weight.copy_(saved)
                for prm in model.parameters():
                    prm.nan_to_num_(0.0, posinf=0.0, neginf=0.0)
    watch.close()
    run = ampwatch.load(watch.path)
    assert "replay-not-reproduced" not in set(run.notices["code"])
    origin = run.events[run.events["origin"]]
    assert origin[["step", "module", "phase"]].values.tolist() == [[fault, "4", "forward"]]


@pytest.mark.parametrize("keep", [True, False], ids=["keep_weights", "keep_weights-off"])
def test_without_a_scaler_each_check_is_read_at_the_next_steps_update(tmp_path, monkeypatch, keep):
    """On the accelerator path no healthy bf16 step reads anything of its own before its update:
    step i's check is read in step i + 1's ``optimizer.step()`` (its pre-hook), the step before a
    layer_every step's at the end of that step (its post-hook, once its pack is made), and the
    last one's when the run closes. layer_every steps (0, 5, 10) are observed live: no check.
    With ``keep_weights=False`` each step reads its own check before its update, holds nothing,
    and the run says why, once."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    watch = ampwatch.attach(model, opt, None, path=str(tmp_path / "r.sqlite"), layer_every=5, keep_weights=keep)
    mode = _Reads()
    held = []
    for i in range(8):
        mode.where = ("step", i)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 16)).float().pow(2).mean()
        loss.backward()
        watch.log(loss=loss)
        with mode:
            opt.step()
        held.append(None if watch._held is None else watch._held.pack.step)
        opt.zero_grad()
    kept = watch._kept_weights
    with mode:
        mode.where = "close"
        watch.close()
    run = ampwatch.load(watch.path)
    assert list(run.steps["step"]) == list(range(8)) and run.steps["grad_norm"].notna().all()
    assert (kept is not None and kept.allocated) == keep
    waits = run.notices[run.notices.code == "check-read-before-update"]
    if keep:  # held after each step: 1, 2, 3, then 4 through step 5 (observed), 6, 7
        assert held == [None, 1, 2, 3, 4, None, 6, 7]
        assert mode.reads == [("step", 2), ("step", 3), ("step", 4), ("step", 5), ("step", 7), "close"]
        assert waits.empty
    else:
        assert held == [None] * 8
        assert mode.reads == [("step", i) for i in (1, 2, 3, 4, 6, 7)]
        assert waits.step.tolist() == [1] and "keep_weights=False" in waits.message.iloc[0]


def test_without_a_scaler_where_the_weights_do_not_fit_the_check_is_read_before_the_update(tmp_path, record_path,
                                                                                       monkeypatch):
    """Where keeping a copy of the weights needs more than the device has room for (here: any
    bytes at all, on a CPU that reports no free memory), each step's check is read before its
    update as before: a bad step is still localized on its own step, training is unchanged, and
    on a device path the run says once why its steps wait, with the bytes."""
    from ampwatch.record import deferred
    monkeypatch.setattr(deferred, "HOLD_AT_MOST_BYTES", 0)
    fault = 7
    plain_losses, plain_params = _bf16_run(tmp_path / "plain.sqlite", fault, watched=False)
    losses, params = _bf16_run(tmp_path / "run.sqlite", fault, watched=True)
    assert all(torch.equal(a, b) or (a.isnan().all() and b.isnan().all()) for a, b in zip(losses, plain_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    run = ampwatch.load(tmp_path / "run.sqlite")
    origin = run.events[run.events["origin"]]
    assert origin[["step", "module", "phase"]].values.tolist() == [[fault, "2", "forward"]]
    assert set(run.modules["step"]) == {0, 5, 10, fault}
    waits = run.notices[run.notices.code == "check-read-before-update"]
    if record_path == "accelerator":
        weight_bytes = sum(p.numel() * 4 for p in params)
        assert waits.step.tolist() == [1]
        assert f"weights kept ({weight_bytes / 2 ** 20:,.0f} MiB)" in waits.message.iloc[0]
        finding = {f.id: f for f in ampwatch.diagnose(run)}["misuse-check-read-before-update"]
        assert finding.severity == "info" and "fused=True" in finding.advice and "copy of the weights" in finding.advice
    else:  # where reads are free nothing waits and nothing is said
        assert waits.empty


def test_a_fused_adamw_skips_a_bad_bf16_step_in_its_kernel_and_its_update_is_applied_after_the_replay(
        tmp_path, monkeypatch):
    """kernelskip.py: with AdamW(fused=True) the check before the update is handed to the kernel as
    its skip flag and read once step() has queued it. A bad step keeps the weights it ran with, is
    replayed on them, and its update is applied again: weights and AdamW moments bitwise as without
    ampwatch, the origin on its own step, and no flag left on the optimizer."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    fault = 7
    seen: list = []  # what each call of the optimizer's step carried as its skip flag

    def model_():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))

    def flag(opt, args, kwargs):
        found = getattr(opt, "found_inf", None)
        seen.append(None if found is None else float(found))

    def after(weights):  # the loop's own post-hook, registered before ampwatch's: the weights it sees
        return lambda opt, args, kwargs: weights.append(opt.param_groups[0]["params"][2].detach().clone())

    plain_weights, weights = [], []
    plain_losses, plain_state = bf16_fault_run(model_(), tmp_path / "plain.sqlite", fault, False, steps=12,
                                               batch=8, fused=True, post_hook=after(plain_weights))
    losses, state = bf16_fault_run(model_(), tmp_path / "run.sqlite", fault, True, steps=12, batch=8,
                                   fused=True, pre_hook=flag, post_hook=after(weights))
    assert all(torch.equal(a, b) or (a.isnan().all() and b.isnan().all()) for a, b in zip(losses, plain_losses))
    assert len(state) == len(plain_state) > 10  # parameters, exp_avg, exp_avg_sq and step of each
    assert all(torch.equal(a, b) for a, b in zip(state, plain_state))  # training unchanged, bitwise
    # layer_every steps (0, 5, 10) are observed live and carry no flag; the bad one runs twice
    expected = [None, 0.0, 0.0, 0.0, 0.0, None, 0.0, 1.0, None, 0.0, 0.0, None, 0.0]
    assert seen == expected
    # the loop's post-hook ran twice on the bad step, each time after the update was applied again
    assert len(weights) == len(plain_weights) + 1
    assert weights[fault].isnan().any() and weights[fault + 1].isnan().any()  # never the skipped weights
    del weights[fault]
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(weights, plain_weights))
    assert plain_weights[fault].isnan().any()
    run = ampwatch.load(tmp_path / "run.sqlite")
    origin = run.events[run.events["origin"]]
    assert origin[["step", "module", "phase"]].values.tolist() == [[fault, "2", "forward"]]
    assert set(run.modules["step"]) == {0, 5, 10, fault}
    assert not {"replay-not-reproduced", "check-read-before-update"} & set(run.notices["code"])
    steps = run.steps.set_index("step")
    assert not math.isfinite(steps.loc[fault, "grad_norm"]) and steps.drop(index=fault)["grad_norm"].notna().all()


def test_a_bf16_update_the_kernel_skipped_is_applied_even_when_recording_fails_on_that_step(tmp_path, monkeypatch):
    """Recording may fail while a skipped bf16 step is localized (here: an injected failure in that
    code): it stops with one warning, and the update the kernel skipped is applied all the same."""
    from ampwatch.record import watch as watch_module
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")

    def broken(self):
        raise RuntimeError("injected")
    monkeypatch.setattr(watch_module.Watch, "_localize_skipped_update", broken)
    fault = 7

    def model_():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))

    plain_losses, plain_state = bf16_fault_run(model_(), tmp_path / "plain.sqlite", fault, False, steps=10,
                                               batch=8, fused=True)
    with pytest.warns(RuntimeWarning, match="stopped recording.*injected"):
        losses, state = bf16_fault_run(model_(), tmp_path / "run.sqlite", fault, True, steps=10, batch=8, fused=True)
    assert all(torch.equal(a, b) or (a.isnan().all() and b.isnan().all()) for a, b in zip(losses, plain_losses))
    assert all(torch.equal(a, b) for a, b in zip(state, plain_state))
    run = ampwatch.load(tmp_path / "run.sqlite")
    assert "recording-stopped" in set(run.notices["code"]) and run.steps["step"].max() < fault + 1


def test_the_root_hooks_list_of_tensors_is_the_nested_walk_in_the_same_order():
    """The replay's root hooks find a forward's tensors with a list walk (no generator per level):
    the same tensors, in the same order and to the same depth, as the walk the module hooks use."""
    from collections import OrderedDict
    from ampwatch.record import torch_access
    t = [torch.full((1,), float(i)) for i in range(8)]
    cases = [t[0], (t[0], [t[1], {"a": t[2], "b": (t[3],)}], None, 3, "s"),
             OrderedDict(logits=t[4], past=((t[5], t[6]),)), ((((t[7],),),),), [], {"k": None}]
    for case in cases:
        walked = list(torch_access.nested_tensors(case))
        listed = torch_access.tensors_in(case)
        assert [id(x) for x in listed] == [id(x) for x in walked]
    assert torch_access.tensors_in(((((t[7],),),),)) == []  # deeper than three levels: left out, as before
    assert len(torch_access.tensors_in(cases[1])) == 3  # t[3] sits four levels down


# -- memory: a step observed live keeps no inputs where a replay can fetch them -------------------------

def _allocation_peak(fn) -> int:
    """Bytes above the start at the highest point of the CPU allocations ``fn`` made, from the
    profiler's memory events in order (the CPU allocator keeps no peak statistic)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = top = 0
    for event in events:
        now += event.nbytes()
        top = max(top, now)
    return top


def _observed_step_peak(tmp_path, name: str, *, fp32_check: bool, replay: bool = True) -> int:
    """The allocation peak of step 2, observed live (layer_every=2), of 40 Linear -> Dropout pairs:
    a Dropout's input (its Linear's output) is not saved for backward, so autograd frees it during
    the forward; a kept reference would hold each one to the step's end."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(40) for m in (nn.Linear(64, 64), nn.Dropout(0.1))])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(256, 64)
    peaks = []
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / f"{name}.sqlite"), layer_every=2,
                         fp32_check=fp32_check, replay=replay) as watch:
        for step in range(3):
            run = lambda: amp_step(model, opt, scaler, x, x[:, :64])  # noqa: E731
            if step == 2:
                assert watch.observer.observing
                peaks.append(_allocation_peak(run))
            else:
                run()
    return peaks[0]


def test_a_step_observed_live_keeps_no_inputs_for_the_fp32_recompute(tmp_path):
    """The fp32 recompute needs a bad step's origin's inputs. Kept by reference on every observed
    step, they held 40 Dropout inputs (fp16, 256 x 64: 32 KiB each) to the step's end. With a
    replay possible, a live step keeps none (a bad one runs its forward again for them), so the
    observed step's peak is the one without the fp32 check; without a replay it keeps them."""
    kept = 40 * 256 * 64 * 2
    with_check = _observed_step_peak(tmp_path, "check", fp32_check=True)
    without = _observed_step_peak(tmp_path, "nocheck", fp32_check=False)
    assert abs(with_check - without) < kept / 8
    live = _observed_step_peak(tmp_path, "live", fp32_check=True, replay=False)
    live_without = _observed_step_peak(tmp_path, "live_nocheck", fp32_check=False, replay=False)
    assert live - live_without > kept / 2  # kept on every step: the inputs the peak above is free of


def _dropout_pairs(n: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(n) for m in (nn.Linear(16, 16), nn.Dropout(0.1))])


def test_an_observed_step_holds_no_activation_or_gradient_past_its_life(tmp_path):
    """Observed tensors wait for their chunk (batched.py) before one reduction. They must not
    outlive the pass that made them: a Linear's output feeding a Dropout (not saved for backward)
    is gone once the forward returns, and the gradients of those outputs once the optimizer's step
    begins, on an observed step as without ampwatch."""
    import weakref
    model = _dropout_pairs()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    outputs, grads, seen = [], [], {}

    def keep_ref(module, args, output):
        outputs.append(weakref.ref(output))
        output.register_hook(lambda g: grads.append(weakref.ref(g)))

    def at_optimizer_step(optimizer, args, kwargs):  # registered after attach: runs after ampwatch's
        seen["grads alive"] = sum(r() is not None for r in grads)

    x, y = torch.randn(32, 16), torch.randn(32, 16)
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "run.sqlite"), layer_every=2) as watch:
        for linear in model[0::2]:
            linear.register_forward_hook(keep_ref)
        opt.register_step_pre_hook(at_optimizer_step)
        for step in range(3):
            outputs.clear(), grads.clear()
            observed = watch.observer.observing
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            alive_after_forward = sum(r() is not None for r in outputs)
            scaler.scale(F.mse_loss(out.float(), y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            assert len(outputs) == 6 and len(grads) == 6
            assert (alive_after_forward, seen["grads alive"]) == (0, 0), (step, observed)
    assert set(ampwatch.load(tmp_path / "run.sqlite").modules["step"]) == {0, 2}  # observed: 0 and 2


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_a_healthy_steps_output_gradient_goes_before_its_optimizer_step(tmp_path, fused):
    """A replay needs the gradient that reached the model's outputs, kept from the backward. A step
    whose update begins will not be replayed: the loop's logits' gradient is let go then, not at
    the step's end (it hung on the logits' graph node, alive while the loop holds the logits). A
    fused optimizer may still skip inside its kernel: its steps keep it, except the one observed
    live (step 0), which is never replayed."""
    import weakref
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu")
    refs, seen = [], []
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "run.sqlite")):
        opt.register_step_pre_hook(lambda o, a, k: seen.append(refs[-1]() is not None))
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
            logits.register_hook(lambda g: refs.append(weakref.ref(g)))
            scaler.scale(F.mse_loss(logits.float(), y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    assert seen == ([False, True, True] if fused else [False, False, False])
