"""Run by test_distributed.py in a subprocess: 2 DDP ranks (gloo, CPU), each attached to ampwatch."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))


def worker(rank: int, world: int, out: str, port: str, how: str = "") -> None:
    """``how``: "compiled", the DDP model under ``torch.compile`` (aot_eager); "blocks", each Linear
    compiled on its own (aot_eager, torchtitan's way, before attach); or "eager": all on the
    accelerator path with modules observed every third step, 7 steps; "": the CPU path, 12 steps."""
    compiled = how == "compiled"
    if how:
        os.environ["AMPWATCH_CPU_AS_ACCELERATOR"] = "1"  # hooks out between observed steps
    import ampwatch
    from loops import amp_step, data, gloo_ddp_mlp
    model, opt = gloo_ddp_mlp(rank, world, port)
    if how == "blocks":
        layers = model.module
        for i, layer in enumerate(layers):
            if isinstance(layer, torch.nn.Linear):
                layers[i] = torch.compile(layer, backend="aot_eager")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=3)
    path = os.path.join(out, f"ddp{how}.sqlite")  # no {rank}: ampwatch adds it under world_size > 1
    options = {"layer_every": 3} if how else {}
    with ampwatch.attach(model, opt, scaler, path=path, config={"world": world}, **options):
        net = torch.compile(model, backend="aot_eager") if compiled else model
        for i in range(7 if how else 12):
            amp_step(net, opt, scaler, *data(i * world + rank))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, *sys.argv[1:4]), nprocs=2, join=True)
