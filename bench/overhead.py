"""Step-time overhead of ampwatch against an unwatched loop, and against other debuggers.

Variants run interleaved in blocks (A B C ... then rotated order), one torch thread, the same model,
optimizer and batch throughout, so the machine's noise hits every variant alike. Reported: the
median step time per variant and the median over rounds of the paired ratio variant/baseline.

    python bench/overhead.py --workload mlp --rounds 30 --steps 20
    python bench/overhead.py --workload gpt --rounds 5 --steps 2      # the reference transformer
    python bench/overhead.py --workload mlp --variants base,ampwatch,duo,anomaly
    python bench/overhead.py --lightning --workload gpt-small --rounds 12 --steps 20   # the Lightning callback
    python bench/overhead.py --workload mlp --variants base,ampwatch,ampwatch_mirror --flush-every-s 0.05
        # mirroring to a TensorBoard log folder (attach mirror=); a short flush interval makes the writer
        # thread commit, and so mirror, during the timed steps and not only at close

Workloads: ``gpt`` = GPT-like, 4 layers, d_model 256, seq 128, batch 16 (the reference transformer);
``gpt-small`` = 2 layers, d_model 128, seq 64, batch 8; ``mlp`` = 3-layer MLP (64-128-128-10),
batch 64. fp16 autocast + ``GradScaler("cpu")``, unscale_ + clip_grad_norm_ as in the README loop.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

import ampwatch
from ampwatch.samples.models import TinyGPT


def make_workload(name: str):
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
        x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
        loss_fn = lambda out: F.cross_entropy(out.float(), y)  # noqa: E731
    else:
        vocab, d, layers, heads, seq, batch = (256, 256, 4, 8, 128, 16) if name == "gpt" else (256, 128, 2, 4, 64, 8)
        model = TinyGPT(vocab=vocab, d=d, layers=layers, heads=heads, seq=seq)
        x, y = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
        loss_fn = lambda out: F.cross_entropy(out.float().view(-1, vocab), y.reshape(-1))  # noqa: E731
    return model, x, loss_fn


class Trainer:
    """One model + optimizer + scaler; ``block`` runs k timed steps under a variant's context."""

    def __init__(self, model: nn.Module, x: torch.Tensor, loss_fn: Callable) -> None:
        self.model, self.x, self.loss_fn = model, x, loss_fn
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler("cpu")
        self.anomaly = False

    def step(self) -> float:
        t0 = time.perf_counter()
        guard = torch.autograd.detect_anomaly(check_nan=True) if self.anomaly else contextlib.nullcontext()
        with guard:
            with torch.autocast("cpu", dtype=torch.float16):
                out = self.model(self.x)
            self.scaler.scale(self.loss_fn(out)).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def variants(folder: Path, base: Trainer, duo: Trainer | None,
             flush_every_s: float | None = None) -> dict[str, Callable[[int], list[float]]]:
    counter = iter(range(10 ** 9))
    flush = {} if flush_every_s is None else {"flush_every_s": flush_every_s}

    def plain(trainer: Trainer) -> Callable[[int], list[float]]:
        return lambda k: [trainer.step() for _ in range(k)]

    def watched(**options) -> Callable[[int], list[float]]:
        def run(k: int) -> list[float]:
            path = folder / f"run{next(counter)}.sqlite"
            extra = {"mirror": str(folder / f"tb_{path.stem}")} if options.get("mirror") == "tensorboard" else {}
            with ampwatch.attach(base.model, base.opt, base.scaler, path=str(path), **flush, **dict(options, **extra)):
                return [base.step() for _ in range(k)]
        return run

    def anomaly(k: int) -> list[float]:
        base.anomaly = True
        try:
            return [base.step() for _ in range(k)]
        finally:
            base.anomaly = False

    table = {"base": plain(base), "ampwatch": watched(), "ampwatch_layer_every_1": watched(layer_every=1),
             "ampwatch_no_localize": watched(localize=False), "anomaly": anomaly,
             "ampwatch_mirror": watched(mirror="tensorboard")}
    if duo is not None:
        table["duo"] = plain(duo)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="mlp", choices=["mlp", "gpt", "gpt-small"])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default="base,ampwatch,ampwatch_layer_every_1,ampwatch_no_localize,duo,anomaly")
    ap.add_argument("--flush-every-s", type=float, default=None,
                    help="the watched variants' flush_every_s (default: ampwatch's default)")
    ap.add_argument("--lightning", action="store_true",
                    help="measure the Lightning callback instead (runs bench/overhead_lightning.py)")
    args = ap.parse_args()
    if args.lightning:  # same flags; the Lightning loop lives in its own script
        import runpy
        import sys
        sys.argv = [str(Path(__file__).with_name("overhead_lightning.py")), "--rounds", str(args.rounds),
                    "--steps", str(args.steps), "--workload", "mlp" if args.workload == "mlp" else "gpt-small"]
        runpy.run_path(sys.argv[0], run_name="__main__")
        return
    torch.set_num_threads(1)
    import ampwatch.record.watch  # noqa: F401  (installs ampwatch's log handler, which we then quieten)
    logging.getLogger("ampwatch").setLevel(logging.WARNING)  # one "recording to" line per block is noise
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    model, x, loss_fn = make_workload(args.workload)
    base = Trainer(model, x, loss_fn)
    wanted = args.variants.split(",")
    duo = None
    if "duo" in wanted:
        try:
            from transformers.debug_utils import DebugUnderflowOverflow
        except ImportError:
            print("# duo skipped: transformers is not installed (pip install transformers)")
        else:
            # DUO keeps no hook handles (it cannot be detached), so it gets an identical copy of its own.
            duo = Trainer(copy.deepcopy(model), x, loss_fn)
            DebugUnderflowOverflow(duo.model)
    with tempfile.TemporaryDirectory() as tmp:
        table = variants(Path(tmp), base, duo, args.flush_every_s)
        names = [n for n in wanted if n in table]
        for name in names:  # warm-up: allocator, autocast caches, first-step skips
            table[name](args.warmup)
        medians: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                medians[name].append(statistics.median(table[name](args.steps)))
    report(args, names, medians)


def report(args, names: list[str], medians: dict[str, list[float]]) -> None:
    base = medians["base"]
    print(f"\n## {args.workload}: {args.rounds} rounds x {args.steps} steps, torch {torch.__version__}, 1 thread\n")
    print("| variant | median step ms | median paired ratio | delta ms/step |")
    print("|---|---|---|---|")
    for name in names:
        ms = statistics.median(medians[name]) * 1e3
        ratio = statistics.median(v / b for v, b in zip(medians[name], base))
        delta = statistics.median(v - b for v, b in zip(medians[name], base)) * 1e3
        print(f"| {name} | {ms:.2f} | {ratio:.3f} | {delta:+.2f} |")


if __name__ == "__main__":
    main()
