"""A step's skip or check, read one step late, so that healthy steps do not wait for the device.

A fused optimizer (``AdamW(fused=True)``) skips inside its kernel, and only the scaler's inf flag
tells the host. Reading it within the step makes the host wait for the device on every step:
skipflag.py narrows that wait to the flag, but any wait stops the host from running ahead of the
device, which a fused loop without ampwatch does (GPT-2 small on an H100 paid 1.04-1.09x a step
for it: docs/performance.md).

So between ``layer_every`` steps a fused step's pack is held instead of handed to the writer,
with its flag on its way to the host (skipflag.py) and the replayer's kept micro-batches, and is
settled at the next step's ``optimizer.step()``, before that step changes any weight. By then the
device has usually finished the held step, so the read rarely waits, and when it does, only for
that step while the next one's work stays queued. A healthy step's pack goes to the writer as it
is. A skipped step left the weights as they were, so it is replayed then, as it would have been a
step earlier: its module rows and events, and its gradients' detail measured on the replayed
gradients (its ``.grad`` is gone by then), join its pack, which reaches the writer before the
next step's.

What it costs: the kept micro-batches (references to the inputs and to the gradients the outputs
received) live one step longer, through the next step's forward and backward, so peak memory
holds one more output gradient when the loss is computed outside the model; and a step's row
reaches the file a step later. A step whose kept gradients pass ``HOLD_AT_MOST_BYTES`` (a large
vocabulary's logits) is held only where the device has ``HOLD_FREE_FACTOR`` times their bytes free,
so that the memory it adds at the next step's peak is memory nobody uses; elsewhere it is read
within itself, paying the wait rather than the memory (GPT-2 small's 823 MB logits gradient, read
within the step on an H200: 1.049x a fused step, against 1.002x held a step); the run gets a
``skip-read-within-step`` notice saying so, once. The step before a ``layer_every`` step is read
within its own step, as before (the next step's module observation would mix with its replay's).

Without a scaler, a step of an optimizer that cannot skip in its kernel is held the same way, its
check on its way to the host, with its weights kept on the device (keptweights.py): its update is
not skipped, so a bad one is replayed on the kept weights. Such a step may be held through a
``layer_every`` step too, settled once that step's pack is made (its update does not touch the
kept weights: an observed step keeps none).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import torch_access
from .keptweights import KeptWeights
from .kernelskip import CHECK_BEFORE_UPDATE
from .packing import StepPack
from .skipflag import EarlyFlag
from .step import StepScalars, extend_scalars, transfer_step


@dataclass
class HeldStep:
    """A fused step whose skip is not read yet: its pack, as it would reach the writer."""
    pack: StepPack
    scalars: StepScalars
    flag: EarlyFlag   # its inf flag on its way to the host
    batches: list     # the replayer's kept micro-batches (Replayer.hand_over)
    weights: Optional[KeptWeights] = None  # its weights, where its update was not skipped


# Held output gradients stay alive through the next step's forward, where memory peaks: a step
# that kept more than this (a large vocabulary's logits with the loss computed outside the model)
# is held only where the device has HOLD_FREE_FACTOR times that free, else read within itself
HOLD_AT_MOST_BYTES = 256 * 2 ** 20
HOLD_FREE_FACTOR = 4


def may_hold(watch: Any, weights: Optional[KeptWeights] = None) -> bool:
    """Whether the step now ending can be settled at the next step's optimizer step: a step whose
    skip or check can be replayed, on a device path, nothing else held, the next step no
    ``layer_every`` step (unless ``weights`` are kept: see the module docstring), and what it keeps
    (its output gradients, and ``weights`` where not allocated yet) within
    :data:`HOLD_AT_MOST_BYTES` or within the device's free memory divided by :data:`HOLD_FREE_FACTOR`."""
    if not (watch._held is None and not watch._reads_free
            and (weights is not None or (watch.step + 1) % watch.options["layer_every"] != 0)):
        return False
    grads = kept_bytes(watch.replayer.batches)
    kept = grads + (weights.nbytes if weights is not None and not weights.allocated else 0)
    if kept <= HOLD_AT_MOST_BYTES:
        return True
    free = free_bytes(watch._device)
    if kept * HOLD_FREE_FACTOR <= free:
        return True
    code = READ_WITHIN_STEP if weights is None else CHECK_BEFORE_UPDATE
    if code not in watch._noted:  # why this run's steps wait, with its numbers: once
        room = (f"holding them to the next step needs {HOLD_FREE_FACTOR}x that free on the device "
                f"({free / 2 ** 20:,.0f} MiB free)")
        if weights is None:
            message = (f"the fused optimizer's skip flag is read within each step, where the host waits for "
                       f"the device: the step keeps {grads / 2 ** 20:,.0f} MiB of output gradients for a "
                       f"replay, and {room}")
        else:
            message = (f"without a GradScaler, each step's check of its loss and gradient norms is read before "
                       f"optimizer.step(), where the host waits for the device: reading it a step later needs "
                       f"the step's weights kept ({weights.nbytes / 2 ** 20:,.0f} MiB) with its output "
                       f"gradients ({grads / 2 ** 20:,.0f} MiB), and {room}")
        watch._note_once(code, message)
    return False


# the notice code of a run whose fused steps read their skip flag within the step (doctor: advice)
READ_WITHIN_STEP = "skip-read-within-step"


# device -> (time.monotonic() when asked, bytes free then)
_FREE_SEEN: dict[torch.device, tuple[float, int]] = {}
FREE_ASKED_EVERY_S = 10.0


def free_bytes(device: torch.device) -> int:
    """Memory free on ``device`` that no process holds (the caching allocator's cached blocks count
    as held), by the driver's count; 0 where the device has no such count. Asked at most once every
    :data:`FREE_ASKED_EVERY_S` seconds per device: ``cudaMemGetInfo`` takes ~5 us as a plain host
    call, but was seen taking ms on some machines (pytorch/pytorch#174625, sgl-project/sglang#25225)."""
    module = getattr(torch, device.type, None)
    get = getattr(module, "mem_get_info", None) if device.type != "cpu" else None
    if get is None:
        return 0
    now = time.monotonic()
    seen = _FREE_SEEN.get(device)
    if seen is not None and now - seen[0] < FREE_ASKED_EVERY_S:
        return seen[1]
    try:
        free = int(get(device)[0])
    except Exception:  # a backend that has the function but cannot answer
        free = 0
    _FREE_SEEN[device] = (now, free)
    return free


def kept_bytes(batches: list) -> int:
    """Bytes of the output gradients a step's micro-batches keep (their inputs are the loop's own)."""
    return sum(g.numel() * g.element_size() for batch in batches for g in batch.grads.values())


def hold(watch: Any, pack: StepPack, scalars: StepScalars, weights: Optional[KeptWeights] = None) -> None:
    """Keep the step that ends now (its flag started, its micro-batches kept, ``weights`` taken
    before its update where the update was not skipped) until :func:`settle`."""
    watch._held = HeldStep(pack, scalars, watch._skip_flag, watch.replayer.hand_over(), weights)
    watch._skip_flag = EarlyFlag()  # the next step's


def settle(watch: Any) -> None:
    """Read the held step's flag and hand its pack to the writer, replayed first if it skipped or
    its check was bad (if the replay fails, the pack goes as it is, its skip or non-finite values
    still recorded, and the error is raised)."""
    held, watch._held = watch._held, None
    if not held.flag.read(again=False):  # sync point, where the device has usually passed it long ago
        watch.writer.put_step(held.pack)
        return
    try:
        pack = _replayed(watch, held)
    except Exception:
        watch.writer.put_step(held.pack)  # the step's row without what its replay would add
        raise
    watch.writer.put_step(pack)


def _replayed(watch: Any, held: HeldStep) -> StepPack:
    """The held step's pack with what its replay found: module values, events, gradient detail."""
    replayed: list = [None] * len(watch._params)
    current = watch.step
    watch.step = held.pack.step  # what the replay writes (notices) belongs to the held step
    weights = held.weights.swapped_in() if held.weights is not None else contextlib.nullcontext()
    try:
        with weights:  # the weights the held step ran with, where its update was applied since
            if watch.replayer is not None:
                watch._replay(held.batches, replayed)
            watch._fp32_check(False)
            detail = _detail(watch, held, replayed)
        scalars, detail_ids = held.scalars, held.pack.detail_ids
        if detail is not None:
            scalars, detail_ids = extend_scalars(scalars, [("detail", detail)]), list(held.pack.norm_ids)
        flat, ready, loc = transfer_step(watch, scalars)  # the replay's module values
    finally:
        watch.step = current
    return dataclasses.replace(held.pack, flat=flat, ready=ready, loc=loc, layout=scalars.layout,
                               scalar_bytes=scalars.nbytes, pack_dtype=scalars.dtype, detail_ids=detail_ids)


def _detail(watch: Any, held: HeldStep, replayed: list) -> Optional[torch.Tensor]:
    """The held step's per-parameter detail (as a bad step's, with exact counts) from its replayed
    gradients, unscaled by the scale its pack holds; None unless every measured parameter got one."""
    ids = held.pack.norm_ids
    grads = [replayed[i] for i in ids]
    if not ids or any(g is None for g in grads):
        return None
    detail = torch_access.tensor_details(grads, [watch._params[i] for i in ids], watch._device,
                                         watch._pack_dtype)
    if "scale" in held.scalars.layout:  # the replay's gradients carry the scale; its norms do not
        offset, _ = held.scalars.layout["scale"]
        scale = held.scalars.device[offset]
        detail[:, 0] *= scale.double().reciprocal().to(detail.dtype)
    return detail.reshape(-1)
