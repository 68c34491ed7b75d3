"""The Hugging Face Trainer callback on a tiny GPT-2 (built from a config, random weights) on the CPU.

Ground truth is the Trainer's own ``log_history`` (loss, grad_norm at logging_steps=1) and, for the
GradScaler path, parameter snapshots around each optimizer step.
"""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import ampwatch

transformers = pytest.importorskip("transformers")
from ampwatch.errors import OptionError  # noqa: E402
from ampwatch.integrations.transformers import AmpwatchCallback  # noqa: E402
from helpers.torch_compat import NEEDS_TRACED_HOOKS  # noqa: E402

STEPS = 6


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 64, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def make_trainer(tmp_path, callbacks, *, steps: int = STEPS, model=None, **args) -> "transformers.Trainer":
    settings = dict(output_dir=str(tmp_path / "out"), use_cpu=True, gradient_accumulation_steps=2,
                    per_device_train_batch_size=4, logging_steps=1, max_steps=steps, learning_rate=1e-3,
                    report_to="none", save_strategy="no", disable_tqdm=True, seed=0)
    settings.update(args)
    return transformers.Trainer(model=model or tiny_gpt2(), args=transformers.TrainingArguments(**settings),
                                train_dataset=Tokens(), callbacks=callbacks)


def logged(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]


def trainer_losses(logs: list[dict]) -> object:
    """The losses the Trainer logged, to compare ours with: to 1e-6, or to the 4 decimals that
    transformers before 5 rounds its logged loss to."""
    losses = [h["loss"] for h in logs]
    if all(x == round(x, 4) for x in losses):
        return pytest.approx(losses, abs=5.1e-5)
    return pytest.approx(losses, rel=1e-6)


def use_cpu_grad_scaler(trainer, **kwargs) -> torch.amp.GradScaler:
    """What accelerate does on a GPU with fp16 (a GradScaler and native autocast), on the CPU:
    the same Trainer/accelerate code paths, with a real scaler that really skips steps."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=3, **kwargs)
    trainer.accelerator.scaler = scaler
    trainer.accelerator.native_amp = True
    return scaler


class StepTruth(transformers.TrainerCallback):
    """Independent ground truth: was each update applied (parameter snapshot), which scale it used."""

    def __init__(self) -> None:
        self.trainer = None
        self.skipped: list[bool] = []
        self.scales: list[float] = []
        self.accelerate_skipped: list[bool] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.before = [p.detach().clone() for p in model.parameters()]
        self.scales.append(self.trainer.accelerator.scaler.get_scale())

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.skipped.append(all(torch.equal(b, p) for b, p in zip(self.before, model.parameters())))
        self.accelerate_skipped.append(self.trainer.accelerator.optimizer_step_was_skipped)


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def precision_run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    callback = AmpwatchCallback(str(tmp / "run.sqlite"))
    trainer = make_trainer(tmp, [callback], **{request.param: True})
    trainer.train()
    return request.param, trainer, ampwatch.load(tmp / "run.sqlite")


def test_one_row_per_optimizer_step_with_the_trainers_loss_and_grad_norm(precision_run):
    _, trainer, run = precision_run
    steps, logs = run.steps, logged(trainer)
    assert list(steps["step"]) == list(range(STEPS)) and len(logs) == STEPS
    assert list(steps["micro_batches"]) == [2] * STEPS
    assert list(steps["loss"]) == trainer_losses(logs)
    assert list(steps["grad_norm"]) == pytest.approx([h["grad_norm"] for h in logs], rel=1e-4)
    assert not steps["skipped"].any() and steps["loss_scale"].isna().all()  # accelerate has no CPU scaler


def test_run_info_names_the_framework_and_keeps_training_arguments(precision_run):
    precision, trainer, run = precision_run
    info = run.info
    assert info["framework"] == "transformers" and info["status"] == "finished"
    config = info["config"]
    assert config["fp16"] is (precision == "fp16") and config["bf16"] is (precision == "bf16")
    assert config["learning_rate"] == 1e-3 and config["per_device_train_batch_size"] == 4
    assert config["gradient_accumulation_steps"] == 2 and config["max_grad_norm"] == 1.0
    # accelerate autocasts bf16 on the CPU, but not fp16 (that run is really fp32): the run says so
    assert info["amp_dtype"] == ("bfloat16" if precision == "bf16" else None)


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_grad_scaler_path_skips_agree_with_parameters_and_accelerate(tmp_path, optim, record_path):
    """On both record paths: on the accelerator path a fused step's skip is read a step late and
    every skipped step of the storm is replayed (deferred.py), through accelerate's own loop."""
    truth = StepTruth()
    callback = AmpwatchCallback(str(tmp_path / "run.sqlite"))
    trainer = make_trainer(tmp_path, [callback, truth], steps=10, fp16=True, optim=optim)
    truth.trainer = trainer
    scaler = use_cpu_grad_scaler(trainer)
    trainer.train()
    run = ampwatch.load(tmp_path / "run.sqlite")
    steps = run.steps
    assert 3 <= sum(truth.skipped) < 10, "the storm must skip some steps and not others"
    assert list(steps["skipped"]) == truth.skipped
    if optim == "adamw_torch":
        assert truth.accelerate_skipped == truth.skipped
    # else: a fused step is always called, so accelerate reports no skips (huggingface/accelerate#4242)
    assert list(steps["loss_scale"]) == truth.scales
    assert run.info["scaler_enabled"] == 1 and run.info["init_scale"] == 2.0 ** 24
    assert run.info["amp_dtype"] == "float16"
    logs = logged(trainer)
    assert list(steps["loss"]) == trainer_losses(logs)
    finite = [(s, h["grad_norm"]) for s, h in zip(steps.itertuples(), logs) if math.isfinite(h["grad_norm"])]
    assert len(finite) >= 4
    assert [s.grad_norm for s, _ in finite] == pytest.approx([g for _, g in finite], rel=1e-4)
    assert scaler.__dict__.keys().isdisjoint({"scale", "unscale_", "step", "update"}), "patches removed"
    if record_path == "accelerator":  # each skipped step replayed: localized, not given up on
        assert "replay-not-reproduced" not in set(run.notices["code"])


def test_a_fused_trainer_storm_read_a_step_late_records_what_reading_each_step_records(tmp_path, monkeypatch):
    """Through accelerate's loop, on the accelerator path, with AdamW(fused=True): skips read at the
    next step's optimizer step (deferred.py) give the same rows as reading each in its own step."""
    from ampwatch.record import deferred
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    class Held(transformers.TrainerCallback):  # the step a watch still holds unread, after each step
        def __init__(self, recorder):
            self.recorder, self.steps = recorder, []

        def on_step_end(self, args, state, control, **kwargs):
            held = self.recorder.watch._held if self.recorder.watch is not None else None
            if held is not None:
                self.steps.append(held.pack.step)

    runs = {}
    for name, limit in (("late", deferred.HOLD_AT_MOST_BYTES), ("now", -1)):  # -1: no step is held
        monkeypatch.setattr(deferred, "HOLD_AT_MOST_BYTES", limit)
        truth, recorder = StepTruth(), AmpwatchCallback(str(tmp_path / f"{name}.sqlite"))
        held = Held(recorder)
        trainer = make_trainer(tmp_path / name, [recorder, truth, held], steps=10, fp16=True,
                               optim="adamw_torch_fused")
        truth.trainer = trainer
        use_cpu_grad_scaler(trainer)
        trainer.train()
        runs[name] = (ampwatch.load(tmp_path / f"{name}.sqlite"), truth.skipped, held.steps)
    (late, late_truth, late_held), (now, now_truth, now_held) = runs["late"], runs["now"]
    assert late_held == list(range(1, 10)) and now_held == []  # step 0 observes modules
    assert late_truth == now_truth and list(late.steps["skipped"]) == late_truth and 3 <= sum(late_truth) < 10
    # the Trainer clips: read in its own step, a skipped step's gradient detail is taken after the
    # clip multiplied every gradient by NaN; read a step late, from the replay's, as backward made
    # them. The module values and which gradients were non-finite are the same
    cols = ["step", "phase", "module", "kind", "count", "amax", "origin", "micro_batch"]
    modules = [run.events[run.events.phase != "param_grad"].sort_values(["step", "phase", "module"])[cols]
               .reset_index(drop=True) for run in (late, now)]
    assert (modules[0]["phase"] == "backward").any()  # a replay's module values, not only the norms
    import pandas.testing
    pandas.testing.assert_frame_equal(modules[0], modules[1], check_exact=False, rtol=1e-5)
    grads = [sorted(map(tuple, run.events[run.events.phase == "param_grad"][["step", "module"]].values))
             for run in (late, now)]
    assert grads[0] == grads[1] and grads[0]
    assert sorted(set(late.modules["step"])) == sorted(set(now.modules["step"]))


def test_injected_fault_is_localized_to_its_module(tmp_path):
    model = tiny_gpt2()
    target = model.transformer.h[1].mlp.c_fc
    state = {"calls": 0}

    def overflow_on_last_step(module, inputs, output):
        state["calls"] += 1  # 2 micro-batches per step: the last step's forwards are calls 11 and 12
        return output * float("inf") if state["calls"] > 2 * (STEPS - 1) else None

    target.register_forward_hook(overflow_on_last_step)
    trainer = make_trainer(tmp_path, [AmpwatchCallback(str(tmp_path / "run.sqlite"))], model=model, bf16=True)
    trainer.train()
    events = ampwatch.load(tmp_path / "run.sqlite").events
    assert set(events["step"]) == {STEPS - 1}
    origin = events[(events["origin"] == 1) & (events["phase"] == "forward")]
    assert list(origin["module"]) == ["transformer.h.1.mlp.c_fc"]


def test_a_bf16_fault_under_the_trainer_with_fused_adamw_is_localized_and_training_is_unchanged(
        tmp_path, monkeypatch):
    """bf16 and optim="adamw_torch_fused" on the accelerator path: the Trainer calls the fused
    AdamW through Accelerate (closure=None), so ampwatch hands it the check as its skip flag
    (kernelskip.py). A fault from step 3 on is localized on step 3, and the weights end as the same
    Trainer's without ampwatch."""
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    flags: list = []

    class Flags(transformers.TrainerCallback):  # after ampwatch's callback: its hooks come first
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            inner = getattr(optimizer, "optimizer", optimizer)
            inner.register_step_pre_hook(lambda opt, a, k: flags.append(getattr(opt, "found_inf", None) is not None))

    def train(callbacks):
        torch.manual_seed(0)
        model = tiny_gpt2()
        calls = {"n": 0}

        def overflow_from_step_3(module, inputs, output):
            calls["n"] += 1  # 2 micro-batches per step: step 3's forwards are calls 7 and 8 (a replay's, later)
            return output * float("inf") if calls["n"] >= 7 else None

        model.transformer.h[1].mlp.c_fc.register_forward_hook(overflow_from_step_3)
        trainer = make_trainer(tmp_path, callbacks, model=model, bf16=True, optim="adamw_torch_fused")
        trainer.train()
        return [p.detach().clone() for p in model.parameters()]

    plain = train([])
    watched = train([AmpwatchCallback(str(tmp_path / "run.sqlite"), layer_every=5), Flags()])
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(watched, plain))
    assert any(p.isnan().any() for p in plain)  # the fault reached the weights, with and without ampwatch
    assert flags[:3] == [False, True, True] and True in flags[3:]  # step 0 is observed live
    events = ampwatch.load(tmp_path / "run.sqlite").events
    origin = events[(events["origin"] == 1) & (events["phase"] == "forward")]
    assert origin[["step", "module"]].values.tolist()[:1] == [[3, "transformer.h.1.mlp.c_fc"]]


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["forward", "callback"])
def test_a_raising_train_closes_the_run_as_crashed(tmp_path, where):
    model = tiny_gpt2()
    calls = {"n": 0}

    class RaiseAfterThirdStep(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise Boom("callback failed at step 3")

    def raise_in_forward(module, args):
        calls["n"] += 1
        if calls["n"] == 7:  # first micro-batch of the fourth step
            raise Boom("forward failed at step 3")

    extra = []
    if where == "forward":
        model.transformer.h[0].register_forward_pre_hook(raise_in_forward)
    else:
        extra = [RaiseAfterThirdStep()]
    trainer = make_trainer(tmp_path, [AmpwatchCallback(str(tmp_path / "run.sqlite"))] + extra, model=model,
                           bf16=True)
    with pytest.raises(Boom):
        trainer.train()
    run = ampwatch.load(tmp_path / "run.sqlite")
    assert run.info["status"] == "crashed"
    assert f"{where} failed at step 3" in run.info["error"]
    if where == "forward":  # the step it raised in, as far as it got (record/unfinished.py)
        assert len(run.steps) == 4 and run.notices[["step", "code"]].values.tolist() == [[3, "step-unfinished"]]
    else:  # raised after its step ended
        assert len(run.steps) == 3 and run.notices.empty


def test_reused_trainer_and_a_second_trainer_give_separate_correct_runs(tmp_path):
    first = make_trainer(tmp_path, [AmpwatchCallback(str(tmp_path / "a.sqlite"))], bf16=True)
    second = make_trainer(tmp_path, [AmpwatchCallback(str(tmp_path / "b.sqlite"), layer_every=1)],
                          bf16=True, learning_rate=3e-3)
    expected = {}
    first.train()
    expected["a.sqlite"] = logged(first)
    second.train()
    expected["b.sqlite"] = logged(second)
    first.train()  # the same Trainer again: a new run, never appended to the first file
    expected["a-2.sqlite"] = logged(first)
    for name, logs in expected.items():
        run = ampwatch.load(tmp_path / name)
        assert run.info["status"] == "finished" and len(run.steps) == STEPS == len(logs)
        assert list(run.steps["loss"]) == trainer_losses(logs)
        assert list(run.steps["grad_norm"]) == pytest.approx([h["grad_norm"] for h in logs], rel=1e-4)
    assert ampwatch.load(tmp_path / "b.sqlite").info["config"]["learning_rate"] == 3e-3
    assert ampwatch.load(tmp_path / "a-2.sqlite").steps["loss"].iloc[0] != expected["a.sqlite"][0]["loss"]


def test_bad_options_fail_when_the_callback_is_made():
    with pytest.raises(OptionError, match="layer_evry"):
        AmpwatchCallback("x.sqlite", layer_evry=5)
    with pytest.raises(TypeError, match="framework"):
        AmpwatchCallback("x.sqlite", framework="mine")


IMPORTS_NOTHING = """
import sys, ampwatch, ampwatch.record.watch, ampwatch.integrations
heavy = sorted(m for m in ("transformers", "accelerate", "lightning", "pytorch_lightning") if m in sys.modules)
assert not heavy, heavy
"""

WITHOUT_TRANSFORMERS = """
import sys
sys.modules["transformers"] = None  # as if not installed
try:
    from ampwatch.integrations.transformers import AmpwatchCallback
except ImportError as exc:
    print(exc)
"""


def test_import_ampwatch_imports_no_framework():
    subprocess.run([sys.executable, "-c", IMPORTS_NOTHING], check=True, timeout=120)


def test_without_transformers_one_clear_error_names_the_extra():
    out = subprocess.run([sys.executable, "-c", WITHOUT_TRANSFORMERS], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out.count("\n") == 0 and "pip install 'ampwatch[transformers]'" in out


class GraphsByStep(transformers.TrainerCallback):
    """Dynamo's count of graphs compiled so far, at the end of each optimizer step."""

    def __init__(self) -> None:
        self.graphs: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        from torch._dynamo.utils import counters
        self.graphs.append(counters["stats"]["unique_graphs"])


@NEEDS_TRACED_HOOKS
def test_a_compiled_trainer_model_with_graph_breaks_is_observed_without_compiling_twice(tmp_path, monkeypatch):
    """``torch_compile=True`` with a model that breaks its graph inside (a hook of the user's on a
    block; HF models break on a logger call or a cache object), so its blocks run in frames the
    forward wrapper's flag does not reach, and the watch falls back to Dynamo's guards on module
    hooks as the first observed step ends. It must do so without dropping the graphs compiled so
    far: the observed step's graphs compile on step 0, the others' on step 1, and no step after
    compiles anything (dropped graphs would compile again on steps 1 and 2, or 2 and 3). Every
    ``layer_every`` step is observed, inside the blocks too, and the Trainer's losses are bitwise
    those of the unwatched run."""
    from torch._dynamo.utils import counters
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")  # the path a GPU takes: hooks out between
    found = {}
    for watched in (False, True):
        torch._dynamo.reset()
        counters.clear()
        by_step = GraphsByStep()
        callbacks = [by_step] + ([AmpwatchCallback(str(tmp_path / "run.sqlite"), layer_every=2)] if watched else [])
        model = tiny_gpt2()
        model.transformer.h[1].register_forward_pre_hook(lambda module, args: torch._dynamo.graph_break())
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
            trainer = make_trainer(tmp_path, callbacks, model=model, bf16=True, torch_compile=True,
                                   torch_compile_backend="aot_eager", gradient_accumulation_steps=1)
            trainer.train()
        found[watched] = ([h["loss"] for h in trainer.state.log_history if "loss" in h], by_step.graphs,
                          sum(counters["graph_break"].values()))
    assert found[False][2] > 0  # the premise: the model breaks its graph
    assert found[True][0] == found[False][0]
    graphs = found[True][1]
    assert graphs[0] < graphs[1] == graphs[-1] and found[False][1][0] == found[False][1][-1]
    modules = ampwatch.load(tmp_path / "run.sqlite").modules
    forward = modules[modules.phase == "forward"]
    assert sorted(set(forward.step)) == [0, 2, 4]
    seen = {s: set(forward[forward.step == s].module) for s in (0, 2, 4)}
    assert seen[2] == seen[4] >= seen[0] and "transformer.h.1.mlp.c_fc" in seen[0]  # inside the blocks


def test_a_run_resumed_from_a_checkpoint_goes_on_with_the_trainers_step_numbers(tmp_path):
    """``train(resume_from_checkpoint=...)``: the callback attaches after the Trainer loaded the
    checkpoint's state, and numbers the rows from its global step. Ground truth: the steps the
    Trainer logged (its ``step`` is the global step after each update) and their losses."""
    first = make_trainer(tmp_path, [AmpwatchCallback(str(tmp_path / "a.sqlite"))], bf16=True,
                         save_strategy="steps", save_steps=4)
    first.train()
    before = (tmp_path / "a.sqlite").read_bytes()
    # the same script, so the same path: the run before keeps its file, this one gets a sibling
    callback = AmpwatchCallback(str(tmp_path / "a.sqlite"))
    resumed = make_trainer(tmp_path, [callback], bf16=True)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    logs = [h for h in logged(resumed) if h["step"] > 4]  # its log_history holds the checkpoint's too
    assert [h["step"] for h in logs] == [5, 6]  # the premise: the Trainer went on from step 4
    assert sorted(p.name for p in tmp_path.glob("*.sqlite")) == ["a-2.sqlite", "a.sqlite"]
    assert (tmp_path / "a.sqlite").read_bytes() == before
    run = ampwatch.load(tmp_path / "a-2.sqlite")
    assert list(run.steps["step"]) == [h["step"] - 1 for h in logs] == [4, 5]
    assert list(run.steps["loss"]) == trainer_losses(logs)
    assert list(ampwatch.load(tmp_path / "a.sqlite").steps["step"]) == list(range(STEPS))
