"""Fused optimizers. GradScaler always calls a fused optimizer's ``step()``; the kernel
skips the update itself when the scaler found inf. So "step() was not called" cannot be the skip
signal: the recorded skips must still equal the parameter ground truth in an overflow storm.
(``torch.optim.AdamW(fused=True)`` runs on the CPU in torch 2.13, grad_scale/found_inf included.)
"""
from __future__ import annotations

import math

import pytest
import torch
from pandas import testing as pd_testing

import ampwatch
from helpers.loops import data, mlp, snapshot, changed
from helpers.torch_compat import total_norm


def fused_storm(tmp_path, *, steps: int = 40, clip: bool = False, accum: int = 1):
    """A hand-written AMP loop with AdamW(fused=True); returns (run, truth)."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=4)
    truth = {"skipped": [], "norm": [], "steps_called": 0, "scale": []}
    opt.register_step_pre_hook(lambda *a: truth.__setitem__("steps_called", truth["steps_called"] + 1))
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "run.sqlite")) as watch:
        for i in range(steps):
            x, y = data(i)
            before = snapshot(model)
            for xb, yb in zip(x.chunk(accum), y.chunk(accum)):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(xb * 4).float(), yb)
                scaler.scale(loss).backward()
            scale = scaler.get_scale()
            if clip:
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:  # the grads are still scaled: the truth divides by the scale they carry
                norm = total_norm([p.grad for p in model.parameters()]) / scale
            truth["norm"].append(float(norm))
            truth["scale"].append(scale)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            truth["skipped"].append(not changed(before, model))
    return ampwatch.load(watch.path), truth


@pytest.mark.parametrize("clip", [False, True], ids=["no-unscale", "unscale-and-clip"])
def test_fused_adamw_overflow_storm_skips_are_exact(tmp_path, clip):
    run, truth = fused_storm(tmp_path, clip=clip)
    steps = run.steps
    assert truth["steps_called"] == 40, "GradScaler calls a fused step() even when it skips"
    assert 6 <= sum(truth["skipped"]) < 40
    assert list(steps["skipped"]) == truth["skipped"]
    assert list(steps["loss_scale"]) == truth["scale"]
    finite = [(r, t) for r, t in zip(steps["grad_norm"], truth["norm"]) if math.isfinite(t)]
    assert len(finite) >= 20
    assert [r for r, _ in finite] == pytest.approx([t for _, t in finite], rel=1e-4)


def test_fused_with_accumulation_one_row_per_step(tmp_path):
    run, truth = fused_storm(tmp_path, steps=16, accum=2)
    assert list(run.steps["skipped"]) == truth["skipped"] and any(truth["skipped"])
    assert list(run.steps["micro_batches"]) == [2] * 16


def test_fused_optimizer_under_lightning_16_mixed(tmp_path):
    """Lightning does not unscale_ for fused optimizers (and forbids clipping them); the kernel does."""
    L = pytest.importorskip("lightning.pytorch")
    from test_integrations_lightning import Regressor, StepTruth, fp16_plugin, loader
    from ampwatch.integrations.lightning import AmpwatchCallback
    truth = StepTruth()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=16, accumulate_grad_batches=2,
                        plugins=[fp16_plugin()], callbacks=[AmpwatchCallback(str(tmp_path / "run.sqlite")), truth],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Regressor(fused=True), loader())
    run = ampwatch.load(tmp_path / "run.sqlite")
    assert 3 <= sum(truth.skipped) < 16
    assert list(run.steps["skipped"]) == truth.skipped
    assert list(run.steps["loss_scale"]) == truth.scales
    # on_before_optimizer_step sees still-scaled grads here, so the truth divides by the scale
    pairs = [(r, t / s) for r, t, s, k in zip(run.steps["grad_norm"], truth.norms, truth.scales, truth.skipped)
             if not k]
    assert [r for r, _ in pairs] == pytest.approx([t for _, t in pairs], rel=1e-4)


def _fused_step(model, opt, scaler, x, y, clip, accum=1) -> bool:
    """One fp16 GradScaler step of ``accum`` micro-batches (unscale_ + clip when ``clip``); whether
    it left the parameters unchanged (skipped), by snapshot."""
    before = snapshot(model)
    for xb, yb in zip(x.chunk(accum), y.chunk(accum)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(xb).float(), yb) / accum
        scaler.scale(loss).backward()
    if clip:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return not changed(before, model)


@pytest.mark.parametrize("clip", [False, True], ids=["no-unscale", "unscale-and-clip"])
def test_a_fused_skip_is_replayed_and_healthy_steps_observe_nothing(tmp_path, monkeypatch, clip):
    """On the accelerator path a fused optimizer's skip is read from the scaler's inf flag and the
    step replayed: the overflow is localized on its own step while healthy steps between
    ``layer_every`` steps write no module row (they were not observed). The flag is taken where the
    scaler makes it: at unscale_ (the clip loop) or as the optimizer's step begins (skipflag.py).
    The fault here depends on Python state (the loop's step counter), so the skipped step is read
    within itself: the next step is a ``layer_every`` one (deferred.py holds no such step)."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    fault_step = 7
    state = {"step": 0}
    model[2].register_forward_hook(lambda m, i, o: o * 1e6 if state["step"] == fault_step else o)
    skipped = []
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "run.sqlite"), layer_every=4) as watch:
        for i in range(12):
            state["step"] = i
            x, y = data(i)
            skipped.append(_fused_step(model, opt, scaler, x, y, clip))
    run = ampwatch.load(watch.path)
    assert skipped == [i == fault_step for i in range(12)]  # the truth: only the fault step skipped
    assert list(run.steps["skipped"]) == skipped
    origin = run.events[run.events["origin"]]
    assert set(origin["step"]) == {fault_step}
    assert origin.iloc[0]["module"] == "2" and origin.iloc[0]["phase"] == "forward"
    assert set(run.modules["step"]) == {0, 4, 8, fault_step}  # layer_every steps and the replayed one
    assert "replay-not-reproduced" not in set(run.notices["code"])


def _bad_batch_run(path, layer_every, clip, fault_step=7, steps=12, watched=True, fused=True, mult=1e5,
                   accum=1):
    """Fused AdamW on the accelerator path; the batch of ``fault_step`` is ``mult`` times too large,
    a fault its kept inputs reproduce: at 1e5 module "0"'s fp16 output overflows; at 1e3 the
    forward stays finite and only the weights' gradient products overflow (the biases' stay finite)."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    watch = ampwatch.attach(model, opt, scaler, path=str(path), layer_every=layer_every) if watched else None
    skipped, held = [], []  # held: the steps whose skip was still unread when they ended
    for i in range(steps):
        x, y = data(i)
        if i == fault_step:  # with several micro-batches, the second one's part of the batch
            x = x.clone()
            size = -(-len(x) // accum)  # x.chunk(accum)'s chunk size
            part = slice(size, 2 * size) if accum > 1 else slice(None)
            x[part] *= mult
        skipped.append(_fused_step(model, opt, scaler, x, y, clip, accum))
        if watch is not None and watch._held is not None:
            held.append(watch._held.pack.step)
    if watch is not None:
        watch.close()
    return skipped, [p.detach().clone() for p in model.parameters()], held


@pytest.mark.parametrize("mult,origins", [(1e5, [[7, "0", "forward"]]), (1e3, [])], ids=["forward", "weight-grads"])
@pytest.mark.parametrize("clip", [False, True], ids=["no-unscale", "unscale-and-clip"])
def test_a_fused_skip_read_a_step_late_is_localized_as_one_read_in_its_own_step(tmp_path, monkeypatch, clip,
                                                                                mult, origins):
    """deferred.py: between layer_every steps a fused step's skip is read at the next step's
    optimizer step, and a skipped step is replayed there, before any weight changes. Its rows must
    be those the same step gets when it is read within itself (layer_every=8: step 8 is a
    layer_every step, so step 7 is not held), and training must not change."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    fault = 7
    truth, plain, _ = _bad_batch_run(tmp_path / "plain.sqlite", 5, clip, watched=False, mult=mult)
    late_skips, late_params, late_held = _bad_batch_run(tmp_path / "late.sqlite", 5, clip, mult=mult)
    now_skips, _, now_held = _bad_batch_run(tmp_path / "now.sqlite", 8, clip, mult=mult)
    assert truth == [i == fault for i in range(12)] == late_skips == now_skips
    # held: every step that observes nothing and is followed by no layer_every step
    assert late_held == [1, 2, 3, 6, 7, 8, 11] and now_held == [1, 2, 3, 4, 5, 6, 9, 10, 11]
    assert all(torch.equal(a, b) for a, b in zip(late_params, plain))  # training unchanged
    late, now = ampwatch.load(tmp_path / "late.sqlite"), ampwatch.load(tmp_path / "now.sqlite")
    assert list(late.steps["step"]) == list(range(12)) and list(late.steps["skipped"]) == truth
    for run in (late, now):
        origin = run.events[run.events["origin"]]
        assert origin[["step", "module", "phase"]].values.tolist() == origins
        assert "replay-not-reproduced" not in set(run.notices["code"])
        assert set(run.events[run.events.phase == "param_grad"]["step"]) == {fault}
    replayed = {fault} if origins else set()  # module rows of a skipped step: where a module value was bad
    assert set(late.modules["step"]) == {0, 5, 10} | replayed and set(now.modules["step"]) == {0, 8} | replayed

    def at_fault(frame, columns):
        rows = frame[frame["step"] == fault].sort_values(columns[:3])
        return rows[columns].reset_index(drop=True)

    cols = ["module", "phase", "kind", "amax", "origin", "dtype"]
    events = [run.events if not clip else run.events[run.events.phase != "param_grad"] for run in (late, now)]
    pd_testing.assert_frame_equal(at_fault(events[0], ["step"] + cols), at_fault(events[1], ["step"] + cols),
                                  check_exact=False, rtol=1e-5)
    module_cols = [c for c in late.modules.columns if c not in ("module_id",)]
    pd_testing.assert_frame_equal(at_fault(late.modules, module_cols), at_fault(now.modules, module_cols),
                                  check_exact=False, rtol=1e-5)
    layers = late.layers[late.layers["step"] == fault]
    assert layers["grad_nonfinite"].notna().all() and (layers["grad_nonfinite"] > 0).any()
    if mult == 1e3:  # the biases' gradients stayed finite: their max |g|, unscaled, is known
        assert layers[layers.name.str.endswith("bias")]["grad_amax"].between(1e-3, 1e3).all()
    if not clip:  # no clip rewrote the gradients in place: the replay's detail is the step's own
        pd_testing.assert_frame_equal(at_fault(late.layers, ["step", "name", "grad_nonfinite", "grad_zero_frac",
                                                             "grad_amax", "param_norm"]),
                                      at_fault(now.layers, ["step", "name", "grad_nonfinite", "grad_zero_frac",
                                                            "grad_amax", "param_norm"]),
                                      check_exact=False, rtol=1e-5)


def test_a_fused_skip_on_the_last_step_is_settled_when_the_run_closes(tmp_path, monkeypatch):
    """The last step has no next step to read its flag: close() reads it, and replays it then."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    truth, _, held = _bad_batch_run(tmp_path / "run.sqlite", 5, False, fault_step=11, steps=12)
    assert held[-1] == 11
    run = ampwatch.load(tmp_path / "run.sqlite")
    assert list(run.steps["skipped"]) == truth == [i == 11 for i in range(12)]
    origin = run.events[run.events["origin"]]
    assert origin[["step", "module", "phase"]].values.tolist() == [[11, "0", "forward"]]
    assert run.info["status"] == "finished"


@pytest.mark.parametrize("mult", [1e5, 1e3], ids=["forward", "weight-grads"])
def test_a_fused_skip_read_a_step_late_names_its_micro_batch(tmp_path, monkeypatch, mult):
    """Three micro-batches, the second one bad: the held step's replay runs all three, sums their
    gradients for the detail, and names micro-batch 1, as reading the step in itself does."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    truth, plain, _ = _bad_batch_run(tmp_path / "plain.sqlite", 5, False, watched=False, accum=3, mult=mult)
    late_skips, late_params, late_held = _bad_batch_run(tmp_path / "late.sqlite", 5, False, accum=3, mult=mult)
    now_skips, _, _ = _bad_batch_run(tmp_path / "now.sqlite", 8, False, accum=3, mult=mult)
    assert truth == late_skips == now_skips == [i == 7 for i in range(12)] and 7 in late_held
    assert all(torch.equal(a, b) for a, b in zip(late_params, plain))
    late, now = ampwatch.load(tmp_path / "late.sqlite"), ampwatch.load(tmp_path / "now.sqlite")
    assert list(late.steps["micro_batches"]) == [3] * 12
    cols = ["step", "phase", "module", "kind", "count", "amax", "micro_batch"]
    rows = [run.events[run.events.step == 7].sort_values(["phase", "module"])[cols].reset_index(drop=True)
            for run in (late, now)]
    assert len(rows[0]) > 0
    pd_testing.assert_frame_equal(rows[0], rows[1], check_exact=False, rtol=1e-5)
    if mult == 1e5:
        origin = late.events[late.events.origin]
        assert origin[["step", "module", "phase", "micro_batch"]].values.tolist() == [[7, "0", "forward", 1]]
    layer_cols = ["name", "grad_nonfinite", "grad_zero_frac", "grad_amax", "param_norm"]
    layers = [run.layers[run.layers.step == 7].sort_values("name")[layer_cols].reset_index(drop=True)
              for run in (late, now)]
    pd_testing.assert_frame_equal(layers[0], layers[1], check_exact=False, rtol=1e-4)


def test_a_loop_that_raises_on_the_nan_it_saw_still_gets_that_step_localized(tmp_path, monkeypatch):
    """A loop that raises on a non-finite loss closes the run with that step still held: close()
    replays it, so the crashed run names the origin of the NaN that stopped it."""
    import math
    import warnings
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(FloatingPointError):
        warnings.simplefilter("always")
        with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "run.sqlite"), layer_every=5) as watch:
            for i in range(4):
                x, y = data(i)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(x * (1e5 if i == 3 else 1)).float(), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                if not math.isfinite(loss.item()):
                    assert watch._held is not None and watch._held.pack.step == 3
                    raise FloatingPointError(f"loss is {loss.item()} at step {i}")
    assert not [w for w in caught if "ampwatch" in str(w.message)]
    run = ampwatch.load(tmp_path / "run.sqlite")
    assert run.info["status"] == "crashed"
    assert list(run.steps["step"]) == [0, 1, 2, 3] and list(run.steps["skipped"]) == [False, False, False, True]
    origin = run.events[run.events.origin]
    assert origin[["step", "module", "phase"]].values.tolist() == [[3, "0", "forward"]]


def test_a_step_that_keeps_large_output_gradients_is_read_within_itself(tmp_path, monkeypatch):
    """Holding a step keeps its output gradients through the next forward, where memory peaks:
    above deferred.HOLD_AT_MOST_BYTES (here 0) no step is held, and the skip is localized all the same."""
    from ampwatch.record import deferred
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    monkeypatch.setattr(deferred, "HOLD_AT_MOST_BYTES", 0)
    truth, _, held = _bad_batch_run(tmp_path / "run.sqlite", 5, False)
    assert held == [] and truth == [i == 7 for i in range(12)]
    run = ampwatch.load(tmp_path / "run.sqlite")
    assert list(run.steps["skipped"]) == truth
    origin = run.events[run.events.origin]
    assert origin[["step", "module", "phase"]].values.tolist() == [[7, "0", "forward"]]
    # the run says why its fused steps wait, once, with the bytes kept and the memory free (none
    # on the CPU), and the doctor turns it into advice, not a warning about the loop
    notices = run.notices[run.notices.code == "skip-read-within-step"]
    assert len(notices) == 1 and int(notices.step.iloc[0]) == 1, run.notices
    assert "(0 MiB free)" in notices.message.iloc[0] and "output gradients for a replay" in notices.message.iloc[0]
    finding = {f.id: f for f in ampwatch.diagnose(run)}["misuse-skip-read-within-step"]
    assert finding.severity == "info" and "labels=" in finding.advice


def test_a_step_that_keeps_large_output_gradients_is_held_where_the_device_has_room(tmp_path, monkeypatch):
    """Past deferred.HOLD_AT_MOST_BYTES (here 0) a step is still held where the device has
    HOLD_FREE_FACTOR times its kept gradients free. The CPU has no such count (free_bytes is 0
    there, as the test above needs); here it reports a device with room, and the steps are held and
    the skip replayed a step late as below the limit."""
    from ampwatch.record import deferred
    assert deferred.free_bytes(torch.device("cpu")) == 0
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    monkeypatch.setattr(deferred, "HOLD_AT_MOST_BYTES", 0)
    monkeypatch.setattr(deferred, "free_bytes", lambda device: 10 ** 12)
    truth, _, held = _bad_batch_run(tmp_path / "run.sqlite", 5, False)
    assert held == [1, 2, 3, 6, 7, 8, 11] and truth == [i == 7 for i in range(12)]
    run = ampwatch.load(tmp_path / "run.sqlite")
    assert "skip-read-within-step" not in set(run.notices["code"])
    assert list(run.steps["skipped"]) == truth
    origin = run.events[run.events.origin]
    assert origin[["step", "module", "phase"]].values.tolist() == [[7, "0", "forward"]]
