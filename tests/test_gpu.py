"""The recorder on CUDA: the transfer/event path, fused AdamW, a real fp16 overflow. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampwatch
from helpers.loops import bf16_fault_run

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


def test_fused_adamw_overflow_on_cuda_is_replayed_to_its_module(tmp_path):
    """A fused AdamW skips inside its kernel: the skip is read from the scaler's inf flag in time to
    replay the step before update(), so the overflow is localized between layer_every steps too."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    run, _ = _train(tmp_path, model, opt, 4, fault_step=2, layer_every=20)
    ev = run.events
    origin = ev[ev.origin & (ev.phase == "forward")]
    assert set(origin["module"]) == {"2"} and list(origin["step"]) == [2, 3]
    steps = run.steps.set_index("step")
    assert steps.loc[[2, 3], "skipped"].all() and not steps.loc[[0, 1], "skipped"].any()
    assert set(run.modules["step"]) == {0, 2, 3}  # observed: step 0 and the two replays, nothing else


def _bf16_cuda_run(path, fault_step, watched, fused=False):
    """bf16 autocast on CUDA, no scaler, the loss through watch.log: module 2's output is inf once."""
    return bf16_fault_run(_net(), path, fault_step, watched, steps=8, batch=16, device="cuda", fused=fused)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
def test_bf16_nan_on_cuda_is_localized_on_its_own_step_and_training_is_unchanged(tmp_path, fused):
    """With AdamW(fused=True) the check is the kernel's skip flag and the skipped update is applied
    after the replay (kernelskip.py): weights and moments must still come out bitwise."""
    fault = 3
    plain_losses, plain_params = _bf16_cuda_run(tmp_path / "plain.sqlite", fault, watched=False, fused=fused)
    losses, params = _bf16_cuda_run(tmp_path / "run.sqlite", fault, watched=True, fused=fused)
    assert all(torch.equal(a, b) or (a.isnan().all() and b.isnan().all()) for a, b in zip(losses, plain_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    run = ampwatch.load(tmp_path / "run.sqlite")
    origin = run.events[run.events["origin"]]
    assert origin[["step", "module", "phase"]].values.tolist() == [[fault, "2", "forward"]]
    assert set(run.modules["step"]) == {0, 5, fault}


_SYNCS: dict = {"counting": False, "waits": []}


def _count_syncs_from_now_on() -> None:
    """Every host wait on the GPU is told to torch's GPU-trace callbacks, on the thread that waits:
    a stream's (``.item()``, a blocking copy to the host: everything queued so far), an event's
    (everything queued before the event) or the device's."""
    if not _SYNCS.get("registered"):
        import threading
        from torch.cuda import _gpu_trace

        def seen(kind):
            def callback(*_):
                if _SYNCS["counting"]:
                    _SYNCS["waits"].append((threading.get_ident(), kind))
            return callback
        torch._C._activate_gpu_trace()
        _gpu_trace.register_callback_for_stream_synchronization(seen("stream"))
        _gpu_trace.register_callback_for_event_synchronization(seen("event"))
        _gpu_trace.register_callback_for_device_synchronization(seen("device"))
        _SYNCS["registered"] = True


def _syncs_per_step(tmp_path, loop, watched, steps=6):
    """The host waits of the training thread in each of ``steps`` healthy steps, by kind (after one
    warm-up step, with layer_every=20: none of them observes modules)."""
    import threading
    from collections import Counter
    _count_syncs_from_now_on()
    model = _net()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if "fused" in loop
           else torch.optim.SGD(model.parameters(), lr=1e-2))
    scaler = None if loop.startswith("bf16") else torch.amp.GradScaler("cuda")
    watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / f"{loop}-{watched}.sqlite"),
                            layer_every=20) if watched else None
    g = torch.Generator(device="cuda").manual_seed(0)
    me = threading.get_ident()
    per_step = []
    for step in range(steps + 1):
        x = torch.randn(16, 32, device="cuda", generator=g)
        y = torch.randn(16, 8, device="cuda", generator=g)
        _SYNCS["waits"].clear()
        _SYNCS["counting"] = step > 0
        with torch.autocast("cuda", dtype=torch.bfloat16 if scaler is None else torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        if scaler is None:
            loss.backward()
            if watch is not None:
                watch.log(loss=loss)
            opt.step()
        else:
            scaler.scale(loss).backward()
            if loop != "fused-no-unscale":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        _SYNCS["counting"] = False
        if step > 0:
            per_step.append(Counter(kind for thread, kind in _SYNCS["waits"] if thread == me))
    if watch is not None:
        watch.close()
        assert len(ampwatch.load(watch.path).steps) == steps + 1
    return per_step


@pytest.mark.parametrize("loop,added", [("fp16", [{}]), ("fused", [{}, {"event": 1}]),
                                        ("fused-no-unscale", [{}, {"event": 1}]), ("bf16", [{}, {"event": 1}]),
                                        ("bf16-fused", [{}, {"event": 1}])])
def test_host_waits_ampwatch_adds_to_a_healthy_cuda_step(tmp_path, loop, added):
    """What docs/performance.md promises on CUDA: nothing added to a GradScaler loop (it already
    waits inside scaler.step, for its inf flag). With a fused optimizer no stream wait: the inf flag
    is copied where the scaler makes it (skipflag.py) and read at the next step's optimizer step
    (deferred.py), with a wait on that copy's event only where it is not done yet. Without a scaler
    no stream wait either: with a fused AdamW the check is the kernel's skip flag, read on an event
    once the optimizer's kernel is queued (kernelskip.py); with SGD the weights are kept and the
    check read at the next step's optimizer step, on an event (keptweights.py). The writer thread's waits for its copies are not the
    training thread's and are not counted."""
    plain = _syncs_per_step(tmp_path, loop, False)
    watched = _syncs_per_step(tmp_path, loop, True)
    print(f"{loop}: host waits per step without ampwatch {[dict(c) for c in plain]}, "
          f"with {[dict(c) for c in watched]}")
    assert all(dict(w - p) in added for w, p in zip(watched, plain))
    assert all(not (p - w) for w, p in zip(watched, plain))  # no wait of the loop's own went away


@pytest.mark.parametrize("factor,held", [(1, True), (10 ** 15, False)], ids=["room", "no-room"])
def test_a_fused_step_keeping_more_than_the_limit_is_held_only_where_the_device_has_room(
        tmp_path, monkeypatch, factor, held):
    """Past deferred.HOLD_AT_MOST_BYTES (here 0: every kept output gradient is past it) a fused step
    is held a step only where the device has HOLD_FREE_FACTOR times its kept gradients' bytes free
    (cudaMemGetInfo); else its flag is read within the step. Either way every step gets its row."""
    from ampwatch.record import deferred
    monkeypatch.setattr(deferred, "HOLD_AT_MOST_BYTES", 0)
    monkeypatch.setattr(deferred, "HOLD_FREE_FACTOR", factor)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    seen = []
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite"), layer_every=20) as watch:
        for _ in range(4):
            x = torch.randn(16, 32, device="cuda", generator=g)
            y = torch.randn(16, 8, device="cuda", generator=g)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
            scaler.scale(F.mse_loss(out.float(), y)).backward()  # the loss outside: out's gradient is kept
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            seen.append(watch._held is not None)
    assert deferred.free_bytes(torch.device("cuda")) > 0
    assert seen[1:] == [held] * 3  # step 0 is a layer_every step, observed live: never held
    run = ampwatch.load(watch.path)
    assert list(run.steps["step"]) == [0, 1, 2, 3]
    # a run whose steps wait says so once (its numbers: the bytes kept, the device's free memory)
    assert list(run.notices.code).count("skip-read-within-step") == (0 if held else 1)
