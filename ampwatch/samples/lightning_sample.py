"""A sample run recorded through the Lightning callback, for ``ampwatch demo`` (needs lightning).

TinyGPT from :mod:`ampwatch.samples.models` wrapped in a LightningModule, ``16-mixed`` on the CPU through the
real MixedPrecision plugin, ``accumulate_grad_batches=2``, ``gradient_clip_val=1.0``. The GradScaler
starts at 2**24, so the first steps skip while it backs off, and every ``growth_interval`` clean steps
it tries a larger scale. Fixed seeds, one torch thread: the same file every time on one torch build.
"""
from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Union

import torch
from torch.nn import functional as F

from .models import TinyGPT, batches
from ..integrations import require

SAMPLE_STEPS = 200
_VOCAB, _SEQ, _MICRO_BATCH, _ACCUMULATE = 64, 32, 4, 2


def _module_class(pl: Any) -> type:
    class TinyGPTModule(pl.LightningModule):
        def __init__(self, lr: float = 3e-3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.model = TinyGPT(vocab=_VOCAB, seq=_SEQ)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.model(x)
            return F.cross_entropy(logits.float().view(-1, _VOCAB), y.reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)

    return TinyGPTModule


def _loader(steps: int, seed: int) -> torch.utils.data.DataLoader:
    stream = batches(_VOCAB, _SEQ, _MICRO_BATCH, seed)
    pairs = [next(stream) for _ in range(steps * _ACCUMULATE)]
    x = torch.cat([p[0] for p in pairs])
    y = torch.cat([p[1] for p in pairs])
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=_MICRO_BATCH)


@contextmanager
def _quiet() -> Iterator[None]:
    """Lightning announces devices and tips at INFO: keep ``ampwatch demo``'s output to its own."""
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"lightning\.")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def record_sample(path: Union[str, Path], steps: int = SAMPLE_STEPS, seed: int = 0) -> Path:
    """Train TinyGPT for ``steps`` optimizer steps under Lightning with the callback; returns the run
    file. ``path`` is replaced if it exists. About 200 steps in well under a minute on one CPU thread."""
    pl = require("lightning.pytorch", "lightning")
    from lightning.pytorch.plugins import MixedPrecision

    from ..integrations.lightning import AmpwatchCallback

    path = Path(path)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    module = _module_class(pl)()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=50)
    callback = AmpwatchCallback(str(path), name=path.stem,
                                config={"model": "TinyGPT(d=64, layers=2)", "micro_batch": _MICRO_BATCH})
    with _quiet():
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=_ACCUMULATE,
                             gradient_clip_val=1.0, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
                             callbacks=[callback], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, deterministic=True)
        trainer.fit(module, _loader(steps, seed))
    return path


__all__ = ["record_sample", "SAMPLE_STEPS"]
