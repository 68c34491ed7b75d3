"""What each step's row records - skipped, loss scale, loss, grad norm, micro-batches, metrics, layer
rows - on real training of a tiny MLP on the CPU, checked against ground truth taken from the loop."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import ampwatch
from helpers.loops import amp_step, changed, data, mlp, snapshot, train
from helpers.torch_compat import total_norm

# every test runs on both recorder paths: the CPU's free reads and the accelerator path
pytestmark = pytest.mark.usefixtures("record_path")


def storm_scaler(**kw):
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=kw.pop("growth_interval", 5), **kw)


def attach_to(tmp_path, name="run", **options):
    return lambda m, o, s: ampwatch.attach(m, o, s, path=str(tmp_path / f"{name}.sqlite"), **options)


def test_skipped_steps_equal_parameter_ground_truth(tmp_path):
    _, watch, applied = train(60, scaler_factory=storm_scaler, attach=attach_to(tmp_path), lr=0.5)
    steps = ampwatch.load(watch.path).steps
    assert list(steps["step"]) == list(range(60))
    truth = [not a for a in applied]
    assert sum(truth) >= 8, "the storm must actually skip steps"
    assert list(steps["skipped"]) == truth


def test_loss_scale_is_the_scale_used_then_backs_off_and_grows(tmp_path):
    scales_used = []

    class Spy(torch.amp.GradScaler):  # a real GradScaler; the subclass only reads the scale it used
        def update(self, new_scale=None):
            scales_used.append(float(self._scale))
            super().update(new_scale)

    _, watch, _ = train(60, scaler_factory=lambda: Spy("cpu", init_scale=2.0 ** 24, growth_interval=5),
                        attach=attach_to(tmp_path))
    steps = ampwatch.load(watch.path).steps
    assert list(steps["loss_scale"]) == scales_used
    for prev, cur in zip(steps.itertuples(), list(steps.itertuples())[1:]):
        if prev.skipped:
            assert cur.loss_scale == prev.loss_scale / 2
    grew = [cur.loss_scale == 2 * prev.loss_scale for prev, cur in zip(steps.itertuples(), list(steps.itertuples())[1:])]
    assert any(grew), "growth after growth_interval clean steps must be visible"


def test_gradient_accumulation_one_row_per_optimizer_step(tmp_path):
    _, watch, _ = train(10, scaler_factory=lambda: torch.amp.GradScaler("cpu"), attach=attach_to(tmp_path), accum=4)
    steps = ampwatch.load(watch.path).steps
    assert len(steps) == 10
    assert set(steps["micro_batches"]) == {4}


@pytest.mark.parametrize("divide, log", [(True, False), (False, False), (True, True)])
def test_loss_is_the_sum_of_what_the_scaler_saw_or_the_mean_of_logged_losses(tmp_path, divide, log):
    """The loss a user means. With nanoGPT's loss / k the row is the mean micro-batch loss;
    a loop that does not divide gets k x the mean (what its gradient is the gradient of);
    watch.log(loss=...) wins with the mean of the logged values."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x, y = data(1)
    expected = []
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite")) as watch:
        for _ in range(3):
            losses = []
            for xb, yb in zip(x.chunk(2), y.chunk(2)):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
                losses.append(loss.item())
                if log:
                    watch.log(loss=loss)
                scaler.scale(loss / 2 if divide else loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            expected.append(sum(losses) / 2 if divide or log else sum(losses))
    run = ampwatch.load(watch.path)
    assert list(run.steps["loss"]) == pytest.approx(expected, rel=1e-6)
    assert run.info["loss_definition"] == ("logged-mean" if log else "scaled-sum")


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
@pytest.mark.parametrize("fused", [False, True])
def test_a_one_element_loss_of_any_shape_is_recorded_with_its_scale(tmp_path, shape, fused):
    """The step's pack joins the loss, the scale and (fused) the inf flag: whatever shape the loop's
    one-element loss has, its row holds that loss and the scale it was scaled by, and recording goes on."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x, y = data(1)
    losses, scales = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a recorder failure warns: it must not
        with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite")) as watch:
            for _ in range(4):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(x).float(), y).reshape(shape)
                losses.append(loss.item())
                scales.append(scaler.get_scale())
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    steps = ampwatch.load(watch.path).steps
    assert list(steps["loss"]) == pytest.approx(losses, rel=1e-6)
    assert list(steps["loss_scale"]) == scales


def test_grad_norm_is_unscaled_pre_clip_norm(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    truth = []
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite")) as watch:
        for i in range(8):
            x, y = data(i)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)  # a second unscale_ by ampwatch would raise inside GradScaler
            truth.append(float(total_norm([p.grad for p in model.parameters()])))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # clips hard: post-clip norm is 1e-3
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    got = list(ampwatch.load(watch.path).steps["grad_norm"])
    assert got == pytest.approx(truth, rel=1e-5)
    assert min(got) > 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_without_scaler_rows_come_from_optimizer_and_loss_from_log(tmp_path, dtype):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    expected = []
    with ampwatch.attach(model, opt, None, path=str(tmp_path / "r.sqlite")) as watch:
        for i in range(12):
            x, y = data(i)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            expected.append(loss.item())
            watch.log(loss=loss, tokens=100 + i)
            opt.step()
            opt.zero_grad()
    run = ampwatch.load(watch.path)
    steps = run.steps
    assert list(steps["loss"]) == pytest.approx(expected)
    assert steps["loss_scale"].isna().all() and not steps["skipped"].any()
    assert list(run.metrics[run.metrics.key == "tokens"]["value"]) == [100.0 + i for i in range(12)]
    assert run.info["amp_dtype"] == (None if dtype == torch.float32 else "bfloat16")


def test_disabled_and_deprecated_scalers(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deprecated = torch.cuda.amp.GradScaler()  # no CUDA here: a disabled scaler, as on a CPU box
    for i, factory in enumerate([lambda: torch.amp.GradScaler("cpu", enabled=False), lambda: deprecated]):
        _, watch, applied = train(6, scaler_factory=factory, attach=attach_to(tmp_path, f"d{i}"))
        run = ampwatch.load(watch.path)
        assert len(run.steps) == 6 and all(applied)
        assert run.steps["loss_scale"].isna().all()
        assert not run.steps["skipped"].any()
        assert run.steps["loss"].notna().all()
        assert run.info["scaler_enabled"] is False


def _bf16_loop(scaler_arg, loop, path, steps=6, bad_step=3):
    """bf16 autocast with AMP's scaler switched off; ``loop``: how the step is taken. "scaler": the
    AMP loop kept as it was (scale, step, update on the disabled scaler); "direct": backward and
    optimizer.step(), the scaler never touched; "scaled-direct": scaler.scale(loss).backward() then
    optimizer.step(); "direct+update": optimizer.step() then scaler.update(). Step ``bad_step``'s
    input holds a NaN (its weights are repaired after it). Returns the final weights and the watch."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    watch = None
    if path is not None:
        watch = ampwatch.attach(model, opt, scaler if scaler_arg == "disabled" else None, path=str(path))
    for i in range(steps):
        x, y = data(i)
        if i == bad_step:
            x[0, 0] = float("nan")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if loop in ("scaler", "scaled-direct"):
            scaler.scale(loss).backward()
        else:
            loss.backward()
            if watch is not None:
                watch.log(loss=loss)
        if loop == "scaler":
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
            if loop == "direct+update":
                scaler.update()
        opt.zero_grad()
        if i == bad_step:
            with torch.no_grad():
                for p in model.parameters():
                    p.nan_to_num_(0.0)
    if watch is not None:
        watch.close()
    return snapshot(model), watch


@pytest.mark.parametrize("loop", ["direct", "scaler", "scaled-direct", "direct+update"])
def test_a_disabled_scaler_records_like_no_scaler_however_the_loop_steps(tmp_path, loop):
    """GradScaler(enabled=False) handed to attach (AMP switched off, the same attach line kept):
    every optimizer step is recorded once, whether the loop steps through the disabled scaler or
    calls optimizer.step() itself (it used to record no step at all then), with the rows a run
    attached without a scaler gets; no scale is claimed; training is unchanged."""
    import sqlite3
    unwatched, _ = _bf16_loop("disabled", loop, None)
    weights, watch = _bf16_loop("disabled", loop, tmp_path / "disabled.sqlite")
    assert all(torch.equal(a, b) for a, b in zip(unwatched, weights))
    _, plain = _bf16_loop("none", "direct", tmp_path / "none.sqlite")  # its loss through watch.log

    def rows(path, query):
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return conn.execute(query).fetchall()
        finally:
            conn.close()

    steps = "SELECT step, loss, loss_scale, skipped, grad_norm, nan_mask, micro_batches FROM steps ORDER BY step"
    got, want = rows(watch.path, steps), rows(plain.path, steps)
    assert [r[0] for r in got] == list(range(6))  # one row per optimizer step, none twice
    assert all(r[2] is None for r in got)  # no scale claimed
    assert [r[1:] for r in got] == [r[1:] for r in want]
    assert got[3][1] is None and got[3][5] & 1  # the NaN loss, flagged NaN (not "not measured")
    events = "SELECT step, phase, module, kind FROM events ORDER BY step, phase, module"
    assert rows(watch.path, events) == rows(plain.path, events) and rows(watch.path, events)
    info = rows(watch.path, "SELECT scaler_enabled, init_scale, growth_factor FROM run")
    assert info == [(0, None, None)]


def test_param_groups_frozen_params_and_zero_grad_to_zero(tmp_path):
    model = mlp()
    model[0].weight.requires_grad_(False)
    opt = torch.optim.SGD([{"params": [model[2].weight, model[2].bias], "lr": 0.1},
                           {"params": [model[4].weight, model[4].bias, model[0].bias], "lr": 0.01}])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=4)
    applied = []
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite"), layer_every=1) as watch:
        for i in range(20):
            before = snapshot(model)
            amp_step(model, opt, scaler, *data(i), set_to_none=False)
            applied.append(changed(before, model))
    run = ampwatch.load(watch.path)
    assert list(run.steps["skipped"]) == [not a for a in applied]
    assert run.steps["lr"].eq(0.1).all()
    assert "0.weight" not in set(run.layers["name"])  # frozen: never has a grad
    assert run.info["param_count"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind", ["SGD", "AdamW"])
def test_a_tensor_learning_rate_is_recorded_as_it_stood_each_step(tmp_path, kind):
    """torch takes ``lr`` as a tensor (compiled and capturable optimizer steps), and a scheduler then
    changes it in place. Each row holds the value the step ran with; where reads are not free it
    travels in the step's pack rather than being read on the host every step."""
    model = mlp()
    lr = torch.tensor(0.05)
    opt = getattr(torch.optim, kind)(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    used = []
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite")) as watch:
        for i in range(6):
            opt.param_groups[0]["lr"].fill_(0.05 * 0.5 ** i)  # what a scheduler does to a tensor lr
            used.append(float(opt.param_groups[0]["lr"]))
            amp_step(model, opt, scaler, *data(i))
    assert list(ampwatch.load(watch.path).steps["lr"]) == pytest.approx(used, rel=1e-6)
    assert len(set(used)) == 6


def test_layers_every_n_and_on_skipped_steps(tmp_path):
    _, watch, applied = train(30, scaler_factory=storm_scaler, attach=attach_to(tmp_path, layer_every=7), lr=0.5)
    run = ampwatch.load(watch.path)
    layer_steps = set(run.layers["step"])
    skipped = {i for i, a in enumerate(applied) if not a}
    assert layer_steps == {s for s in range(30) if s % 7 == 0} | skipped
    one = run.layers[run.layers.step == 0].set_index("name")
    # independently: layer norms of step 0 combine to the step's global norm
    g = run.steps.set_index("step").loc[0, "grad_norm"]
    if math.isfinite(g):
        assert math.sqrt((one["grad_norm"] ** 2).sum()) == pytest.approx(g, rel=1e-5)
    assert (run.layers["grad_zero_frac"].dropna().between(0, 1)).all()


def test_tied_weights_counted_once(tmp_path):
    from ampwatch.samples.models import TinyGPT
    model = TinyGPT(d=16, layers=1, heads=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampwatch.attach(model, opt, None, path=str(tmp_path / "r.sqlite")) as watch:
        pass
    unique = {id(p): p.numel() for p in model.parameters()}
    assert ampwatch.load(watch.path).info["param_count"] == sum(unique.values())


def _pre_clip_truth(model, scale=1.0):
    return float(total_norm([p.grad for p in model.parameters()])) / scale


@pytest.mark.parametrize("mode", ["bf16-no-scaler", "scaled-clip-misuse", "accumulated"])
def test_grad_norm_is_pre_clip_whoever_clips(tmp_path, mode):
    """No scaler: the norm is taken when backward ends, before the user's clip. Clipping still-scaled
    gradients (a misuse) or clipping after accumulation: still the unscaled pre-clip norm."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = None if mode == "bf16-no-scaler" else torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    dtype = torch.bfloat16 if scaler is None else torch.float16
    accum = 2 if mode == "accumulated" else 1
    truth = []
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite")) as watch:
        for i in range(6):
            x, y = data(i)
            for xb, yb in zip(x.chunk(accum), y.chunk(accum)):
                with torch.autocast("cpu", dtype=dtype):
                    loss = torch.nn.functional.mse_loss(model(xb).float(), yb) / accum
                if scaler is None:
                    loss.backward()
                    watch.log(loss=loss)
                else:
                    scaler.scale(loss).backward()
            scale = 1.0 if scaler is None else scaler.get_scale()
            truth.append(_pre_clip_truth(model, scale))
            if mode == "accumulated":
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-4)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
    got = list(ampwatch.load(watch.path).steps["grad_norm"])
    assert got == pytest.approx(truth, rel=1e-5)
    assert min(got) > 1e-2  # far above the 1e-4 clip: not the post-clip norm


@pytest.mark.parametrize("unscale_first", [False, True])
def test_clip_before_unscale_is_noticed(tmp_path, unscale_first):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite"), layer_every=2) as watch:
        for i in range(6):
            x, y = data(i)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    notices = ampwatch.load(watch.path).notices
    codes = list(notices["code"])
    # checked on every layer_every=2 step, noticed on each that shows it: the doctor tells every step
    assert codes == ([] if unscale_first else ["clip-before-unscale"] * 3)
    if not unscale_first:
        assert list(notices["step"]) == [0, 2, 4]
        assert len(ampwatch.load(watch.path).steps) == 6  # a notice, not an extra or a lost step
    doctor_ids = {f.id for f in ampwatch.diagnose(watch.path)}
    assert ("misuse-clip-before-unscale" in doctor_ids) is (not unscale_first)


def test_backward_end_is_seen_when_the_first_parameter_gets_no_gradient(tmp_path):
    """The norm is taken when backward ends, before clipping, even when the parameter whose
    post-accumulate-grad hook used to be the only signal gets no gradient (an unused parameter
    here; FSDP1's flat parameters, likewise): the root output's gradient hook also signals it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))  # first: own params go first
    assert next(model.parameters()) is model.unused
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pre_clip = []
    with ampwatch.attach(model, opt, path=str(tmp_path / "r.sqlite")) as watch:
        for i in range(3):
            x, y = data(i)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            watch.log(loss=loss)
            pre_clip.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)))
            opt.step()
            opt.zero_grad()
    steps = ampwatch.load(watch.path).steps
    assert steps["grad_norm"].tolist() == pytest.approx(pre_clip, rel=1e-5)
    assert steps["micro_batches"].tolist() == [1, 1, 1]


def test_a_value_log_cannot_record_is_refused_at_the_call_and_recording_goes_on(tmp_path):
    """User review: ``watch.log(val="hello")`` used to stop the whole recording at the step's end, and
    the file still read as a healthy finished run. Now each bad key warns once, at the call, and
    is left out; every step and every good value is recorded."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite")) as watch:
            for i in range(5):
                watch.log(text="hello", vec=torch.ones(3), nothing=None, table={"a": 1},
                          lr=0.5 + i, one=torch.tensor([2.0 * i]), flag=True)
                amp_step(model, opt, scaler, *data(i))
    ours = [str(w.message) for w in caught if "ampwatch" in str(w.message)]
    assert sorted(m.split("(")[1].split("=")[0] for m in ours) == ["nothing", "table", "text", "vec"]
    assert any("a tensor of 3 elements" in m for m in ours) and any("got str" in m for m in ours)
    run = ampwatch.load(watch.path)
    assert list(run.steps["step"]) == list(range(5)) and run.info["status"] == "finished"
    metrics = run.metrics.pivot(index="step", columns="key", values="value")
    assert sorted(metrics.columns) == ["flag", "lr", "one"]
    assert metrics["lr"].tolist() == [0.5, 1.5, 2.5, 3.5, 4.5]
    assert metrics["one"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert run.notices.empty


def test_grad_norm_of_non_finite_gradients_is_inf_or_nan_as_the_gradients_say(tmp_path):
    """The step row's grad_norm: inf when a gradient holds inf, NaN when one holds NaN (NaN wins over
    inf, as in the sum of squares), finite otherwise; each bad parameter named in an event. Gradients
    poisoned through parameter hooks on chosen steps; the scaler skips those steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    poison = {2: {"0.weight": math.inf}, 4: {"0.weight": math.inf, "2.bias": math.nan}}
    step = [0]
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: g.fill_(poison[step[0]][name])
                        if name in poison.get(step[0], {}) else g)
    watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / "run.sqlite"))
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    for step[0] in range(6):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    watch.close()
    run = ampwatch.load(watch.path)
    norms = run.steps.set_index("step")["grad_norm"]
    assert norms[2] == math.inf
    assert math.isnan(norms[4])
    assert all(math.isfinite(norms[s]) and norms[s] > 0 for s in (0, 1, 3, 5))
    assert list(run.steps["skipped"]) == [False, False, True, False, True, False]
    grads = run.events[run.events["phase"] == "param_grad"]
    named = {(int(r.step), r.module, r.kind) for r in grads.itertuples()}
    assert named == {(2, "0.weight", "inf"), (4, "0.weight", "inf"), (4, "2.bias", "nan")}


def test_zero_fraction_of_each_gradient_matches_the_gradient(tmp_path, record_path):
    """grad_zero_frac of every layer row is the share of exact zeros in that parameter's gradient as
    the optimizer stepped with it: an embedding whose unused rows get none, a ReLU that blocks some."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(12, 6), torch.nn.Flatten(), torch.nn.Linear(18, 8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    names = {id(p): n for n, p in model.named_parameters()}
    truth: dict[tuple[int, str], float] = {}
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "r.sqlite"), layer_every=1) as watch:
        step = [0]
        opt.register_step_pre_hook(lambda *_: truth.update(
            {(step[0], names[id(p)]): float((p.grad == 0).sum()) / p.grad.numel()
             for p in model.parameters() if p.grad is not None}))
        for i in range(4):
            tokens = torch.randint(0, 4, (5, 3))  # rows 4..11 of the embedding get no gradient
            target = torch.randn(5, 2)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(tokens).float(), target)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            step[0] += 1
    layers = ampwatch.load(watch.path).layers
    got = {(int(r.step), r.name): r.grad_zero_frac for r in layers.itertuples()}
    assert set(got) == set(truth) and len(truth) == 4 * 5
    assert got == pytest.approx(truth, abs=1e-6)
    assert all(truth[(s, "0.weight")] >= 8 / 12 for s in range(4))  # the test sees zeros at all


@pytest.mark.parametrize("scaled", [True, False], ids=["scaler", "no_scaler"])
def test_a_finite_gradient_whose_float32_norm_overflows_is_no_nan_inf_event(tmp_path, record_path, scaled):
    """Inputs 1e17 times too large at step 3 make weight gradients of finite elements up to ~1e33,
    whose float32 norms overflow (their squares pass 3.4e38). Such a gradient was recorded as an
    inf event with a count of 0, and the doctor called it an Inf born in the parameter's gradient.
    Now: no event, its layer row counts no non-finite element; where reads are free its norm is
    measured again in float64 and recorded as the finite number it is. Ground truth: the gradients
    as the loop left them, measured here in float64."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0) if scaled else None
    watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / "run.sqlite"), layer_every=100)
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x * (1e17 if i == 3 else 1.0)), y)
        (scaler.scale(loss) if scaled else loss).backward()
        if i == 3:
            grads = [p.grad.detach().clone() for p in model.parameters()]
        if scaled:
            scaler.step(opt)
            scaler.update()
        else:
            watch.log(loss=loss)
            opt.step()
        opt.zero_grad()
    watch.close()
    assert all(bool(torch.isfinite(t).all()) for t in grads)  # every element finite ...
    fp32 = [float(torch.linalg.vector_norm(t)) for t in grads]
    fp64 = [float(torch.linalg.vector_norm(t, dtype=torch.float64)) for t in grads]
    overflowed = [i for i, n in enumerate(fp32) if n == math.inf]
    assert overflowed == [0, 2] and all(math.isfinite(n) for n in fp64)  # ... and two float32 norms inf
    assert scaler is None or scaler.get_scale() == 1.0  # the scaler found them finite: no backoff
    run = ampwatch.load(watch.path)
    assert run.events.empty
    assert "replay-not-reproduced" not in set(run.notices["code"])  # nothing was non-finite to replay
    layers = run.layers[run.layers["step"] == 3].set_index("name")
    names = [n for n, _ in model.named_parameters()]
    norm = run.steps.set_index("step").loc[3, "grad_norm"]
    if record_path == "host":  # measured again in float64, on this step only: a finite step
        assert norm == pytest.approx(math.sqrt(sum(n * n for n in fp64)), rel=1e-6)
        assert layers.empty  # no layer_every step, nothing non-finite
    else:  # the device's float32 norm, not measured again (that would cost every step an op)
        assert norm == math.inf
        assert [layers.loc[names[i], "grad_norm"] for i in overflowed] == [math.inf] * 2
        assert [int(layers.loc[names[i], "grad_nonfinite"]) for i in overflowed] == [0, 0]
    findings = {f.id for f in ampwatch.diagnose(watch.path)}
    assert not findings & {"nonfinite-origin", "step-not-reproduced"}
