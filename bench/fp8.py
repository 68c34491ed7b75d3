"""What recording an fp8 model's casts costs: a healthy step and a ``layer_every`` step.

A bf16 MLP converted with torchao's ``convert_to_float8_training`` (tensorwise), AdamW, trained
on the CPU (one torch thread) through ``torch._scaled_mm``. Variants run interleaved (order rotated
each round), each round a whole run per variant; the median step time of each run, then the median over rounds:

    plain         no ampwatch
    watch         ampwatch attached, fp8 recognisers off (what the run cost before fp8 support)
    watch+fp8     ampwatch attached, fp8 layers measured

once with ``layer_every`` larger than the run (every step but the first is a healthy step: what
fp8 support adds there should be nothing) and once with ``layer_every=1`` (every step measures
every cast). Then ops per step on the accelerator path (``AMPWATCH_CPU_AS_ACCELERATOR=1``,
counted as bench/ops.py counts them), in a subprocess.

    python bench/fp8.py [--rounds 5] [--steps 40] [--width 512]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ampwatch  # noqa: E402
from ampwatch.record import fp8  # noqa: E402

logging.getLogger("ampwatch").setLevel(logging.WARNING)


def model(width: int) -> nn.Module:
    from torchao.float8 import convert_to_float8_training
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.GELU(),
                      nn.Linear(width, width)).to(torch.bfloat16)
    return convert_to_float8_training(m)


def run(width: int, steps: int, variant: str, layer_every: int, folder: Path, counter=None) -> list[float]:
    m = model(width)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randn(64, width, dtype=torch.bfloat16)
    y = torch.randn(64, width, dtype=torch.bfloat16)
    saved = list(fp8.RECOGNISERS)
    if variant == "watch":
        fp8.RECOGNISERS.clear()
    watch = None
    try:
        if variant != "plain":
            watch = ampwatch.attach(m, opt, path=str(folder / f"{variant}-{time.monotonic_ns()}.sqlite"),
                                    layer_every=layer_every)
        times = []
        for i in range(steps):
            mode = counter(i) if counter else None
            t = time.perf_counter()
            if mode:
                mode.__enter__()
            loss = (m(x).float() - y.float()).pow(2).mean()
            loss.backward()
            if watch is not None:
                watch.log(loss=loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if mode:
                mode.__exit__(None, None, None)
            times.append(time.perf_counter() - t)
        return times
    finally:
        if watch is not None:
            watch.close()
        fp8.RECOGNISERS[:] = saved


def ops(width: int) -> dict:
    """Ops per step on the accelerator path: a healthy step (step 2 of layer_every=1000) and a
    detail step (layer_every=1), with and without fp8 measurement."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ops import OpCounter
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for label, every, at in (("healthy", 1000, 2), ("layer_every", 1, 2)):
            for variant in ("plain", "watch", "watch+fp8"):
                seen = {}

                def counter(i: int, seen=seen):
                    if i == at:
                        seen["c"] = OpCounter()
                        return seen["c"]
                    return None
                run(width, at + 1, variant, every, Path(d), counter)
                out[f"{label} {variant}"] = sum(seen["c"].ops.values())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--ops-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.ops_only:
        print(json.dumps(ops(args.width)))
        return
    variants = ("plain", "watch", "watch+fp8")
    with tempfile.TemporaryDirectory() as d:
        for label, every in (("healthy steps (layer_every > steps)", 10 ** 9), ("every step measured (layer_every=1)", 1)):
            medians: dict[str, list[float]] = {v: [] for v in variants}
            for r in range(args.rounds):
                for v in variants[r % 3:] + variants[:r % 3]:  # rotated: no variant always runs first
                    times = run(args.width, args.steps, v, every, Path(d))[3:]  # past step 0 and warm-up
                    medians[v].append(statistics.median(times))
            ms = {v: 1e3 * statistics.median(m) for v, m in medians.items()}
            print(f"{label}: " + ", ".join(f"{v} {ms[v]:.2f} ms" for v in variants)
                  + f"; fp8 measurement adds {ms['watch+fp8'] - ms['watch']:+.2f} ms/step "
                  f"({100 * (ms['watch+fp8'] / ms['watch'] - 1):+.1f}%)")
    env = dict(os.environ, AMPWATCH_CPU_AS_ACCELERATOR="1")
    res = subprocess.run([sys.executable, __file__, "--ops-only", "--width", str(args.width)], env=env,
                         capture_output=True, text=True, check=True)
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    print("ops per step, accelerator path: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
