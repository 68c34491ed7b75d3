"""The inputs of a step whose forward went NaN/Inf, saved in the run file to reproduce it.

"Inf born in h.1.mlp.fc at step 180" says where; to run that step again the user needs the batch
it ran on, which the data loader has long shuffled past. When a step's forward made a non-finite
loss or output, the root module's inputs of each micro-batch that did (its tensor arguments, by
name: ``args[0]``, ``kwargs['input_ids']``, ``args[0]['pixel_values']``) are copied to the host
and written to the ``batches`` table with their dtype, shape and SHA-256: the data loader's
sample can be found by its hash, or the batch fed again to a checkpoint of the step before.

Nothing is done on a healthy step. With replay (an accelerator and a GradScaler, or bf16 on an
accelerator) the step's inputs are the replay's kept references, and the replay tells which
micro-batches made non-finite outputs (a read per micro-batch of a replayed step). Where reads are
free (the CPU), and where every step is observed (DDP, FSDP, ``replay=False``), a pre-hook on the
root keeps a reference to each micro-batch's arguments until the step ends (no copy; on a device
the latest only, as holding the others would hold device memory the loop had freed), and the
step's losses say which went bad: read for free on the CPU (the pack's loss), and elsewhere only
on a step the scaler skipped (the host knows that already). Elsewhere, on a step whose module
values are measured live, the latest micro-batch goes to the writer thread by reference with the
step's pack, and is saved there when those values say its forward went bad (the model's input or
output non-finite): no read on the training thread (``packing.PackReader``). A run that crashes
inside a step saves every micro-batch kept for it: a loop that raises on the NaN loss it saw raises
before the scaler sees that loss. Gradient overflows with a finite loss (the scaler probing its
ceiling) save nothing: they are the scale's doing, not the batch's.

Budget: the first :data:`MAX_STEPS` such steps, at most :data:`STEP_BYTES` a step and
:data:`RUN_BYTES` a run; a tensor beyond it is listed (name, dtype, shape) without its bytes.
"""
from __future__ import annotations

import hashlib
import json
import threading
from typing import Any, Iterator, Optional

import torch

from . import torch_access
from .copies import ours

MAX_STEPS = 8                 # steps whose inputs are saved, the first ones
STEP_BYTES = 16 << 20         # a step's tensors, at most
RUN_BYTES = 64 << 20          # a run's, at most
MAX_TENSORS = 64              # tensors listed per micro-batch


def named_tensors(args: Any, kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor among a call's arguments with the path to it: ``args[0]``, ``kwargs['x']``,
    ``args[1][0]``, ``kwargs['batch']['ids']`` (tuples, lists and dicts, three levels deep)."""
    yield from _walk("args", args, 0)
    if kwargs:
        yield from _walk("kwargs", kwargs, 0)


def _walk(name: str, obj: Any, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from _walk(f"{name}[{i}]", item, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for key, item in obj.items():
            yield from _walk(f"{name}[{key!r}]", item, depth + 1)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``float16``: the name the reader maps back (store/reader.py)."""
    return str(dtype).removeprefix("torch.")


class BatchSaver:
    """Turns a bad step's kept micro-batches into ``batches`` rows, within the budget."""

    def __init__(self) -> None:
        self.steps_saved = 0
        self.bytes_saved = 0
        # the training thread saves what the host knows is bad, the writer thread what the module
        # values say (packing.PackReader): one budget
        self._lock = threading.Lock()

    @property
    def full(self) -> bool:
        return self.steps_saved >= MAX_STEPS or self.bytes_saved >= RUN_BYTES

    def rows(self, step: int, calls: list[tuple[int, Any, Any]]) -> list[tuple]:
        """Rows ``(step, micro_batch, name, dtype, shape, nbytes, sha256, data)`` for ``calls``,
        each ``(micro_batch, args, kwargs)``. A copy to the host per tensor (a sync on an
        accelerator): on a bad step only."""
        with self._lock:
            if self.full or not calls:
                return []
            self.steps_saved += 1
            step_bytes, out = 0, []
            for micro_batch, args, kwargs in calls:
                for count, (name, t) in enumerate(named_tensors(args, kwargs)):
                    if count >= MAX_TENSORS:
                        break
                    row = self._row(step, micro_batch, name, t, step_bytes)
                    step_bytes += row[5] if row[7] is not None else 0
                    out.append(row)
            self.bytes_saved += step_bytes
            return out

    def _row(self, step: int, micro_batch: int, name: str, t: torch.Tensor, step_bytes: int) -> tuple:
        t = torch_access.local(t.detach())
        shape = json.dumps(list(t.shape))
        nbytes = t.numel() * t.element_size()
        plain = t.layout == torch.strided and not t.is_complex() and not t.is_nested
        if (not plain or step_bytes + nbytes > STEP_BYTES or self.bytes_saved + step_bytes + nbytes > RUN_BYTES):
            return (step, micro_batch, name, dtype_name(t.dtype), shape, nbytes, None, None)
        data = t.reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes()
        return (step, micro_batch, name, dtype_name(t.dtype), shape, nbytes, hashlib.sha256(data).hexdigest(), data)


class RootInputs:
    """A pre-hook on the root that keeps a reference to the micro-batches' arguments until the
    step ends (no copy): for the steps that no replay keeps them for (module docstring). Each is
    kept as ``(micro_batch, args, kwargs)``. ``keep_all`` False (a device, where holding every
    micro-batch's inputs would hold device memory the loop had freed): the latest only."""

    def __init__(self, root: torch.nn.Module, keep_all: bool) -> None:
        self.calls: list[tuple[int, Any, Any]] = []
        self.count = 0  # forwards of the root this step
        self._keep_all = keep_all
        # run eagerly under torch.compile(model), outside its graph, as the replay's root hook
        self._handle = root.register_forward_pre_hook(ours(torch._dynamo.disable(self._keep)), with_kwargs=True)

    def _keep(self, module: Any, args: Any, kwargs: Any = None) -> None:
        # ``kwargs`` missing: removed while the forward that calls it had begun (a recording failure
        # in a hook before it; torch then calls it as a hook without kwargs): nothing to keep
        if kwargs is None or not (module.training and torch.is_grad_enabled()):
            return
        if not self._keep_all or self.count >= 1024:  # 1024: forwards with grad but no step (an eval in train mode)
            self.calls.clear()
        self.calls.append((self.count, args, kwargs))
        self.count += 1

    def clear(self) -> None:
        self.calls = []
        self.count = 0

    def remove(self) -> None:
        self._handle.remove()
        self.calls = []


def bad_losses(losses: list) -> Optional[list[int]]:
    """Which of a step's micro-batch losses are non-finite (their positions; one read each, so
    free on the CPU and a sync elsewhere): None when there are none to read."""
    if not losses:
        return None
    return [i for i, loss in enumerate(losses)
            if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss.detach()).all())]
