"""Run by test_group.py in a subprocess: 4 DDP ranks (gloo, CPU), each attached to ampwatch, with a
forward overflow injected into rank 2's second micro-batch at one step."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(__file__))

STEPS, BAD_STEP, BAD_RANK, WORLD = 8, 5, 2, 4


def worker(rank: int, world: int, out: str, port: str) -> None:
    import ampwatch
    from loops import data, gloo_ddp_mlp
    model, opt = gloo_ddp_mlp(rank, world, port)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)  # low: no warm-up overflow to confuse
    with ampwatch.attach(model, opt, scaler, path=os.path.join(out, "ddp.sqlite")):
        for i in range(STEPS):
            x, y = data(i * world + rank)
            for k, (xb, yb) in enumerate(zip(x.chunk(2), y.chunk(2))):
                if i == BAD_STEP and rank == BAD_RANK and k == 1:
                    xb = xb * 1e6  # a corrupt sample: the first Linear's fp16 output overflows
                with torch.autocast("cpu", dtype=torch.float16):
                    out_ = model(xb)
                scaler.scale(F.mse_loss(out_.float(), yb) / 2).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(WORLD, sys.argv[1], sys.argv[2]), nprocs=WORLD, join=True)
