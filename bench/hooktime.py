"""Where ampwatch's host time goes: the time spent inside each of its entry points during real steps.

``overhead.py`` gives the total a step pays; this breaks it down. Every place where training calls
into ampwatch (module hooks, gradient hooks, the backward-end trigger, the scaler and optimizer
moments, the step end) is wrapped with a timer, and the median over steps of the time spent inside
each is printed, with the step's own median. Inside a training step Python runs ~3x slower than in
a tight loop (cold caches), which is why this times the real thing rather than micro-benchmarks.

The wrappers cost ~1 us a call themselves, so the step time printed is a little above
``overhead.py``'s. Reductions (``_flush``, ``fold_into``) are listed on their own and are also
inside the hook that triggered them; other entries do not nest.

    python bench/hooktime.py                          # the MLP, CPU path, steps between layer_every steps
    python bench/hooktime.py --localize off           # without module observation
    python bench/hooktime.py --workload gpt2-tree --path accelerator   # bench/hostcost.py's model
"""
from __future__ import annotations

import argparse
import collections
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

PATH_ARG = "accelerator" if "--path" in sys.argv and sys.argv[sys.argv.index("--path") + 1] == "accelerator" else "cpu"
if PATH_ARG == "accelerator":
    os.environ["AMPWATCH_CPU_AS_ACCELERATOR"] = "1"  # before ampwatch is imported

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ampwatch  # noqa: E402
from ampwatch.record import backward as backward_end  # noqa: E402
from ampwatch.record import batched  # noqa: E402
from ampwatch.record import hoststats
from ampwatch.record import observe
from ampwatch.record import watch

ENTRY_POINTS: list[tuple[Any, tuple[str, ...]]] = [
    (observe.ModuleObserver, ("_before", "_after", "_on_grad")),
    (backward_end.BackwardEnd, ("_on_output", "_on_parameter", "_on_output_grad", "_on_end")),
    (watch.Watch, ("on_scale", "on_unscaled", "before_scaler_step", "after_scaler_step", "before_update",
                   "end_step", "_before_optimizer_step", "_after_optimizer_step", "on_clip")),
    (batched.BatchedReducer, ("_flush", "fold_into")),
    (hoststats.HostQueue, ("flush",)),
]
NESTED = {"_flush", "fold_into", "flush"}


def instrument(spent: dict[str, float]) -> None:
    """Wrap every entry point (at class level, before attach binds them) with a timer."""
    clock = time.perf_counter
    for cls, names in ENTRY_POINTS:
        for name in names:
            original = getattr(cls, name)

            def timed(*args: Any, _original: Callable = original, _name: str = name, **kwargs: Any) -> Any:
                start = clock()
                try:
                    return _original(*args, **kwargs)
                finally:
                    spent[_name] += clock() - start
            setattr(cls, name, timed)


def trainer(name: str) -> Any:
    """overhead.py's Trainer (the README loop: AdamW, GradScaler, unscale_, clip) on ``name``."""
    from overhead import Trainer, make_workload
    if name == "gpt2-tree":
        from hostcost import model_and_batch
        model, x = model_and_batch()
        return Trainer(model, x, lambda out: F.cross_entropy(out.logits.float().view(-1, out.logits.size(-1)),
                                                             x.view(-1)))
    return Trainer(*make_workload(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["mlp", "gpt-small", "gpt2-tree"], default="mlp")
    ap.add_argument("--path", choices=["cpu", "accelerator"], default="cpu")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--localize", choices=["on", "off"], default="on")
    ap.add_argument("--layer-every", type=int, default=10 ** 9,
                    help="default: never after step 0, so every timed step is a healthy in-between step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("ampwatch").setLevel(logging.WARNING)
    spent: dict[str, float] = collections.defaultdict(float)
    instrument(spent)
    run = trainer(args.workload)

    per_step: dict[str, list[float]] = collections.defaultdict(list)
    totals = []
    with ampwatch.attach(run.model, run.opt, run.scaler, path=f"{tempfile.mkdtemp()}/run.sqlite",
                         localize=args.localize == "on", layer_every=args.layer_every):
        for _ in range(5):  # the learning step and the first steady ones
            run.step()
        for _ in range(args.steps):
            spent.clear()
            totals.append(run.step())
            for name in {n for _, names in ENTRY_POINTS for n in names}:
                per_step[name].append(spent.get(name, 0.0))
    print(f"\n## {args.workload}, {args.path} path, localize {args.localize}, torch {torch.__version__}, "
          f"{args.steps} steps, 1 thread: step median {statistics.median(totals) * 1e3:.3f} ms\n")
    print("| entry point | median us/step |")
    print("|---|---|")
    rows = sorted(((statistics.median(v) * 1e6, n) for n, v in per_step.items()), reverse=True)
    for us, name in rows:
        if us > 0:
            print(f"| {name}{' (also inside a hook above)' if name in NESTED else ''} | {us:.1f} |")
    print(f"| sum of the entry points that do not nest | {sum(us for us, n in rows if n not in NESTED):.1f} |")


if __name__ == "__main__":
    main()
