"""A loop that clips pays for gradient norms once: the recorder takes the per-gradient norms that
``clip_grad_norm_`` computed (before it clipped) instead of measuring its own. The recorded norms
must be the pre-clip, unscaled norms whatever the loop does, and training must not change."""
from __future__ import annotations

import math

import pytest
import torch

import ampwatch
from ampwatch.record.torch_access import TORCH_VERSION
from helpers.loops import data, mlp
from helpers.torch_compat import HAS_SPLIT_CLIP


def _loop(path, how: str, steps: int = 4, attach: bool = True, accum: int = 1, growth_interval: int = 2000):
    """Trains an MLP under fp16 autocast; returns (run or None, per step the pre-clip unscaled norm
    of every parameter's gradient as the loop computed it itself, final parameters)."""
    model = mlp()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=growth_interval)
    truth = []
    watch = ampwatch.attach(model, opt, scaler, path=str(path), layer_every=1) if attach else None
    for i in range(steps):
        for k in range(accum):
            x, y = data(10 * i + k)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y) / accum
            scaler.scale(loss).backward()
        if how != "before-unscale":
            scaler.unscale_(opt)
        inv = 1.0 if how != "before-unscale" else 1.0 / float(scaler.get_scale())
        truth.append([float(p.grad.double().norm()) * inv for p in params])
        if how == "part":  # only the first layer: the rest must still be measured, unclipped
            torch.nn.utils.clip_grad_norm_(params[:2], 0.01)
        elif how == "none":
            pass
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # clips every step
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    if watch is not None:
        watch.close()
        return ampwatch.load(watch.path), truth, [p.detach().clone() for p in params]
    return None, truth, [p.detach().clone() for p in params]


def _recorded(run) -> list[list[float]]:
    layers = run.layers
    names = list(run.tensors[run.tensors["kind"] == "param"]["name"])
    return [[float(layers[(layers.step == s) & (layers.name == n)].grad_norm.iloc[0]) for n in names]
            for s in sorted(set(layers.step))]


@pytest.mark.parametrize("how", ["after-unscale", "before-unscale", "part", "none"])
def test_recorded_norms_are_the_pre_clip_unscaled_norms(tmp_path, record_path, how):
    run, truth, _ = _loop(tmp_path / "r.sqlite", how)
    recorded = _recorded(run)
    assert len(recorded) == len(truth) == 4
    for step, (got, want) in enumerate(zip(recorded, truth)):
        assert got == pytest.approx(want, rel=1e-5), f"step {step}"
        # and the global norm is theirs too
        total = float(run.steps.grad_norm.iloc[step])
        assert total == pytest.approx(math.sqrt(sum(v * v for v in want)), rel=1e-5)
    assert min(min(t) for t in truth) > 0.01  # every step really was clipped (max_norm 0.01)


@pytest.mark.parametrize("how", ["none", "before-unscale"])
def test_norms_are_unscaled_by_the_scale_of_their_own_step_while_it_grows(tmp_path, record_path, how):
    """growth_interval=1: the scale doubles after every step, so a 1/scale kept from an earlier
    step would be off by a power of two."""
    run, truth, _ = _loop(tmp_path / "r.sqlite", how, steps=5, growth_interval=1)
    assert list(run.steps.loss_scale) == [2.0 ** (10 + i) for i in range(5)]
    assert _recorded(run) == [pytest.approx(t, rel=1e-5) for t in truth]


def test_norms_with_accumulation_are_the_whole_steps(tmp_path, record_path):
    run, truth, _ = _loop(tmp_path / "r.sqlite", "after-unscale", accum=3)
    assert _recorded(run) == [pytest.approx(t, rel=1e-5) for t in truth]


def test_taking_the_clips_norms_changes_no_number_training_produces(tmp_path, record_path):
    _, _, watched = _loop(tmp_path / "r.sqlite", "after-unscale")
    _, _, plain = _loop(tmp_path / "p.sqlite", "after-unscale", attach=False)
    assert all(torch.equal(a, b) for a, b in zip(watched, plain))


def test_torch_is_left_as_it_was(tmp_path):
    def now():  # _get_total_norm: torch >= 2.6
        return (torch._foreach_norm, torch.stack, getattr(torch.nn.utils.clip_grad, "_get_total_norm", None),
                torch.nn.utils.clip_grad_norm_)
    before = now()
    _loop(tmp_path / "r.sqlite", "after-unscale", steps=2)
    assert now() == before


def test_a_clip_that_raises_leaves_torch_as_it_was(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with ampwatch.attach(model, opt, path=str(tmp_path / "r.sqlite")):
        x, y = data(0)
        model(x).sum().mul(float("inf")).backward()
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        assert torch._foreach_norm is torch._C._VariableFunctions._foreach_norm
        assert torch.stack is torch._C._VariableFunctions.stack


class _SometimesBranch(torch.nn.Module):
    """An MLP whose side branch runs on every third step only (a mixture-of-experts' idle expert):
    on the other steps its parameters have no gradient, and the clip's gradient list is shorter."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.side = mlp(), torch.nn.Linear(16, 4)
        self.use_side = False

    def forward(self, x):
        out = self.body(x)
        return out + self.side(x) if self.use_side else out


@pytest.mark.parametrize("layer_every", [1, 2])  # 2: step 4, without the branch, follows a step with it
def test_each_norm_stays_with_its_parameter_when_some_have_no_gradient(tmp_path, record_path, layer_every):
    """The clip's norms are mapped to parameters from the clip's parameter list when every
    parameter gave a gradient; a step on which some gave none must not shift them onto others."""
    model = _SometimesBranch()
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    opt = torch.optim.SGD(params, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite"), layer_every=layer_every)
    truth = []
    for i in range(7):
        model.use_side = i % 3 == 0
        x, y = data(i)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        truth.append({n: float(p.grad.double().norm()) for n, p in zip(names, params) if p.grad is not None})
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    watch.close()
    run = ampwatch.load(watch.path)
    layers = run.layers
    assert len(truth[0]) == len(params) and len(truth[1]) == len(params) - 2  # the branch's weight and bias
    for step, want in enumerate(truth):
        total = float(run.steps.grad_norm.iloc[step])
        assert total == pytest.approx(math.sqrt(sum(v * v for v in want.values())), rel=1e-5), f"step {step}"
        if step % layer_every:
            continue  # per-parameter rows are written on layer_every steps
        rows = layers[(layers.step == step) & layers.grad_norm.notna()]
        got = dict(zip(rows.name, rows.grad_norm))
        assert set(want) <= set(got), f"step {step}"
        for name, norm in want.items():
            assert got[name] == pytest.approx(norm, rel=1e-5), f"step {step}, {name}"


def test_a_clip_handed_an_empty_generator_warns_as_torch_does(tmp_path):
    """The wrapper lists a generator first: an empty one goes on as it came, for torch's own warning
    about it (torch >= 2.6 warns; older torch returns 0 silently: the same, watched or not)."""
    import warnings

    def clip_empty():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            total = torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)
        return float(total), [str(w.message) for w in caught]
    plain = clip_empty()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with ampwatch.attach(model, opt, path=str(tmp_path / "r.sqlite")):
        assert clip_empty() == plain
    if HAS_SPLIT_CLIP:
        assert any("empty generator" in m for m in plain[1])


def _clipping_step(model, opt, scaler, x, y, watch=None) -> None:
    """One step of the loop that clips: fp16 + GradScaler (unscale_ first), or, without a scaler,
    bf16 with the loss through ``watch.log``."""
    with torch.autocast("cpu", dtype=torch.bfloat16 if scaler is None else torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    if scaler is None:
        loss.backward()
        if watch is not None:
            watch.log(loss=loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    opt.zero_grad(set_to_none=True)


def test_a_clipping_loop_measures_no_norm_of_its_own_between_layer_every_steps(tmp_path, monkeypatch):
    """On the accelerator path a healthy step between layer_every steps runs one foreach norm over
    the gradients, the clip's own; the same loop without ampwatch runs the same one."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")

    def norms_per_step(attach: bool) -> list[int]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu")
        watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / f"{attach}.sqlite"),
                                layer_every=100) if attach else None
        counts = []
        for i in range(4):
            x, y = data(i)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                _clipping_step(model, opt, scaler, x, y)
            counts.append(sum(e.count for e in prof.key_averages() if e.key == "aten::_foreach_norm"))
        if watch is not None:
            watch.close()
        return counts

    plain, watched = norms_per_step(False), norms_per_step(True)
    assert plain == [1, 1, 1, 1]
    # step 0 (a layer_every step) measures at backward end and learns that the loop clips; from
    # step 1 on the clip's norms are the recorder's
    assert watched[0] > 1
    assert watched[1:] == plain[1:]


@pytest.mark.parametrize("clips", [True, False])
def test_a_clipping_loop_queues_nothing_at_backward_end_and_still_counts_micro_batches(tmp_path, monkeypatch, clips):
    """Once the clip hands the recorder its norms, the end of a backward pass has nothing to do: each
    pass costs the parameter trigger's one call, with no callback queued on the autograd engine, and
    every micro-batch is still counted. A loop that does not clip has its norms measured at each
    pass's end, as before."""
    from ampwatch.record import torch_access
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    queued = []
    real = torch_access.at_backward_end
    monkeypatch.setattr(torch_access, "at_backward_end", lambda callback: (queued.append(1), real(callback)))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite"), layer_every=100)
    per_step, truth = [], []
    for i in range(4):
        queued.clear()
        for k in range(3):
            x, y = data(10 * i + k)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y) / 3
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        truth.append(math.sqrt(sum(float(p.grad.double().norm()) ** 2 for p in model.parameters())))
        if clips:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        per_step.append(len(queued))
    watch.close()
    run = ampwatch.load(watch.path)
    assert list(run.steps.micro_batches) == [3, 3, 3, 3]
    assert list(run.steps.grad_norm) == pytest.approx(truth, rel=1e-5)
    # step 0 learns that the loop clips; from step 1 on its passes queue nothing, unless it does not clip
    assert per_step == ([3, 0, 0, 0] if clips else [3, 3, 3, 3])


def test_a_clip_inside_a_compiled_function_breaks_no_graph(tmp_path, record_path):
    """Under torch.compile the wrappers step aside (a listener's call would break the graph):
    the norms are then measured by the recorder itself, and are still the pre-clip ones."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = mlp()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-2)
    clip = torch.compile(lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.01), backend="aot_eager")
    truth = []
    with ampwatch.attach(model, opt, path=str(tmp_path / "r.sqlite"), layer_every=1) as watch:
        for i in range(3):
            x, y = data(i)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            watch.log(loss=loss)
            truth.append([float(p.grad.double().norm()) for p in params])
            clip(params)
            opt.step()
            opt.zero_grad(set_to_none=True)
    breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    counters.clear()
    clip = torch.compile(lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.01), backend="aot_eager")
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    clip(params)  # unwatched: torch's own clip breaks its graph before torch 2.6 (_group_tensors_by_device_and_dtype)
    assert set(breaks) == set(counters["graph_break"])  # none of ours
    if TORCH_VERSION >= (2, 13):  # torch's own clip compiles whole there (2.4 and 2.10 break on its grouping)
        assert breaks == {}
    assert _recorded(ampwatch.load(watch.path)) == [pytest.approx(t, rel=1e-5) for t in truth]


def test_two_watched_models_each_take_their_own_clips_norms(tmp_path, monkeypatch):
    """Every watch hears every clip. A clip over another watched model's parameters is recognised
    from the parameters the clip was handed, so its gradients are never mapped against ours (that
    cost ~50 us a step per other watch); each run still records its own model's pre-clip norms."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    from ampwatch.record.watch import Watch
    mapped = []
    real = Watch._clip_gradient_ids

    def mapping(self, tensors):  # our own method, counted: which watch mapped a clip's gradients
        mapped.append(self.name)
        return real(self, tensors)

    monkeypatch.setattr(Watch, "_clip_gradient_ids", mapping)
    loops = []
    for seed in (0, 1):
        model = mlp(seed)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / f"m{seed}.sqlite"), layer_every=1)
        loops.append((model, opt, scaler, watch, []))
    for i in range(4):
        for model, opt, scaler, _, truth in loops:
            x, y = data(i)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            truth.append([float(p.grad.double().norm()) for p in model.parameters()])
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    for _, _, _, watch, truth in loops:
        watch.close()
        recorded = _recorded(ampwatch.load(watch.path))
        assert len(recorded) == 4
        for got, want in zip(recorded, truth):
            assert got == pytest.approx(want, rel=1e-5)
    # each watch mapped its own model's clip once (step 1, the first clip it takes), never the other's
    assert sorted(mapped) == ["m0", "m1"]


@pytest.mark.parametrize("loop", ["fp16", "fp16-fused", "bf16", "fp16-tensor-lr"])
def test_a_healthy_step_between_layer_every_steps_adds_one_concatenation(tmp_path, monkeypatch, loop):
    """On the accelerator path, what ampwatch adds to a healthy clipping step between layer_every
    steps is the step pack: one ``cat`` of loss, scale and the clip's norms (packed before
    ``scaler.update()``, so the scale needs no copy of its own), with a fused optimizer the
    scaler's inf flag too (read as it is: one device, one flag, nothing summed). Without a scaler
    (bf16) the same pack is made before ``optimizer.step()``, one reduction of it tells the host
    whether the step must be replayed, and one copy keeps the weights for that replay: the check is
    read at the next step's optimizer step (here, on a CPU without events, as a read of the
    previous step's check; on CUDA a copy to the host and an event). Ops that launch nothing (views, allocations, ``detach``)
    are left out, as ``bench/ops.py`` leaves them out; a host read counts as ``_local_scalar_dense``.
    A learning rate given as a tensor (compiled or capturable optimizer steps) joins the pack: no
    read of it."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    free = {"empty", "empty_like", "empty_strided", "new_empty", "detach", "alias", "lift_fresh"}

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            schema = func._schema
            view = any(r.alias_info is not None for r in schema.returns) and not any(
                a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
            name = func.overloadpacket.__name__
            if not view and name not in free:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    def ops_per_step(attach: bool) -> list[Counter]:
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3) if loop == "fp16-tensor-lr" else 1e-3,
                                fused=loop == "fp16-fused")
        scaler = None if loop == "bf16" else torch.amp.GradScaler("cpu")
        watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / f"ops{attach}.sqlite"),
                                layer_every=100) if attach else None
        counts = []
        for i in range(4):
            x, y = data(i)
            with Ops() as mode:
                _clipping_step(model, opt, scaler, x, y, watch)
            counts.append(mode.ops)
        if watch is not None:
            watch.close()
        return counts

    plain, watched = ops_per_step(False), ops_per_step(True)
    added = {"fp16": Counter({"cat": 1}), "fp16-tensor-lr": Counter({"cat": 1}), "fp16-fused": Counter({"cat": 1, "_local_scalar_dense": 1}),
             "bf16": Counter({"cat": 1, "linalg_vector_norm": 1, "_foreach_copy_": 1, "_local_scalar_dense": 1})}[loop]
    for step in (2, 3):  # step 0 is a layer_every step; step 1 learned that the loop clips
        assert watched[step] - plain[step] == added
        assert plain[step] - watched[step] == Counter()
