"""The Lightning callback on a tiny LightningModule on the CPU.

``precision="16-mixed"`` runs through the real MixedPrecision plugin with a CPU GradScaler whose huge
initial scale makes real skipped steps. Ground truth comes from a separate callback: parameter
snapshots around every optimizer step, the scale the plugin's scaler held, and the unscaled pre-clip
gradient norm seen in ``on_before_optimizer_step`` (Lightning unscales before that hook, clips after).
"""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

import ampwatch

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

from ampwatch.integrations.lightning import AmpwatchCallback  # noqa: E402


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 1e-2, fused: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.losses: list[float] = []
        self.fail_at: int = -1

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError(f"training_step failed at batch {batch_idx}")
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, fused=self.hparams.fused or None)


def loader(batches: int = 32, batch: int = 4) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batches * batch, 16, generator=g), torch.randn(batches * batch, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


class StepTruth(L.Callback):
    def __init__(self) -> None:
        self.skipped: list[bool] = []
        self.scales: list[float] = []
        self.norms: list[float] = []
        self.losses: list[float] = []
        self._seen = 0
        self._pending = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before = [p.detach().clone() for p in pl_module.parameters()]
        self._pending = True
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(scaler.get_scale() if scaler is not None else math.nan)
        window = pl_module.losses[self._seen:]  # training_step losses since the previous step
        self.losses.append(sum(window) / len(window))
        self._seen = len(pl_module.losses)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._pending:
            self.skipped.append(all(torch.equal(b, p) for b, p in zip(self.before, pl_module.parameters())))
            self._pending = False


def fp16_plugin(**kwargs) -> MixedPrecision:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=kwargs.pop("growth_interval", 3))
    return MixedPrecision("16-mixed", "cpu", scaler=scaler)


def make_trainer(callbacks, *, precision: str = "16-mixed", **kwargs) -> "L.Trainer":
    settings = dict(accelerator="cpu", devices=1, max_steps=24, accumulate_grad_batches=2, gradient_clip_val=1.0,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0)
    settings.update(kwargs)
    if precision == "16-mixed":
        settings["plugins"] = [fp16_plugin()]
    else:
        settings["precision"] = precision
    return L.Trainer(callbacks=callbacks, **settings)


@pytest.fixture(scope="module", params=["16-mixed", "bf16-mixed"])
def precision_run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    truth = StepTruth()
    # 28 samples of batch 4 = 7 batches per epoch: each epoch ends on a one-batch accumulation window
    trainer = make_trainer([AmpwatchCallback(str(tmp / "run.sqlite")), truth], precision=request.param)
    trainer.fit(Regressor(), loader(batches=7))
    return request.param, truth, ampwatch.load(tmp / "run.sqlite")


def test_one_row_per_optimizer_step_with_exact_skips_and_scale(precision_run):
    precision, truth, run = precision_run
    steps = run.steps
    assert list(steps["step"]) == list(range(24)) and len(truth.skipped) == 24
    assert list(steps["skipped"]) == truth.skipped
    if precision == "16-mixed":
        assert 4 <= sum(truth.skipped) < 24, "the scale storm must skip some steps, and not all"
        assert list(steps["loss_scale"]) == truth.scales
    else:
        assert not any(truth.skipped) and steps["loss_scale"].isna().all()
    assert list(steps["micro_batches"]) == ([2, 2, 2, 1] * 6)


def test_loss_is_the_mean_training_step_loss_of_each_window(precision_run):
    _, truth, run = precision_run
    # Lightning divides each loss by accumulate_grad_batches (also in the one-batch window); undone
    assert list(run.steps["loss"]) == pytest.approx(truth.losses, rel=1e-6)


def test_grad_norms_are_unscaled_and_before_clipping(precision_run):
    precision, truth, run = precision_run
    pairs = [(r, t) for r, t, s in zip(run.steps["grad_norm"], truth.norms, truth.skipped) if not s]
    assert len(pairs) >= 6
    assert [r for r, _ in pairs] == pytest.approx([t for _, t in pairs], rel=1e-4)
    assert max(t for _, t in pairs) > 1.0, "clipping to 1.0 must have had something to clip"
    skipped = run.steps[run.steps["skipped"]]
    assert not skipped["grad_norm"].apply(math.isfinite).any()


def test_run_info_names_the_framework_and_keeps_trainer_settings(precision_run):
    precision, _, run = precision_run
    info = run.info
    assert info["framework"] == "lightning" and info["status"] == "finished"
    assert info["amp_dtype"] == ("float16" if precision == "16-mixed" else "bfloat16")
    assert info["scaler_enabled"] == (precision == "16-mixed")
    config = info["config"]
    assert config["precision"] == precision and config["accumulate_grad_batches"] == 2
    assert config["gradient_clip_val"] == 1.0 and config["hparams"]["lr"] == 1e-2


def test_two_callbacks_a_reused_trainer_and_a_second_trainer(tmp_path):
    a, b = AmpwatchCallback(str(tmp_path / "a.sqlite")), AmpwatchCallback(str(tmp_path / "b.sqlite"), localize=False)
    truth = StepTruth()
    trainer = make_trainer([a, b, truth], max_steps=10)
    model = Regressor()
    trainer.fit(model, loader())
    trainer.fit_loop.epoch_loop.max_steps = 16
    trainer.fit(model, loader())  # the same Trainer again: continues to step 16 in new files
    other_truth = StepTruth()
    make_trainer([AmpwatchCallback(str(tmp_path / "c.sqlite")), other_truth], max_steps=6,
                 precision="bf16-mixed").fit(Regressor(lr=3e-3), loader())
    for name, rows in {"a": range(0, 10), "b": range(0, 10), "a-2": range(10, 16), "b-2": range(10, 16)}.items():
        run = ampwatch.load(tmp_path / f"{name}.sqlite")
        assert run.info["status"] == "finished"
        assert list(run.steps["skipped"]) == [truth.skipped[i] for i in rows]
        assert list(run.steps["loss"]) == pytest.approx([truth.losses[i] for i in rows], rel=1e-6)
    other = ampwatch.load(tmp_path / "c.sqlite")
    assert other.info["config"]["hparams"]["lr"] == 3e-3
    assert list(other.steps["loss"]) == pytest.approx(other_truth.losses, rel=1e-6)


def test_an_exception_in_fit_closes_the_run_as_crashed(tmp_path):
    model = Regressor()
    model.fail_at = 9  # the tenth batch: four whole steps done
    with pytest.raises(RuntimeError, match="failed at batch 9"):
        make_trainer([AmpwatchCallback(str(tmp_path / "run.sqlite"))]).fit(model, loader())
    run = ampwatch.load(tmp_path / "run.sqlite")
    assert run.info["status"] == "crashed" and "failed at batch 9" in run.info["error"]
    # four whole steps, and the fifth as far as it got (its first micro-batch: record/unfinished.py)
    assert len(run.steps) == 5 and run.notices[["step", "code"]].values.tolist() == [[4, "step-unfinished"]]
    assert run.steps["loss"].iloc[:4].notna().all()


def test_the_sample_run_records_through_the_callback(tmp_path):
    from ampwatch.samples.lightning_sample import record_sample
    path = record_sample(tmp_path / "lightning_fp16.sqlite", steps=12)
    run = ampwatch.load(path)
    assert run.info["framework"] == "lightning" and run.info["status"] == "finished"
    assert len(run.steps) == 12 and run.steps["skipped"].any()


WITHOUT_LIGHTNING = """
import sys
sys.modules["lightning"] = None  # as if not installed
try:
    from ampwatch.integrations.lightning import AmpwatchCallback
except ImportError as exc:
    print(exc)
"""


def test_without_lightning_one_clear_error_names_the_extra():
    out = subprocess.run([sys.executable, "-c", WITHOUT_LIGHTNING], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out.count("\n") == 0 and "pip install 'ampwatch[lightning]'" in out


def test_a_fit_resumed_from_a_checkpoint_goes_on_with_the_trainers_step_numbers(tmp_path):
    """``fit(ckpt_path=...)``: the callback attaches after Lightning restored the checkpoint and
    numbers the rows from its global step. Ground truth: the trainer's global step before each
    optimizer step, and the losses its training_step returned."""
    trainer = make_trainer([AmpwatchCallback(str(tmp_path / "run.sqlite"))], max_steps=6)
    trainer.fit(Regressor(), loader())
    trainer.save_checkpoint(tmp_path / "six.ckpt")
    before = (tmp_path / "run.sqlite").read_bytes()

    class Steps(L.Callback):
        def __init__(self) -> None:
            self.at: list[int] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.at.append(trainer.global_step)

    truth, steps = StepTruth(), Steps()
    # the same script, so the same path: the run before keeps its file, this one gets a sibling
    callback = AmpwatchCallback(str(tmp_path / "run.sqlite"))
    make_trainer([callback, truth, steps], max_steps=10).fit(Regressor(), loader(), ckpt_path=str(tmp_path / "six.ckpt"))
    assert steps.at == [6, 7, 8, 9]  # the premise: the trainer went on from step 6
    assert sorted(p.name for p in tmp_path.glob("*.sqlite")) == ["run-2.sqlite", "run.sqlite"]
    assert (tmp_path / "run.sqlite").read_bytes() == before
    run = ampwatch.load(tmp_path / "run-2.sqlite")
    assert list(run.steps["step"]) == steps.at
    assert list(run.steps["loss"]) == pytest.approx(truth.losses, rel=1e-6)
    assert list(run.steps["skipped"]) == truth.skipped
