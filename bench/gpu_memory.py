"""On a GPU: memory step by step under CUDA graphs (``torch.compile(mode="reduce-overhead")``), with
and without ampwatch, to take apart what an observed step adds.

One GPT-2 (random weights, ``--layers`` blocks), batch ``--batch`` x ``--seq``, fp16 autocast +
GradScaler, AdamW, the README loop; one model per process, so nothing else shares its CUDA graph
tree. Each step prints the peak allocated during it (``torch.cuda.max_memory_allocated`` reset
before it), what stays allocated after it, and what the allocator has reserved; observed steps
are those at multiples of ``--layer-every``. ``--partition off`` turns inductor's graph
partitioning off, so a graph holding an op kept out of CUDA graphs runs without them whole
instead of being split around the op.

    python bench/gpu_memory.py --watch off
    python bench/gpu_memory.py --watch on
    python bench/gpu_memory.py --watch on --partition off
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ampwatch  # noqa: E402
from hostcost import make_step  # noqa: E402  (the README loop; its CPU-path switch touches only the CPU)

GIB = 2 ** 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watch", default="on", choices=("on", "off"))
    parser.add_argument("--partition", default="default", choices=("default", "off"),
                        help="inductor's graph partitioning (torch._inductor.config.graph_partition)")
    parser.add_argument("--mode", default="reduce-overhead", help="torch.compile mode")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layer-every", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    logging.getLogger("ampwatch").setLevel(logging.WARNING)
    if args.partition == "off":
        torch._inductor.config.graph_partition = False
    from transformers import GPT2Config, GPT2LMHeadModel
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(use_cache=False, n_layer=args.layers)).to(device)
    x = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device.type)
    watch = None
    if args.watch == "on":
        watch = ampwatch.attach(model, opt, scaler, path=f"{tempfile.mkdtemp()}/run.sqlite",
                                layer_every=args.layer_every)
    net = torch.compile(model, mode=args.mode)
    step = make_step(model, net, x, opt, scaler, watch)
    cuda = device.type == "cuda"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else device}, GPT-2 "
          f"{args.layers} layers, batch {args.batch} x {args.seq}, mode {args.mode}, ampwatch {args.watch}, "
          f"graph_partition {torch._inductor.config.graph_partition}", flush=True)
    peaks: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        seconds = step()  # fp16 autocast + GradScaler, unscale_, clip, AdamW
        observed = watch is not None and i % args.layer_every == 0
        if cuda:
            torch.cuda.synchronize()
            peak, now, reserved = (torch.cuda.max_memory_allocated() / GIB, torch.cuda.memory_allocated() / GIB,
                                   torch.cuda.memory_reserved() / GIB)
            if i >= 2:  # past the recordings of the first steps
                peaks[observed].append(peak)
        else:
            peak = now = reserved = 0.0
        print(f"step {i:3d}{' observed' if observed else '         '} {seconds:7.3f} s  peak "
              f"{peak:6.2f} GiB  allocated after {now:6.2f} GiB  reserved {reserved:6.2f} GiB", flush=True)
    for observed, got in peaks.items():
        if got:
            print(f"{'observed' if observed else 'healthy'} steps past step 2: peak {min(got):.2f}-{max(got):.2f} GiB")
    if watch is not None:
        watch.close()


if __name__ == "__main__":
    main()
