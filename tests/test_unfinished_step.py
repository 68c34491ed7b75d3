"""The step a run ends in: a loop that raises on a NaN loss (``if not torch.isfinite(loss): raise``)
ended the run inside a step, and the file held none of it: not its loss, not its NaN/Inf events,
not the module where the NaN was born, which is what the user needs. On close (the crash's, or
``watch.close()`` after catching) the recorder now writes the step as far as it got.

Real training of the helpers' MLP (fp16 autocast + GradScaler on the CPU, both recorder paths),
real subprocesses that die of the exception, real SQLite. The fault: module "2"'s weights set to
inf at FAULT, so its output holds NaN (inf - inf) from finite inputs; the ground truth is taken by
the loop itself from the modules' own outputs.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ampwatch
from ampwatch.cli.main import cli
from helpers.loops import data, mlp
from helpers.sqltruth import sql_frame

FAULT = 7

LOOP = textwrap.dedent("""
    import json, os, sys, torch, ampwatch
    sys.path.insert(0, {tests!r})
    from helpers.loops import data, mlp
    torch.set_num_threads(1)
    model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    watch = ampwatch.attach(model, opt, scaler, path={path!r})
    for i in range(20):
        x, y = data(i)
        if i == {fault}:
            with torch.no_grad():
                model[2].weight.fill_(float("inf"))
        with torch.autocast("cpu", dtype=torch.float16):
            inner = model[1](model[0](x))  # the truth, from the modules themselves
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        if {after_backward}:
            scaler.scale(loss).backward()
        if not torch.isfinite(loss):
            print(json.dumps({{"step": i, "inner_finite": bool(torch.isfinite(inner).all()),
                               "out2_finite": bool(torch.isfinite(model[2](inner.float())).all())}}), flush=True)
            raise RuntimeError("nan loss")
        if not {after_backward}:
            scaler.scale(loss).backward()
        scaler.step(opt); scaler.update(); opt.zero_grad()
    watch.close()
""")


def _crash(tmp_path: Path, path_kind: str, after_backward: bool) -> tuple[Path, dict]:
    path = tmp_path / "crash.sqlite"
    env = dict(__import__("os").environ, AMPWATCH_CPU_AS_ACCELERATOR="1" if path_kind == "accelerator" else "0")
    script = LOOP.format(tests=str(Path(__file__).parent), path=str(path), fault=FAULT, after_backward=after_backward)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1 and "RuntimeError: nan loss" in proc.stderr, proc.stderr[-2000:]
    return path, json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_the_step_is_named(path: Path, truth: dict, loss_known: bool, status: str) -> None:
    assert truth == {"step": FAULT, "inner_finite": True, "out2_finite": False}
    steps = sql_frame(path, "SELECT step, loss, skipped, nan_mask FROM steps ORDER BY step")
    assert steps["step"].tolist() == list(range(FAULT + 1))  # the step it raised in is there
    last = steps.iloc[-1]
    assert math.isnan(last["loss"]) and bool(int(last["nan_mask"]) & 1) == loss_known  # NaN, or not known
    assert int(last["skipped"]) == 0
    born = sql_frame(path, "SELECT module, phase FROM events WHERE step = ? AND origin = 1", (FAULT,))
    assert born.values.tolist() == [["2", "forward"]]
    notices = sql_frame(path, "SELECT step, code FROM notices")
    assert notices.values.tolist() == [[FAULT, "step-unfinished"]]
    assert ampwatch.load(path).info["status"] == status
    findings = ampwatch.diagnose(path)
    root = findings[0]
    assert (root.id, root.cause, root.steps) == ("nonfinite-origin", None, (FAULT, FAULT))
    assert root.title.startswith(f"NaN born in 2 (Linear, forward) at step {FAULT}")
    crashed = [f for f in findings if f.id == "run-crashed"]
    if status == "crashed":  # the crash follows from the NaN, in the step it was born in
        assert [(f.steps, f.cause) for f in crashed] == [((FAULT, FAULT), "nonfinite-origin")]
        assert f"The run crashed at step {FAULT}: RuntimeError: nan loss" == crashed[0].title
    else:
        assert crashed == []
    out = CliRunner().invoke(cli, ["summary", str(path)]).output.splitlines()
    reached = "backward" if loss_known else "forward"
    ended = "the run crashed" if status == "crashed" else "the run was closed"
    assert out[1].endswith(f"; step {FAULT} did not end: {ended} after its {reached}")
    assert out[4] == f"nonfinite first at step {FAULT}  " + (
        f"(loss first NaN/inf at step {FAULT})" if loss_known else
        f"(the loss stayed finite; step {FAULT}'s was not recorded)")


@pytest.mark.parametrize("after_backward", [False, True], ids=["raised_before_backward", "raised_after_backward"])
@pytest.mark.parametrize("path_kind", ["host", "accelerator"])
def test_a_process_that_dies_on_a_nan_loss_leaves_that_step_in_its_file(tmp_path, path_kind, after_backward):
    """Between layer_every steps on the accelerator path no module was observed: the step's kept
    forward is run again at close, observed."""
    path, truth = _crash(tmp_path, path_kind, after_backward)
    _assert_the_step_is_named(path, truth, loss_known=after_backward, status="crashed")


def _loop_in_process(path: Path, fault: int, error: type = RuntimeError, tail: str = "") -> None:
    """The same loop in this process, raising ``error`` at ``fault`` (a NaN loss for RuntimeError,
    else after a healthy forward), caught; the watch closed after. ``tail``: 'eval', a forward in
    train mode without grad after the last step (not a step)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    watch = ampwatch.attach(model, opt, scaler, path=str(path))
    try:
        for i in range(fault + 1 if fault >= 0 else 10):
            x, y = data(i)
            if i == fault and error is RuntimeError:
                with torch.no_grad():
                    model[2].weight.fill_(float("inf"))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            if i == fault:
                raise error("nan loss" if error is RuntimeError else "data loader broke")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        if tail == "eval":
            with torch.no_grad():
                model(data(99)[0])
    except (RuntimeError, KeyError):
        pass
    finally:
        watch.close()


def test_close_after_catching_the_error_writes_the_step_too(tmp_path, record_path):
    path = tmp_path / "caught.sqlite"
    _loop_in_process(path, FAULT)
    _assert_the_step_is_named(path, {"step": FAULT, "inner_finite": True, "out2_finite": False}, loss_known=False,
                              status="finished")


def test_a_crash_that_is_not_a_nan_is_not_read_as_one(tmp_path, record_path):
    """An exception after a healthy forward (a data loader that broke): the step is written as far as
    it got, with no loss; nothing calls it NaN, and the crash is at that step, not after it."""
    path = tmp_path / "keyerror.sqlite"
    with pytest.raises(KeyError):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        with ampwatch.attach(model, opt, scaler, path=str(path)):
            for i in range(FAULT + 1):
                x, y = data(i)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
                if i == FAULT:
                    raise KeyError("data loader broke")
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    steps = sql_frame(path, "SELECT step, loss, nan_mask FROM steps ORDER BY step")
    assert steps["step"].tolist() == list(range(FAULT + 1))
    assert steps["loss"].iloc[:-1].notna().all() and math.isnan(steps["loss"].iloc[-1])
    assert int(steps["nan_mask"].iloc[-1]) == 0  # not measured, not NaN
    assert sql_frame(path, "SELECT COUNT(*) n FROM events")["n"].iloc[0] == 0
    out = CliRunner().invoke(cli, ["summary", str(path)]).output.splitlines()
    assert out[4] == "nonfinite none"
    assert out[2].startswith(f"loss     first {steps['loss'].iloc[0]:.4g}  last {steps['loss'].iloc[-2]:.4g}  ")
    crashed = next(f for f in ampwatch.diagnose(path) if f.id == "run-crashed")
    assert crashed.steps == (FAULT, FAULT) and crashed.cause is None
    assert crashed.title == f"The run crashed at step {FAULT}: KeyError: 'data loader broke'"


@pytest.mark.parametrize("tail", ["", "eval"])
def test_a_run_closed_between_steps_gets_no_extra_step(tmp_path, record_path, tail):
    """A loop that ended its last step (and then ran a forward without grad to evaluate) closes
    with exactly its steps."""
    path = tmp_path / "clean.sqlite"
    _loop_in_process(path, -1, tail=tail)
    assert sql_frame(path, "SELECT step FROM steps ORDER BY step")["step"].tolist() == list(range(10))
    assert sql_frame(path, "SELECT COUNT(*) n FROM notices")["n"].iloc[0] == 0
