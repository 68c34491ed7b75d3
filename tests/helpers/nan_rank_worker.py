"""Run by test_batches.py in a subprocess: 2 DDP ranks (gloo, CPU); rank 1 feeds a NaN at step 4.
Precision ``fp16`` (a GradScaler: both ranks skip step 4) or ``bf16`` (no scaler, nothing skips, no
loss logged: the update writes NaN into the weights from step 4 on)."""
import hashlib
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))


def worker(rank: int, world: int, out: str, port: str, path_kind: str, precision: str = "fp16") -> None:
    if path_kind == "accelerator":
        os.environ["AMPWATCH_CPU_AS_ACCELERATOR"] = "1"
    import ampwatch
    from loops import amp_step, data, gloo_ddp_mlp
    model, opt = gloo_ddp_mlp(rank, world, port)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    with ampwatch.attach(model, opt, scaler, path=os.path.join(out, "job.sqlite"), layer_every=5):
        for i in range(8):
            x, y = data(i * world + rank)
            if i == 4 and rank == 1:
                x = x.clone()
                x[0, 0] = float("nan")
                with open(os.path.join(out, "truth.txt"), "w") as f:
                    f.write(hashlib.sha256(x.numpy().tobytes()).hexdigest())
            amp_step(model, opt, scaler, x, y, dtype=dtype)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, *sys.argv[1:5]), nprocs=2, join=True)
