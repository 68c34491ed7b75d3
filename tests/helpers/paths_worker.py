"""Run by test_paths.py in a subprocess: 2 gloo ranks attach with three kinds of path."""
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
    scaler = torch.amp.GradScaler("cpu")
    paths = {"fstring": os.path.join(out, f"run_{rank}.sqlite"),   # already one file per rank: as given
             "placeholder": os.path.join(out, "ph-{rank}.sqlite"),  # filled in
             "fixed": os.path.join(out, "shared.sqlite")}          # shared: .rank<N> is added
    for kind, path in paths.items():
        with ampwatch.attach(model, opt, scaler, path=path, config={"kind": kind}) as watch:
            for i in range(2):
                amp_step(model, opt, scaler, *data(i * world + rank))
        print(f"{kind} rank{rank} {watch.path}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2, join=True)
