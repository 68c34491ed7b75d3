"""Peak memory ampwatch adds to a training step: between observed steps and on an observed one.

Recording holds tensors past the moment training would free them: on the accelerator path the
module hooks queue the tensors they observe and reduce them in chunks (``record/batched.py``: up to
64 tensors or ``CHUNK_BYTES``), the replay keeps each step's inputs and output gradients until the
step ends (so a skipped step can be run again; the logits' gradient when the loss is computed
outside the model), a compiled model's observed steps run a second graph. This measures what that
does to a step's peak: GPT-2 small at its real widths (``transformers.GPT2Config()``: 12 blocks of
768, its 50257-token vocabulary), a short sequence so a CPU step takes about a second, bf16 autocast
(fp16 matmuls are ~50x slower on CPUs without fp16 units; ``--fp16`` for a GradScaler loop where
they are fast), AdamW, ``clip_grad_norm_``, on the accelerator path (``AMPWATCH_CPU_AS_ACCELERATOR=1``,
what a GPU runs) with ``layer_every=4``: steps 1-3 observe no module, step 4 does.

Each variant runs in a process of its own (Dynamo's caches and the allocator start empty). The peak
of a step is the highest point of the bytes torch had allocated during it, above what was allocated
when it began: on CUDA ``torch.cuda.max_memory_allocated``; on the CPU, which keeps no such
statistic, the profiler's memory events (every allocation and free, in order) summed. Weights,
optimizer state and anything kept from step to step are in neither: what is kept across steps is
printed apart (``held after``, the bytes allocated at the step's end above its start: 0 in a
steady loop).

    python bench/memory.py                       # eager: base, ampwatch, localize=False
    python bench/memory.py --compile inductor    # the same, compiled
    python bench/memory.py --loss inside         # the loss computed by the model (labels=...)
    python bench/memory.py --seq 256 --batch 4   # more tokens: activations, not AdamW, make the peak
    python bench/memory.py --fp16 --fused        # a fused GradScaler loop (slow where fp16 is emulated)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if "--device" not in sys.argv or sys.argv[sys.argv.index("--device") + 1] != "cuda":
    os.environ["AMPWATCH_CPU_AS_ACCELERATOR"] = "1"  # before ampwatch is imported

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ampwatch  # noqa: E402
from own_code import with_own_code  # noqa: E402

VARIANTS = {"base": None, "ampwatch": {}, "localize=False": {"localize": False}}
LAYER_EVERY = 4


def _peak_cpu(fn) -> tuple[int, int]:
    """(peak above start, held at the end) in bytes of the CPU allocations ``fn`` made, from the
    profiler's memory events in the order they happened."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = top = 0
    for event in events:
        if event.device_type().name == "CPU":
            now += event.nbytes()
            top = max(top, now)
    return top, now


def _peak_cuda(fn) -> tuple[int, int]:
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, torch.cuda.memory_allocated() - start


def run_variant(name: str, args: argparse.Namespace) -> dict:
    """In the variant's own process: the peak of every step after the first (the first compiles
    and learns), and whether it observed modules."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    config = GPT2Config(n_positions=max(1024, args.seq))
    options = VARIANTS[name]
    # an unwatched compiled copy runs under a code object of its own, as in hostcost.py
    cls = with_own_code(GPT2LMHeadModel) if args.compile and options is None else GPT2LMHeadModel
    model = cls(config).to(device).train()
    x = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused)
    scaler = torch.amp.GradScaler(device.type) if args.fp16 else None
    watch = None
    if options is not None:
        watch = ampwatch.attach(model, opt, scaler, path=f"{tempfile.mkdtemp()}/run.sqlite",
                                layer_every=LAYER_EVERY, **options)
    net = torch.compile(model, backend=args.compile) if args.compile else model
    dtype = torch.float16 if args.fp16 else torch.bfloat16

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype):
            if args.loss == "inside":
                loss = net(x, labels=x, use_cache=False).loss
            else:
                logits = net(x, use_cache=False).logits
        if args.loss == "outside":
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), x.view(-1))
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

    peak = _peak_cuda if device.type == "cuda" else _peak_cpu
    steps = []
    for i in range(args.steps):
        observed = watch is not None and watch.observer is not None and watch.observer.observing
        t0 = time.perf_counter()
        if i == 0:  # compiles (both graphs: the first step observes) and learns
            step()
            top = held = 0
        else:
            top, held = peak(step)
        steps.append({"step": i, "observed": observed, "peak": top, "held": held,
                      "seconds": time.perf_counter() - t0})
    if watch is not None:
        watch.close()
    return {"variant": name, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", metavar="BACKEND", help="torch.compile the model with this backend (inductor, aot_eager)")
    ap.add_argument("--loss", choices=["outside", "inside"], default="outside",
                    help="cross-entropy on the logits in the loop (outside) or the model's own (labels=)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2 * LAYER_EVERY + 1)
    ap.add_argument("--fp16", action="store_true", help="fp16 autocast with a GradScaler instead of bf16")
    ap.add_argument("--fused", action="store_true", help="AdamW(fused=True): with --fp16 its skip is read a "
                    "step late, and the step's kept output gradients live until then (deferred.py)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run this variant here, print JSON
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_variant(args.one, args)))
        return
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}: choose from {list(VARIANTS)}")
    results = {}
    for name in names:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", name],
                             capture_output=True, text=True)
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"variant {name} failed:\n{out.stderr[-3000:]}")
        results[name] = json.loads(line[len("RESULT "):])["steps"]
    mib = 2 ** 20
    mode = f"torch.compile({args.compile})" if args.compile else "eager"
    print(f"\n## GPT-2 small (12 x 768, vocab 50257), batch {args.batch} x {args.seq} tokens, {mode}, "
          f"{'fp16 + GradScaler' if args.fp16 else 'bf16'}, {'AdamW(fused=True)' if args.fused else 'AdamW'}, loss {args.loss}, {args.device}, torch {torch.__version__}\n")
    print("| variant | peak, between observed (MiB) | added | peak, observed step (MiB) | added | held after a step (MiB) |")
    print("|---|---|---|---|---|---|")

    def figures(steps: list, observed: bool) -> list[dict]:
        return [s for s in steps if s["step"] > 0 and s["observed"] == observed]

    base_between = max(s["peak"] for s in figures(results[names[0]], False))
    for name in names:
        between = max(s["peak"] for s in figures(results[name], False))
        seen = figures(results[name], True)
        observed = max(s["peak"] for s in seen) if seen else None
        held = max(abs(s["held"]) for s in results[name] if s["step"] > 0)
        print(f"| {name} | {between / mib:.1f} | {(between - base_between) / mib:+.1f} | "
              + (f"{observed / mib:.1f} | {(observed - base_between) / mib:+.1f}" if observed is not None else "— | —")
              + f" | {held / mib:.2f} |")


if __name__ == "__main__":
    main()
