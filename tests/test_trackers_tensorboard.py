"""AMP series and findings in TensorBoard: exported afterwards and mirrored live, read back with
TensorBoard's own EventAccumulator (nothing sampled) against the run file read with plain sqlite3."""
from __future__ import annotations

import math
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import ampwatch
from helpers.loops import amp_step, data, mlp
from helpers.sqltruth import sql_frame

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

STEPS = 40
INJECT_AT = 25  # a non-finite gradient on purpose: a skipped step with a doctor finding at it


def _train(path: Path, *, mirror=None, steps: int = STEPS, layer_every: int = 5):
    """The canonical fp16 loop: a huge initial scale overflows the first steps (natural skips),
    and a gradient hook makes one parameter's gradient inf at INJECT_AT (an injected skip)."""
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30, growth_interval=4)
    step = {"i": 0}
    model[2].weight.register_hook(lambda g: g * math.inf if step["i"] == INJECT_AT else g)
    options = {} if mirror is None else {"mirror": mirror}
    watch = ampwatch.attach(model, opt, scaler, path=str(path), layer_every=layer_every, **options)
    for i in range(steps):
        step["i"] = i
        x, y = data(i)
        amp_step(model, opt, scaler, x, y)
    watch.close()
    return model


def _events(logdir: Path) -> EventAccumulator:
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})  # 0: keep every event
    ea.Reload()
    return ea


def _series(ea: EventAccumulator, tag: str) -> dict[int, float]:
    events = ea.Scalars(tag)
    assert len({e.step for e in events}) == len(events), f"{tag}: a step written twice"
    return {e.step: e.value for e in events}


def _texts(ea: EventAccumulator, tag: str) -> dict[int, str]:
    return {e.step: e.tensor_proto.string_val[0].decode() for e in ea.Tensors(tag)}


def _close(a: float, b: float) -> bool:
    """Event files keep float32 (simple_value): equal to float32 precision, NaN equal to NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-30) or (math.isinf(a) and a == b)


def _check_against_run_file(ea: EventAccumulator, run: Path, text_tag: str = "amp/findings") -> None:
    truth = sql_frame(run, "SELECT step, loss, loss_scale, skipped, grad_norm, lr, nan_mask FROM steps ORDER BY step")
    assert len(truth) == STEPS
    skipped = _series(ea, "amp/skipped")
    assert sorted(skipped) == truth["step"].tolist()  # every step, none sampled away
    assert [s for s, v in skipped.items() if v == 1.0] == truth.loc[truth["skipped"] == 1, "step"].tolist()
    assert truth["skipped"].sum() >= 3 and INJECT_AT in [s for s, v in skipped.items() if v]
    scale, norm, lr = _series(ea, "amp/loss_scale"), _series(ea, "amp/grad_norm"), _series(ea, "amp/lr")
    for row in truth.itertuples():
        assert _close(scale[row.step], row.loss_scale), row.step
        want = math.nan if row.nan_mask & 2 else row.grad_norm  # SQLite keeps NaN as NULL + a mask bit
        if want is None or (isinstance(want, float) and math.isnan(want) and not row.nan_mask & 2):
            assert row.step not in norm
        else:
            assert _close(norm[row.step], want), (row.step, norm[row.step], want)
        assert _close(lr[row.step], row.lr)
    layers = sql_frame(run, "SELECT l.step, t.name, l.grad_norm, l.nan_mask FROM layers l"
                            " JOIN tensors t ON t.id = l.param_id")
    layers["want"] = layers["grad_norm"].where(layers["nan_mask"] & 1 == 0, math.nan)
    measured = layers[layers["grad_norm"].notna() | (layers["nan_mask"] & 1 == 1)]
    assert (measured["want"].isna() | measured["want"].abs().eq(math.inf)).any()  # a non-finite layer norm too
    for name, g in measured.groupby("name"):
        got = _series(ea, f"amp/layer_grad_norm/{name}")
        assert sorted(got) == sorted(g["step"].tolist())
        assert all(_close(got[s], v) for s, v in zip(g["step"], g["want"]))
    assert {0, 5, 10, INJECT_AT} <= set(layers["step"])  # layer_every steps and the skipped one
    modules = sql_frame(run, "SELECT m.step, MAX(m.amax) AS amax FROM modules m JOIN tensors t ON t.id = m.module_id"
                             " WHERE m.phase = 0 AND m.nonfinite = 0 GROUP BY m.step")
    headroom = _series(ea, "amp/fp16_headroom_min")
    assert set(modules["step"]) <= set(headroom) and len(modules) >= 5
    for row in modules.itertuples():
        assert _close(headroom[row.step], 65504.0 / row.amax) or headroom[row.step] == 0.0
    memory = sql_frame(run, "SELECT step, host_rss FROM memory WHERE host_rss IS NOT NULL")
    if len(memory):  # Linux: the process's resident bytes at each commit, at the commit's last step
        rss = _series(ea, "amp/memory/host_rss")
        assert sorted(rss) == memory["step"].tolist()
        assert all(_close(rss[s], v) for s, v in zip(memory["step"], memory["host_rss"]))
    findings = ampwatch.diagnose(str(run))
    texts = _texts(ea, text_tag)
    assert findings and set(texts) == {f.steps[0] for f in findings}
    for f in findings:
        assert f.title in texts[f.steps[0]] and f.id in texts[f.steps[0]]


def test_export_writes_every_step_layer_and_finding(tmp_path):
    run = tmp_path / "storm.sqlite"
    _train(run)
    out = tmp_path / "tb"
    proc = subprocess.run([sys.executable, "-m", "ampwatch", "export", str(run), "--to", "tensorboard",
                           "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote storm to {out / 'storm'} ({STEPS} steps")
    _check_against_run_file(_events(out / "storm"), run)
    again = subprocess.run([sys.executable, "-m", "ampwatch", "export", str(run), "--to", "tensorboard",
                            "--out", str(out)], capture_output=True, text=True)
    assert again.returncode == 2 and "already holds TensorBoard events" in again.stderr  # no duplicate points


def test_export_of_a_folder_writes_one_logdir_per_run(tmp_path):
    for name in ("a", "b"):
        _train(tmp_path / "runs" / f"{name}.sqlite", steps=STEPS)
    (tmp_path / "runs" / "broken.sqlite").write_text("not a run")
    proc = subprocess.run([sys.executable, "-m", "ampwatch", "export", str(tmp_path / "runs"), "--to",
                           "tensorboard", "--out", str(tmp_path / "tb")], capture_output=True, text=True)
    assert proc.returncode == 2 and "broken.sqlite" in proc.stderr  # said, and the others still exported
    for name in ("a", "b"):
        assert len(_series(_events(tmp_path / "tb" / name), "amp/skipped")) == STEPS


def test_export_bad_input_is_one_line(tmp_path):
    run = tmp_path / "r.sqlite"
    _train(run, steps=3)
    cases = [(["--to", "tensorboard"], "--to tensorboard needs --out"),
             (["--to", "tensorboard", "--format", "csv", "--out", str(tmp_path)], "--format is for files"),
             (["--to", "mlflow", "--out", str(tmp_path)], "--out is for files and TensorBoard")]
    for args, needle in cases:
        proc = subprocess.run([sys.executable, "-m", "ampwatch", "export", str(run), *args],
                              capture_output=True, text=True)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_live_mirror_to_a_log_folder_matches_the_run_file_and_changes_no_number(tmp_path):
    plain = _train(tmp_path / "plain.sqlite")
    mirrored = _train(tmp_path / "live.sqlite", mirror=str(tmp_path / "tb"))
    for a, b in zip(plain.parameters(), mirrored.parameters()):
        assert torch.equal(a, b)  # same process: mirroring changes no number training produces
    _check_against_run_file(_events(tmp_path / "tb"), tmp_path / "live.sqlite")


def test_live_mirror_to_a_summary_writer_and_closing_it_midway(tmp_path):
    """A SummaryWriter given by the user: ampwatch writes through it and never closes it. Closed by
    the user mid-run, torch's writer reopens a new event file on the next call: nothing is lost."""
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(str(tmp_path / "tb"))
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30)
    watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / "w.sqlite"), mirror=writer, flush_every_s=0.05)
    for i in range(30):
        if i == 15:
            time.sleep(0.3)  # let the writer thread commit and mirror the first half
            writer.close()
        amp_step(model, opt, scaler, *data(i))
    watch.close()
    writer.close()
    ea = _events(tmp_path / "tb")
    truth = sql_frame(tmp_path / "w.sqlite", "SELECT step, skipped FROM steps ORDER BY step")
    got = _series(ea, "amp/skipped")
    assert sorted(got) == list(range(30)) and [got[s] for s in range(30)] == truth["skipped"].astype(float).tolist()


class FailingWriter:
    """A tracker client that works, then fails for good (a full disk, a dropped connection): a
    real TensorBoard writer whose calls raise OSError once its budget of calls is spent."""

    def __init__(self, logdir: str, works_for: int) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.inner = SummaryWriter(logdir)
        self.calls, self.works_for = 0, works_for

    def add_scalar(self, tag, value, step, walltime=None):
        self.calls += 1
        if self.calls > self.works_for:
            raise OSError(28, "No space left on device")
        self.inner.add_scalar(tag, value, step, walltime=walltime)

    def add_text(self, tag, text, step):
        self.inner.add_text(tag, text, step)

    def flush(self):
        self.inner.flush()


def test_a_tracker_raising_mid_run_warns_once_and_recording_goes_on(tmp_path):
    failing = FailingWriter(str(tmp_path / "tb"), works_for=30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = _train(tmp_path / "plain.sqlite")
        model = _train(tmp_path / "live.sqlite", mirror=failing)
    mirror_warnings = [w for w in caught if "stopped mirroring" in str(w.message)]
    assert len(mirror_warnings) == 1 and "No space left on device" in str(mirror_warnings[0].message)
    assert not [w for w in caught if "stopped recording" in str(w.message)]
    assert failing.calls == 31  # one failing call, then no more
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)
    steps = sql_frame(tmp_path / "live.sqlite", "SELECT COUNT(*) AS n FROM steps")["n"].iloc[0]
    status = sql_frame(tmp_path / "live.sqlite", "SELECT status FROM run")["status"].iloc[0]
    assert steps == STEPS and status == "finished"


def test_an_unusable_mirror_warns_at_attach_and_records(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("in the way")
    with pytest.warns(RuntimeWarning, match="not mirroring"):
        _train(tmp_path / "r.sqlite", mirror=str(blocker / "tb"), steps=5)
    assert sql_frame(tmp_path / "r.sqlite", "SELECT COUNT(*) AS n FROM steps")["n"].iloc[0] == 5


def test_a_bad_mirror_value_is_one_line():
    with pytest.raises(ampwatch.errors.OptionError, match="mirror=3 is invalid"):
        ampwatch.attach(mlp(0), torch.optim.SGD(mlp(0).parameters(), lr=0.1), mirror=3)
