"""Python calls ampwatch adds to a healthy step: a count, the same on any machine.

Step times on a shared 2-core machine move by several percent between runs and between two copies
of one model (bench/hostcost.py's "base again"), more than ampwatch adds between observed steps. A
count does not move: cProfile counts every Python function call and every C function called from
Python during ``--steps`` healthy steps (between ``layer_every`` steps) of GPT-2 small's module tree
(bench/hostcost.py's model and loop, fp16 + GradScaler, AdamW, clip, the accelerator path), once
without ampwatch and once with it, each in its own copy, and prints the calls per step of each and
the functions whose call counts differ. Times under cProfile are not step times, so none are printed.

    python bench/pycalls.py
    python bench/pycalls.py --compile inductor     # the compiled copies: the graph between observed steps
    python bench/pycalls.py --fused                # AdamW(fused=True)
"""
from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import sys
import tempfile
from pathlib import Path

os.environ["AMPWATCH_CPU_AS_ACCELERATOR"] = "1"  # before ampwatch is imported

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ampwatch  # noqa: E402
import hostcost  # noqa: E402


def calls(watched: bool, args: argparse.Namespace) -> tuple[float, dict]:
    """Calls per healthy step, and per function (file, line, name) its calls per step."""
    # the unwatched copy's forward runs under a code object of its own (own_code), so compiled it
    # has its own Dynamo cache, as in a process without ampwatch
    model, x = hostcost.model_and_batch(own_code=not watched)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused)
    hostcost.state_now(opt)
    scaler = torch.amp.GradScaler("cpu")
    watch = ampwatch.attach(model, opt, scaler, path=f"{tempfile.mkdtemp()}/run.sqlite",
                            layer_every=10 ** 6) if watched else None  # step 0 observed, then none
    net = torch.compile(model, backend=args.compile) if args.compile else model
    step = hostcost.make_step(model, net, x, opt, scaler, watch)
    for _ in range(args.warmup):
        step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        step()
    profile.disable()
    if watch is not None:
        watch.close()
    stats = pstats.Stats(profile)
    per_function = {(os.path.basename(f), line, name): counts[1] / args.steps
                    for (f, line, name), counts in stats.stats.items()}  # type: ignore[attr-defined]
    return stats.total_calls / args.steps, per_function  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps before counting (the first is observed)")
    parser.add_argument("--compile", metavar="BACKEND", help="torch.compile both copies (inductor, aot_eager)")
    parser.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    parser.add_argument("--top", type=int, default=25, help="how many differing functions to list")
    args = parser.parse_args()
    logging.getLogger("ampwatch").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    base, base_fns = calls(False, args)
    watched, watched_fns = calls(True, args)
    mode = f"torch.compile ({args.compile})" if args.compile else "eager"
    print(f"## Python calls per healthy step, GPT-2 small's module tree, {mode}, AdamW"
          f"{'(fused=True)' if args.fused else ''}, fp16 + GradScaler, clip, accelerator path, torch "
          f"{torch.__version__}, {args.steps} steps\n")
    print(f"without ampwatch {base:,.0f}; with ampwatch {watched:,.0f}; added **{watched - base:+,.0f}** "
          f"({watched / base - 1:+.1%})\n")
    differ = [(watched_fns.get(k, 0.0) - base_fns.get(k, 0.0), k) for k in set(base_fns) | set(watched_fns)]
    differ = sorted((d for d in differ if abs(d[0]) > 1e-9), key=lambda d: (-abs(d[0]), d[1]))
    print("| calls added per step | function |\n|---|---|")
    for added, (file, line, name) in differ[:args.top]:
        where = name if file == "~" else f"{file}:{line} {name}"
        print(f"| {added:+.1f} | `{where}` |")


if __name__ == "__main__":
    main()
