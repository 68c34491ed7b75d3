"""Host time ampwatch adds per step on GPT-2 small's module structure: a CPU proxy for the GPU.

On a GPU an eager GPT-2 small step is host-bound (bench/gpu_gpt2.py: ~72 ms of Python and kernel
launches on an H100), so what ampwatch costs there is mostly host time: hooks, bookkeeping and
the launches of its own ops. This measures that host time where no GPU is lent: GPT-2 small's
exact module tree (``transformers.GPT2Config()``: 12 blocks, 164 modules, 148 parameters) with
tiny widths (``n_embd`` 48, 16 tokens), so the arithmetic is negligible and a step is almost all
dispatch, on the accelerator path (``AMPWATCH_CPU_AS_ACCELERATOR=1``: no free host reads, the
reductions batched as on CUDA). Each variant trains its own copy, attached once; a round runs one
block of ``layer_every`` steps of each variant, interleaved, one thread. Reported per variant:
the step time averaged over whole blocks (the observed ``layer_every`` step included: what a run
pays), the median step between observed ones, and each as added milliseconds and as a ratio to
the base (medians of paired per-round figures). Variants: the defaults (a skipped step would be
replayed), ``replay=False`` (every module observed on every step), ``localize=False``, and in
eager for scale the *hook floor*: what per-module observation through Python hooks costs when the
hooks do nothing (a forward hook per module, a gradient hook per output).

Two copies of one model, trained the same way, differ by up to ~0.3 ms a step here (where their
tensors and code land in memory): as much as ampwatch adds between observed steps. So each
variant runs ``--copies`` copies (default 2; a round runs a block of each) and its figure is their
mean, and a second, independent set of base copies (``base again``) shows what that spread still
leaves: a ratio is only as good as ``base again``'s distance from 1.

Compiled, the base copies are what a user without ampwatch runs, and the ``localize=False`` copies
what a user of that option runs: their graphs are traced under torch's default guards and cached
apart from the observing copies' (their class's ``forward`` runs under a code object of its own).
A watch that observes modules may turn on Dynamo's guards on module hooks for the whole process,
as a fallback (a graph break inside the model, docs/localization.md); copies compiled beside such a
watch would pay those guards too (~50 us a call on this tree, ``bench/guards.py``) and hide them
from the table, so these copies compile under torch's default whatever the process has set.

Where the first step puts AdamW's moments on the CPU heap changes how fast the proxy's update
arithmetic runs (148 small tensors, one kernel each): a watch's observed first step allocates and
frees around the moments' making, and in a lazily made state the optimizer's own step ran up to
~0.2 ms slower in the ampwatch copies, with the same ops. That is where tensors landed, not host
time, and a GPU keeps the moments in device memory, so every copy's state is made before
anything else runs (``state_now``; ``--lazy-state`` leaves it to the first step, as a loop does).
The bench prints the optimizer's own step, timed between its step hooks, for each variant: where
the variants' figures differ, the table carries that difference.

Each watch's writer thread turns steps into rows every 0.1 s, so a block's last steps used to be
made into rows during the next variant's block: ``replay=False`` (a module row per module a step)
landed on ``localize=False``, next in the order (+0.33 ms a step between observed ones, against
+0.18 for the defaults, in a run where the order was the only difference). After each block the
bench waits until that copy's writer has caught up (``RunWriter.wait_rows``), outside the timing.

A CPU op is not a CUDA launch (each costs a few microseconds of host time either way), so this
is a proxy to compare versions of ampwatch on one machine, not a GPU figure.

    python bench/hostcost.py --rounds 8
    python bench/hostcost.py --path cpu        # the free-reads path instead
    python bench/hostcost.py --compile inductor --rounds 6   # compiled copies (no model graph breaks)
    python bench/hostcost.py --compile-blocks inductor        # each block compiled on its own (torchtitan)
    python bench/hostcost.py --fused           # AdamW(fused=True): a skip is read from the inf flag
    python bench/hostcost.py --bf16            # bf16 without a scaler: no skip to replay
    python bench/hostcost.py --no-clip         # a loop that does not clip: the recorder's own norms
    python bench/hostcost.py --positions       # also each step's cost by its place after the observed one
    python bench/hostcost.py --lazy-state      # AdamW's state made by the first step, where it lands
    python bench/hostcost.py --compile-time inductor   # seconds to compile, with and without ampwatch
    python bench/hostcost.py --compile-time inductor --compile-blocks inductor   # the same, block by block
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ampwatch  # noqa: E402
from own_code import with_own_code  # noqa: E402


def model_and_batch(seq: int = 16, own_code: bool = False):
    """GPT-2 small's module tree with tiny widths, and a batch. ``own_code``: an instance of a
    subclass whose ``forward`` runs the same code under a code object of its own (Dynamo caches
    graphs, and checks their guards, per code object: such a copy never shares them with others)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_embd=48, n_head=12, n_positions=64, vocab_size=256,  # GPT-2 small's 12 layers
                        bos_token_id=0, eos_token_id=0)
    model = (with_own_code(GPT2LMHeadModel) if own_code else GPT2LMHeadModel)(config)
    model.train()
    x = torch.randint(0, config.vocab_size, (1, seq))
    return model, x


def hook_floor(model: torch.nn.Module) -> None:
    """The least any per-module observation in Python costs: a forward hook on every module that
    does nothing but give each floating output a gradient hook (ampwatch's own cheap way,
    ``observe.add_grad_hook``) that does nothing (``dict.get``: a C call returning None)."""
    from ampwatch.record.observe import add_grad_hook
    nothing = {}.get

    def hook(module, args, kwargs, output):
        for t in ((output,) if isinstance(output, torch.Tensor) else output if isinstance(output, tuple) else ()):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                add_grad_hook(t, t.grad_fn, nothing)

    for m in model.modules():
        m.register_forward_hook(hook, with_kwargs=True)


def state_now(opt: torch.optim.Optimizer) -> None:
    """Make the optimizer's state now (one step at learning rate 0 on zero gradients: no weight
    changes), as it would be made by the first ``step()``. On the CPU where a tensor lands on the
    heap changes how fast the proxy's arithmetic runs on it (a single-tensor AdamW over 148 small
    tensors: the moments made among whatever else the first step allocated ran ~0.2 ms a step
    slower than moments made on their own, with the same ops): a CPU-cache effect of this proxy,
    not host time. Every variant's state is made so before anything else runs (unless
    ``--lazy-state``), so copies compare the host time added, not where their moments landed."""
    params = [p for group in opt.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in opt.param_groups]
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step()
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)


def make_step(model, net, x, opt, scaler, watch, clip: bool = True):
    """fp16 with a GradScaler; or, without a scaler, bf16 with the loss given to ``watch.log``.
    ``clip``: ``clip_grad_norm_`` every step, as nanoGPT, the HF Trainer and torchtitan do (the
    recorder then takes the clip's gradient norms instead of measuring its own)."""
    dtype = torch.float16 if scaler is not None else torch.bfloat16

    def step() -> float:
        t0 = time.perf_counter()
        with torch.autocast(x.device.type, dtype=dtype):  # the CPU here; CUDA in gpu_memory.py
            logits = net(x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), x.view(-1))
        if scaler is None:
            loss.backward()
            if watch is not None:
                watch.log(loss=loss)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0
    return step


class Variant:
    """One copy of the model, ampwatch attached once (or not), compiled or eager."""

    def __init__(self, options, folder: str, name: str, backend, fused: bool, bf16: bool, clip: bool = True,
                 blocks_backend=None, state_first: bool = False) -> None:
        # compiled copies without module observation (the base, localize=False): torch's default
        # guards, as in a process with no observing watch, and a cache of their own (see the
        # module docstring)
        self.default_guards = backend is not None and (options is None or options == {"localize": False})
        self.model, x = model_and_batch(own_code=self.default_guards)
        if blocks_backend:  # torchtitan's way: each block compiled on its own, before the optimizer
            blocks = self.model.transformer.h
            for i, block in enumerate(blocks):
                blocks[i] = torch.compile(block, backend=blocks_backend)
        opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused)
        if state_first:
            state_now(opt)
        scaler = None if bf16 else torch.amp.GradScaler("cpu")
        self.watch = None
        if options == "hook floor":
            hook_floor(self.model)
        elif options is not None:
            self.watch = ampwatch.attach(self.model, opt, scaler, path=f"{folder}/{name}.sqlite", **options)
        net = torch.compile(self.model, backend=backend) if backend else self.model
        self.step = make_step(self.model, net, x, opt, scaler, self.watch, clip)
        # the optimizer's own step, timed between its step hooks (registered after the watch's:
        # what lies between them is the update's arithmetic, whose speed on this CPU depends on
        # where its tensors landed, see state_now; and without a scaler the watch's step end,
        # which runs in its post-hook, before this one)
        self.optimizer_times: list[float] = []
        self._optimizer_began = 0.0
        opt.register_step_pre_hook(self._optimizer_begins)
        opt.register_step_post_hook(self._optimizer_ends)

    def _optimizer_begins(self, *_) -> None:
        self._optimizer_began = time.perf_counter()

    def _optimizer_ends(self, *_) -> None:
        self.optimizer_times.append(time.perf_counter() - self._optimizer_began)

    def compile_steps(self, n: int) -> None:
        """The first steps, which compile: a copy without module observation under torch's default
        guards (a watch's fallback turns on the hook guards process-wide; guards are built when a
        graph is compiled)."""
        if self.default_guards:
            with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
                self.block(n)
        else:
            self.block(n)

    def catch_up(self) -> float:
        """Seconds spent waiting, after a block, for this copy's writer thread to turn the block's
        last steps into rows (``RunWriter.wait_rows``), 0 without a watch. Left to itself the
        thread does that (it wakes every 0.1 s) during the next variant's block, which would pay
        for it: ``replay=False``'s ~0.5 ms of rows a step fell on ``localize=False``, next in the
        order. Not counted in any figure: the wait (~0.5-0.7 ms a block) is mostly the two threads' hand-off,
        and what the thread does in it, a 0.1 s tail of a block's steps, is ~10 us of rows a step
        between observed ones; the rows of the observed step, the block's first, are made inside
        the block, as in a run."""
        if self.watch is None:
            return 0.0
        started = time.perf_counter()
        self.watch.writer.wait_rows()
        return time.perf_counter() - started

    def block(self, n: int) -> tuple[list[float], list[bool]]:
        """n steps: their times, and whether each observed modules (a layer_every step)."""
        times, observed = [], []
        for _ in range(n):
            obs = self.watch is not None and self.watch.observer is not None and self.watch.observer.observing
            times.append(self.step())
            observed.append(obs)
        return times, observed


def first_steps(variant: str, backend: str, n: int, blocks: bool = False) -> None:
    """In a subprocess of :func:`compile_time`: the first ``n`` steps' seconds and the graphs compiled.
    ``blocks``: each block compiled on its own, the rest eager."""
    torch.set_num_threads(1)
    logging.getLogger("ampwatch").setLevel(logging.WARNING)
    v = Variant(None if variant == "base" else {}, tempfile.mkdtemp(), "c", None if blocks else backend, False, False,
                blocks_backend=backend if blocks else None)
    times = [v.step() for _ in range(n)]
    print(variant, *(f"{t:.3f}" for t in times), torch._dynamo.utils.counters["stats"]["unique_graphs"])


def compile_time(backend: str, blocks: bool = False) -> None:
    """Seconds the first steps take with and without ampwatch, each in a fresh process with inductor's
    caches off: without, step 0 compiles the one graph; with, step 0 compiles the observed graph and
    step 1 the one the steps between observed ones run. Step ``layer_every`` (observed again) shows
    that neither compiles again."""
    import subprocess
    from ampwatch.record.options import SETTINGS
    every = next(s.default for s in SETTINGS if s.name == "layer_every")
    env = dict(os.environ, TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    here = str(Path(__file__).resolve().parent)
    how = f"torch.compile({backend})" + (" per block" if blocks else "")
    print(f"\n## compile time, {how}, GPT-2 small structure, {PATH_ARG} path, torch {torch.__version__}\n")
    print(f"| variant | step 0 s | step 1 s | step {every} s | graphs |")
    print("|---|---|---|---|---|")
    for variant in ("base", "ampwatch"):
        code = (f"import sys; sys.path.insert(0, {here!r}); import hostcost; "
                f"hostcost.first_steps({variant!r}, {backend!r}, {every + 1}, {blocks!r})")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        fields = next(line for line in out.splitlines() if line.startswith(variant)).split()
        times = fields[1:-1]
        print(f"| {variant} | {float(times[0]):.1f} | {float(times[1]):.1f} | {times[every]} | {fields[-1]} |")


def main() -> None:
    from ampwatch.record.options import SETTINGS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--copies", type=int, default=2, help="independent copies of the model per variant, "
                    "averaged (copies differ by up to ~0.3 ms a step where their memory lands)")
    ap.add_argument("--path", choices=["accelerator", "cpu"], default="accelerator")
    ap.add_argument("--compile", metavar="BACKEND", help="torch.compile every copy with this backend (inductor, aot_eager)")
    ap.add_argument("--compile-blocks", metavar="BACKEND", help="torch.compile each of the 12 blocks on its own "
                    "(torchtitan's way) with this backend; the rest runs eagerly")
    ap.add_argument("--fused", action="store_true", help="AdamW(fused=True) instead of the default AdamW")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast without a GradScaler (nothing to replay)")
    ap.add_argument("--positions", action="store_true",
                    help="also print each variant's median step by its place in the block, against the base's")
    ap.add_argument("--no-clip", action="store_true", help="a loop without clip_grad_norm_ (the recorder measures "
                    "the gradient norms itself)")
    ap.add_argument("--lazy-state", action="store_true", help="leave each copy's AdamW state to its first "
                    "step, as a loop does, instead of making it before attaching (state_now): where that "
                    "step puts it on the CPU heap moved the proxy's update arithmetic by up to ~0.2 ms a step")
    ap.add_argument("--compile-time", metavar="BACKEND", choices=["inductor", "aot_eager"], help="only time the compiling steps, with and without "
                    "ampwatch, with this backend (inductor's caches off)")
    args = ap.parse_args()
    if args.copies < 1 or args.rounds < 1:
        ap.error("--copies and --rounds must be at least 1")
    if args.compile_time:
        compile_time(args.compile_time, blocks=bool(args.compile_blocks))
        return
    every = next(s.default for s in SETTINGS if s.name == "layer_every")
    torch.set_num_threads(1)
    logging.getLogger("ampwatch").setLevel(logging.WARNING)
    folder = tempfile.mkdtemp()
    specs = [("base", None), ("base again", None), ("ampwatch", {}), ("replay=False", {"replay": False}),
             ("localize=False", {"localize": False})]
    if args.compile and args.compile_blocks:
        ap.error("--compile and --compile-blocks: one or the other")
    if not args.compile and not args.compile_blocks:
        specs.insert(2, ("hook floor", "hook floor"))
    else:
        # Every copy's graphs are cached under a code object of its own (a watched copy's forward
        # wrapper, a base copy's own class), but a copy that fell back to the hook guards shares
        # its class's: past Dynamo's recompile limit (8) a copy would silently run eager and the
        # table would compare eager with compiled. This process holds len(specs) x copies models.
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name,
                        max(getattr(torch._dynamo.config, name), 8 + 4 * len(specs) * args.copies))
    variants = {name: [Variant(options, folder, f"{name.replace('=', '_').replace(' ', '_')}_{c}", args.compile,
                               args.fused, args.bf16, not args.no_clip, args.compile_blocks,
                               not args.lazy_state)
                         for c in range(args.copies)]
                for name, options in specs}
    for copies in variants.values():
        for v in copies:
            v.compile_steps(3)  # compiles (both graphs: the first steps observe), learns, warms up
            v.block(every - 3)  # blocks start on a layer_every step from here on
    for copies in variants.values():
        for v in copies:
            v.optimizer_times.clear()  # the rounds' steps only
    mean: dict[str, list[float]] = {name: [] for name in variants}
    between: dict[str, list[float]] = {name: [] for name in variants}
    catch_up: dict[str, list[float]] = {name: [] for name in variants}
    by_position: dict[str, list[list[float]]] = {name: [[] for _ in range(every)] for name in variants}
    for copies in variants.values():
        for v in copies:
            v.catch_up()
    names = list(variants)
    for r in range(args.rounds):
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for c in range(args.copies):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times, observed = variants[name][c].block(every)
                catch_up[name].append(variants[name][c].catch_up())
                for i, t in enumerate(times):
                    by_position[name][i].append(t)
                runs[name].append((statistics.fmean(times),
                                   statistics.median(t for t, o in zip(times, observed) if not o)
                                   if not all(observed) else statistics.median(times)))
        for name, figures in runs.items():  # the mean over the variant's copies
            mean[name].append(statistics.fmean(f[0] for f in figures))
            between[name].append(statistics.fmean(f[1] for f in figures))
    modules = len(list(variants["base"][0].model.modules()))
    params = len(list(variants["base"][0].model.parameters()))
    mode = f"torch.compile({args.compile})" if args.compile else \
        f"torch.compile({args.compile_blocks}) per block" if args.compile_blocks else "eager"
    opt = ("AdamW(fused=True)" if args.fused else "AdamW") + (", bf16 without a scaler" if args.bf16 else ", fp16 + GradScaler") \
        + (", no clip" if args.no_clip else ", clip_grad_norm_") \
        + (", optimizer state made by the first step" if args.lazy_state else ", optimizer state made first")
    print(f"\n## GPT-2 small structure ({modules} modules, {params} parameters, tiny widths), {args.path} path, "
          f"{mode}, {opt}, torch {torch.__version__}, {args.rounds} rounds x {every} steps (layer_every) x "
          f"{args.copies} copies a variant, 1 thread\n")
    print("| variant | ms/step, whole blocks | added | ratio | ms/step between observed | added | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        added = statistics.median(v - b for v, b in zip(mean[name], mean["base"])) * 1e3
        ratio = statistics.median(v / b for v, b in zip(mean[name], mean["base"]))
        added_b = statistics.median(v - b for v, b in zip(between[name], between["base"])) * 1e3
        ratio_b = statistics.median(v / b for v, b in zip(between[name], between["base"]))
        print(f"| {name} | {statistics.median(mean[name]) * 1e3:.2f} | {added:+.2f} | {ratio:.3f}x "
              f"| {statistics.median(between[name]) * 1e3:.2f} | {added_b:+.2f} | {ratio_b:.3f}x |")
    print("\nthe optimizer's own step, timed between its step hooks, median ms: " + ", ".join(
        f"{name} {statistics.median(t for v in variants[name] for t in v.optimizer_times) * 1e3:.2f}"
        for name in names))
    print("each block's wait for its writer to catch up after it (not counted), median ms: " + ", ".join(
        f"{name} {statistics.median(catch_up[name]) * 1e3:.2f}" for name in names if variants[name][0].watch is not None))
    if args.positions:  # where in a block ampwatch's time lands: the observed step, and after it
        print("\nmedian step by its place in the block (0: the observed one), ms added to the base's:")
        print("| variant | " + " | ".join(str(i) for i in range(every)) + " |")
        print("|---|" + "---|" * every)
        base = [statistics.median(ts) for ts in by_position["base"]]
        for name in names[1:]:
            print(f"| {name} | " + " | ".join(f"{(statistics.median(ts) - b) * 1e3:+.2f}"
                                            for ts, b in zip(by_position[name], base)) + " |")
    if args.compile or args.compile_blocks:  # a watch that fell back pays the hook guards (docs/localization.md)
        fell_back = [name for name, copies in variants.items() for v in copies
                     if v.watch is not None and v.watch.observer is not None and v.watch.observer._split.guarded]
        print(f"\nwatches that fell back to guards on every hook dict: {len(fell_back) or 'none'}")
        print(f"graphs compiled in this process: {torch._dynamo.utils.counters['stats']['unique_graphs']}")
    for copies in variants.values():
        for v in copies:
            if v.watch is not None:
                v.watch.close()


if __name__ == "__main__":
    main()
