"""What a run is: its name, file path, environment and parameter table, gathered once at attach."""
from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional

import torch

from . import __version__, probes
from .schema import SCHEMA_VERSION


def _distributed() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_attach_count = itertools.count()  # per process: the n-th watch of every rank agrees on one key


def job_id(world_size: int) -> Optional[str]:
    """What every rank of one job records alike, so a reader can put the ranks back together.

    ``TORCHELASTIC_RUN_ID`` (torchrun's rendezvous id) when it names the job: torchrun without
    ``--rdzv-id`` or ``--standalone`` sets it to ``none`` for every job, which names nothing. Else
    ``MASTER_ADDR:MASTER_PORT@<UTC time>``, the time being the first rank's attach time, handed to
    the others through the rendezvous store (:func:`probes.agreed_value`: one compare-and-set at
    attach, not a collective, no waiting). Only without a store (no such process group) does each
    rank fall back to its own time rounded down to the minute, which can split a job whose ranks
    attach on either side of a minute. None for a single process.
    """
    if world_size <= 1:
        return None
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id.lower() != "none":
        return run_id
    address = f"{os.environ.get('MASTER_ADDR', socket.gethostname())}:{os.environ.get('MASTER_PORT', '')}"
    now = time.time()
    agreed = probes.agreed_value(f"ampwatch/job_id/{next(_attach_count)}",
                                 f"{address}@{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now))}")
    return agreed or f"{address}@{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime(now))}"


def grad_sharding(model: torch.nn.Module, params: list[torch.Tensor], world_size: int) -> str:
    """'sharded' when each rank holds part of the gradients (FSDP2/DTensor ``Shard``, FSDP1): the
    global norm is sqrt(sum over ranks of grad_norm^2). 'replicated' for any other multi-process run
    (DDP all-reduces: every rank's grad_norm is the global one). 'none' for a single process."""
    if any(probes.is_sharded(p) for p in params) or probes.fsdp1_wrapped(model):
        return "sharded"
    return "replicated" if world_size > 1 else "none"


def parameter_table(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                    ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """The parameters we track (model's, tied weights once, then any optimizer-only ones) and their rows."""
    params: list[torch.Tensor] = []
    rows: list[dict[str, Any]] = []
    seen: set[int] = set()

    def add(name: str, p: torch.Tensor) -> None:
        if id(p) in seen:
            return
        seen.add(id(p))
        rows.append({"id": len(params), "kind": "param", "name": name,
                     "type": str(p.dtype).replace("torch.", ""), "shape": "x".join(map(str, p.shape)),
                     "numel": p.numel(), "trainable": int(p.requires_grad)})
        params.append(p)

    for name, p in model.named_parameters(remove_duplicate=True):
        add(name, p)
    for g, group in enumerate(optimizer.param_groups):
        for k, p in enumerate(group["params"]):
            add(f"<optimizer group {g} param {k}>", p)
    return params, rows


def describe_run(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any,
                 name: Optional[str], config: Optional[dict], options: dict[str, Any],
                 params: list[torch.Tensor]) -> dict[str, Any]:
    rank, world = _distributed()
    if options.get("rank") is not None:
        rank = options["rank"]
    device = params[0].device if params else torch.device("cpu")
    info = {
        "name": name, "status": "running", "started_at": time.time(), "heartbeat_at": time.time(),
        "pid": os.getpid(), "hostname": socket.gethostname(), "torch_version": torch.__version__,
        "ampwatch_version": __version__, "device": str(device), "amp_dtype": None,
        "optimizer": type(optimizer).__name__, "param_count": sum(p.numel() for p in params),
        "rank": rank, "world_size": world, "framework": options.get("framework"),
        "job_id": job_id(world), "grad_sharding": grad_sharding(model, params, world),
        "layer_every": options["layer_every"], "localize": int(options["localize"]),
        "config": config or {}, "schema_version": SCHEMA_VERSION,
    }
    info.update(probes.scaler_settings(scaler))
    info["scaler_enabled"] = int(info["scaler_enabled"])
    return info


def resolve_path(path: Optional[str], name: Optional[str], rank: int, world_size: int) -> Path:
    """``runs/<name or timestamp>.sqlite`` by default; ``{rank}`` is filled in (and added under
    distributed training); an existing file is never overwritten: a numbered sibling is used."""
    if path is None:
        stem = name or time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join("runs", f"{stem}.sqlite")
    path = os.fspath(path)
    if world_size > 1 and "{rank}" not in path:
        root, ext = os.path.splitext(path)
        path = f"{root}.rank{{rank}}{ext or '.sqlite'}"
    target = Path(path.replace("{rank}", str(rank))).absolute()
    candidate, n = target, 1
    while candidate.exists():
        n += 1
        candidate = target.with_name(f"{target.stem}-{n}{target.suffix}")
    return candidate
