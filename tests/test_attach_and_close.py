"""Attaching changes no number training produces; close() puts the scaler, optimizer and model back;
two watches live side by side; a recording that stops on an internal failure says so in its file."""
from __future__ import annotations

import pytest
import torch

import ampwatch
from helpers.loops import amp_step, data, mlp, train

# every test runs on both recorder paths: the CPU's free reads and the accelerator path
pytestmark = pytest.mark.usefixtures("record_path")


def test_attach_changes_no_number(tmp_path):
    kwargs = dict(scaler_factory=lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=3),
                  accum=2, clip=0.5, lr=0.05)
    plain, _, _ = train(25, **kwargs)
    watched, _, _ = train(25, attach=lambda m, o, s: ampwatch.attach(m, o, s, path=str(tmp_path / "run.sqlite"),
                                                                    layer_every=1), **kwargs)
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a, b)


HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
              "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


@pytest.mark.parametrize("steps", [1, 2])
def test_close_restores_scaler_optimizer_and_model(tmp_path, steps, record_path):
    """Closed after step 0 (on the accelerator path the module hooks are then out until step 2,
    the next layer_every step) or after step 1 (they are back in): every hook dict of every module
    is as before attach."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def hooks():
        return [[sorted(getattr(m, d, {})) for d in HOOK_DICTS] for m in model.modules()]

    before = (dict(scaler.__dict__), len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks),
              hooks())
    watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite"), layer_every=2)
    assert "step" in scaler.__dict__
    for i in range(steps):
        amp_step(model, opt, scaler, *data(i))
    hooked = hooks()[1:] != before[3][1:]  # the root keeps the replay's hooks on every step
    watch.close()
    watch.close()  # idempotent
    after = (dict(scaler.__dict__), len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks),
             hooks())
    assert set(after[0]) == set(before[0]) and after[1:] == before[1:]
    if record_path == "accelerator":  # replay localizes a skip: modules are observed on layer_every steps
        assert hooked == (steps == 2)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters()
               if getattr(p, "_post_accumulate_grad_hooks", None) is not None)


def test_two_watches_in_one_process(tmp_path):
    a_model, b_model = mlp(0), mlp(1)
    a_opt, b_opt = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (a_model, b_model))
    a_sc, b_sc = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    with ampwatch.attach(a_model, a_opt, a_sc, path=str(tmp_path / "a.sqlite")) as wa, \
            ampwatch.attach(b_model, b_opt, b_sc, path=str(tmp_path / "b.sqlite")) as wb:
        for i in range(5):
            amp_step(a_model, a_opt, a_sc, *data(i))
        for i in range(3):
            amp_step(b_model, b_opt, b_sc, *data(i))
    assert len(ampwatch.load(wa.path).steps) == 5 and len(ampwatch.load(wb.path).steps) == 3
    assert ampwatch.load(wb.path).steps["skipped"].iloc[0]


def test_two_watches_on_one_scaler_close_in_any_order(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    first = ampwatch.attach(model, opt, scaler, path=str(tmp_path / "a.sqlite"))
    second = ampwatch.attach(model, opt, scaler, path=str(tmp_path / "b.sqlite"))
    amp_step(model, opt, scaler, *data(0))
    first.close()  # closed first: the second watch must keep recording
    for i in range(1, 4):
        amp_step(model, opt, scaler, *data(i))
    second.close()
    assert len(ampwatch.load(first.path).steps) == 1
    assert len(ampwatch.load(second.path).steps) == 4
    for method in ("scale", "unscale_", "step", "update"):  # the scaler works as before: a plain loop
        assert callable(getattr(scaler, method))
    amp_step(model, opt, scaler, *data(9))


def test_recording_that_stops_says_so_in_the_file(tmp_path, monkeypatch):
    """An internal failure warns once and stops recording; the file then carries a notice naming the
    step, and the doctor reports it, instead of reading as a healthy run that just ended early."""
    from ampwatch.record import watch as watch_module
    real = watch_module.Watch.before_update

    def fails_at_step_3(self):
        if self.step == 3:
            raise ZeroDivisionError("injected internal bug")
        return real(self)

    monkeypatch.setattr(watch_module.Watch, "before_update", fails_at_step_3)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.warns(RuntimeWarning, match="stopped recording"):
        with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite")) as watch:
            for i in range(6):
                amp_step(model, opt, scaler, *data(i))
    run = ampwatch.load(watch.path)
    assert list(run.steps["step"]) == [0, 1, 2]
    assert run.notices[["step", "code"]].values.tolist() == [[3, "recording-stopped"]]
    assert "ZeroDivisionError: injected internal bug" in run.notices["message"].iloc[0]
    from ampwatch.doctor import diagnose
    found = {f.id: f for f in diagnose(run)}
    assert found["misuse-recording-stopped"].severity == "warning"
    assert "not in this file" in found["misuse-recording-stopped"].title
    assert "ampwatch bug" in found["misuse-recording-stopped"].advice
