"""Kernel-launching ops and host reads that ampwatch adds per training step, on the accelerator path.

Counted with a ``TorchDispatchMode`` over whole optimizer steps of the README loop (fp16 autocast,
GradScaler, unscale_ + clip_grad_norm_, AdamW), with ``AMPWATCH_CPU_AS_ACCELERATOR=1`` so the CPU
takes the path a GPU takes (no free host reads). Not counted: view/alias ops (they launch nothing),
allocations (``empty*``). Counted once: a ``torch._foreach_*`` call (on CUDA one multi-tensor
kernel per ~chunk of tensors). Host reads: ``_local_scalar_dense`` (``.item()``, ``float()``,
``bool()``) and ``.tolist()`` copies.

    python bench/ops.py                  # reference GPT (4 layers, d_model 256, seq 128, batch 3, vocab 2000) and the MLP
    python bench/ops.py --workload gpt --layer-every 1
    python bench/ops.py --free-reads --by-op   # the CPU path instead (host reads are free there), per op
    python bench/ops.py --mirror               # also mirroring to a TensorBoard log folder (attach mirror=)
    python bench/ops.py --loop fused           # AdamW(fused=True): the skip is in the kernel
    python bench/ops.py --loop bf16            # bf16 autocast, no GradScaler, the loss through watch.log
    python bench/ops.py --loop bf16-fused      # the same with AdamW(fused=True)

On the CPU path an op costs ~15 us of host time inside a training step (a cold dispatcher, against
~6 us in a tight loop), so the count matters there too.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

FREE_READS = "--free-reads" in sys.argv
if not FREE_READS:
    os.environ["AMPWATCH_CPU_AS_ACCELERATOR"] = "1"  # before ampwatch is imported

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ampwatch  # noqa: E402
from ampwatch.samples.models import TinyGPT  # noqa: E402

_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
         "_local_scalar_dense", "detach", "alias", "set_", "resize_", "_has_compatible_shallow_copy_type"}


def _is_view(func) -> bool:
    schema = func._schema
    returns_alias = any(r.alias_info is not None for r in schema.returns)
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return returns_alias and not writes


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.reads += 1
        elif name not in _FREE and not _is_view(func):
            self.ops[name] += 1
        if func.namespace == "ampwatch":  # count what the custom op launches, not the op itself
            self.ops[name] -= 1
            with self:
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def workload(name: str):
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
        x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
        return model, x, lambda out: F.cross_entropy(out.float(), y)
    vocab, seq, batch = 2000, 128, 3
    model = TinyGPT(vocab=vocab, d=256, layers=4, heads=8, seq=seq)
    x, y = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    return model, x, lambda out: F.cross_entropy(out.float().view(-1, vocab), y.reshape(-1))


LOOPS = {"fp16": "fp16 autocast + GradScaler, AdamW", "fused": "fp16 autocast + GradScaler, AdamW(fused=True)",
         "bf16": "bf16 autocast, no GradScaler (loss through watch.log), AdamW",
         "bf16-fused": "the same with AdamW(fused=True): the check is the kernel's skip flag"}


def count(name: str, watched: bool, layer_every: int, steps: int = 3, loop: str = "fp16",
          **options) -> tuple[float, float, int, Counter]:
    """(ops per step, host reads per step, modules, ops by name) over ``steps`` steps after two
    warm-up steps."""
    model, x, loss_fn = workload(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=loop in ("fused", "bf16-fused"))
    scaler = None if loop.startswith("bf16") else torch.amp.GradScaler("cpu")
    watch = None
    if watched:
        folder = tempfile.mkdtemp()
        watch = ampwatch.attach(model, opt, scaler, path=f"{folder}/run.sqlite", layer_every=layer_every, **options)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16 if scaler is None else torch.float16):
            out = model(x)
        loss = loss_fn(out)
        if scaler is None:
            loss.backward()
            if watch is not None:
                watch.log(loss=loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    counter = OpCounter()
    with counter:
        for _ in range(steps):
            step()
    if watch is not None:
        watch.close()
    return sum(counter.ops.values()) / steps, counter.reads / steps, len(list(model.modules())), counter.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["gpt", "mlp", "both"], default="both")
    parser.add_argument("--layer-every", type=int, default=None, help="default: report 20 (the default) and 1")
    parser.add_argument("--free-reads", action="store_true", help="count the CPU path (host reads are free)")
    parser.add_argument("--by-op", action="store_true", help="also list the added ops by name")
    parser.add_argument("--mirror", action="store_true", help="also mirror to a TensorBoard log folder")
    parser.add_argument("--loop", choices=list(LOOPS), default="fp16", help="; ".join(f"{k}: {v}" for k, v in LOOPS.items()))
    args = parser.parse_args()
    logging.getLogger("ampwatch").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    names = ["gpt", "mlp"] if args.workload == "both" else [args.workload]
    settings = [args.layer_every] if args.layer_every else [20, 1]
    path = "CPU path (free host reads)" if FREE_READS else "accelerator path on the CPU (AMPWATCH_CPU_AS_ACCELERATOR=1)"
    print(f"torch {torch.__version__}, {path}, {LOOPS[args.loop]}, unscale_ + clip_grad_norm_")
    for name in names:
        base_ops, base_reads, modules, base_by_op = count(name, False, 1, loop=args.loop)
        print(f"{name}: {modules} modules; the step itself: {base_ops:.0f} ops, {base_reads:.0f} host reads")
        mirror = {"mirror": tempfile.mkdtemp()} if args.mirror else {}
        for every, options in [(e, dict(o, **mirror)) for e in settings for o in ({}, {"replay": False})]:
            # steps 2..4 of the run: with layer_every=20 none is a detail step (step 0 is), so at
            # the defaults no module is observed (a skipped step would be replayed); replay=False
            # observes every module on every step, as every step does at layer_every=1
            ops, reads, _, by_op = count(name, True, every, loop=args.loop, **options)
            label = f"layer_every={every}" + (", replay=False" if "replay" in options else "") + \
                (", mirror" if "mirror" in options else "")
            print(f"  {label:<30} ampwatch adds {ops - base_ops:.0f} ops/step, "
                  f"{reads - base_reads:.0f} host reads/step")
            if args.by_op:
                added = {op: n - base_by_op.get(op, 0) for op, n in by_op.items()}
                print("    " + ", ".join(f"{op} {n / 3:g}" for op, n in sorted(added.items(), key=lambda kv: -kv[1]) if n))


if __name__ == "__main__":
    main()
