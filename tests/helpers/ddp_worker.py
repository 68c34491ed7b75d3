"""Run by test_distributed.py in a subprocess: 2 DDP ranks (gloo, CPU), each attached to ampwatch."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))


def worker(rank: int, world: int, out: str, port: str) -> None:
    import ampwatch
    from loops import amp_step, data, gloo_ddp_mlp
    model, opt = gloo_ddp_mlp(rank, world, port)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=3)
    path = os.path.join(out, "ddp.sqlite")  # no {rank}: ampwatch adds it under world_size > 1
    with ampwatch.attach(model, opt, scaler, path=path, config={"world": world}):
        for i in range(12):
            amp_step(model, opt, scaler, *data(i * world + rank))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2, join=True)
