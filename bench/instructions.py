"""Host instructions ampwatch adds per step: a count that does not move with the machine's load.

bench/hostcost.py times GPT-2 small's module tree (tiny widths, the accelerator path), but on a
shared machine its "base again" drifts by several percent between runs, more than the 1% it is
meant to tell apart. This counts instead: each variant trains its own copy of the same model in its
own process under Valgrind's callgrind, which counts every machine instruction each thread executes
(``Ir``). The same step gives the same count again to within a few hundredths of a percent: a
figure to compare versions of ampwatch on, on any machine, whatever else runs on it. The main
thread's count is split three ways: instructions in ATen's CPU kernel bodies (the arithmetic: inner
loops, BLAS, vector math, inductor's kernels), which on a GPU would run on the device; those that
hand locks between threads (the GIL's condition variable, whose count depends on when the writer
thread happened to wait); and the rest, the *host* instructions (the interpreter, dispatch,
autograd's bookkeeping, ampwatch's Python): what a GPU step waits for when it is host-bound.

Each process builds the model, attaches (or not), and trains one whole block of ``layer_every``
steps uninstrumented (compiling, where ``--compile``: Valgrind without instrumentation runs it at a
few times native speed). Then ``callgrind_control`` turns counting on, and the process trains the
next block's observed step, then ``--healthy`` steps between observed ones, each part counted on its
own, each after the writer thread caught up with it (``RunWriter.wait_rows``), whose rows are
counted too. Reported per variant: the main thread's instructions on the observed step, on a step
between observed ones (their mean), and averaged over a whole block
(``(observed + (layer_every - 1) * between) / layer_every``: what a run pays), each against the
base's; and the other threads' (the writer's: turning packs into rows; its commits, every
``flush_every_s``, are left out of the window, as a run makes one per ~7 steps). Last, per
variant, the instructions inside the CPU's per-tensor loops of ``torch._foreach_*`` ops (which a GPU
runs as multi-tensor launches): how much of a count is that CPU-only form; and the host instructions
spent in the C allocator (glibc's malloc and free, C++'s new and delete, ``c10::alloc_cpu``), with
the added host count without them. What one allocation costs depends on the state of the heap that
earlier steps left (its free lists), not on the code that asks: over 19 runs (eager, fused and
inductor, several commits) the allocator's share of the added count between observed steps ranged
from -0.15 to +0.35 M a step, in both directions, while the rest moved by less than 0.1 M between
runs of the same code.

What a count is not: time. An instruction of the interpreter and one of a vectorized kernel cost
differently, cache misses and waits for the GIL are not counted, and Valgrind's CPU has no AVX-512
(torch takes its AVX2 kernels). The arithmetic of this proxy's tiny widths is counted with the
host's work here, and split off by the names of the functions it runs in. A count says how much work
ampwatch adds on the host, in what part of the step, closely enough to see a change of 0.1%.

Needs ``valgrind`` (Debian: ``apt-get install valgrind``), which runs a step ~50x slower: about
three minutes for two variants on two cores.

    python bench/instructions.py
    python bench/instructions.py --variants base,ampwatch,localize_off,replay_off
    python bench/instructions.py --fused            # AdamW(fused=True)
    python bench/instructions.py --bf16             # bf16 without a scaler
    python bench/instructions.py --compile inductor # compiled copies (~12 minutes: compiling under Valgrind)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = {"base": None, "ampwatch": {}, "localize_off": {"localize": False}, "replay_off": {"replay": False}}


def child(args: argparse.Namespace) -> None:
    """Runs under Valgrind: train, then count the observed step and the healthy ones."""
    os.environ["AMPWATCH_CPU_AS_ACCELERATOR"] = "1" if args.path == "accelerator" else "0"
    import logging

    import torch
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    import ampwatch
    import hostcost
    logging.getLogger("ampwatch").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    options = VARIANTS[args.child]
    # the base runs its forward under a code object of its own, as bench/hostcost.py's base copies
    model, x = hostcost.model_and_batch(own_code=options is None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused)
    hostcost.state_now(opt)
    scaler = None if args.bf16 else torch.amp.GradScaler("cpu")
    watch = None
    if options is not None:
        watch = ampwatch.attach(model, opt, scaler, path=f"{args.out}/{args.child}.sqlite",
                                layer_every=args.layer_every, flush_every_s=3600.0, **options)
    net = torch.compile(model, backend=args.compile) if args.compile else model
    step = hostcost.make_step(model, net, x, opt, scaler, watch)

    def caught_up() -> None:
        if watch is not None:
            watch.writer.wait_rows()

    def control(*flags: str) -> None:
        subprocess.run(["callgrind_control", *flags, str(os.getpid())], check=True, stdout=subprocess.DEVNULL)

    for _ in range(args.layer_every):  # a whole block: the observed step and the ones between
        step()
    caught_up()
    control("-i", "on")
    control("-z")
    step()  # the next block's observed step
    caught_up()
    control("-d", "observed")
    for _ in range(args.healthy):
        step()
    caught_up()
    control("-d", "between")
    os._exit(0)  # nothing after the counted parts: no close, no exit dump worth reading


# ATen's CPU kernel bodies (inner loops, BLAS, vector math, memset/memcpy) and the kernels inductor
# generates (functions named ``kernel``, code in its compiled .so files): the arithmetic, which on a
# GPU runs on the device. The rest is host work (the interpreter, dispatch, autograd, ampwatch).
_KERNEL = re.compile(r"at::native::.*(kernel|Kernel|loop|Loop|Vectorized|reduce|_impl<)|at::vec::|Sleef_|mkl_|"
                     r"fp16_dot|cpublas|gemm|memset|memcpy|memmove|function_ref<void \(char\*\*|:kernel$|"
                     r":kernel \[|torchinductor")
_LINE = re.compile(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)")


# Handing the GIL and other locks between threads (the condition variable's signal spins while the
# other thread wakes): how many instructions that takes depends on when the writer thread happened
# to wait, not on the step (0.05 to 0.25 M a step between two runs of the same code), so it is
# counted apart from the host's work
_SYNC = re.compile(r"pthread_cond_|pthread_mutex_|take_gil|drop_gil|futex|__lll_|sem_|PyThread_acquire_lock|"
                   r"PyThread_release_lock|PyCOND_|PyMUTEX_")


# The C allocator: glibc's malloc and free (and their helpers), C++'s new and delete, torch's CPU
# storages (posix_memalign under c10::alloc_cpu). On a GPU a tensor's memory comes from the CUDA
# caching allocator instead; and here one allocation's count depends on the heap's free lists
_ALLOC = re.compile(r"malloc\.c:|arena\.c:|operator new|operator delete|c10::alloc_cpu|c10::free_cpu")


def split(path: str) -> tuple[int, int, int]:
    """Instructions of ``path``'s dump that ran in ATen's CPU kernel bodies, in handing locks
    between threads, and (of the rest) in the C allocator (callgrind_annotate's exclusive cost per
    function, every function listed)."""
    listing = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", path],
                             capture_output=True, text=True, check=True).stdout
    kernel = sync = alloc = 0
    for line in listing.splitlines():
        match = _LINE.match(line)
        if match and "PROGRAM TOTALS" not in line:
            if _KERNEL.search(match.group(2)):
                kernel += int(match.group(1).replace(",", ""))
            elif _SYNC.search(match.group(2)):
                sync += int(match.group(1).replace(",", ""))
            elif _ALLOC.search(match.group(2)):
                alloc += int(match.group(1).replace(",", ""))
    return kernel, sync, alloc


# On the CPU a ``torch._foreach_*`` op runs its tensors one by one, each a whole op through the
# dispatcher (``foreach_tensor_<op>_slow``); on a GPU the same call is one multi-tensor launch per
# ~chunk of tensors. Their inclusive count (the per-tensor ops, arithmetic included) is reported
# apart: the part of a count that a GPU step does not pay as host time in that form.
_FOREACH_LOOP = re.compile(r"at::native::foreach_tensor_\w+_slow_?\(")  # in place: ..._slow_


def foreach_loops(path: str) -> int:
    """Instructions of ``path``'s dump inside the CPU's per-tensor loops of ``_foreach_*`` ops
    (inclusive: each loop with the ops it calls). The loops call no other such loop."""
    listing = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", path],
                             capture_output=True, text=True, check=True).stdout
    loops: dict[str, int] = {}
    for line in listing.splitlines():
        match = _LINE.match(line)
        if match and _FOREACH_LOOP.search(match.group(2)):
            name = re.sub(r"'\d+$", "", match.group(2).split(" [")[0].strip())  # recursion: one figure
            loops[name] = max(loops.get(name, 0), int(match.group(1).replace(",", "")))
    return sum(loops.values())


def counts(out: str, variant: str) -> dict[str, tuple[int, int, int, int, int, int]]:
    """Part (observed, between) -> (main thread's Ir, of which in kernel bodies, of which in handing
    locks between threads, other threads' Ir, the main thread's in per-tensor loops of foreach ops,
    the main thread's host Ir in the C allocator)."""
    parts: dict[str, list[int]] = {}
    for path in glob.glob(f"{out}/{variant}.cg.*.[0-9]*-[0-9]*"):
        match = re.search(r"\.(\d+)-(\d+)$", path)
        total = re.search(r"^(?:summary|totals): (\d+)", Path(path).read_text(errors="replace"), re.M)
        part = {"1": "observed", "2": "between"}.get(match.group(1)) if match else None
        if part is None or total is None:
            continue
        threads = parts.setdefault(part, [0, 0, 0, 0, 0, 0])
        if match.group(2) == "01":  # the main thread: the training loop
            kernel, sync, alloc = split(path)
            threads[5] += alloc
            threads[0] += int(total.group(1))
            threads[1] += kernel
            threads[2] += sync
            threads[4] += foreach_loops(path)
        else:
            threads[3] += int(total.group(1))
    return {part: (v[0], v[1], v[2], v[3], v[4], v[5]) for part, v in parts.items()}


def run_variant(variant: str, args: argparse.Namespace, out: str) -> dict[str, tuple[int, int]]:
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
               f"--callgrind-out-file={out}/{variant}.cg.%p", sys.executable, __file__, "--child", variant,
               "--out", out, "--layer-every", str(args.layer_every), "--healthy", str(args.healthy),
               "--path", args.path]
    command += ["--fused"] * args.fused + ["--bf16"] * args.bf16 + (["--compile", args.compile] if args.compile else [])
    # one hash seed for every process: the same dict and set layouts (string keys), so that two runs
    # of the same code count the same probes
    # and AVX2 at most: Valgrind's CPU has no AVX-512, but on a host that has it inductor would pick
    # its AVX-512 kernels (it reads /proc/cpuinfo) and compile them with -march=native, and the
    # counted process would stop (SIGILL); ATen's own dispatch asks the CPU, which under Valgrind
    # answers AVX2 anyway
    env = {**os.environ, "PYTHONHASHSEED": "0", "ATEN_CPU_CAPABILITY": "avx2"}
    if platform.machine() in ("x86_64", "AMD64"):
        env["TORCHINDUCTOR_CPP_MARCH"] = "haswell"  # AVX2, FMA, BMI, F16C; read by inductor (torch 2.13 does)
    # and a cache of their own, so that kernels built under these settings never reach a plain
    # process: on an AVX-512 host, plain compiled runs that read the shared cache after these counts
    # died in inductor's kernels with a corrupted heap, and ran once the cache was moved aside
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(out, "torchinductor")  # its kernels: matched by _KERNEL
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    found = counts(out, variant)
    if done.returncode != 0 or set(found) != {"observed", "between"}:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise SystemExit(f"{variant}: the counted run failed (exit {done.returncode}):\n{tail}")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="base,ampwatch", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--layer-every", type=int, default=20, help="ampwatch's option (its default, 20)")
    ap.add_argument("--healthy", type=int, default=None,
                    help="steps between observed ones to count (their mean; default: the rest of the block, layer_every - 1)")
    ap.add_argument("--path", choices=["accelerator", "cpu"], default="accelerator")
    ap.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast without a GradScaler")
    ap.add_argument("--compile", metavar="BACKEND", help="torch.compile every copy (inductor, aot_eager)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="variants counted at once")
    ap.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.healthy is None:
        args.healthy = max(1, args.layer_every - 1)
    if args.child:
        child(args)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("bench/instructions.py needs valgrind (with callgrind_control): apt-get install valgrind")
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}: choose from {', '.join(VARIANTS)}")
    if "base" not in variants:
        variants.insert(0, "base")
    out = tempfile.mkdtemp(prefix="ampwatch-instructions-")
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = dict(zip(variants, pool.map(lambda v: run_variant(v, args, out), variants)))
    import torch
    mode = f"torch.compile ({args.compile})" if args.compile else "eager"
    loop = "bf16 autocast, no scaler" if args.bf16 else "fp16 + GradScaler"
    print(f"## Instructions per step (callgrind Ir), GPT-2 small's module tree, {args.path} path, {mode}, "
          f"AdamW{'(fused=True)' if args.fused else ''}, {loop}, clip, torch {torch.__version__}, "
          f"layer_every {args.layer_every}, {args.healthy} steps between counted\n")
    print("Main thread, instructions per step (M), and in brackets the ratio to the base's; *host*: outside ATen's "
          "CPU kernel bodies (the arithmetic, which a GPU runs on the device) and outside the hand-over of locks "
          "between threads (a block's mean in the last column but one)\n")
    print("| variant | observed step, all | host | between observed, all | host | averaged over a block, all "
          "| host | lock hand-overs | other threads (the writer), a step |\n|---|---|---|---|---|---|---|---|---|")
    L = args.layer_every

    def per_step(r: dict) -> list[float]:
        (o_all, o_kernel, o_sync, o_other, *_), (b_all, b_kernel, b_sync, b_other, *_) = r["observed"], r["between"]
        h = args.healthy
        observed = (o_all, o_all - o_kernel - o_sync)
        between = (b_all / h, (b_all - b_kernel - b_sync) / h)
        block = [(o + (L - 1) * b) / L for o, b in zip(observed, between)]
        sync = (o_sync + (L - 1) * b_sync / h) / L
        return [*observed, *between, *block, (o_other + (L - 1) * b_other / h) / L, sync]

    figures = {variant: per_step(results[variant]) for variant in variants}
    base = figures["base"]
    for variant in variants:
        mine = figures[variant]
        cells = [f"{v / 1e6:,.2f}" + ("" if variant == "base" else f" ({v / ref:.4f}x)")
                 for v, ref in zip(mine[:6], base[:6])]
        print(f"| {variant} | " + " | ".join(cells) + f" | {mine[7] / 1e6:,.2f} | {mine[6] / 1e6:,.2f} |")
    print("\nhost instructions added per step (M): " + "; ".join(
        f"{variant} {figures[variant][1] / 1e6 - base[1] / 1e6:+,.2f} on the observed step, "
        f"{figures[variant][3] / 1e6 - base[3] / 1e6:+,.3f} between, "
        f"{figures[variant][5] / 1e6 - base[5] / 1e6:+,.3f} averaged" for variant in variants if variant != "base"))
    loops = {variant: (results[variant]["observed"][4], results[variant]["between"][4] / args.healthy)
             for variant in variants}
    print("\nof that, in the CPU's per-tensor loops of `_foreach_*` ops (M a step, their arithmetic included; a GPU "
          "runs each such call as one multi-tensor launch per chunk of tensors): " + "; ".join(
              f"{variant} {o / 1e6:,.2f} on the observed step, {b / 1e6:,.3f} between"
              + ("" if variant == "base" else
                 f" ({(o - loops['base'][0]) / 1e6:+,.2f} and {(b - loops['base'][1]) / 1e6:+,.3f} against the base)")
              for variant, (o, b) in loops.items()))
    # the C allocator's part of the host count, and the host count without it (see the docstring)
    alloc = {variant: (results[variant]["observed"][5], results[variant]["between"][5] / args.healthy)
             for variant in variants}
    print("\nof the host instructions, in the C allocator (M a step; what one allocation costs depends on the "
          "heap's state): " + "; ".join(f"{variant} {o / 1e6:,.2f} on the observed step, {b / 1e6:,.3f} between"
                                         for variant, (o, b) in alloc.items()))
    rest = {variant: [figures[variant][1] - alloc[variant][0], figures[variant][3] - alloc[variant][1]]
            for variant in variants}
    for figure in rest.values():
        figure.append((figure[0] + (L - 1) * figure[1]) / L)
    print("\nhost instructions added per step without the allocator's (M, and the ratio to the base's host count "
          "without it): " + "; ".join(
              f"{variant} " + ", ".join(f"{(v - ref) / 1e6:+,.3f} {where} ({v / ref:.4f}x)" for v, ref, where in zip(
                  rest[variant], rest["base"], ("on the observed step", "between", "averaged")))
              for variant in variants if variant != "base"))
    print(f"\n(dump files in {out})")


if __name__ == "__main__":
    main()
