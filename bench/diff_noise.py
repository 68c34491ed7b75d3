"""How far rounding alone moves the figures `ampwatch diff` compares: the MLP of tests/helpers/loops.py
(16-32-32-4, SGD lr 0.01 momentum 0.9, batches of 64) trained from one seed in float16 (GradScaler at
2**10), bfloat16 and float32 (no scaler), recorded with layer_every=1, then each pair compared.

Prints, per pair, the largest relative difference of each figure over the first --steps steps (over
the seeds), measured the way ampwatch.doctor.diff measures it, and whether `diff` says the pair parts
at its default tolerance.

    python bench/diff_noise.py [--seeds 0,1,2,3] [--steps 3]
    python bench/diff_noise.py --seeds 0 --steps 60
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import ampwatch
from ampwatch.doctor.diff import diff_runs, rel_diff

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
PAIRS = (("float16", "float32"), ("bfloat16", "float32"), ("float16", "bfloat16"))
FIGURES = ("loss", "grad_norm", "layer grad_norm (vs G)", "layer grad_norm (own)", "module forward",
           "module backward")


def train(path: Path, dtype: str, seed: int, steps: int) -> ampwatch.Run:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if dtype == "float16" else None
    watch = ampwatch.attach(model, opt, scaler, path=str(path), layer_every=1, overwrite=True)
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + step)
        x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
        with torch.autocast("cpu", dtype=DTYPES[dtype], enabled=dtype != "float32"):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            watch.log(loss=loss)
            opt.step()
        opt.zero_grad()
    watch.close()
    return ampwatch.load(watch.path)


def largest(a: ampwatch.Run, b: ampwatch.Run) -> dict[str, float]:
    s = a.steps.merge(b.steps, on="step", suffixes=("_a", "_b"))
    whole = np.fmax(s["grad_norm_a"].abs(), s["grad_norm_b"].abs())
    lay = a.layers.merge(b.layers, on=["step", "name"], suffixes=("_a", "_b"))
    lay_whole = lay["step"].map(dict(zip(s["step"], whole)))
    mod = a.modules.merge(b.modules, on=["step", "module", "phase"], suffixes=("_a", "_b"))
    scales = [mod["step"].map(run.steps.set_index("step")["loss_scale"]).fillna(1.0) for run in (a, b)]
    back = mod["phase"] == "backward"
    return {
        "loss": rel_diff(s["loss_a"], s["loss_b"]).max(),
        "grad_norm": rel_diff(s["grad_norm_a"], s["grad_norm_b"]).max(),
        "layer grad_norm (vs G)": rel_diff(lay["grad_norm_a"], lay["grad_norm_b"], floor=lay_whole).max(),
        "layer grad_norm (own)": rel_diff(lay["grad_norm_a"], lay["grad_norm_b"]).max(),
        "module forward": rel_diff(mod.loc[~back, "amax_a"], mod.loc[~back, "amax_b"]).max(),
        "module backward": rel_diff(mod.loc[back, "amax_a"] / scales[0][back],
                                    mod.loc[back, "amax_b"] / scales[1][back]).max(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2,3", help="comma-separated seeds")
    ap.add_argument("--steps", type=int, default=3, help="steps per run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    worst = {pair: dict.fromkeys(FIGURES, 0.0) for pair in PAIRS}
    verdicts = {pair: [] for pair in PAIRS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            runs = {d: train(Path(tmp) / f"{d}_{seed}.sqlite", d, seed, args.steps) for d in DTYPES}
            for pair in PAIRS:
                found = largest(runs[pair[0]], runs[pair[1]])
                worst[pair] = {f: max(worst[pair][f], found[f]) for f in FIGURES}
                d = diff_runs(runs[pair[0]], runs[pair[1]])
                verdicts[pair].append(f"seed {seed}: " + (f"parts at step {d.parting_step}" if d.parted
                                                          else f"no parting (rtol {d.rtol:.3g})"))
    print(f"largest relative difference over {args.steps} step(s), seeds {args.seeds}")
    print("| pair | " + " | ".join(FIGURES) + " |")
    print("| --- " * (len(FIGURES) + 1) + "|")
    for pair in PAIRS:
        print(f"| {pair[0]} vs {pair[1]} | " + " | ".join(f"{worst[pair][f]:.1e}" for f in FIGURES) + " |")
    for pair in PAIRS:
        print(f"{pair[0]} vs {pair[1]}: " + "; ".join(verdicts[pair]))


if __name__ == "__main__":
    main()
