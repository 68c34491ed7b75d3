"""Host time ampwatch adds per step on GPT-2 small's module structure: a CPU proxy for the GPU.

On a GPU an eager GPT-2 small step is host-bound (bench/gpu_gpt2.py: ~72 ms of Python and kernel
launches on an H100), so what ampwatch costs there is mostly host time: hooks, bookkeeping and
the launches of its own ops. This measures that host time where no GPU is lent: GPT-2 small's
exact module tree (``transformers.GPT2Config()``: 12 blocks, 164 modules, 148 parameters) with
tiny widths (``n_embd`` 48, 16 tokens), so the arithmetic is negligible and a step is almost all
dispatch, on the accelerator path (``AMPWATCH_CPU_AS_ACCELERATOR=1``: no free host reads, the
reductions batched as on CUDA). Reported: the added milliseconds per step (median of paired
block differences, variants interleaved, one thread), at the defaults (the measured steps lie
between ``layer_every`` steps: no module is observed, a skipped step would be replayed), with
``replay=False`` (every module observed on every step, as on a ``layer_every`` step) and with
``localize=False``,
and for scale the *hook floor*: what per-module observation through Python hooks costs when the
hooks do nothing (a forward hook per module, a gradient hook per output).

A CPU op is not a CUDA launch (each costs a few microseconds of host time either way), so this
is a proxy to compare versions of ampwatch on one machine, not a GPU figure.

    python bench/hostcost.py --rounds 30 --steps 10
    python bench/hostcost.py --path cpu        # the free-reads path instead
    python bench/hostcost.py --compile aot_eager --rounds 12   # compiled copies (no model graph breaks)
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

PATH_ARG = "cpu" if "--path" in sys.argv and sys.argv[sys.argv.index("--path") + 1] == "cpu" else "accelerator"
if PATH_ARG == "accelerator":
    os.environ["AMPWATCH_CPU_AS_ACCELERATOR"] = "1"  # before ampwatch is imported

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ampwatch  # noqa: E402


def model_and_batch(seq: int = 16):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_embd=48, n_head=12, n_positions=64, vocab_size=256,  # GPT-2 small's 12 layers
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.train()
    x = torch.randint(0, config.vocab_size, (1, seq))
    return model, x


def hook_floor(model: torch.nn.Module, steps):
    """The least any per-module observation in Python costs: a forward hook on every module that
    does nothing but give each floating output a gradient hook (ampwatch's own cheap way,
    ``observe.add_grad_hook``) that does nothing (``dict.get``: a C call returning None)."""
    from ampwatch.record.observe import add_grad_hook
    nothing = {}.get

    def hook(module, args, kwargs, output):
        for t in ((output,) if isinstance(output, torch.Tensor) else output if isinstance(output, tuple) else ()):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                add_grad_hook(t, t.grad_fn, nothing)

    def run(k: int) -> float:
        handles = [m.register_forward_hook(hook, with_kwargs=True) for m in model.modules()]
        try:
            return steps(k)
        finally:
            for h in handles:
                h.remove()
    return run


def make_step(model, x, opt, scaler):
    def step() -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), x.view(-1))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0
    return step


def eager_variants(folder: str) -> tuple[dict, torch.nn.Module]:
    """One model; ampwatch attached for each of its blocks and closed after it."""
    model, x = model_and_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    step = make_step(model, x, opt, scaler)
    counter = iter(range(10 ** 9))

    def watched(**options):
        def run(k: int) -> float:
            with ampwatch.attach(model, opt, scaler, path=f"{folder}/run{next(counter)}.sqlite", **options):
                for _ in range(3):  # the learning step, then steady state
                    step()
                return statistics.median(step() for _ in range(k))
        return run

    return {"base": lambda k: statistics.median(step() for _ in range(k)),
            "hook floor": hook_floor(model, lambda k: statistics.median(step() for _ in range(k))),
            "ampwatch": watched(), "replay=False": watched(replay=False),
            "localize=False": watched(localize=False)}, model


def compiled_variants(folder: str, backend: str) -> tuple[dict, torch.nn.Module]:
    """A compiled copy per variant (hooks are guarded: attaching to one compiled copy and detaching
    again would recompile it every block), ampwatch attached before compiling, as docs/localization.md says."""
    variants = {}
    for name, options in (("base", None), ("ampwatch", {}), ("replay=False", {"replay": False}),
                          ("localize=False", {"localize": False})):
        model, x = model_and_batch()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler("cpu")
        if options is not None:
            ampwatch.attach(model, opt, scaler, path=f"{folder}/{name}.sqlite", **options)
        step = make_step(torch.compile(model, backend=backend), x, opt, scaler)
        variants[name] = lambda k, step=step: statistics.median(step() for _ in range(k))
    return variants, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--path", choices=["accelerator", "cpu"], default="accelerator")
    ap.add_argument("--compile", metavar="BACKEND", help="torch.compile every copy with this backend (aot_eager)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("ampwatch").setLevel(logging.WARNING)
    folder = tempfile.mkdtemp()
    variants, model = compiled_variants(folder, args.compile) if args.compile else eager_variants(folder)
    for run in variants.values():
        run(3)  # compiles, learns, warms up
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(variants[name](args.steps))
    modules = len(list(model.modules()))
    params = len(list(model.parameters()))
    mode = f"torch.compile({args.compile})" if args.compile else "eager"
    print(f"\n## GPT-2 small structure ({modules} modules, {params} parameters, tiny widths), {args.path} path, "
          f"{mode}, torch {torch.__version__}, {args.rounds} rounds x {args.steps} steps, 1 thread\n")
    print("| variant | median step ms | added ms/step (median paired) |")
    print("|---|---|---|")
    for name in names:
        added = statistics.median(v - b for v, b in zip(times[name], times["base"])) * 1e3
        print(f"| {name} | {statistics.median(times[name]) * 1e3:.2f} | {added:+.2f} |")


if __name__ == "__main__":
    main()
