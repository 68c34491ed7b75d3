"""A run resumed from a checkpoint: ``first_step`` numbers its rows on from the checkpoint, so the
doctor, the summary and the trackers speak of the loop's own steps. Ground truth: the step numbers
the loop counted, the losses it computed, the skips its GradScaler made (its scale backed off), and
the weights of the same resumed training without ampwatch."""
from __future__ import annotations

import copy

import pytest
import torch
from click.testing import CliRunner
from torch.nn import functional as F

import ampwatch
from ampwatch.cli.main import cli
from ampwatch.errors import OptionError

CHECKPOINT_STEP = 25


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)  # the loop's step decides its batch, as a resumed loader does
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _train(model, opt, scaler, steps, *, bad_at=None, value=float("nan")):
    """The canonical fp16 loop over ``steps`` (the loop's own numbers). Returns what it saw: the
    unscaled loss and whether the scaler skipped, by step."""
    seen = {}
    for step in steps:
        x, y = _batch(step)
        if step == bad_at:
            x[2, 5] = value
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        seen[step] = (loss.item(), scaler.get_scale() < scale)  # a skip backs the scale off
    return seen


@pytest.fixture(scope="module")
def checkpoint():
    """The state a first attempt saved after CHECKPOINT_STEP steps (its scaler's warm-up included)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    _train(model, opt, scaler, range(CHECKPOINT_STEP))
    return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()})


def _resumed(checkpoint, *, load_scaler=True):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(copy.deepcopy(checkpoint["opt"]))
    if load_scaler:
        scaler.load_state_dict(checkpoint["scaler"])
    return model, opt, scaler


def test_a_resumed_run_is_numbered_with_the_loops_steps(tmp_path, record_path, checkpoint):
    steps = range(CHECKPOINT_STEP, CHECKPOINT_STEP + 25)
    bad = 33  # between layer_every steps (30, 40)
    control = _resumed(checkpoint)
    control_seen = _train(*control, steps, bad_at=bad)
    model, opt, scaler = _resumed(checkpoint)
    path = tmp_path / "resumed.sqlite"
    with ampwatch.attach(model, opt, scaler, path=path, layer_every=10, first_step=CHECKPOINT_STEP):
        seen = _train(model, opt, scaler, steps, bad_at=bad)
    # attaching changed nothing training produced
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), control[0].parameters()))
    assert {s: v for s, v in seen.items() if s != bad} == {s: v for s, v in control_seen.items() if s != bad}

    run = ampwatch.load(path)
    rows = run.steps.set_index("step")
    assert list(rows.index) == list(steps)
    skipped = {s for s, (_, skip) in seen.items() if skip}
    assert skipped == {bad} and set(rows.index[rows["skipped"].astype(bool)]) == skipped
    good = [s for s in steps if s != bad]
    assert list(rows.loc[good, "loss"]) == pytest.approx([seen[s][0] for s in good], rel=1e-6)
    # per-layer detail where the loop's own step number is a multiple of layer_every, and on the skip
    assert set(run.layers["step"]) == {30, 40} | skipped
    born = run.events[run.events["origin"].astype(bool)]
    assert set(born["step"]) == {bad}
    first = ampwatch.diagnose(run)[0]
    assert (first.id, first.title) == ("nonfinite-origin", f"NaN in the model's input batch at step {bad}")
    assert not any(f.id == "warmup-skips" for f in ampwatch.diagnose(run))  # the scaler's state came back

    out = CliRunner().invoke(cli, ["summary", str(path)])
    assert out.exit_code == 0 and f"steps    25 (steps {steps[0]}-{steps[-1]})  skipped 1 (4.0%)" in out.output


def test_a_compiled_resumed_run_observes_and_localizes_by_the_loops_step_numbers(tmp_path, monkeypatch, checkpoint):
    """Compiled after attach, on the accelerator path: the first step (25) is not observed, the
    graph between observed steps is compiled first, and an overflow the first Linear makes at step
    33 is replayed and localized there, with no graph break."""
    from torch._dynamo.utils import counters
    monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    torch._dynamo.reset()
    counters.clear()
    model, opt, scaler = _resumed(checkpoint)
    path = tmp_path / "compiled.sqlite"
    steps = range(CHECKPOINT_STEP, CHECKPOINT_STEP + 17)
    with ampwatch.attach(model, opt, scaler, path=path, layer_every=10, first_step=CHECKPOINT_STEP) as watch:
        assert not watch.observer.observing  # step 25 runs the graph between observed steps, at its cost
        net = torch.compile(model, backend="aot_eager")
        seen = _train(net, opt, scaler, steps, bad_at=33, value=1e6)
    assert dict(counters["graph_break"]) == {}
    assert {s for s, (_, skip) in seen.items() if skip} == {33}  # the premise: the scaler skipped it
    run = ampwatch.load(path)
    assert list(run.steps["step"]) == list(steps)
    assert set(run.layers["step"]) == {30, 40, 33}
    assert set(run.modules["step"]) == {30, 40, 33}  # module values on observed steps and the replay
    born = run.events[run.events["origin"].astype(bool)]
    assert list(zip(born["step"], born["phase"], born["module"])) == [(33, "forward", "0")]


def test_a_resume_without_the_scalers_state_is_told_to_checkpoint_it(tmp_path, checkpoint):
    """The scaler not restored starts again at its init_scale and skips its warm-up a second time:
    the doctor names the missing state as the fix, not init_scale alone."""
    model, opt, scaler = _resumed(checkpoint, load_scaler=False)
    path = tmp_path / "forgot.sqlite"
    with ampwatch.attach(model, opt, scaler, path=path, first_step=CHECKPOINT_STEP):
        seen = _train(model, opt, scaler, range(CHECKPOINT_STEP, CHECKPOINT_STEP + 12))
    skips = []  # the warm-up: the skips back to back from the first step
    while seen[CHECKPOINT_STEP + len(skips)][1]:
        skips.append(CHECKPOINT_STEP + len(skips))
    assert len(skips) >= 2  # the premise
    warm = [f for f in ampwatch.diagnose(path) if f.id == "warmup-skips"]
    assert len(warm) == 1 and warm[0].steps == (skips[0], skips[-1])
    assert f"starts at step {CHECKPOINT_STEP}, resumed from a checkpoint" in warm[0].advice
    assert "scaler.state_dict()" in warm[0].advice and "scaler.load_state_dict()" in warm[0].advice


@pytest.mark.parametrize("value", [-1, 2.5, True, "3", None])
def test_first_step_takes_a_non_negative_int(tmp_path, value):
    model = _model()
    with pytest.raises(OptionError, match="first_step=.* is invalid: expected an int >= 0"):
        ampwatch.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), path=tmp_path / "x.sqlite",
                        first_step=value)
    assert not (tmp_path / "x.sqlite").exists()


def test_an_optimizer_with_updates_and_no_first_step_is_noted(tmp_path, checkpoint):
    """A resumed run attached without first_step: numbered from 0, and told why once (an info
    finding). Ground truth: the 25 updates AdamW's restored state counts (warm-up skips excluded)."""
    model, opt, scaler = _resumed(checkpoint)
    updates = int(next(iter(opt.state.values()))["step"])
    assert 0 < updates <= CHECKPOINT_STEP  # the premise: skipped steps made no update
    path = tmp_path / "unnumbered.sqlite"
    with ampwatch.attach(model, opt, scaler, path=path):
        _train(model, opt, scaler, range(3))
    run = ampwatch.load(path)
    assert list(run.steps["step"]) == [0, 1, 2]
    found = [f for f in ampwatch.diagnose(run) if f.id == "misuse-resume-numbered-from-0"]
    assert len(found) == 1 and found[0].severity == "info"
    assert f"had made {updates:,} updates before ampwatch attached" in found[0].title
    assert "first_step=N" in found[0].advice
    # numbered: nothing to say; and a fresh optimizer has made no update
    for name, (m, o, s), options in (("numbered", _resumed(checkpoint), {"first_step": CHECKPOINT_STEP}),
                                     ("fresh", (_model(), None, torch.amp.GradScaler("cpu")), {})):
        o = o or torch.optim.AdamW(m.parameters(), lr=1e-3)
        with ampwatch.attach(m, o, s, path=tmp_path / f"{name}.sqlite", **options):
            _train(m, o, s, range(2))
        assert ampwatch.load(tmp_path / f"{name}.sqlite").notices.empty


def test_attach_with_first_step_still_refuses_an_existing_path(tmp_path):
    """Only the framework callbacks number a resumed run's file on (their script names the path the
    run before had); an explicit attach path is never redirected."""
    from ampwatch.errors import RunExistsError
    path = tmp_path / "run.sqlite"
    model = _model()
    ampwatch.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), path=path).close()
    before = path.read_bytes()
    with pytest.raises(RunExistsError, match="a run resumed from a checkpoint goes to a new path"):
        ampwatch.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), path=path, first_step=5)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["run.sqlite"]


def test_a_resumed_jobs_summary_gives_its_step_range(tmp_path):
    """Two rank files of a job numbered from step 500 (written by the run writer, no training): the
    job summary says which steps it holds, as a single run's does."""
    from helpers.synthetic_job import write_rank
    rows = [(500 + i, 0.0, 0.1, 1.0, 1024.0, 0, 0.5, 1e-3, 1, 0) for i in range(40)]
    for rank in range(2):
        write_rank(tmp_path, f"job.rank{rank}", rank, 2, rows, job_id="j1")
    out = CliRunner().invoke(cli, ["summary", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert "steps    40 (steps 500-539)  skipped 0 (0.0%)" in out.output
