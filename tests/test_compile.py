"""Recording under torch.compile (aot_eager: inductor compiles too slowly on 2 cores).

Ground truth is the eager run of the same model and data: the compiled run must record the same
steps, skips, scales and norms, localize the same injected faults, add no graph break and no
graph, and leave the losses bitwise unchanged."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch.nn import functional as F

import ampwatch
from helpers.loops import Amplify
from helpers.torch_compat import NEEDS_TRACED_HOOKS


class BackwardBomb(nn.Module):
    """Parameter-free; finite forward, but multiplies the gradient flowing back by 1e6."""

    def forward(self, x):
        return Amplify.apply(x)


class Net(nn.Module):
    def __init__(self, bomb: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.bomb = BackwardBomb() if bomb else nn.Identity()
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.fc2(self.bomb(self.act(self.fc1(x)))) + x[:, :32].sum(1, keepdim=True))


def run(tmp_path, name, *, compiled, watched, attach_after=False, fault_step=None, bomb=False, steps=4,
        fused=False, layer_every=2, held=None):
    """``held``: a list that gets, after each step, the step a watch still holds unread (deferred.py)."""
    torch._dynamo.reset()
    counters.clear()
    model = Net(bomb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if fused else \
        torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    watch = None
    if watched and not attach_after:
        watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / f"{name}.sqlite"), layer_every=layer_every)
    net = torch.compile(model, backend="aot_eager") if compiled else model
    if watched and attach_after:
        watch = ampwatch.attach(net, opt, scaler, path=str(tmp_path / f"{name}.sqlite"), layer_every=layer_every)
    def after_step():
        if held is not None and watch is not None and watch._held is not None:
            held.append(watch._held.pack.step)

    # fp16 output > 65504 from the fault step on
    losses = _fp16_steps(net, opt, scaler, steps, fault_step, lambda: model.fc2.weight, after_step)
    breaks, graphs = dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
    if watch is not None:
        watch.close()
        return ampwatch.load(watch.path), losses, breaks, graphs
    return None, losses, breaks, graphs


def _fp16_steps(net, opt, scaler, steps, fault_step=None, fault_weight=None, after_step=None):
    """``steps`` fp16 steps with a GradScaler on seeded batches (8 x 16 -> 4); from ``fault_step`` on,
    ``fault_weight()`` blown up by 1e6 (an fp16 overflow). The losses."""
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        if step == fault_step:
            with torch.no_grad():
                fault_weight().mul_(1e6)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            out = net(x)
        loss = F.mse_loss(out.float(), y)
        losses.append(loss.detach().clone())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if after_step is not None:
            after_step()
    return losses


def _train(net, model_opt_scaler, x, steps):
    """``steps`` fp16 steps of ``net`` on one batch with a GradScaler; the losses."""
    opt, scaler = model_opt_scaler
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = net(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _same_record(a, b):
    cols = ["step", "loss_scale", "skipped", "micro_batches"]
    assert a.steps["loss"].fillna(-1).tolist() == pytest.approx(b.steps["loss"].fillna(-1).tolist(), rel=1e-6)
    assert a.steps[cols].equals(b.steps[cols])
    assert a.steps["grad_norm"].fillna(-1).tolist() == pytest.approx(b.steps["grad_norm"].fillna(-1).tolist(), rel=1e-5)


@pytest.mark.parametrize("attach_after", [False, True], ids=["attach-then-compile", "compile-then-attach"])
@NEEDS_TRACED_HOOKS
def test_compiled_run_records_what_eager_records_without_graph_breaks(tmp_path, attach_after):
    eager, eager_losses, _, _ = run(tmp_path, "eager", compiled=False, watched=True)
    plain, plain_losses, _, plain_graphs = run(tmp_path, "plain", compiled=True, watched=False)
    comp, comp_losses, breaks, graphs = run(tmp_path, "comp", compiled=True, watched=True, attach_after=attach_after)
    assert breaks == {} and graphs == plain_graphs
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, comp_losses))  # attaching changes nothing
    _same_record(eager, comp)
    assert len(comp.modules) and set(comp.modules["module"]) == set(eager.modules["module"])


@pytest.mark.parametrize("kind", ["forward", "backward"])
@NEEDS_TRACED_HOOKS
def test_compiled_run_localizes_like_eager(tmp_path, kind, monkeypatch):
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")  # the path a GPU takes
    opts = {"fault_step": 2} if kind == "forward" else {"bomb": True}
    eager, _, _, _ = run(tmp_path, "eager", compiled=False, watched=True, **opts)
    comp, _, breaks, _ = run(tmp_path, "comp", compiled=True, watched=True, **opts)
    assert breaks == {}
    cols = ["step", "phase", "module", "origin"]
    origins = eager.events[eager.events.origin][cols].reset_index(drop=True)
    assert len(origins) and origins.equals(comp.events[comp.events.origin][cols].reset_index(drop=True))
    first = origins[origins.phase == kind].iloc[0]
    assert first["module"] == ("fc2" if kind == "forward" else "bomb")
    assert first["step"] == (2 if kind == "forward" else 0)
    _same_record(eager, comp)


@pytest.mark.parametrize("accelerator", [True, False], ids=["accelerator-path", "cpu-path"])
@NEEDS_TRACED_HOOKS
def test_the_fp32_recompute_of_a_compiled_forward_origin(tmp_path, monkeypatch, accelerator):
    """On the accelerator path a compiled run's forward origin gets the fp32 recompute eager gives:
    its inputs are fetched by running that micro-batch's forward again eagerly (replay.inputs_of).
    On the CPU path under compile no module's inputs are kept, so none is done (docs/localization.md)."""
    if accelerator:
        monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    else:
        monkeypatch.delenv("AMPWATCH_CPU_AS_ACCELERATOR", raising=False)
    eager, _, _, _ = run(tmp_path, "eager", compiled=False, watched=True, fault_step=2, steps=5)
    comp, _, _, _ = run(tmp_path, "comp", compiled=True, watched=True, fault_step=2, steps=5)
    cols = ["step", "phase", "module"]
    want, got = eager.events[eager.events.origin], comp.events[comp.events.origin]
    assert want[cols].reset_index(drop=True).equals(got[cols].reset_index(drop=True)) and len(want) == 3
    assert all(v > 65504 for v in want["fp32_amax"])  # fc2's output is beyond fp16's range, finite in fp32
    if accelerator:
        assert got["fp32_amax"].tolist() == pytest.approx(want["fp32_amax"].tolist(), rel=1e-4)
    else:
        assert all(v is None for v in got["fp32_amax"])


@pytest.mark.parametrize("kind", ["forward", "backward"])
@NEEDS_TRACED_HOOKS
def test_a_compiled_model_with_a_fused_optimizer_localizes_skips_read_a_step_late_like_eager(tmp_path, kind,
                                                                                              monkeypatch):
    """The GPU user's stack: torch.compile and AdamW(fused=True). Between layer_every steps a fused
    step's skip is read at the next step's optimizer step and replayed there (deferred.py), in eager
    mode like every replay: the origins must be eager's, with no graph break."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    opts = dict(fault_step=2) if kind == "forward" else dict(bomb=True)
    opts.update(fused=True, layer_every=5, steps=7)
    eager_held, comp_held = [], []
    eager, eager_losses, _, _ = run(tmp_path, "eager", compiled=False, watched=True, held=eager_held, **opts)
    comp, comp_losses, breaks, _ = run(tmp_path, "comp", compiled=True, watched=True, held=comp_held, **opts)
    assert breaks == {}
    assert eager_held == comp_held == [1, 2, 3, 6]  # observed: 0 and 5; step 4 is read in itself
    cols = ["step", "phase", "module", "origin"]
    origins = eager.events[eager.events.origin][cols].reset_index(drop=True)
    assert origins.equals(comp.events[comp.events.origin][cols].reset_index(drop=True))
    skipped = eager.steps.set_index("step")["skipped"]
    bad = [s for s in range(7) if skipped[s]]
    assert bad and set(origins["step"]) == set(bad)  # every skipped step localized, held or not
    assert set(origins[origins.phase == kind]["module"]) == {"fc2" if kind == "forward" else "bomb"}
    _same_record(eager, comp)


def test_hooks_leave_compiled_models_between_observed_steps_without_recompiles(tmp_path, monkeypatch):
    """On the accelerator path the module hooks are removed between observed steps under compile too
    (kept, Dynamo would check ~20 guards a module before every call), and registered again on the
    next observed step with new handles: Dynamo keeps the two graphs, with no recompile however
    often they alternate; every observed step is recorded from inside the graph and training is
    bitwise that of the unwatched run."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")  # the path a GPU takes

    def train(watched):
        torch._dynamo.reset()
        counters.clear()
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
        watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / "w.sqlite"), layer_every=2) if watched else None
        net = torch.compile(model, backend="aot_eager")
        inner = list(model.modules())[1:]  # the root's own hooks (backward end, replay) stay: they run outside the graph
        hooked, losses = [], []
        x = torch.randn(8, 16)
        for _ in range(9):
            hooked.append(sum(len(m._forward_hooks) for m in inner))
            losses += _train(net, (opt, scaler), x, 1)
        if watch is not None:
            watch.close()
        return watch, losses, hooked, counters["stats"]["unique_graphs"], dict(counters["graph_break"])

    _, plain_losses, _, plain_graphs, _ = train(False)
    watch, losses, hooked, graphs, breaks = train(True)
    assert breaks == {} and graphs == plain_graphs + 1
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses))
    assert [n > 0 for n in hooked] == [step % 2 == 0 for step in range(9)]
    modules = ampwatch.load(watch.path).modules
    forward = modules[modules.phase == "forward"]
    assert sorted(set(forward.step)) == [0, 2, 4, 6, 8]
    assert all(set(forward[forward.step == s].module) >= {"fc1", "act", "fc2", "head"} for s in (0, 2, 4, 6, 8))


def test_attach_to_a_compiled_model_that_already_ran(tmp_path):
    """The old failure: attaching after the compiled model ran raised inside Dynamo. Now it recompiles
    once with the hooks and records the rest of the run; training is unchanged."""
    _, plain_losses, _, _ = run(tmp_path, "plain", compiled=True, watched=False)
    torch._dynamo.reset()
    counters.clear()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    net = torch.compile(model, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    losses, watch = [], None
    for step in range(4):
        if step == 1:
            watch = ampwatch.attach(net, opt, scaler, path=str(tmp_path / "late.sqlite"))
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(net(x).float(), y)
        losses.append(loss.detach().clone())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    watch.close()
    assert dict(counters["graph_break"]) == {}
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses))
    assert len(ampwatch.load(watch.path).steps) == 3


class BrokenBlock(nn.Module):
    """A block with a graph break of its own: compiled, its call is run eagerly around the break,
    and so are its hooks (as happens in HF models under torch.compile)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = nn.GELU()

    def forward(self, x):
        h = self.fc(x)
        torch._dynamo.graph_break()
        return self.act(h)


def _broken_run(tmp_path, watched, steps=4, layer_every=1):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(*[BrokenBlock() for _ in range(10)], nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / "broken.sqlite"),
                            layer_every=layer_every) if watched else None
    net = torch.compile(model, backend="aot_eager")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    losses = _train(net, (opt, scaler), x, steps)
    graphs = counters["stats"]["unique_graphs"]
    if watch is not None:
        watch.close()
        return ampwatch.load(watch.path), losses, graphs
    return None, losses, graphs


@NEEDS_TRACED_HOOKS
def test_hooks_around_a_models_own_graph_break_are_not_compiled(tmp_path, monkeypatch):
    """Hooks that run eagerly around a model's own graph break are not compiled as frames of their
    own, nor is anything they call (Dynamo would specialize each per module, hit its recompile
    limit and run a graph per call: +80 ms a step on GPT-2 small's tree); training is unchanged
    and the modules are still all recorded."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from ampwatch.record import batched
    from ampwatch.record import observe
    from ampwatch.record import watch
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    _, plain_losses, _ = _broken_run(tmp_path, watched=False)
    run_, losses, _ = _broken_run(tmp_path, watched=True)
    ours = [observe.ModuleObserver._after, observe.ModuleObserver._before, observe.ModuleObserver._observe,
            observe.add_grad_hook, batched.BatchedReducer.add, watch._AutocastProbe.__call__]
    assert {fn.__qualname__: len(_debug_get_cache_entry_list(fn)) for fn in ours} == {fn.__qualname__: 0 for fn in ours}
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses))
    recorded = set(run_.modules["module"])
    assert {f"{i}.fc" for i in range(10)} | {f"{i}.act" for i in range(10)} | {"10"} <= recorded


@NEEDS_TRACED_HOOKS
def test_failure_inside_the_compiled_op_stops_recording_not_training(tmp_path, monkeypatch):
    """An internal failure in the op's body, inside the user's compiled forward, warns once and
    stops recording; the compiled training goes on with the losses of the unwatched run."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    from ampwatch.record import batched
    _, plain_losses, _, _ = run(tmp_path, "plain", compiled=True, watched=False)
    calls = []

    def broken(self, d, amax, slot):  # the body of ampwatch::keep_max, in the compiled backward
        if len(calls) >= 6:  # a bug met after the first steps: an internal error, not torch's
            raise ZeroDivisionError("injected")
        calls.append(slot)

    monkeypatch.setattr(batched.BatchedReducer, "keep", broken)
    with pytest.warns(RuntimeWarning, match="stopped recording") as caught:
        _, losses, breaks, _ = run(tmp_path, "broken", compiled=True, watched=True)
    assert len([w for w in caught if "stopped recording" in str(w.message)]) == 1
    assert len(calls) == 6
    assert breaks == {}
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses))


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
@NEEDS_TRACED_HOOKS
def test_the_op_is_kept_out_of_cuda_graphs_in_forward_and_backward(tmp_path, monkeypatch, path):
    """CUDA graphs (mode 'reduce-overhead'/'max-autotune') replay captured kernels without running
    Python: ``ampwatch::observe`` would record once, at capture. Inductor's own check for ops it
    must keep out of a CUDA graph flags every call of our ops in the graphs AOTAutograd hands it
    (the gradient hooks in the backward; in the forward too where reads are free), and nothing else
    in them. On the accelerator path the forward holds no op at all: its maxima are plain graph
    ops whose results leave joined, one output per dtype, so a CUDA graph takes the forward whole; the backward's
    maxima are reduced in the graph too and only handed out by ``ampwatch::keep_max``."""
    if path == "accelerator":
        monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node
    if getattr(torch.Tag, "cudagraph_unsafe", None) is None:
        pytest.skip("torch without the cudagraph_unsafe tag: the op's body checks for a capture instead")
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    torch._dynamo.reset()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / "run.sqlite"))
    net = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = net(torch.randn(8, 16)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    watch.close()
    assert len(graphs) == 2  # forward, backward
    ours = {torch.ops.ampwatch.observe.default, torch.ops.ampwatch.keep_max.default}
    for gm, phase in zip(graphs, ["forward", "backward"]):
        calls = [n for n in gm.graph.nodes if n.target in ours]
        unsafe = [n for n in gm.graph.nodes if n.op == "call_function" and is_cudagraph_unsafe_fx_node(n)]
        assert unsafe == calls
        assert bool(calls) == (phase == "backward" or path == "cpu")
        if phase == "backward":  # on the accelerator path the gradients' maxima are reduced in the graph
            kept = {n.target for n in calls}
            assert kept == ({torch.ops.ampwatch.keep_max.default} if path == "accelerator"
                            else {torch.ops.ampwatch.observe.default})
    if path == "accelerator":
        # the forward's maxima leave the graph joined: one stacked output per dtype (fp32 and fp16
        # here), made of one amax per observed tensor, instead of one output per tensor
        fwd = graphs[0].graph
        outputs = next(n for n in fwd.nodes if n.op == "output").args[0]
        joined = [o for o in outputs if getattr(o, "target", None) is torch.ops.aten.stack.default]
        amax = [n for n in fwd.nodes if n.target is torch.ops.aten.amax.default]
        assert len(joined) == 2 and not any(getattr(o, "target", None) is torch.ops.aten.amax.default for o in outputs)
        assert {n for o in joined for n in o.args[0]} == set(amax) and len(amax) >= 5
    rows = ampwatch.load(watch.path).modules
    assert {"fc1", "act", "fc2", "head"} <= set(rows[rows.phase == "forward"].module)


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
@pytest.mark.parametrize("handed_compiled", [True, False], ids=["attach-after", "attach-before"])
@NEEDS_TRACED_HOOKS
def test_a_compiled_model_keeps_no_autocast_probe_on_its_children(tmp_path, how, handed_compiled):
    """Traced into a graph, the autocast probes return at once and learn nothing, and each child's
    would add its guards to every call of the graph. A model handed over compiled gets the root's
    alone (it runs eagerly, outside the graph); one attached before compiling loses its children's
    at its first compiled call, before the forward is traced, so nothing recompiles. The run still
    says which autocast dtype the loop ran."""
    from ampwatch.record import copies
    if handed_compiled and how == "model.compile()":
        pytest.skip("model.compile() compiles in place: there is no compiled object to hand over")
    torch._dynamo.reset()
    counters.clear()

    def ours(module):
        return [h for h in module._forward_pre_hooks.values() if copies._is_ours(h)]

    x = torch.randn(8, 16)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    net = model
    if handed_compiled:
        net = torch.compile(model, backend="aot_eager")
    with ampwatch.attach(net, opt, scaler, path=str(tmp_path / "r.sqlite"), localize=False) as watch:
        children = list(model.children())
        assert [len(ours(child)) for child in children] == [0 if handed_compiled else 1] * len(children)
        if not handed_compiled:
            if how == "model.compile()":
                model.compile(backend="aot_eager")
            else:
                net = torch.compile(model, backend="aot_eager")
        _train(net, (opt, scaler), x, 3)
        assert [len(ours(child)) for child in children] == [0] * len(children)
    assert counters["stats"]["unique_graphs"] == 1 and dict(counters["graph_break"]) == {}
    assert ampwatch.load(watch.path).info["amp_dtype"] == "float16"


@NEEDS_TRACED_HOOKS
def test_an_unwatched_instance_of_the_same_class_shares_no_graph_with_the_watched_one(tmp_path):
    """Dynamo caches graphs per code object, so instances of one class share them unless a guard
    tells them apart. An unwatched twin compiled first must not hand the watched model its graph
    (nothing inside would be observed), and the watched model's graph must not run for the twin
    (the twin's values would land in the watched run)."""
    torch._dynamo.reset()
    twin = torch.compile(Net(), backend="aot_eager")
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        twin(x).float().sum().backward()  # the twin's graph is compiled first
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "w.sqlite"), layer_every=1) as watch:
        net = torch.compile(model, backend="aot_eager")
        for step in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = net(x).float().pow(2).mean()
                if step == 1:  # between the watched steps the twin runs, on a batch 1e4 times larger
                    twin(x * 1e4).float().sum().backward()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    modules = ampwatch.load(watch.path).modules
    fc1 = modules[(modules.module == "fc1") & (modules.phase == "forward")]
    assert sorted(fc1.step) == [0, 1]  # observed on both steps, inside the compiled graph
    # what the watched model's fc1 saw is its own batch (x), not the twin's (x * 1e4)
    with torch.no_grad():
        ref = max(x.abs().max().item(), Net().fc1(x).abs().max().item())  # same seed, same weights
    assert fc1.amax.max() < 10 * ref


def _own_code(model):
    """The code object the watched model's graphs are cached under: its forward's wrapper's
    (record/compiled.py)."""
    return model.__dict__["forward"].func.__code__


def _observed_steps(path, module="fc1"):
    modules = ampwatch.load(path).modules
    return sorted(modules[(modules.module == module) & (modules.phase == "forward")].step)


@pytest.mark.parametrize("user_reset", [False, True])
def test_a_twin_compiled_while_recording_does_not_hand_the_watched_model_its_graph(tmp_path, monkeypatch,
                                                                                  user_reset):
    """A graph compiled for an unwatched instance of the watched class between two watched steps
    (also right after the user's own ``torch._dynamo.reset()``) comes first in Dynamo's cache for
    the class's forward: with torch's default guards it would run for the watched model on its next
    step, with nothing inside observed. The hook guards ampwatch turns on reject it, and the watched
    model keeps running its own graph."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")  # the path a GPU takes
    torch._dynamo.reset()
    x = torch.randn(8, 16)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "w.sqlite"), layer_every=1) as watch:
        net = torch.compile(model, backend="aot_eager")
        _train(net, (opt, scaler), x, 2)
        if user_reset:
            torch._dynamo.reset()
        twin = torch.compile(Net(), backend="aot_eager")  # compiled after the watched model, first in Dynamo's cache
        with torch.autocast("cpu", dtype=torch.float16):
            twin(x * 1e4).float().sum().backward()
        _train(net, (opt, scaler), x, 2)
    assert _observed_steps(watch.path) == [0, 1, 2, 3]


@pytest.mark.parametrize("what", ["model", "a function calling it"])
def test_a_model_compiled_first_on_a_step_between_observed_ones_is_observed_on_the_next(tmp_path, monkeypatch,
                                                                                     what):
    """Between ``layer_every`` steps an eager model runs without ampwatch's module hooks; compiled
    for the first time there (itself, or inside a compiled function), its graph has none. With
    torch's default guards Dynamo would reuse that graph on the observed step; the hook guards make
    the observed step recompile with the hooks."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")  # the path a GPU takes: hooks off between
    torch._dynamo.reset()
    x = torch.randn(8, 16)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "w.sqlite"), layer_every=4) as watch:
        _train(model, (opt, scaler), x, 2)  # eager; step 0 observed
        if what == "model":
            net = torch.compile(model, backend="aot_eager")
        else:
            net = torch.compile(lambda batch: model(batch) * 1.0, backend="aot_eager")
        _train(net, (opt, scaler), x, 7)  # compiled on step 2, between observed steps
    assert _observed_steps(watch.path) == [0, 4, 8]


@NEEDS_TRACED_HOOKS
def test_compiled_micro_batches_are_localized_like_eager(tmp_path, monkeypatch):
    """Three micro-batches a step, a NaN in micro-batch 1's input on an observed step: on the
    accelerator path the compiled forward hands its maxima out as graph outputs, folded after each
    forward, so which micro-batch went bad first must come out as in eager, with no graph beyond
    the observed step's own."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")  # the path a GPU takes
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    found = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
        g = torch.Generator().manual_seed(3)
        with ampwatch.attach(model, opt, scaler, path=str(tmp_path / f"mb{compiled}.sqlite"), layer_every=2) as watch:
            net = torch.compile(model, backend="inductor") if compiled else model
            code = _own_code(model)
            for step in range(6):
                for mb in range(3):
                    x = torch.randn(8, 16, generator=g)
                    if step == 4 and mb == 1:
                        x[0, 0] = float("nan")
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = net(x).float().pow(2).mean() / 3
                    scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        if compiled:
            assert len(_debug_get_cache_entry_list(code)) == 2
        events = ampwatch.load(watch.path).events
        found[compiled] = sorted(events[events.phase == "forward"][["step", "module", "micro_batch"]]
                                 .itertuples(index=False, name=None))
    assert (4, "<model>", 1) in found[False]
    assert found[True] == found[False]


def test_a_model_compiled_as_one_graph_turns_on_no_hook_guards(tmp_path, monkeypatch):
    """Between observed steps the watched model runs a graph traced without ampwatch's hooks. Dynamo's
    guards tell it from the observed step's graph by the flag its forward's wrapper reads, so torch's
    default (no guard on an empty hook dict) stays for every compiled model of the process (guards on
    every hook dict cost ~0.19 ms a forward on GPT-2 small's tree, bench/guards.py). Observed steps are
    still observed inside the graph, with two graphs over the run, and the model's forward and its
    signature are its own again after close."""
    import inspect
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")  # the path a GPU takes: hooks off between
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(8, 16)
    model = Net()
    signature = inspect.signature(model.forward)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "w.sqlite"), layer_every=3) as watch:
            assert inspect.signature(model.forward) == signature  # HF's Trainer picks dataset columns by it
            net = torch.compile(model, backend="aot_eager")
            _train(net, (opt, scaler), x, 7)
            graphs = len(_debug_get_cache_entry_list(_own_code(model)))
            assert torch._dynamo.config.skip_nnmodule_hook_guards is True
            assert not watch.observer._split.guarded
    assert graphs == 2 and dict(counters["graph_break"]) == {}
    assert _observed_steps(watch.path) == [0, 3, 6]
    assert "forward" not in model.__dict__ and inspect.signature(model.forward) == signature


@NEEDS_TRACED_HOOKS
def test_a_graph_break_inside_the_watched_model_falls_back_to_guards_on_every_hook_dict(tmp_path, monkeypatch):
    """A graph break inside the model makes Dynamo compile its blocks' forwards as frames of their
    own, which the wrapper's flag does not reach: a block's graph traced between observed steps,
    without the hooks, would run on the next observed step and nothing inside it would be observed.
    The watch sees those frames before the observed step and turns on the guards on every hook dict
    (with Dynamo's caches reset): every observed step observes the modules inside the blocks, and
    training is bitwise unchanged."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    _, plain_losses, _ = _broken_run(tmp_path, watched=False, steps=7)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        run_, losses, _ = _broken_run(tmp_path, watched=True, steps=7, layer_every=3)
        assert torch._dynamo.config.skip_nnmodule_hook_guards is False
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses))
    for inner in ("0.fc", "4.act", "9.fc"):
        assert _observed_steps(run_.path, inner) == [0, 3, 6]


@NEEDS_TRACED_HOOKS
def test_a_model_with_graph_breaks_compiled_before_attach_is_observed_inside_its_blocks(tmp_path, monkeypatch):
    """Compiled and run before attach, a model that breaks its graph leaves graphs traced without
    hooks, among them those of the frames Dynamo resumes in after each break (code objects of their
    own). Attach must drop them: every observed step after it observes the modules inside the
    blocks, after the break too."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*[BrokenBlock() for _ in range(3)], nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    net = torch.compile(model, backend="aot_eager")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    _train(net, (opt, scaler), x, 2)  # compiled without ampwatch
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        with ampwatch.attach(net, opt, scaler, path=str(tmp_path / "late.sqlite"), layer_every=3) as watch:
            _train(net, (opt, scaler), x, 7)
    for inner in ("0.fc", "0.act", "2.act"):  # .act runs after its block's break
        assert _observed_steps(watch.path, inner) == [0, 3, 6], inner


def test_a_forward_replaced_over_the_wrapper_falls_back_to_guards_on_every_hook_dict(tmp_path, monkeypatch):
    """Code that wraps ``model.forward`` after attach (as Accelerate does) hides the wrapper's code
    object from Dynamo: the watch falls back to the guards on every hook dict on its next observed
    step, and every observed step is observed."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    torch._dynamo.reset()
    x = torch.randn(8, 16)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "w.sqlite"), layer_every=2) as watch:
            inner = model.forward

            def forward(batch):
                return inner(batch) * 1.0
            model.forward = forward
            net = torch.compile(model, backend="aot_eager")
            _train(net, (opt, scaler), x, 5)
            assert watch.observer._split.guarded and torch._dynamo.config.skip_nnmodule_hook_guards is False
    assert _observed_steps(watch.path) == [0, 2, 4]
    assert model.__dict__["forward"] is forward  # theirs stays


def test_only_module_observation_wraps_the_forward(tmp_path):
    """Without module observation (localize=False) no graph holds anything of ampwatch's: the
    model's forward stays its own."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with ampwatch.attach(model, opt, None, path=str(tmp_path / "nl.sqlite"), localize=False):
        assert "forward" not in model.__dict__
    with ampwatch.attach(model, opt, None, path=str(tmp_path / "l.sqlite")):
        assert "forward" in model.__dict__
    assert "forward" not in model.__dict__


class Block(nn.Module):
    """A residual MLP block: several of them, each compiled on its own, as torchtitan compiles its
    transformer blocks."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.fc1 = nn.Linear(32, 64)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Tower(nn.Module):
    def __init__(self, blocks: int = 10):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _train_tower(tmp_path, name, **kwargs):
    """:func:`_train_tower_under_defaults` under torch's default guards (another test's fallback may
    have left the hook guards on for the process)."""
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        return _train_tower_under_defaults(tmp_path, name, **kwargs)


def _train_tower_under_defaults(tmp_path, name, *, watched, when="before", fault_step=None, steps=7):
    """Each block compiled on its own (aot_eager), before or after attach; ``fault_step``: block 6's
    fc2 weights blown up from then on (an fp16 overflow in its forward)."""
    torch._dynamo.reset()
    counters.clear()
    model = Tower()

    def compile_blocks():
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="aot_eager")

    if when == "before":
        compile_blocks()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / f"{name}.sqlite"), layer_every=3) \
        if watched else None
    if when == "after":
        compile_blocks()
    losses = _fp16_steps(model, opt, scaler, steps, fault_step, lambda: model.blocks[6].fc2.weight)
    graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    hook_guards = watch is not None and watch.observer._split.guarded  # fell back to guards on hook dicts
    run_ = None
    if watch is not None:
        watch.close()
        run_ = ampwatch.load(watch.path)
    return run_, losses, graphs, breaks, hook_guards


@pytest.mark.parametrize("when", ["before", "after"], ids=["blocks-compiled-then-attach", "attach-then-blocks-compiled"])
@NEEDS_TRACED_HOOKS
def test_blocks_compiled_one_by_one_compile_one_graph_and_are_observed_at_their_call(tmp_path, when, record_path):
    """torchtitan's way: each block compiled on its own. Hooks inside the blocks would be traced into
    their graph with each module's own constants: one graph per block, ten here, past Dynamo's
    recompile limit of 8, after which the other blocks ran eagerly (and the watch fell back to guards
    on every hook dict). The watch leaves the inside of compiled blocks alone: one graph, as without
    ampwatch, training bitwise the same, and a fault in block 6 localized to it on the steps observed
    live; a replayed step (the accelerator path) runs the blocks eagerly with hooks inside them, and
    localizes it to the Linear inside the block."""
    plain, plain_losses, plain_graphs, _, _ = _train_tower(tmp_path, "plain", watched=False, when=when, fault_step=4)
    run_, losses, graphs, breaks, hook_guards = _train_tower(tmp_path, "watched", watched=True, when=when, fault_step=4)
    assert plain_graphs == 1 and graphs == plain_graphs and breaks == {}
    assert not hook_guards  # no fallback to guards on every hook dict
    for a, b in zip(plain_losses, losses):  # bitwise, the fault's inf and NaN included
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert run_.steps["skipped"].tolist()[4:] == [True, True, True]
    modules = run_.modules
    live = modules[modules.step.isin([0, 3, 6])]["module"]
    # observed live: each block at its own call (its OptimizedModule, or the block itself when it was
    # compiled after attach); one graph above says no hook was traced inside a block
    assert {f"blocks.{i}" for i in range(10)} <= set(live)
    origin = run_.query("SELECT step, module FROM events WHERE phase = 'forward' AND origin = 1")
    by_step = {step: group["module"].tolist() for step, group in origin.groupby("step")}
    inner = "blocks.6._orig_mod.fc2" if when == "before" else "blocks.6.fc2"
    replayed = record_path == "accelerator"  # the host path observes every step live
    assert by_step == {4: [inner if replayed else "blocks.6"], 5: [inner if replayed else "blocks.6"], 6: ["blocks.6"]}


@NEEDS_TRACED_HOOKS
def test_a_submodule_compiled_alone_is_observed_inside_its_graph(tmp_path, record_path):
    """One block compiled on its own is one graph, traced with the hooks: the modules inside it stay
    observed on every observed step (only blocks compiled one by one, two or more of a class, are
    observed at their call)."""
    torch._dynamo.reset()
    model = Tower()
    model.blocks[6] = torch.compile(model.blocks[6], backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / "one.sqlite"), layer_every=3)
        _fp16_steps(model, opt, scaler, 4)
        watch.close()
    modules = ampwatch.load(watch.path).modules
    for step in (0, 3):
        inside = set(modules[modules.step == step]["module"])
        assert {"blocks.6._orig_mod.fc1", "blocks.6._orig_mod.fc2", "blocks.5.fc2"} <= inside, step


class ResidualNet(nn.Module):
    """A residual stream through containers (a tensor handed from module to module, a container's
    input handed to its first child, its output its last child's), an in-place ReLU, and, with
    ``in_place_between``, a tensor the parent changes in place between the module that made it and
    the one that reads it (a buffer multiplied in, 1 until a fault)."""

    def __init__(self, in_place_between: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.ReLU(inplace=True),
                                                  nn.Linear(32, 32)) for _ in range(2))
        self.head = nn.Linear(32, 4)
        self.in_place_between = in_place_between
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x):
        h = self.inp(x)
        if self.in_place_between:
            h.mul_(self.gain)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _observed_run(tmp_path, name, model, compiled, fault_step=None, steps=6):
    """fp16 + GradScaler steps of ``model`` (a ResidualNet or a TinyGPT), every other step
    observed, on the accelerator path; from ``fault_step`` on a ResidualNet's gain makes ``inp``'s
    output overflow. (run, per step the slots whose gradients were observed, losses, whether the
    trace looked tensors up)."""
    from ampwatch.record import batched, observe
    from ampwatch.samples.models import TinyGPT
    torch._dynamo.reset()
    counters.clear()
    grads_seen: list = []
    on_grad, keep = observe.ModuleObserver._on_grad, batched.BatchedReducer.keep

    def counted_on_grad(self, slot, grad):  # eager: every gradient hook
        if not compiled:
            grads_seen[-1].append(slot)
        return on_grad(self, slot, grad)

    def counted_keep(self, d, amax, slot):  # compiled: every ampwatch::keep_max call of the backward
        grads_seen[-1].append(slot)
        return keep(self, d, amax, slot)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    g = torch.Generator().manual_seed(1)
    losses = []
    try:
        observe.ModuleObserver._on_grad = counted_on_grad
        batched.BatchedReducer.keep = counted_keep
        with ampwatch.attach(model, opt, scaler, path=str(tmp_path / f"{name}.sqlite"), layer_every=2) as watch:
            net = torch.compile(model, backend="aot_eager") if compiled else model
            for step in range(steps):
                if step == fault_step:
                    model.gain.fill_(1e6)
                grads_seen.append([])
                x = torch.randint(0, 32, (2, 8), generator=g) if isinstance(model, TinyGPT) else \
                    torch.randn(8, 16, generator=g)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = net(x).float().pow(2).mean()
                losses.append(loss.detach().clone())
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            dedupe = watch.observer._trace_dedupe
    finally:
        observe.ModuleObserver._on_grad, batched.BatchedReducer.keep = on_grad, keep
    return ampwatch.load(watch.path), grads_seen, losses, dedupe


def _same_module_rows(eager, comp, every_row=True):
    """The module rows of the compiled run are eager's, values to fp16 rounding. ``every_row=False``:
    eager's rows are among the compiled run's (eager leaves out, on the step it learns its aliases,
    the forward row of a module whose output a later module changed in place; compiled it is there)."""
    key = ["step", "module", "phase"]
    a, b = (r.modules.sort_values(key).reset_index(drop=True) for r in (eager, comp))
    if not every_row:
        b = a[key].merge(b, on=key, how="left")
    assert len(a) and a[key].equals(b[key])
    assert b["amax"].tolist() == pytest.approx(a["amax"].tolist(), rel=1e-3)


@NEEDS_TRACED_HOOKS
def test_a_compiled_observed_step_observes_each_tensor_once_as_eager_does(tmp_path, monkeypatch):
    """Eager observes a tensor that another module already handed on (the residual stream, a
    container's input handed to its first child, its output its last child's) once, by the
    aliases it learns. The compiled observed graph must too, by what its trace notes: the same
    gradients observed (its backward's ``keep_max`` calls, one per module input and output
    before), the same module rows, no graph break."""
    from ampwatch.samples.models import TinyGPT
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")  # the path a GPU takes: maxima in the graph
    model = lambda: TinyGPT(vocab=32, d=32, layers=2, heads=2, seq=8)  # noqa: E731 (same seed: same weights)
    torch.manual_seed(0)
    eager, eager_grads, eager_losses, _ = _observed_run(tmp_path, "eager", model(), compiled=False)
    torch.manual_seed(0)
    comp, comp_grads, comp_losses, dedupe = _observed_run(tmp_path, "comp", model(), compiled=True)
    assert dict(counters["graph_break"]) == {} and dedupe
    modules = eager.modules["module"].nunique()
    for step in (0, 2, 4):  # observed
        assert 0 < len(eager_grads[step]) < 1.2 * modules  # one per distinct tensor, not two per module
        assert sorted(comp_grads[step]) == sorted(eager_grads[step])
    assert not any(comp_grads[step] for step in (1, 3, 5))
    _same_module_rows(eager, comp)
    assert torch.allclose(torch.stack(eager_losses), torch.stack(comp_losses), rtol=1e-3)


@NEEDS_TRACED_HOOKS
def test_a_module_working_in_place_keeps_aliases_on_and_values_as_in_eager(tmp_path, monkeypatch):
    """A ReLU(inplace=True) hands out the tensor it received, changed: its input and output are
    observed anew (not as aliases of the Linear's output before it), and aliases stay on."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    eager, _, _, _ = _observed_run(tmp_path, "eager", ResidualNet(), compiled=False)
    comp, comp_grads, _, dedupe = _observed_run(tmp_path, "comp", ResidualNet(), compiled=True)
    assert dedupe and dict(counters["graph_break"]) == {}
    assert len(comp_grads[0]) < 2 * comp.modules["module"].nunique()
    _same_module_rows(eager, comp, every_row=False)


def test_eager_keeps_its_aliases_after_a_module_working_in_place(tmp_path, monkeypatch):
    """Eager, the step that learns the aliases finds the in-place ReLU's slots changed while pending
    and learns again on the next observed step. An unobserved step in between (the accelerator
    path: no module hooks run) must leave that re-learning pending, not end it with no aliases
    (which hooked every module input and output, 24 gradients, on every later observed step). The
    host path observes every step, so it learns again at once: its count is the ground truth."""
    counts = {}
    for path in ("1", "0"):  # accelerator (observed steps 0, 2, 4, ...), host (every step)
        monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", path)
        _, grads, _, _ = _observed_run(tmp_path, f"eager{path}", ResidualNet(), compiled=False, steps=9)
        counts[path] = [len(grads[step]) for step in (2, 4, 6, 8)]
    hooked_apart = 2 * 12  # every input and output of the 12 modules below the root, observed apart
    assert counts["1"] == counts["0"] and counts["1"][0] < hooked_apart


def test_a_tensor_changed_in_place_between_modules_is_observed_on_its_own(tmp_path, monkeypatch):
    """The parent multiplies a module's output in place before the next module reads it: the same
    tensor, another value, which the traced identity test cannot tell. The trace notes the change,
    so the observed graph is compiled again without aliases from the next observed step on, and a
    fault born there (the parent's gain overflows fp16 at step 4) is localized as in eager."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    eager, _, _, _ = _observed_run(tmp_path, "eager", ResidualNet(True), compiled=False, fault_step=4)
    comp, _, _, dedupe = _observed_run(tmp_path, "comp", ResidualNet(True), compiled=True, fault_step=4)
    assert not dedupe
    assert dict(counters["graph_break"]) == {}
    cols = ["step", "phase", "module", "origin"]
    origins = eager.events[eager.events.origin][cols].reset_index(drop=True)
    assert len(origins) and origins.equals(comp.events[comp.events.origin][cols].reset_index(drop=True))
    assert origins.iloc[0]["step"] == 4 and origins.iloc[0]["phase"] == "forward"


@NEEDS_TRACED_HOOKS
def test_a_failing_trace_note_leaves_the_compile_to_observe_every_tensor_apart(tmp_path, monkeypatch):
    """What the trace notes runs inside the user's torch.compile: an error there (a torch whose
    Dynamo hands it other locals) must not reach the user's compile. The run trains, and from the
    next observed step the observed graph observes every tensor apart, with eager's module rows."""
    from ampwatch.record import traced_aliases
    from ampwatch.samples.models import TinyGPT
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")

    def broken(ctx, observer, kind):
        raise RuntimeError("a local this torch does not have")
    monkeypatch.setattr(traced_aliases, "note", broken)
    torch.manual_seed(0)
    eager, _, _, _ = _observed_run(tmp_path, "eager", TinyGPT(vocab=32, d=32, layers=2, heads=2, seq=8), compiled=False)
    torch.manual_seed(0)
    comp, comp_grads, _, dedupe = _observed_run(tmp_path, "comp", TinyGPT(vocab=32, d=32, layers=2, heads=2, seq=8),
                                                compiled=True)
    assert not dedupe and dict(counters["graph_break"]) == {}
    assert len(comp_grads[2]) > len(comp_grads[0])  # step 0's graph skipped tensors; step 2's observes each
    key = ["step", "module", "phase"]
    later = [r.modules[r.modules.step > 0].sort_values(key).reset_index(drop=True) for r in (eager, comp)]
    assert len(later[0]) and later[0][key].equals(later[1][key])
    assert later[1]["amax"].tolist() == pytest.approx(later[0]["amax"].tolist(), rel=1e-3)


@pytest.mark.parametrize("path", ["host", "accelerator"])
def test_before_torch_2_11_a_compiled_model_is_recorded_without_gradient_hooks(tmp_path, monkeypatch, path):
    """Dynamo traces a hook on a tensor made inside the graph from torch 2.11 on. On torch 2.4.1
    every observed compiled step broke the graph there, the trace then failed, and recording stopped
    at step 0 with no row written. Such a torch is stood in for here (``TRACES_TENSOR_HOOKS`` off;
    this test also passes on torch 2.4.1 itself): the compiled run trains to the unwatched run's
    numbers, breaks no graph, records every step as eager does, localizes a forward overflow to its
    module on the accelerator path, and says once, at step 0, what it leaves out."""
    from ampwatch.record import torch_access
    monkeypatch.setattr(torch_access, "TRACES_TENSOR_HOOKS", False)
    if path == "accelerator":
        monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    eager, _, _, _ = run(tmp_path, "eager", compiled=False, watched=True, fault_step=2)
    _, plain_losses, _, _ = run(tmp_path, "plain", compiled=True, watched=False, fault_step=2)
    comp, comp_losses, breaks, _ = run(tmp_path, "comp", compiled=True, watched=True, fault_step=2)
    assert breaks == {}
    assert len(comp_losses) == 4
    assert all(torch.equal(a, b) or (a.isnan() and b.isnan()) for a, b in zip(plain_losses, comp_losses))
    _same_record(eager, comp)
    left_out = comp.notices[comp.notices.code == "compiled-hooks-left-out"]
    assert len(left_out) == 1 and left_out.step.iloc[0] == 0
    assert ("forward only" if path == "accelerator" else "not observed") in left_out.message.iloc[0]
    assert len(eager.notices[eager.notices.code == "compiled-hooks-left-out"]) == 0  # eager leaves nothing out
    origins = comp.events[comp.events.origin]
    forward = origins[origins.phase == "forward"]
    if path == "accelerator":
        assert forward.module.tolist()[:1] == ["fc2"] and forward.step.tolist()[:1] == [2]
        # the observed step 0, run in the graph: in the backward only the root's output gradient,
        # observed outside it (a replay, in eager where torch >= 2.6 can, observes every module)
        first = comp.modules[comp.modules.step == 0]
        assert set(first[first.phase == "backward"].module) <= {"<model>"}
        assert {"fc1", "fc2", "head"} <= set(first[first.phase == "forward"].module)
    else:  # the root's output outside the graph: the model's, not one of its modules
        assert set(forward.module) == {"<model>"} and set(comp.modules.module) <= {"<model>"}
    assert comp.steps.skipped.tolist() == eager.steps.skipped.tolist() and comp.steps.skipped.iloc[2]
