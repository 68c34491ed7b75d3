"""Run by test_fsdp.py as one of 2 processes (gloo, CPU): FSDP2 and FSDP1 with ShardedGradScaler.

Usage: fsdp_worker.py OUT PORT RANK WORLD. Every scenario (FSDP2 eager and with its layers
compiled, FSDP1) trains a real model attached to ampwatch
and writes the harness's own ground truth next to the run files (OUT/truth.rank<R>.json): the
full-tensor gradient norms (through the harness's own collectives, outside what it counts), the
scale, the loss, and whether each rank's parameters changed. It also counts the collectives of
every training step with and without ampwatch attached, and compares the trained parameters bitwise.
"""
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # FSDP2 before torch 2.6
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn import functional as F
from torch.profiler import profile

STEPS = 10
_COLLECTIVE_PREFIXES = ("gloo:", "c10d::", "_c10d_functional::")


def model_fsdp2(mp_dtype=None, backend=None) -> nn.Module:
    """``backend``: each layer compiled with it, then sharded (torchtitan's order, block by block)."""
    torch.manual_seed(0)
    # the last layer has one output: rank 1's shards of its weight and bias are empty
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))
    policy = MixedPrecisionPolicy(param_dtype=mp_dtype) if mp_dtype else MixedPrecisionPolicy()
    for i, layer in enumerate(model):
        if isinstance(layer, nn.Linear):
            if backend:
                layer = model[i] = torch.compile(layer, backend=backend)
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def model_fsdp1() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    return FullyShardedDataParallel(model, device_id=torch.device("cpu"))


BAD_STEP, BAD_RANK = 4, 1


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data, as in data parallel
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
    if (step, rank) == (BAD_STEP, BAD_RANK):
        x[7, 3] = 1e5  # a bad sample on one rank: fp16 turns it into inf inside layer 0's forward
    return x, y


def collectives(prof) -> int:
    return sum(1 for e in prof.events() if e.name.startswith(_COLLECTIVE_PREFIXES)) if prof else 0


def full_norms(model: nn.Module, kind: str, scale: float) -> tuple[float, dict]:
    """The harness's own unscaled global gradient norm (collectives of its own, outside the count)."""
    if kind == "fsdp1":  # torch's own clip_grad_norm_ over the flat shards; max_norm=inf changes nothing
        return float(model.clip_grad_norm_(float("inf"))) / scale, {}
    per_param = {n: float(p.grad.full_tensor().double().norm()) / scale
                 for n, p in model.named_parameters() if p.grad is not None}
    return sum(v * v for v in per_param.values()) ** 0.5, per_param


def train(kind: str, rank: int, path=None, autocast=True, mp_dtype=None, count=False, backend=None) -> dict:
    """``backend``: each layer compiled with it (model_fsdp2); the graphs compiled and the graph breaks
    are counted."""
    counters = torch._dynamo.utils.counters
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    model = model_fsdp1() if kind == "fsdp1" else model_fsdp2(mp_dtype, backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0 ** 20, growth_interval=3)
    watch = None
    if path is not None:
        import ampwatch
        watch = ampwatch.attach(model, opt, scaler, path=path, layer_every=1)
    truth: dict = {"loss": [], "scale": [], "applied": [], "norm": [], "param_norms": [], "collectives": []}
    for step in range(STEPS):
        x, y = batch(step, rank)
        before = [p.detach().clone() for p in model.parameters()]
        with (profile() if count else contextlib.nullcontext()) as prof:
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            scaler.scale(loss).backward()
        n_coll = collectives(prof)
        scale = float(scaler.get_scale())
        norm, per_param = full_norms(model, kind, scale)
        with (profile() if count else contextlib.nullcontext()) as prof:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        truth["collectives"].append(n_coll + collectives(prof))
        truth["loss"].append(float(loss.detach()))
        truth["scale"].append(scale)
        truth["norm"].append(norm)
        truth["param_norms"].append(per_param)
        truth["applied"].append(any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters())))
    if watch is not None:
        watch.close()
    truth["graph_breaks"] = sum(counters["graph_break"].values()) - breaks
    truth["graphs"] = counters["stats"]["unique_graphs"] - graphs  # after attach's reset: those of this run
    truth["final"] = [p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
                      for p in model.parameters()]
    return truth


def bitwise_equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def same_floats(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))  # NaN is NaN


def main(out: str, port: str, rank: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_RUN_ID="none")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    scenarios = {
        "fp16": dict(kind="fsdp2", count=True),
        "mp_fp16": dict(kind="fsdp2", autocast=False, mp_dtype=torch.float16),
        "mp_bf16": dict(kind="fsdp2", autocast=True, mp_dtype=torch.bfloat16),
        "fsdp1": dict(kind="fsdp1"),
        "compiled": dict(kind="fsdp2", backend="aot_eager"),
    }
    for name, kwargs in scenarios.items():
        if name == "fsdp1":  # torchrun with a rendezvous id: the job id is that id
            os.environ["TORCHELASTIC_RUN_ID"] = "elastic-42"
        attached = train(rank=rank, path=os.path.join(out, f"{name}_{{rank}}.sqlite"), **kwargs)
        results[name] = {k: v for k, v in attached.items() if k != "final"}
        if name in ("fp16", "compiled"):  # the same training without ampwatch, in this process: bitwise equal?
            plain = train(rank=rank, **kwargs)
            results[name]["plain_collectives"] = plain["collectives"]
            results[name]["plain_loss"] = plain["loss"]
            results[name]["bitwise_equal"] = (bitwise_equal(attached["final"], plain["final"])
                                              and same_floats(attached["scale"], plain["scale"])
                                              and same_floats(attached["loss"], plain["loss"]))
    with open(os.path.join(out, f"truth.rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
