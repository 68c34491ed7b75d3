"""On a GPU: GPT-2 small step time with and without ampwatch, eager and torch.compile.

GPT-2 small (124M parameters, random weights from ``transformers.GPT2Config(use_cache=False)``: a
training loop has no use for the generation cache, and with it each block compiled on its own
recompiled per layer past Dynamo's limit, both copies alike), batch 8 x 1024
tokens, fp16 autocast + ``torch.amp.GradScaler("cuda")``, AdamW, the README loop (unscale_, clip,
step, update). Two copies of the same model: one watched, one not; timed in blocks interleaved
A B B A ..., each block ``--steps`` steps between two ``torch.cuda.synchronize()``; reported: the
median per-step time of each variant and the median of the paired block ratios. A block is as
long as ``layer_every`` by default, so each holds one live-observed step and the ratio is what a
run pays on average (shorter blocks alternate between blocks with and without one).

    python bench/gpu_gpt2.py                      # eager, then compiled (inductor)
    python bench/gpu_gpt2.py --modes eager --rounds 10
    python bench/gpu_gpt2.py --replay off     # every module observed on every step (no replay)
    python bench/gpu_gpt2.py --modes reduce-overhead --replay on   # inductor with CUDA graphs
    python bench/gpu_gpt2.py --modes blocks --replay on            # each block compiled on its own
    python bench/gpu_gpt2.py --fused off,on --replay on            # AdamW(fused=True) too
    python bench/gpu_gpt2.py --bf16 --fused off,on --replay on     # bf16 autocast, no GradScaler
    python bench/gpu_gpt2.py --fused on --loss inside --replay on  # the loss computed by the model

``--loss outside`` (the default) computes the loss from the logits in the loop, so the replay keeps
the logits' gradient (8 x 1024 x 50257 fp16, 823 MB); ``inside`` passes ``labels=`` and the model
computes it (Hugging Face's and nanoGPT's way), so it keeps one number.

Compiled, the copy without ampwatch is compiled as its user's process would compile it: under
torch's default guards (an observing watch turns on Dynamo's guards on module hooks for the
process; guards are built when a graph is compiled), and as an instance of a subclass with a
``forward`` of its own, so its graphs sit in a Dynamo cache of their own (hostcost.py does the same).
"""
from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch._dynamo
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ampwatch  # noqa: E402
from own_code import with_own_code  # noqa: E402


class Variant:
    def __init__(self, base: torch.nn.Module, watched: bool, compiled: Optional[str], x: torch.Tensor, folder: str,
                 layer_every: int = 20, replay: bool = True, fused: bool = False, bf16: bool = False,
                 loss_inside: bool = False) -> None:
        self.model = copy.deepcopy(base)
        blocks = compiled == "blocks"  # each block compiled on its own (torchtitan's way), before attach
        if compiled and not watched and not blocks:
            self.model.__class__ = _own_class(type(base))
        if blocks:
            for i, block in enumerate(self.model.transformer.h):
                self.model.transformer.h[i] = torch.compile(block)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused)
        self.scaler = None if bf16 else torch.amp.GradScaler("cuda")
        self.watch = ampwatch.attach(self.model, self.opt, self.scaler, path=f"{folder}/run.sqlite",
                                     layer_every=layer_every, replay=replay) if watched else None
        self.net = torch.compile(self.model, mode=compiled) if compiled and not blocks else self.model
        self.x = x
        self.loss_inside = loss_inside
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if watched:
            self.step()
        else:  # torch's default guards, as in a process without ampwatch (a watch's fallback turns them off)
            with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
                self.step()
        torch.cuda.synchronize()
        self.first_s = time.perf_counter() - t0
        self.block_ms: list[float] = []
        self.peak_gib: list[float] = []

    def step(self) -> None:
        with torch.autocast("cuda", dtype=torch.float16 if self.scaler is not None else torch.bfloat16):
            if self.loss_inside:
                loss = self.net(self.x, labels=self.x).loss
            else:
                logits = self.net(self.x).logits
        if not self.loss_inside:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), self.x.view(-1))
        if self.scaler is None:  # bf16: no scaler; the loss reaches the watch through log()
            loss.backward()
            if self.watch is not None:
                self.watch.log(loss=loss)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.opt)
            self.scaler.update()
        self.opt.zero_grad(set_to_none=True)

    def block(self, steps: int) -> float:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        # the peak of the block: both copies' weights and optimizer states are resident in every
        # block, so the difference between the variants' peaks is what recording adds at its peak.
        # Under CUDA graphs a graph's recording (its second run) peaks above its replays: the watched
        # copy records its observed graphs at its first observed step in the timed blocks (the
        # unwatched copy's all record in the warm-up), so the last block's peak is the steady one
        self.peak_gib.append(torch.cuda.max_memory_allocated() / 2 ** 30)
        return elapsed / steps * 1e3


_OWN_CLASSES: dict = {}


def _own_class(cls: type) -> type:
    """One subclass with its own ``forward`` code per base class: the unwatched copies of every
    configuration share its Dynamo cache (the same graph, as in one user's process)."""
    if cls not in _OWN_CLASSES:
        _OWN_CLASSES[cls] = with_own_code(cls)
    return _OWN_CLASSES[cls]


def measure(base: torch.nn.Module, x: torch.Tensor, compiled: Optional[str], args: argparse.Namespace,
            layer_every: int, replay: bool = True, fused: bool = False, loss_inside: bool = False) -> None:
    folder = tempfile.mkdtemp()
    bf16 = args.bf16
    # the watched copy first: attaching drops the graphs Dynamo cached for the model's classes
    # (record/compiled.py), which would make an unwatched copy compiled before it compile again
    watched = Variant(base, True, compiled, x, folder, layer_every, replay, fused, bf16, loss_inside)
    plain = Variant(base, False, compiled, x, folder, fused=fused, bf16=bf16, loss_inside=loss_inside)
    for v in (plain, watched):
        for _ in range(args.warmup):
            v.step()
    ratios = []
    steps = args.steps or layer_every
    for r in range(args.rounds):
        order = (plain, watched) if r % 2 == 0 else (watched, plain)
        got = {id(v): v.block(steps) for v in order}
        plain.block_ms.append(got[id(plain)])
        watched.block_ms.append(got[id(watched)])
        ratios.append(got[id(watched)] / got[id(plain)])
    mode = "torch.compile (inductor) per block" if compiled == "blocks" else \
        f"torch.compile (inductor, mode {compiled})" if compiled else "eager"
    mode += ", AdamW(fused=True)" if fused else ""
    mode += ", bf16 without a scaler" if bf16 else ""
    mode += ", loss inside the model" if loss_inside else ""
    print(f"{mode}, layer_every={layer_every}, replay={replay}: without {statistics.median(plain.block_ms):.2f} ms/step, "
          f"with {statistics.median(watched.block_ms):.2f} ms/step, median paired ratio "
          f"{statistics.median(ratios):.4f}x (min {min(ratios):.4f}, max {max(ratios):.4f}) over "
          f"{args.rounds} rounds of {steps} steps; first step {plain.first_s:.1f} s vs "
          f"{watched.first_s:.1f} s; peak memory in a block {max(plain.peak_gib):.2f} vs "
          f"{max(watched.peak_gib):.2f} GiB, in the last {plain.peak_gib[-1]:.2f} vs {watched.peak_gib[-1]:.2f} GiB",
          flush=True)
    if watched.watch is not None:
        watched.watch.close()
        run = ampwatch.load(f"{folder}/run.sqlite")
        steps = run.steps
        if len(steps) == 0 or run.info["status"] != "finished":
            print(f"  RECORDING FAILED: {len(steps)} steps, status {run.info['status']}: {run.info.get('error')}")
        else:
            print(f"  recorded {len(steps)} steps, skipped {int(steps.skipped.sum())}, last loss "
                  f"{steps.loss.iloc[-1]:.4f}, last scale {steps.loss_scale.iloc[-1]:.0f}, "
                  f"{len(run.events)} NaN/Inf events", flush=True)
    del plain, watched
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="eager,compile",
                        help="eager, compile (inductor, mode default), blocks (each block compiled on its "
                        "own), reduce-overhead or max-autotune")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=0, help="steps per timed block (default: layer_every)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layer-every", default="20", help="comma-separated layer_every values")
    parser.add_argument("--replay", default="on,off", help="ampwatch's replay option: on, off or on,off")
    parser.add_argument("--fused", default="off", help="AdamW(fused=True): off, on or off,on")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast without a GradScaler (loss via watch.log)")
    parser.add_argument("--loss", default="outside", help="where the loss is computed: outside (from the logits, "
                        "in the loop), inside (labels=, by the model) or outside,inside")
    args = parser.parse_args()
    logging.getLogger("ampwatch").setLevel(logging.WARNING)
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(use_cache=False)).cuda()
    n = sum(p.numel() for p in base.parameters())
    x = torch.randint(0, base.config.vocab_size, (args.batch, args.seq), device="cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, GPT-2 small {n / 1e6:.1f}M params, "
          f"batch {args.batch} x {args.seq}, {'bf16 autocast' if args.bf16 else 'fp16 autocast + GradScaler'}, "
          f"AdamW", flush=True)
    for mode in args.modes.split(","):
        for le in (int(v) for v in args.layer_every.split(",")):
            for replay in args.replay.split(","):
                for fused in args.fused.split(","):
                    for where in args.loss.split(","):
                        compiled = None if mode == "eager" else "default" if mode == "compile" else mode
                        measure(base, x, compiled, args, le, replay == "on", fused == "on", where == "inside")


if __name__ == "__main__":
    main()
