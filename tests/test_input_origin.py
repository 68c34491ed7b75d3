"""A batch that brings NaN/Inf in: the recorder names the model's own input as the origin (an
``input`` event on ``<model>``), so the doctor says so from the module values alone, with no bytes
saved and no loss logged, on a step between ``layer_every`` steps and on an observed one, with or
without a GradScaler. Ground truth: the one value the loop wrote into its batch. And the other
side of the model: a NaN target, outside it, is the loss's doing, not a module's or the batch's,
and not a transient fault when the step is replayed."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ampwatch
from ampwatch.doctor.skips import classify
from helpers.app_pages import open_page
from ampwatch.doctor.facts import Facts


def _bf16_loop(path, bad_step, value=float("nan"), *, save=False, log=False, steps=12):
    """bf16 autocast, AdamW, no scaler: nothing skips the bad step. Returns the inputs fed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fed = {}
    with ampwatch.attach(model, opt, path=path, layer_every=5, save_batches=save) as watch:
        for step in range(steps):
            x = torch.randn(4, 8)
            if step == bad_step:
                x[1, 2] = value
            fed[step] = x.clone()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            if log:
                watch.log(loss=loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return fed


@pytest.mark.parametrize("bad_step", [7, 10], ids=["between-observed-steps", "observed-step"])
def test_a_nan_in_the_batch_is_born_in_the_models_input_without_a_loss_or_saved_bytes(tmp_path, record_path, bad_step):
    path = tmp_path / "run.sqlite"
    _bf16_loop(path, bad_step)
    run = ampwatch.load(path)
    assert run.batches.empty  # the premise: nothing to read the NaN from but the module values
    ev = run.events
    at = ev[ev["step"] == bad_step]
    born = at[at["origin"].astype(bool)]
    assert list(zip(born["phase"], born["module"], born["kind"])) == [("input", "<model>", "nan")]
    assert born["dtype"].iloc[0] == "float32"  # the batch's own dtype, before autocast
    if record_path == "host":  # exact counts where reads are free: the one value written
        assert int(born["count"].iloc[0]) == 1
    # the first module's output is NaN too, but its input was not finite: it made nothing
    assert ((at["phase"] == "forward") & (at["module"] == "0")).any()
    assert not (ev[ev["step"] < bad_step]["kind"].notna()).any()  # nothing before the bad step
    first = ampwatch.diagnose(run)[0]
    assert (first.id, first.title) == ("nonfinite-origin", f"NaN in the model's input batch at step {bad_step}")
    assert "before any module ran" in first.evidence and "The data is the cause" in first.advice
    assert "its bytes are not in the run file (save_batches=False" in first.evidence
    assert "param_grad" not in first.title and "Loss" not in first.title


@pytest.mark.parametrize("bad_step", [7, 10], ids=["between-observed-steps", "observed-step"])
def test_a_bad_step_without_a_scaler_or_a_loss_keeps_its_batch(tmp_path, record_path, bad_step):
    """No scaler and no logged loss. The CPU reads the step's non-finite gradients for free; on the
    accelerator path a step between observed ones is replayed, and an observed one (step 10, module
    values measured live, its update not held back) is told by its module values at the writer,
    with no read on the training thread. Its input is saved byte for byte either way, and the
    doctor reads the NaN from those bytes."""
    path = tmp_path / "run.sqlite"
    fed = _bf16_loop(path, bad_step, save=True)
    run = ampwatch.load(path)
    assert bad_step in set(run.batches["step"]) and not (run.batches["step"] < bad_step).any()
    assert run.batch(bad_step)["args[0]"].tobytes() == fed[bad_step].numpy().tobytes()
    first = ampwatch.diagnose(run)[0]
    assert first.title == f"NaN in the model's input batch at step {bad_step}"
    assert "args[0] holds 1 NaN of 32 values" in first.evidence  # read back from the saved bytes


def _scaled_step(watch, model, opt, x) -> None:
    """One fp16 + GradScaler step of a loss computed from the model's output alone."""
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    watch.scaler.scale(loss).backward()
    watch.scaler.step(opt)
    watch.scaler.update()
    opt.zero_grad()


def test_an_inf_batch_under_a_grad_scaler_is_neither_a_probe_nor_the_scales_doing(tmp_path, record_path):
    """fp16 + GradScaler: +inf fed at step 9 is skipped like any overflow; the skip is put down to the
    batch, never to the scale probing its ceiling, and the doctor does not tell to lower the scale."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    path = tmp_path / "run.sqlite"
    with ampwatch.attach(model, opt, torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3),
                         path=path, layer_every=5, save_batches=False) as watch:
        for step in range(14):
            x = torch.randn(4, 8)
            if step == 9:
                x[0, 0] = float("inf")
            _scaled_step(watch, model, opt, x)
    run = ampwatch.load(path)
    assert list(run.steps.index[run.steps["skipped"].astype(bool)]) == [9]  # the premise
    born = run.events[run.events["origin"].astype(bool)]
    assert list(zip(born["step"], born["phase"], born["kind"])) == [(9, "input", "inf")]
    with Facts.open(run) as facts:
        skips = classify(facts)
    assert list(skips["step"]) == [9] and list(skips["label"]) == ["the model's input batch"]
    assert not skips["probe"].any()  # the scale had grown before step 9, yet the batch did this
    first = ampwatch.diagnose(run)[0]
    assert first.title == "Inf in the model's input batch at step 9", first.title
    assert np.isinf(run.steps["loss"].iloc[9]) or np.isnan(run.steps["loss"].iloc[9])


def test_the_events_page_names_the_batch_not_a_module(tmp_path, restore_runs_env):
    _bf16_loop(tmp_path / "bad.sqlite", 7, log=True)
    at = open_page(tmp_path, "events", run="bad.sqlite")
    assert not at.exception, [e.value for e in at.exception]
    text = " ".join(w.value for w in at.warning)
    assert "Root cause (doctor): **NaN in the model's input batch at step 7**" in text
    assert "**the model's input batch** (nan) at step 7" in text and "<model>" not in text
    table = next(d.value for d in at.dataframe if "phase" in d.value.columns)
    assert table.iloc[0][["step", "phase", "module"]].tolist() == [7, "input", "<model>"]  # origin first


class _Cleans(torch.nn.Module):
    """Takes NaN-padded inputs and replaces the NaN before any arithmetic: NaN in, nothing wrong."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.nan_to_num(x, nan=0.0))


def test_a_model_that_cleans_nan_from_its_inputs_is_not_flagged(tmp_path, record_path):
    """NaN padding on every step, cleaned before any arithmetic: healthy steps stay without events,
    and a step whose fault is elsewhere (step 4: a weight of fc set to inf, so fc's forward makes
    inf from finite inputs) is put down to fc, not to the batch."""
    torch.manual_seed(0)
    model = _Cleans()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    path = tmp_path / "run.sqlite"
    with ampwatch.attach(model, opt, torch.amp.GradScaler("cpu"), path=path, layer_every=2) as watch:
        for step in range(6):
            x = torch.randn(4, 8)
            x[:, 6:] = float("nan")  # padding, on every step
            if step == 4:
                with torch.no_grad():
                    model.fc.weight[0, 0] = float("inf")
            _scaled_step(watch, model, opt, x)
            if step == 4:
                with torch.no_grad():
                    model.fc.weight[0, 0] = 0.5
    run = ampwatch.load(path)
    steps = run.steps
    assert list(steps.index[steps["skipped"].astype(bool)]) == [4]  # the premise: one bad step
    assert set(run.events["step"]) == {4} and not (run.events["phase"] == "input").any()
    born = run.events[run.events["origin"].astype(bool)]
    assert list(zip(born["phase"], born["module"])) == [("forward", "fc")]
    first = ampwatch.diagnose(run)[0]
    assert first.title.startswith("Inf born in fc (Linear, forward) at step 4"), first.title


@pytest.mark.parametrize("held", [True, False], ids=["outputs-held", "compact-loop"])
def test_a_nan_target_is_put_down_to_the_loss_and_the_replay_stays_on(tmp_path, record_path, held):
    """A regression loop whose target (outside the model) holds a NaN at step 7: the model's outputs
    were finite, its loss was not. On the accelerator path the replay makes finite outputs again and
    finds the loss's gradient NaN. Where the loop held the step's own outputs (``out = model(x)``)
    they were finite too: the same step, reproduced, not a transient fault. Where it did not
    (``loss = mse_loss(model(x).float(), y)``) that is not known: the replay's values stand, a
    notice says so, and the doctor says 'most likely' the loss or its targets. Either way replay
    stays on for later steps (no replay-not-reproduced), and the step's inputs are saved."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    path = tmp_path / "run.sqlite"
    fed = {}
    with ampwatch.attach(model, opt, torch.amp.GradScaler("cpu"), path=path, layer_every=5) as watch:
        for step in range(12):
            x, y = torch.randn(4, 8), torch.randn(4, 4)
            if step == 7:
                y[1, 2] = float("nan")
            fed[step] = x.clone()
            with torch.autocast("cpu", dtype=torch.float16):
                if held:
                    out = model(x)
                    loss = torch.nn.functional.mse_loss(out.float(), y)
                else:
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
            watch.scaler.scale(loss).backward()
            watch.scaler.step(opt)
            watch.scaler.update()
            opt.zero_grad()
    run = ampwatch.load(path)
    assert list(run.steps.index[run.steps["skipped"].astype(bool)]) == [7]  # the premise
    assert "replay-not-reproduced" not in set(run.notices["code"])
    ev = run.events[run.events["step"] == 7]
    assert not ev["phase"].isin(["forward", "input"]).any()  # the model's forward stayed finite
    assert (run.modules["step"] == 7).any()  # ... and was measured: the step was localized
    found = ampwatch.diagnose(run)
    first = found[0]
    assert first.title == "Loss became NaN at step 7"
    unclear = record_path == "accelerator" and not held
    assert ("replay-outputs-gone" in set(run.notices["code"])) == unclear
    if unclear:
        assert "most likely it was made after the model, by the loss computation or by its targets" in first.evidence
        assert "did not recur is not ruled out" in first.evidence
    else:
        assert "made after the model: by the loss computation or by its targets" in first.evidence
    assert first.advice.startswith("Check the targets (labels) of step 7")
    assert not any(f.id in ("step-not-reproduced", "late-skips") for f in found), [f.id for f in found]
    assert run.batch(7)["args[0]"].tobytes() == fed[7].numpy().tobytes()  # the step can be run again
