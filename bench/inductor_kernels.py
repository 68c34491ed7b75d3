"""Inductor's kernels for the reference GPT, with and without ampwatch, on an unobserved step.

Compiles the reference GPT (TinyGPT, 4 layers, d_model 256, seq 128, vocab 2000) with inductor on
the accelerator path (``AMPWATCH_CPU_AS_ACCELERATOR=1``: module values observed only on
``layer_every`` steps and replays, as on a GPU) and counts the kernels inductor generates for the
forward and backward graphs it compiles (``torch._inductor.metrics.generated_kernel_count``) and the
ampwatch op calls in the graph Dynamo hands it (the forward's; the gradient hooks' ``keep_max`` calls
reach the backward graph later, through AOTAutograd), per variant:

- ``without``: no ampwatch;
- ``unobserved``: ampwatch attached, a step between ``layer_every`` steps (what most steps run);
- ``observed``: ampwatch attached, a ``layer_every`` step (the second graph, compiled once).

    python bench/inductor_kernels.py            # one torch thread, fp16 autocast, GradScaler, AdamW
"""
from __future__ import annotations

import copy
import os
import sys
import tempfile
from pathlib import Path

os.environ["AMPWATCH_CPU_AS_ACCELERATOR"] = "1"

import torch  # noqa: E402
import torch._inductor.metrics as metrics  # noqa: E402
from torch.nn import functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ampwatch  # noqa: E402
from ampwatch.samples.models import TinyGPT  # noqa: E402

VOCAB, SEQ, BATCH = 2000, 128, 2
observe_calls = {"n": 0}


def counting_inductor(gm: torch.fx.GraphModule, example_inputs):
    """Inductor, after counting the ampwatch ops Dynamo put in the graph."""
    observe_calls["n"] += sum(1 for node in gm.graph.nodes if "ampwatch" in str(node.target))
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(gm, example_inputs)


def step(net, model, opt, scaler, x, y) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        out = net(x)
    loss = F.cross_entropy(out.float().view(-1, VOCAB), y.reshape(-1))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def compiled_kernels(base: torch.nn.Module, watched: bool, folder: str) -> list[tuple[str, int, int]]:
    """(which step, kernels generated, ampwatch op calls) for each step that compiled something."""
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    watch = ampwatch.attach(model, opt, scaler, path=f"{folder}/run.sqlite", layer_every=4) if watched else None
    net = torch.compile(model, backend=counting_inductor)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    found = []
    for i in range(6):
        observing = watch is not None and watch.observer.observing
        metrics.reset()
        observe_calls["n"] = 0
        step(net, model, opt, scaler, x, y)
        if metrics.generated_kernel_count:
            found.append(("observed" if observing else ("unobserved" if watched else "without"),
                          metrics.generated_kernel_count, observe_calls["n"]))
    if watch is not None:
        watch.close()
    return found


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = TinyGPT(vocab=VOCAB, d=256, layers=4, seq=SEQ)
    with tempfile.TemporaryDirectory() as folder:
        rows = compiled_kernels(base, False, folder) + compiled_kernels(base, True, folder)
    print(f"{'variant':<12} {'kernels':>8} {'ampwatch ops in graph':>22}")
    for name, kernels, ops in rows:
        print(f"{name:<12} {kernels:>8} {ops:>22}")


if __name__ == "__main__":
    main()
