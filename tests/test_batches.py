"""A bad step's inputs saved in the run file (record/batches.py): exactly the bytes the loop fed,
only for steps whose loss went NaN/Inf (and the step a crash stopped), read back by Run.batch,
ampwatch.load_batch, `ampwatch batch`, the doctor and the step inspector."""
from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from streamlit.testing.v1 import AppTest

import ampwatch
from ampwatch.cli.main import main as cli_main
from ampwatch.record import batches as saving

ROOT = Path(__file__).resolve().parent.parent


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _loop(path, *, steps=12, accum=1, bad=None, save=True, init_scale=2.0 ** 16, watched=True, seed=0):
    """fp16 + GradScaler on a small MLP; ``bad``: {(step, micro_batch): (row, col, value)} written
    into that micro-batch's input. Returns the inputs fed, by (step, micro_batch), and the model."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    fed = {}
    watch = ampwatch.attach(model, opt, scaler, path=path, layer_every=5, save_batches=save) if watched else None
    try:
        for step in range(steps):
            for k in range(accum):
                x = torch.randn(4, 8)
                if bad and (step, k) in bad:
                    r, c, v = bad[(step, k)]
                    x[r, c] = v
                fed[(step, k)] = x.clone()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(x).float().pow(2).mean() / accum
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    finally:
        if watch is not None:
            watch.close()
    return fed, model


def test_the_micro_batch_whose_loss_went_nan_is_saved_byte_for_byte(tmp_path, record_path):
    path = tmp_path / "run.sqlite"
    fed, model = _loop(path, accum=2, bad={(7, 1): (1, 3, float("nan"))})
    run = ampwatch.load(path)
    saved = run.batches
    # only step 7's second micro-batch: its first one and every other step had a finite loss
    assert [(int(r.step), int(r.micro_batch), r.name, r.dtype, r.shape, bool(r.saved)) for r in saved.itertuples()] \
        == [(7, 1, "args[0]", "float32", [4, 8], True)]
    truth = fed[(7, 1)].numpy().tobytes()
    assert saved["sha256"].iloc[0] == hashlib.sha256(truth).hexdigest()
    assert int(saved["nbytes"].iloc[0]) == len(truth)
    assert run.batch(7)["args[0]"].tobytes() == truth
    tensors = ampwatch.load_batch(path, 7)
    assert tensors["args[0]"].dtype == torch.float32 and tensors["args[0]"].numpy().tobytes() == truth
    # saving reads; it changes no number training produces
    _, plain = _loop(None, accum=2, bad={(7, 1): (1, 3, float("nan"))}, watched=False)
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    # the doctor reads the bytes back: the data is the cause, and it says where the batch is
    first = ampwatch.diagnose(run)[0]
    assert first.id == "nonfinite-origin" and first.title == "NaN in the model's input batch at step 7"
    assert "args[0] (micro-batch 1) holds 1 NaN of 32 values" in first.evidence
    assert "ampwatch batch run.sqlite --step 7" in first.advice


def test_a_gradient_overflow_with_a_finite_loss_saves_nothing(tmp_path, record_path):
    """The scaler's warm-up at 2^24 overflows the gradients on several steps: the scale's doing.
    The scaled gradient is already inf where it reaches the model's fp16 outputs, whose loss was
    finite: a replay of such a step reproduces it (before, the accelerator path called it a step
    that did not reproduce, a transient fault, and switched the replay off)."""
    path = tmp_path / "run.sqlite"
    _loop(path, init_scale=2.0 ** 24)
    run = ampwatch.load(path)
    assert int(run.steps["skipped"].sum()) >= 2  # the premise: skipped steps happened
    assert run.batches.empty
    assert run.notices.empty, run.notices[["step", "code"]].values.tolist()
    assert "step-not-reproduced" not in {f.id for f in ampwatch.diagnose(run)}


def test_save_batches_false_saves_nothing(tmp_path):
    path = tmp_path / "run.sqlite"
    _loop(path, bad={(3, 0): (0, 0, float("inf"))}, save=False)
    run = ampwatch.load(path)
    assert run.batches.empty
    assert "ampwatch batch" not in ampwatch.diagnose(run)[0].advice


def test_names_dtypes_and_nested_arguments(tmp_path, record_path):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 8)
            self.lin = torch.nn.Linear(8, 2)

        def forward(self, ids, *, extra):
            h = self.emb(ids) + extra["shift"].float() * extra["scale"]
            return self.lin(h)

    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    path = tmp_path / "run.sqlite"
    with ampwatch.attach(model, opt, scaler, path=path, layer_every=5):
        for step in range(6):
            ids = torch.randint(0, 10, (3, 5))
            shift = torch.randn(3, 5, 8).to(torch.bfloat16)
            scale = torch.tensor(float("inf") if step == 4 else 1.0)
            if step == 4:
                fed = (ids.clone(), shift.clone(), scale.clone())
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(ids, extra={"shift": shift, "scale": scale}).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    run = ampwatch.load(path)
    saved = run.batches
    assert sorted(saved["name"]) == ["args[0]", "kwargs['extra']['scale']", "kwargs['extra']['shift']"]
    assert set(saved["step"]) == {4}
    by_name = {r.name: r for r in saved.itertuples()}
    assert by_name["args[0]"].dtype == "int64" and by_name["kwargs['extra']['shift']"].dtype == "bfloat16"
    assert by_name["kwargs['extra']['scale']"].shape == []
    arrays = run.batch(4)
    assert np.array_equal(arrays["args[0]"], fed[0].numpy())
    assert arrays["kwargs['extra']['shift']"].dtype == np.uint16  # numpy has no bfloat16: its bits
    assert arrays["kwargs['extra']['shift']"].tobytes() == fed[1].view(torch.uint16).numpy().tobytes()
    tensors = ampwatch.load_batch(run, 4)
    assert torch.equal(tensors["args[0]"], fed[0]) and torch.equal(tensors["kwargs['extra']['shift']"], fed[1])
    assert tensors["kwargs['extra']['scale']"].shape == () and torch.isinf(tensors["kwargs['extra']['scale']"])
    assert ampwatch.diagnose(run)[0].title == "Inf in the model's input batch at step 4"
    # the call rebuilt from the names runs the model as the loop did
    args, kwargs = ampwatch.load_batch(run, 4, call=True)
    assert len(args) == 1 and torch.equal(args[0], fed[0]) and sorted(kwargs["extra"]) == ["scale", "shift"]
    with torch.autocast("cpu", dtype=torch.float16):
        again = model(*args, **kwargs)
    assert not torch.isfinite(again).all()  # the saved inf scale makes the output non-finite again


def test_a_call_with_a_non_tensor_argument_is_refused_not_guessed(tmp_path):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, flag, x):
            return self.lin(x) * flag

    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    path = tmp_path / "gap.sqlite"
    with ampwatch.attach(model, opt, torch.amp.GradScaler("cpu"), path=path, layer_every=5) as watch:
        for step in range(4):
            x = torch.randn(3, 4)
            x[0, 0] = float("nan") if step == 2 else x[0, 0]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(2.0, x).float().sum()
            watch.scaler.scale(loss).backward()
            watch.scaler.step(opt)
            watch.scaler.update()
            opt.zero_grad()
    assert list(ampwatch.load_batch(path, 2)) == ["args[1]"]
    with pytest.raises(ampwatch.RunError, match=r"args\[0\] of step 2 of gap.sqlite was not saved"):
        ampwatch.load_batch(path, 2, call=True)


def test_the_budget_keeps_the_first_steps_and_lists_what_it_could_not_hold(tmp_path, monkeypatch):
    monkeypatch.setattr(saving, "STEP_BYTES", 100)  # a 4x8 float32 input is 128 bytes
    path = tmp_path / "small.sqlite"
    _loop(path, bad={(2, 0): (0, 0, float("nan"))})
    saved = ampwatch.load(path).batches
    assert len(saved) == 1 and not bool(saved["saved"].iloc[0]) and saved["sha256"].isna().all()
    assert int(saved["nbytes"].iloc[0]) == 128
    assert ampwatch.load_batch(path, 2) == {}  # listed, not saved: no tensor
    monkeypatch.undo()
    path = tmp_path / "many.sqlite"
    _loop(path, steps=14, bad={(s, 0): (0, 1, float("nan")) for s in range(1, 14)})
    steps = sorted(set(int(s) for s in ampwatch.load(path).batches["step"]))
    assert steps == list(range(1, 1 + saving.MAX_STEPS))


_CRASHING = textwrap.dedent("""
    import sys, torch, ampwatch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if sys.argv[2] == "compile":
        net = torch.compile(model, backend="aot_eager")
    else:
        net = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    watch = ampwatch.attach(model, opt, scaler, path=sys.argv[1], layer_every=5)
    for step in range(20):
        x = torch.randn(4, 8)
        if step == 6:
            x[2, 5] = float("nan")
            open(sys.argv[1] + ".truth", "wb").write(x.numpy().tobytes())
        with torch.autocast("cpu", dtype=torch.float16):
            loss = net(x).float().pow(2).mean()
        if not torch.isfinite(loss):  # the loop's own guard: raises before the scaler sees the loss
            raise RuntimeError(f"loss is {loss.item()} at step {step}")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
""")


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_a_loop_that_raises_on_its_nan_loss_keeps_that_steps_inputs(tmp_path, record_path, mode, capsys):
    script = tmp_path / "crash.py"
    script.write_text(_CRASHING)
    path = tmp_path / "crash.sqlite"
    proc = subprocess.run([sys.executable, str(script), str(path), mode], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)
    assert proc.returncode == 1 and "loss is nan at step 6" in proc.stderr
    run = ampwatch.load(path)
    assert run.info["status"] == "crashed"
    truth = (tmp_path / "crash.sqlite.truth").read_bytes()
    saved = run.batches
    assert list(saved["step"]) == [6] and saved["sha256"].iloc[0] == hashlib.sha256(truth).hexdigest()
    findings = ampwatch.diagnose(run)
    # the batch is the root cause, and the crash (the loop's own raise) follows from it
    assert findings[0].title == "NaN in the model's input batch at step 6"
    crashed = [f for f in findings if f.id == "run-crashed"][0]
    assert crashed.cause == "nonfinite-origin" and crashed.steps == (6, 6)
    assert "args[0] holds 1 NaN/inf of 32 values" in crashed.advice
    assert "ampwatch batch crash.sqlite --step 6 --out step6.pt" in crashed.advice
    if mode == "compile":
        return
    # the command line: list, write, and one line for every mistake, the run file untouched
    before = _md5(path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        cli_main(["batch", str(path)])
    assert done.value.code in (0, None)
    listing = capsys.readouterr().out
    assert "args[0]" in listing and hashlib.sha256(truth).hexdigest()[:16] in listing
    out = tmp_path / "step6.pt"
    with pytest.raises(SystemExit) as done:
        cli_main(["batch", str(path), "--step", "6", "--out", str(out)])
    assert done.value.code in (0, None)
    assert torch.load(out, weights_only=True)["args[0]"].numpy().tobytes() == truth
    for argv, says in ((["batch", str(path), "--step", "3", "--out", str(tmp_path / "x.pt")],
                        "no saved inputs for step 3"),
                       (["batch", str(path), "--step", "6", "--out", str(out)], "exists"),
                       (["batch", str(path), "--out", str(tmp_path / "y.pt")], "need --step"),
                       (["batch", str(path), "--step", "6", "--out", str(tmp_path / "no" / "z.pt")], "does not exist"),
                       (["batch", str(tmp_path / "missing.sqlite")], "missing.sqlite")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            cli_main(argv)
        err = capsys.readouterr().err
        assert done.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert _md5(path) == before
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "y.pt").exists()


def test_a_file_of_the_schema_before_reads_as_none_saved(tmp_path):
    path = tmp_path / "old.sqlite"
    _loop(path, bad={(3, 0): (0, 0, float("nan"))})
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE batches")
        conn.execute("DELETE FROM events WHERE phase = 'input'")  # schema 7's recorder wrote none
        conn.execute("PRAGMA user_version = 7")
    run = ampwatch.load(path)
    assert run.batches.empty and list(run.batches.columns)[:3] == ["step", "micro_batch", "name"]
    assert ampwatch.diagnose(run)[0].title == "Loss became NaN at step 3"  # no bytes to read: the loss


def test_the_step_inspector_shows_and_hands_over_the_saved_inputs(tmp_path, restore_runs_env):
    path = tmp_path / "run.sqlite"
    fed, _ = _loop(path, bad={(7, 0): (1, 3, float("nan"))})
    os.environ["AMPWATCH_RUNS"] = str(tmp_path)
    at = AppTest.from_file(str(ROOT / "app" / "streamlit_app.py"), default_timeout=60)
    at.query_params["run"] = "run.sqlite"
    at.run()
    at.session_state["_inspect"] = 7
    at.switch_page("app_pages/inspector.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    shown = [d.value for d in at.dataframe if "sha256" in d.value.columns]
    assert len(shown) == 1
    row = shown[0].iloc[0]
    assert (row["input"], row["dtype"], row["shape"], int(row["NaN"]), int(row["inf"])) == \
        ("args[0]", "float32", "4×8", 1, 0)
    assert row["sha256"] == hashlib.sha256(fed[(7, 0)].numpy().tobytes()).hexdigest()
    assert any("ampwatch batch run.sqlite --step 7" in c.value for c in at.caption)
    from ampwatch.dashboard.rundata import input_arrays
    import io
    arrays = np.load(io.BytesIO(input_arrays(path, 7)), allow_pickle=False)
    assert arrays["mb0/args[0]"].tobytes() == fed[(7, 0)].numpy().tobytes()


@pytest.mark.parametrize("path_kind,precision", [("host", "fp16"), ("accelerator", "fp16"), ("accelerator", "bf16")])
def test_under_ddp_the_rank_whose_batch_brought_the_nan_keeps_it(tmp_path, path_kind, precision):
    """2 gloo ranks: rank 1's input holds a NaN at step 4. DDP all-reduces the NaN gradient, so both
    ranks skip the step (fp16: a GradScaler); only rank 1's forward went NaN, so only rank 1's file
    keeps its batch. bf16 on the accelerator path: nothing skips and no loss is logged, so the host
    knows nothing without a read; the step's module values (every step is observed under DDP) say
    at the writer that rank 1's forward went bad, and it is saved there."""
    from helpers.ports import free_port
    worker = Path(__file__).parent / "helpers" / "nan_rank_worker.py"
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path), free_port(), path_kind, precision],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rank0, rank1 = (ampwatch.load(tmp_path / f"job.rank{r}.sqlite") for r in (0, 1))
    if precision == "fp16":
        assert bool(rank0.steps["skipped"][4]) and bool(rank1.steps["skipped"][4])  # the premise
    else:  # the NaN update reached both ranks' weights: every later forward is NaN on both
        assert not rank0.steps["skipped"].any() and rank0.steps["loss"].isna().all()  # the premise
    saved = rank1.batches
    if precision == "bf16":  # rank 0's later steps went bad through the weights: not its batch's doing
        assert not (rank0.events["phase"] == "input").any() and set(rank0.batches["step"]) <= {5, 6, 7}
        saved = saved[saved["step"] == 4]
    else:
        assert rank0.batches.empty
    assert list(saved["step"]) == [4] and list(saved["name"]) == ["args[0]"]
    assert saved["sha256"].iloc[0] == (tmp_path / "truth.txt").read_text()
    assert ampwatch.diagnose(rank1)[0].title == "NaN in the model's input batch at step 4"
    # the recorder saw the batch bring it, on rank 1 only: no module is named as its origin
    born = rank1.events[rank1.events["origin"].astype(bool) & (rank1.events["step"] == 4)]
    assert list(zip(born["phase"], born["module"])) == [("input", "<model>")]
    assert not (rank0.events["phase"] == "input").any()
    from ampwatch.doctor.job import diagnose_group
    job = {f.id: f for f in diagnose_group(ampwatch.load_group(tmp_path))}
    assert job["rank-origin"].title == "A bad batch on rank 1: NaN born in the model's input batch (micro-batch 0) at step 4"


class _LabelledModel(torch.nn.Module):
    """Computes its own loss from ``labels`` (as Hugging Face models do)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 16)
        self.head = torch.nn.Linear(16, 20)

    def forward(self, input_ids, labels):
        logits = self.head(self.emb(input_ids)).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 20), labels.reshape(-1))


def test_a_batch_whose_labels_are_all_ignored_is_named_as_the_cause(tmp_path, record_path):
    """Every label -100: a mean cross-entropy over zero tokens is NaN while every gradient is zero,
    so the scaler does not skip the step. Where reads are free the pack's loss says it went bad and
    the batch is saved; on an accelerator the step is neither skipped nor replayed: nothing saved."""
    torch.manual_seed(0)
    model = _LabelledModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    path = tmp_path / "labels.sqlite"
    with ampwatch.attach(model, opt, scaler, path=path, layer_every=5):
        for step in range(9):
            ids = torch.randint(0, 20, (2, 8))
            labels = torch.full_like(ids, -100) if step == 6 else ids.roll(1, dims=1)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(input_ids=ids, labels=labels)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    run = ampwatch.load(path)
    assert np.isnan(run.steps["loss"][6]) and not run.steps["skipped"].any()  # the premise
    first = ampwatch.diagnose(run)[0]
    if record_path == "accelerator":  # not saved; the recorded figures still tell a 0/0 loss
        assert run.batches.empty and first.title == "Loss became NaN at step 6 while its gradients were all zero"
        assert "gradient norm is exactly 0" in first.evidence and "-100" in first.advice
        return
    assert sorted(run.batches["name"]) == ["kwargs['input_ids']", "kwargs['labels']"]
    assert (run.batch(6)["kwargs['labels']"] == -100).all()
    assert first.title == "Loss became NaN at step 6: every label of its batch is -100"
    assert "holds 16 values, all -100" in first.evidence and "num_items_in_batch" in first.advice


def test_a_nan_loss_outside_the_model_with_zero_gradients_reads_as_a_mean_over_nothing(tmp_path, record_path):
    """The loss computed in the loop (targets are no model input, so no labels are saved): a NaN
    loss whose gradient norm is exactly 0 is a 0/0, not the model's arithmetic."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    path = tmp_path / "outside.sqlite"
    with ampwatch.attach(model, opt, scaler, path=path, layer_every=5):
        for step in range(8):
            x, y = torch.randn(4, 8), torch.randint(0, 5, (4,))
            if step == 3:
                y[:] = -100
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    run = ampwatch.load(path)
    assert run.steps["grad_norm"][3] == 0.0 and np.isnan(run.steps["loss"][3])  # the premise
    first = ampwatch.diagnose(run)[0]
    assert first.title == "Loss became NaN at step 3 while its gradients were all zero"
    assert "nothing skipped the step" in first.evidence


def test_a_recording_failure_mid_forward_leaves_the_root_hooks_harmless(tmp_path, record_path):
    """A hook fails inside a forward (an internal bug): the watch stops recording and removes its
    hooks, among them the root's pre-hooks that keep inputs, which torch still calls in that same
    forward, then without kwargs. Training goes on with the numbers it has without ampwatch."""
    from helpers.loops import amp_step, data, mlp
    torch.manual_seed(0)
    model, reference = mlp(), mlp()
    reference.load_state_dict(model.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    scalers = [torch.amp.GradScaler("cpu") for _ in range(2)]
    with pytest.warns(RuntimeWarning, match="stopped recording"):
        with ampwatch.attach(model, opts[0], scalers[0], path=str(tmp_path / "r.sqlite"),
                             layer_every=1) as watch:  # every step observed: the hooks run
            for step in range(5):
                if step == 2:
                    watch.observer._batch.add = lambda *a: 1 / 0
                    watch.observer._batch.reduce_now = lambda *a: 1 / 0
                x, y = data(step)
                amp_step(model, opts[0], scalers[0], x, y)
                amp_step(reference, opts[1], scalers[1], x, y)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_an_attention_mask_of_minus_inf_is_not_blamed(tmp_path):
    """An additive mask holds -inf on purpose (returnn#1446's pitfall): a step that goes NaN for
    another reason must not read as 'Inf in the model's input batch'."""
    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)
            self.out = torch.nn.Linear(6, 3)

        def forward(self, x, mask):
            scores = (self.lin(x) + mask).softmax(-1)  # the mask's -inf gives weight 0
            return self.out(scores * x)

    torch.manual_seed(0)
    model = Masked()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mask = torch.zeros(6)
    mask[4:] = float("-inf")
    path = tmp_path / "mask.sqlite"
    with ampwatch.attach(model, opt, torch.amp.GradScaler("cpu"), path=path, layer_every=5) as watch:
        for step in range(6):
            x = torch.randn(4, 6)
            if step == 3:
                with torch.no_grad():
                    model.out.weight[0, 0] = float("nan")  # the fault: a weight, not the batch
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x, mask).float().pow(2).mean()
            watch.scaler.scale(loss).backward()
            watch.scaler.step(opt)
            watch.scaler.update()
            opt.zero_grad()
            if step == 3:
                with torch.no_grad():
                    model.out.weight[0, 0] = 0.0
    run = ampwatch.load(path)
    assert 3 in set(run.batches["step"])  # the premise: the bad step's inputs, mask included, were saved
    assert int(np.isneginf(run.batch(3)["args[1]"]).sum()) == 2
    titles = [f.title for f in ampwatch.diagnose(run)]
    assert not any("input batch" in t for t in titles), titles
    assert not (run.events["phase"] == "input").any()  # -inf alone in the inputs: a mask, not a fault
