"""What Dynamo's guards cost per call of a compiled model, with and without ampwatch.

Before it runs a compiled graph, Dynamo checks the graph's guards: that the model, its modules,
their flags and the inputs are still what the graph was traced for. A watch that observes modules
wraps the model's forward (ampwatch/record/compiled.py): its graphs are cached under a code object of
their own and told apart by one flag, observed steps or not, and torch's default guards stay for
every compiled model of the process. Only when that split cannot hold (a graph break inside the
model, its forward replaced over the wrapper) does the watch fall back to torch's guards on module
hooks (``skip_nnmodule_hook_guards = False``), process-wide: every model compiled after that checks
every module's hook dicts, and so did every compiled model of the process once an observing watch
attached, before the split.

Measured here on GPT-2 small's module tree (``bench/hostcost.py``'s model) by timing the guard check
of the compiled forward itself (``guard_manager.check`` on the frame's own locals, the call Dynamo
makes before every run of the graph), median of many, for: an unwatched model under torch's
default guards, the same with hook guards on (what the fallback costs), a watched model's two graphs
(the one between observed steps, and the observed one), and a model watched with ``localize=False``. Dynamo builds the guards, not the backend: ``aot_eager``
compiles fastest and checks the same guards as inductor.

A guard check run in a tight loop is the floor: inside a training step, between a forward and
backward of real work, the same checks find colder caches. ``--in-step`` measures that instead: two
unwatched copies of the model, each a code object of its own, one compiled under torch's default
guards and one with the hook guards on, timed forward (the guards and the graph) in interleaved
training steps.

    python bench/guards.py
    python bench/guards.py --in-step 300
"""
from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("AMPWATCH_CPU_AS_ACCELERATOR", "1")  # before ampwatch is imported

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ampwatch  # noqa: E402
from hostcost import make_step, model_and_batch  # noqa: E402


def frame_locals(model: torch.nn.Module, x: torch.Tensor, code) -> dict:
    """The locals ``code`` (the compiled frame) starts with when the model is called on ``x``:
    caught from an eager call, as Dynamo hands them to the guards."""
    caught: dict = {}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code and not caught:
            caught.update(frame.f_locals)
    sys.setprofile(profile)
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            model(x, use_cache=False)
    finally:
        sys.setprofile(None)
    return caught


def check_time(entry, f_locals: dict, n: int = 400) -> float:
    """Median microseconds of one guard check (``n`` checks, in runs of 20), which must pass."""
    manager = entry.guard_manager
    with torch.autocast("cpu", dtype=torch.float16):  # the state the graph was traced under
        if not manager.check(f_locals):
            raise RuntimeError("the guards do not pass for these locals: not the graph this call runs")
        runs = []
        for _ in range(n // 20):
            t0 = time.perf_counter()
            for _ in range(20):
                manager.check(f_locals)
            runs.append((time.perf_counter() - t0) / 20)
    return statistics.median(runs) * 1e6


def train(net, model, x, opt, scaler, steps: int) -> None:
    """``steps`` steps of bench/hostcost.py's loop (fp16, GradScaler, unscale_, clip)."""
    step = make_step(model, net, x, opt, scaler, None)
    for _ in range(steps):
        step()


def passing_entry(code, f_locals: dict):
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    with torch.autocast("cpu", dtype=torch.float16):
        return next(e for e in _debug_get_cache_entry_list(code) if e.guard_manager.check(f_locals))


def in_step(steps: int) -> None:
    """Forward time of two unwatched copies, default guards against hook guards, in training steps."""
    copies = {}
    for label, hook_guards in (("torch's default guards", False), ("hook guards on", True),
                               ("torch's default guards, again", False), ("hook guards on, again", True)):
        model, x = model_and_batch(own_code=True)  # a cache of its own: guards as compiled here
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        net = torch.compile(model, backend="aot_eager")
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=not hook_guards):
            train(net, model, x, opt, torch.amp.GradScaler("cpu"), 2)  # compiles: guards are built now
        copies[label] = (net, model, x, opt, torch.amp.GradScaler("cpu"), [])
    for _ in range(steps):
        for net, model, x, opt, scaler, times in copies.values():
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = net(x, use_cache=False).logits
            times.append(time.perf_counter() - t0)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), x.view(-1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    base = statistics.median(copies["torch's default guards"][-1])
    print(f"\n## forward of the compiled GPT-2 small tree inside training steps (aot_eager), torch "
          f"{torch.__version__}, {steps} steps, 1 thread\n")
    print("| copy | forward ms, median | added |")
    print("|---|---|---|")
    for label, entry in copies.items():
        median = statistics.median(entry[-1])
        print(f"| {label} | {median * 1e3:.3f} | {(median - base) * 1e3:+.3f} ms |")


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--in-step", type=int, metavar="STEPS", help="time the forward inside this many "
                    "training steps instead of the guard check alone")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.in_step:
        in_step(args.in_step)
        return
    logging.getLogger("ampwatch").setLevel(logging.WARNING)
    rows = []

    def unwatched(label: str) -> None:
        model, x = model_and_batch()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        net = torch.compile(model, backend="aot_eager")
        train(net, model, x, opt, torch.amp.GradScaler("cpu"), 2)
        code = type(model).forward.__code__
        f_locals = frame_locals(model, x, code)
        rows.append((label, check_time(passing_entry(code, f_locals), f_locals)))

    unwatched("unwatched, torch's default guards")

    # a watch that observes no module, before any that does: torch's default guards stay
    torch._dynamo.reset()
    model, x = model_and_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    watch = ampwatch.attach(model, opt, scaler, path=f"{tempfile.mkdtemp()}/nl.sqlite", localize=False)
    net = torch.compile(model, backend="aot_eager")
    train(net, model, x, opt, scaler, 2)
    code = type(model).forward.__code__
    f_locals = frame_locals(model, x, code)
    rows.append(("watched, localize=False (no module observed)", check_time(passing_entry(code, f_locals), f_locals)))
    watch.close()

    torch._dynamo.reset()
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):  # what the fallback sets, process-wide
        unwatched("unwatched, hook guards on (what a watch's fallback turns on)")
    torch._dynamo.reset()

    model, x = model_and_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    every = 4
    watch = ampwatch.attach(model, opt, scaler, path=f"{tempfile.mkdtemp()}/run.sqlite", layer_every=every)
    net = torch.compile(model, backend="aot_eager")
    train(net, model, x, opt, scaler, every + 1)  # both graphs compiled; the next step observes nothing
    if watch.observer._split.guarded:
        raise RuntimeError("the watch fell back to guards on every hook dict: not what this measures")
    code = model.__dict__["forward"].func.__code__  # the wrapper's own code object, where its graphs are
    f_locals = frame_locals(model, x, code)  # eager call of the model: between observed steps, no hook runs
    rows.append(("watched, a step between observed ones", check_time(passing_entry(code, f_locals), f_locals)))
    watch.observer.set_observing(True)  # the hooks in, as on a layer_every step
    rows.append(("watched, an observed step", check_time(passing_entry(code, f_locals), f_locals)))
    watch.observer.set_observing(False)
    watch.close()


    modules = len(list(model.modules()))
    print(f"\n## Dynamo guard check per call of the compiled forward, GPT-2 small's tree ({modules} modules), "
          f"torch {torch.__version__}, 1 thread\n")
    print("| graph | us per call |")
    print("|---|---|")
    for label, us in rows:
        print(f"| {label} | {us:.1f} |")


if __name__ == "__main__":
    main()
