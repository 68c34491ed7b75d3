"""The AMP figures inside the frameworks' own logs, with nothing but the callback: HF Trainer with
report_to="tensorboard" and Lightning with a TensorBoardLogger, read back from their event files."""
from __future__ import annotations

import math
import time

import pytest
import torch

from helpers.sqltruth import sql_frame

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _scalars(logdir) -> dict[str, dict[int, float]]:
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}


def _check_windows(windows: list[dict], run_file) -> None:
    """Each window's figures are those of its last step in the run file; every counted skip is a
    skipped step of the run, each counted once."""
    truth = sql_frame(run_file, "SELECT step, loss, loss_scale, skipped, nan_mask FROM steps ORDER BY step")
    by_step = truth.set_index("step")
    assert windows and truth["skipped"].sum() >= 2
    previous = -1
    for w in windows:
        last = int(w["amp/step"])
        assert last > previous
        assert w["amp/loss_scale"] == pytest.approx(by_step.loc[last, "loss_scale"], rel=1e-6)
        assert w["amp/skipped_steps"] == by_step.loc[previous + 1:last, "skipped"].sum()
        previous = last
    assert sum(w["amp/skipped_steps"] for w in windows) >= 2


def test_hf_trainer_report_to_tensorboard_gets_the_amp_figures(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from ampwatch.integrations.transformers import AmpwatchCallback
    from test_integrations_hf import make_trainer, use_cpu_grad_scaler

    class Pace(transformers.TrainerCallback):
        """A slower step, as a real one is: the writer thread commits each step before the next log."""

        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(0.25)

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))  # where report_to="tensorboard" writes
    callback = AmpwatchCallback(str(tmp_path / "hf.sqlite"), flush_every_s=0.02)
    trainer = make_trainer(tmp_path, [Pace(), callback], steps=8, gradient_accumulation_steps=1,
                           report_to="tensorboard", logging_steps=2, fp16=True)
    use_cpu_grad_scaler(trainer)  # a real GradScaler whose scale overflows the first steps
    trainer.train()
    windows = [h for h in trainer.state.log_history if "amp/step" in h]
    _check_windows(windows, tmp_path / "hf.sqlite")
    events = _scalars(tmp_path / "tb")
    logged_at = {h["step"]: h for h in windows}
    for tag in ("amp/loss_scale", "amp/skipped_steps", "amp/grad_norm", "amp/loss"):
        got = events[f"train/{tag}"]  # the Trainer's TensorBoard callback prefixes train/
        assert set(got) == set(logged_at)
        for step, value in got.items():
            want = logged_at[step][tag]
            assert (math.isnan(value) and math.isnan(want)) or value == pytest.approx(want, rel=1e-6)


def test_lightning_tensorboard_logger_gets_the_amp_figures(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import TensorBoardLogger
    from ampwatch.integrations.lightning import AmpwatchCallback
    from test_integrations_lightning import Regressor, loader, make_trainer

    class Pace(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            time.sleep(0.2)  # a slower step, as a real one is: the writer commits before the next log

    logger = TensorBoardLogger(str(tmp_path / "tb"), name="lit", version=0)
    trainer = make_trainer([Pace(), AmpwatchCallback(str(tmp_path / "lit.sqlite"), flush_every_s=0.02)],
                           max_steps=12, accumulate_grad_batches=1, logger=logger, log_every_n_steps=2)
    trainer.fit(Regressor(), loader(batches=12))
    events = _scalars(tmp_path / "tb" / "lit" / "version_0")
    steps = sorted(events["amp/step"])
    assert len(steps) >= 4 and all(s % 2 == 0 for s in steps)
    windows = [{tag: events[tag][s] for tag in events if tag.startswith("amp/") and s in events[tag]} for s in steps]
    _check_windows(windows, tmp_path / "lit.sqlite")
