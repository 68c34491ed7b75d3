"""Step-time overhead of ``ampwatch.integrations.lightning.AmpwatchCallback`` on a Lightning run.

Three variants, interleaved in rotated order, one torch thread, the same LightningModule, data and
``precision="16-mixed"`` CPU plugin throughout: ``base`` (no callback), ``empty_callback`` (a
callback that does nothing: Lightning's own cost of dispatching every hook to one more callback) and
``ampwatch`` (the callback with default options). Each block is one ``Trainer.fit`` of ``--steps`` optimizer steps;
a step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, unscale,
clip, scaler step and update, and every hook of the callback), the block's first step dropped.
Reported: the median step time per variant and the median over rounds of the paired ratio.

    python bench/overhead_lightning.py                       # gpt-small, 12 rounds x 20 steps
    python bench/overhead_lightning.py --workload mlp --rounds 30
"""
from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import lightning.pytorch as L
from lightning.pytorch.plugins import MixedPrecision

import ampwatch.record.watch  # noqa: F401  (imported now, so the log level set below sticks)
from ampwatch.samples.models import TinyGPT
from ampwatch.integrations.lightning import AmpwatchCallback


class Workload(L.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        if name == "mlp":
            self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
            self.x, self.y, self.classes = torch.randn(64, 64), torch.randint(0, 10, (64,)), 10
        else:  # gpt-small, as in bench/overhead.py: 2 layers, d_model 128, seq 64, batch 8
            self.net = TinyGPT(vocab=256, d=128, layers=2, heads=4, seq=64)
            self.x, self.y, self.classes = torch.randint(0, 256, (8, 64)), torch.randint(0, 256, (8, 64)), 256

    def training_step(self, batch, batch_idx):
        out = self.net(self.x)
        return F.cross_entropy(out.float().reshape(-1, self.classes), self.y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(100_000, 1)), batch_size=1)


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._t0)


def block(module: Workload, steps: int, variant: str, folder: Path) -> float:
    """One fit of ``steps`` steps; the median step time, first step dropped."""
    timer = StepTimer()
    callbacks = {"base": [], "empty_callback": [L.Callback()],
                 "ampwatch": [AmpwatchCallback(str(folder / "run.sqlite"))]}[variant]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps + 1, gradient_clip_val=1.0,
                        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
                        callbacks=callbacks + [timer], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return statistics.median(timer.times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="gpt-small", choices=["gpt-small", "mlp"])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per block (one fit)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric", "ampwatch"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    module = Workload(args.workload)
    names = ["base", "empty_callback", "ampwatch"]
    medians: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:  # warm-up: allocator, autocast caches
            block(module, 3, name, Path(tmp))
        for r in range(args.rounds):
            for name in names[r % 3:] + names[:r % 3]:
                medians[name].append(block(module, args.steps, name, Path(tmp)))
    base = medians["base"]
    print(f"\n## Lightning {L.__version__} {args.workload}: {args.rounds} rounds x {args.steps} steps, "
          f"16-mixed CPU, torch {torch.__version__}, 1 thread\n")
    print("| variant | median step ms | median paired ratio | delta ms/step |")
    print("|---|---|---|---|")
    for name, values in medians.items():
        ratio = statistics.median(v / b for v, b in zip(values, base))
        delta = statistics.median(v - b for v, b in zip(values, base)) * 1e3
        print(f"| {name} | {statistics.median(values) * 1e3:.2f} | {ratio:.3f} | {delta:+.2f} |")


if __name__ == "__main__":
    main()
