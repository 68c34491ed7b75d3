"""ampwatch under torch.compile: graph breaks, graphs and compiled step time, with and without it.

The reference GPT (4 layers, d_model 256, seq 128, vocab 2000; batch by --batch), fp16 autocast,
GradScaler, AdamW, the README loop. Each variant compiles a fresh copy of the same model; step
times are the median of the steps after --warmup, variants interleaved in rounds (A B A B),
one torch thread. Graph breaks and graphs come from Dynamo's counters.

    python bench/compile.py                          # inductor
    python bench/compile.py --backend aot_eager --steps 6
"""
from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ampwatch  # noqa: E402
from ampwatch.samples.models import TinyGPT  # noqa: E402

VOCAB, SEQ = 2000, 128


class Variant:
    def __init__(self, base: torch.nn.Module, watched: bool, backend: str, batch: int, folder: str) -> None:
        breaks0, graphs0 = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
        self.model = copy.deepcopy(base)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler("cpu")
        self.watch = ampwatch.attach(self.model, self.opt, self.scaler, path=f"{folder}/run.sqlite") if watched else None
        self.net = torch.compile(self.model, backend=backend)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        self.y = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        t0 = time.perf_counter()
        self.step()
        self.first_s = time.perf_counter() - t0
        self.breaks = sum(counters["graph_break"].values()) - breaks0  # this variant's own compile
        self.graphs = counters["stats"]["unique_graphs"] - graphs0
        self.times: list[float] = []

    def step(self) -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.float16):
            out = self.net(self.x)
        loss = F.cross_entropy(out.float().view(-1, VOCAB), self.y.reshape(-1))
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    logging.getLogger("ampwatch").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    # both variants are instances of one class: the watched copy's graphs are cached apart from the
    # plain copy's all the same (its forward runs under a wrapper with a code object of its own)
    torch.manual_seed(0)
    base = TinyGPT(vocab=VOCAB, d=256, layers=4, heads=8, seq=SEQ)
    folder = tempfile.mkdtemp()
    plain = Variant(base, False, args.backend, args.batch, folder + "/a")
    watched = Variant(base, True, args.backend, args.batch, folder + "/b")
    for v in (plain, watched):
        for _ in range(args.warmup):
            v.step()
    ratios = []
    for r in range(args.rounds):
        order = (plain, watched) if r % 2 == 0 else (watched, plain)
        got = {id(v): statistics.median(v.step() for _ in range(args.steps)) for v in order}
        plain.times.append(got[id(plain)])
        watched.times.append(got[id(watched)])
        ratios.append(got[id(watched)] / got[id(plain)])
    print(f"torch {torch.__version__}, backend={args.backend}, reference GPT batch {args.batch}, one thread")
    for name, v in (("without ampwatch", plain), ("with ampwatch", watched)):
        print(f"  {name:17} graph breaks {v.breaks}, graphs {v.graphs}, first step {v.first_s:.1f} s, "
              f"step {statistics.median(v.times) * 1e3:.1f} ms")
    print(f"  median paired ratio {statistics.median(ratios):.3f}x over {args.rounds} rounds")
    if watched.watch is not None:
        watched.watch.close()


if __name__ == "__main__":
    main()
