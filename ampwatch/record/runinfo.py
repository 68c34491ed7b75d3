"""What a run is: its name, file path, environment and parameter table, gathered once at attach."""
from __future__ import annotations

import itertools
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any, Optional

import torch

from .._version import __version__

from . import torch_access
from ..errors import ArgumentTypeError, OptionError, RunExistsError, RunPathIsFolderError
from ..store.schema import SCHEMA_VERSION
from ..userpath import path_text


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
    the others through the rendezvous store (:func:`torch_access.agreed_value`: one compare-and-set at
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
    agreed = torch_access.agreed_value(f"ampwatch/job_id/{next(_attach_count)}",
                                 f"{address}@{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now))}")
    return agreed or f"{address}@{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime(now))}"


def grad_sharding(model: torch.nn.Module, params: list[torch.Tensor], world_size: int) -> str:
    """'sharded' when each rank holds part of the gradients (FSDP2/DTensor ``Shard``, FSDP1): the
    global norm is sqrt(sum over ranks of grad_norm^2). 'replicated' for any other multi-process run
    (DDP all-reduces: every rank's grad_norm is the global one). 'none' for a single process."""
    if any(torch_access.is_sharded(p) for p in params) or torch_access.fsdp1_wrapped(model):
        return "sharded"
    return "replicated" if world_size > 1 else "none"


def parameter_table(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                    ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """The parameters we track (model's, tied weights once, then any optimizer-only ones) and their rows.

    A tied parameter (nanoGPT's ``lm_head.weight`` is ``transformer.wte.weight``) is tracked once
    under its first name; every other name it has goes into the row's ``aliases``."""
    params: list[torch.Tensor] = []
    rows: list[dict[str, Any]] = []
    index: dict[int, int] = {}

    def add(name: str, p: torch.Tensor) -> None:
        if id(p) in index:
            row = rows[index[id(p)]]
            if name not in row["_names"]:
                row["_names"].append(name)
            return
        index[id(p)] = len(params)
        rows.append({"id": len(params), "kind": "param", "name": name,
                     "type": str(p.dtype).replace("torch.", ""), "shape": "x".join(map(str, p.shape)),
                     "numel": p.numel(), "trainable": int(p.requires_grad), "_names": [name]})
        params.append(p)

    for name, p in model.named_parameters(remove_duplicate=False):
        add(name, p)
    for g, group in enumerate(optimizer.param_groups):
        for k, p in enumerate(group["params"]):
            if id(p) not in index:
                add(f"<optimizer group {g} param {k}>", p)
    for row in rows:
        others = row.pop("_names")[1:]
        row["aliases"] = json.dumps(others) if others else None
    return params, rows


def steps_taken(optimizer: Any) -> int:
    """How many updates the optimizer's state says it made before attach (Adam's ``step``; 0 for a
    fresh optimizer, or one that keeps no count, such as plain SGD). One read at attach: a fused
    Adam keeps the count on the device."""
    try:
        for state in optimizer.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if step is not None:
                return int(step.item() if isinstance(step, torch.Tensor) else step)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        pass
    return 0


def module_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """First name of every module registered under several names -> its other names."""
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name or "<model>")
    return {n[0]: n[1:] for n in names.values() if len(n) > 1}


def tied_owners(model: torch.nn.Module, params: list[torch.Tensor], module_names: list[str]
                ) -> dict[int, list[tuple[int, str]]]:
    """For each tied parameter (several names): (index of the owning module in ``module_names``,
    the parameter's name under that module), in registration order. Used to say which module's
    backward produced a non-finite weight gradient (packing.py)."""
    position = {name: i for i, name in enumerate(module_names)}
    by_id = {id(p): i for i, p in enumerate(params)}
    owners: dict[int, list[tuple[int, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            pid = by_id.get(id(p))
            m = position.get(module_name or "<model>")
            if pid is not None and m is not None:
                full = f"{module_name}.{pname}" if module_name else pname
                owners.setdefault(pid, []).append((m, full))
    return {pid: o for pid, o in owners.items() if len({m for m, _ in o}) > 1}


def param_count(model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    """Elements of the tracked parameters (tied weights once: ``params`` holds each once), less
    those of copies of the trained model held inside the watched module: an EMA or SWA average
    (timm's ``ModelEmaV3`` in a task object, torch's ``AveragedModel``) would count the model
    twice. Frozen parameters of the model itself still count."""
    copies = _copies_of_trained_model(model, {id(p) for g in optimizer.param_groups for p in g["params"]})
    return sum(p.numel() for p in params if id(p) not in copies)


def _copies_of_trained_model(model: torch.nn.Module, trained: set[int]) -> set[int]:
    """Ids of the parameters of every submodule that holds none of the optimizer's parameters
    and has the same parameter names and shapes as a module holding all of them (the trained
    model, or one of its ancestors). A frozen layer of the model itself is no such copy: no
    module that holds every trained parameter looks like it."""
    subtrees = []
    for _, module in model.named_modules():
        named = list(module.named_parameters())
        subtrees.append(({id(p) for _, p in named}, tuple((n, tuple(p.shape)) for n, p in named)))
    trained_here = trained & subtrees[0][0]
    if not trained_here:  # the optimizer holds copies of its own (fp32 master weights): nothing to compare
        return set()
    trained_model = {shape for ids, shape in subtrees if trained_here <= ids}
    copies: set[int] = set()
    for ids, shape in subtrees:
        if shape and ids.isdisjoint(trained) and shape in trained_model:
            copies |= ids
    return copies


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
        "optimizer": type(optimizer).__name__, "param_count": param_count(model, optimizer, params),
        "rank": rank, "world_size": world, "framework": options.get("framework"),
        "job_id": job_id(world), "grad_sharding": grad_sharding(model, params, world),
        "layer_every": options["layer_every"], "localize": int(options["localize"]),
        "config": config or {}, "schema_version": SCHEMA_VERSION,
    }
    info.update(torch_access.scaler_settings(scaler))
    info["scaler_enabled"] = int(info["scaler_enabled"])
    return info


def names_rank(path: str, rank: int) -> bool:
    """Whether ``path`` already names this rank's own file: the rank as a whole number right after
    a separator or the word ``rank`` (``runs/x_{rank}.sqlite``, ``rank3/x.sqlite``, ``x.r3.sqlite``).

    Decided without a collective, from this rank's path alone. A fixed path that merely contains the
    number (``lr_1e-4.sqlite`` on rank 1) is kept by that rank only; every other rank adds
    ``.rank<N>``, so the files stay distinct either way. Folders count only as ``rank<N>``: a
    number in a folder name (``/home/u/exp_1/runs``, pytest's ``test_x0``) says nothing about ranks."""
    folder, name = os.path.basename(os.path.dirname(path)), os.path.basename(path)
    number = rf"0*{rank}(?![0-9])"
    return (re.search(rf"(?:^|[_.=\-]|rank|r){number}", name, re.IGNORECASE) is not None
            or re.search(rf"rank[_\-]?{number}", folder, re.IGNORECASE) is not None)


def next_free(target: Path) -> Path:
    """``target`` or its first free numbered sibling (``x-2.sqlite``, ``x-3.sqlite``, ...)."""
    candidate, n = target, 1
    while candidate.exists():
        n += 1
        candidate = target.with_name(f"{target.stem}-{n}{target.suffix}")
    return candidate


def resolve_path(path: Optional[str], name: Optional[str], rank: int, world_size: int,
                 overwrite: bool = False, resumed_by: Optional[str] = None) -> tuple[Path, Optional[str]]:
    """Where this process records, and a sentence to log when that is not the path as given.

    - no ``path``: ``runs/<name or timestamp>.sqlite``, numbered (``-2``...) if that file exists;
    - ``{rank}`` is filled in; under several ranks, a path that already names this rank is used as
      given (:func:`names_rank`) and a path shared by every rank gets ``.rank<N>`` before its suffix;
    - an explicit path that exists is never redirected: :class:`RunExistsError` unless
      ``overwrite=True``, which removes the old file first; except under a framework callback
      (``resumed_by``) on a run resumed from a checkpoint, whose script gives the path the run
      before it had: a numbered sibling, so that resuming never stops at the start.
    """
    explicit = path is not None
    if path is None:
        stem = name or time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join("runs", f"{stem}.sqlite")
    path = path_text(path, OptionError, "ampwatch.attach: path", "runs/exp1.sqlite", type_error=ArgumentTypeError)
    note = None
    if world_size > 1 and "{rank}" not in path and not names_rank(path, rank):
        root, ext = os.path.splitext(path)
        shared = path
        path = f"{root}.rank{{rank}}{ext or '.sqlite'}"
        if explicit:
            note = (f"rank {rank} of {world_size}: {shared!r} names no rank, so rank {rank} records to "
                    f"{path.replace('{rank}', str(rank))!r} (put {{rank}} in the path to choose the name)")
    target = Path(path.replace("{rank}", str(rank))).absolute()
    if not explicit:
        return next_free(target), None
    if target.is_dir():  # checked first: overwrite=True replaces a run file, never a folder
        raise RunPathIsFolderError(
            f"{str(target)!r} is a folder, not a run file: pass a file path, e.g. "
            f"path={str(target / 'run.sqlite')!r} (overwrite=True never replaces a folder)")
    if target.exists():
        if not overwrite and resumed_by:
            numbered = next_free(target)
            return numbered, (f"{str(target)!r} holds the run before the checkpoint this {resumed_by} run "
                              f"resumes from: this one records to {str(numbered)!r}")
        if not overwrite:
            raise RunExistsError(f"{str(target)!r} already exists: pass overwrite=True to replace it, or a new "
                                 f"path (leave path=None for a fresh numbered file in runs/); a run resumed from "
                                 f"a checkpoint goes to a new path, with first_step=<the step it resumes at>")
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{target}{suffix}").unlink(missing_ok=True)
    return target, note
