"""Step packing: one step's device values into one flat byte tensor, and one transfer.

Layout: the step's scalars (loss, scale, found_inf, grad norms, detail, tensor metrics, a device
tensor ``lr``) in the pack
dtype, then the module stats as they stand at the step's end (the device buffer; on the CPU the host
doubles of ``hoststats.HostStats``), then (steps of several
micro-batches only) the per-slot micro-batch marks. On CUDA the copy to the host is
non-blocking and an event marks when the writer thread may read it; nothing here waits.

Two moments: the scalars are packed (:func:`pack_scalars`) right before ``scaler.update()``, whose
in-place change of the scale would otherwise need a copy of it first, and the step is closed
(:func:`pack_step`) once ``update()`` returned. A step between ``layer_every`` steps costs one op
(the scalars' ``cat``) on the device path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import grads, torch_access
from .packing import StepPack


class StepState:
    """What the hooks collect during one optimizer step (host-side, no device values read). A plain
    class with slots: one is made per step, and a dataclass's default factories cost a call each."""
    __slots__ = ("started", "losses", "logged_losses", "metrics", "scale_calls", "backwards", "stepped",
                 "scaler_stepped")

    def __init__(self, started: float) -> None:
        self.started = started
        self.losses: list = []          # what scaler.scale() saw (summed)
        self.logged_losses: list = []   # watch.log(loss=...): wins over the above
        self.metrics: dict = {}
        self.scale_calls = 0
        self.backwards = 0
        self.stepped = False            # optimizer.step() ran
        self.scaler_stepped = False     # scaler.step() ran (update() closes the step)


def _transfer(flat: torch.Tensor, fresh: bool, kind: str) -> tuple[torch.Tensor, Any]:
    """The step's one device-to-host copy; on CUDA not waited on here (the writer waits on ``ready``).
    ``fresh``: ``flat`` is a new tensor (a concatenation), not the stats buffer itself; ``kind``:
    its device's type (the watch's, known: ``tensor.device.type`` builds a str at each read)."""
    if kind == "cuda":
        host = flat.to("cpu", non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready
    if kind != "cpu":
        return flat.cpu(), None  # sync point: other accelerators have no event API we rely on
    # the stats buffer is reset for the next step: keep this step's values
    return (flat if fresh else flat.clone()), None


def step_loss(watch: Any, host: bool = False) -> Optional[torch.Tensor]:
    """The loss a user means: the mean of what ``watch.log(loss=...)`` got, else the SUM of
    what ``scaler.scale()`` got over the step's micro-batches, i.e. the objective whose gradient the
    step applies (with nanoGPT's ``loss / k`` that is the mean micro-batch loss). No sync.
    ``host``: it is read on the host next, so one loss need not be moved to the device first."""
    state, dev = watch.state, watch._device
    losses = state.logged_losses or state.losses
    if not losses:
        return None
    if state.logged_losses and watch.scaler is not None and not watch._loss_logged:
        watch._loss_logged = True
        watch.writer.put_info(loss_definition="logged-mean")
    if len(losses) == 1:
        loss = losses[0]
        loss = loss if loss.numel() == 1 else loss.float().mean()
        # a device comparison costs a third of a ``to`` that has nothing to do (its argument parsing)
        return loss if host or loss.device == dev else loss.to(dev)
    stacked = torch.stack([l.float().mean().to(dev) for l in losses])
    return stacked.mean() if state.logged_losses else stacked.sum()


def _scalar_segments(watch: Any, scale: Optional[torch.Tensor], found: Optional[torch.Tensor],
                     host_metrics: dict) -> list[tuple[str, torch.Tensor]]:
    state = watch.state
    segments: list[tuple[str, torch.Tensor]] = []
    host = watch._reads_free
    loss = step_loss(watch, host)
    if loss is not None:  # where reads are free a float: each op saved is ~15 us of a CPU step
        segments.append(("loss", loss.item() if host else loss))
    if scale is not None:  # a device tensor, or where reads are free a float
        segments.append(("scale", scale))
    if found is not None and watch._fused:
        segments.append(("found_inf", found))
    segments.extend(grads.segments(watch.grads))
    for key, value in state.metrics.items():
        if isinstance(value, torch.Tensor):
            segments.append((f"metric:{key}", value.detach().float().reshape(-1)[:1]))
        else:
            host_metrics[key] = float(value)
    lr = device_lr(watch)
    if lr is not None:
        segments.append(("lr", lr))
    return segments


def device_lr(watch: Any) -> Optional[torch.Tensor]:
    """The first param group's learning rate when it is a one-element tensor on a device whose reads
    sync (torch takes a Tensor ``lr``, e.g. for a compiled or capturable optimizer step): it travels
    in the pack, as it stood before ``update()``, instead of a ``float()`` that would wait for the
    device every step. None for a float, or a tensor read for free (on the CPU)."""
    groups = watch.optimizer.param_groups
    lr = groups[0].get("lr") if groups else None
    if (isinstance(lr, torch.Tensor) and lr.numel() == 1 and not lr.is_complex()
            and not torch_access.reads_are_free(lr.device)):
        return lr.detach().reshape(1)
    return None


def _host_values(segments: list) -> list[float]:
    """Where reads are free: the scalars read into a list of floats (``tolist``, free on the CPU)."""
    values: list[float] = []
    for _, t in segments:
        if isinstance(t, torch.Tensor):
            values.extend(t.reshape(-1).tolist())
        elif isinstance(t, list):
            values.extend(t)
        else:
            values.append(float(t))
    return values


def _host_stats(observer: Any) -> tuple[Optional[torch.Tensor], dict]:
    """Where reads are free: the observer's host stats as bytes (a memcpy) when it measured any this
    step, and its step structure: no op at all (each op is ~15 us of a CPU training step)."""
    marks = [t.cpu().numpy().tobytes() for t in observer.first_bytes()]
    loc = observer.take()  # flushes what is pending into the host stats
    if not loc["observed"]:  # the stats are empty and nothing reads them (packing._Analysis)
        return None, loc
    buf = bytearray(observer.stats_host_bytes())
    for mark in marks:
        buf += mark
    return torch.frombuffer(buf, dtype=torch.uint8), loc


@dataclass
class StepScalars:
    """The step's scalars (loss, scale, found_inf, gradient norms and detail, tensor metrics, a device
    tensor learning rate), packed
    as soon as they are all known: before ``scaler.update()``, which changes the scale in place, so
    the concatenation copies the scaler's own tensor and no snapshot of it is needed (one op a step
    fewer). ``device``: the scalars in the pack dtype ``dtype``, one dimension, on the device (one
    ``cat``), or None (viewed as bytes only where the module stats join them, or by the writer
    thread); where reads are free ``values`` holds them as floats instead."""
    layout: dict
    host_metrics: dict
    nbytes: int
    dtype: torch.dtype
    scaled: bool = False  # the scale is among them (a GradScaler loop)
    device: Optional[torch.Tensor] = None
    values: Optional[list] = None


def pack_scalars(watch: Any, scale: Any, found: Optional[torch.Tensor]) -> StepScalars:
    """The step's scalars: ``scale`` is the scaler's live scale tensor (or, where reads are free, a
    float), read here before ``update()`` changes it. One op on the device path, none on the host."""
    dt = torch.float64 if watch._reads_free else watch._pack_dtype  # the host path packs doubles
    host_metrics: dict[str, float] = {}
    segments = _scalar_segments(watch, scale, found, host_metrics)
    layout, offset = {}, 0
    for key, t in segments:
        n = t.numel() if isinstance(t, torch.Tensor) else len(t) if isinstance(t, list) else 1
        layout[key] = (offset, n)
        offset += n
    device, values = None, None
    if watch._reads_free:
        values = _host_values(segments)
    elif segments:
        dev = watch._device
        tensors = [t if t.device == dev else t.to(dev) for _, t in segments]
        if max(map(torch.Tensor.dim, tensors)) > 1:  # a loss shaped (1, 1): hstack joins up to 1-d
            tensors = _one_dimensional(tensors)
        if all(t.dtype == torch.float32 for t in tensors):
            # every value is a float32 already (a healthy step's loss, scale and norms): packed as
            # they are, exactly; a cat into float64 needed an output allocated first, at ~3x the host
            # time. hstack: the 0-d ones (loss, scale) join as they are, made 1-d inside ATen, not by a
            # view op called from Python for each (~8.6k host instructions each, by callgrind)
            dt = torch.float32
            device = torch.hstack(tensors)
        else:  # one op: cat converts every segment into the pack dtype as it copies
            device = torch.cat(_one_dimensional(tensors), out=torch.empty(offset, dtype=dt, device=dev))
    return StepScalars(layout, host_metrics, offset * dt.itemsize, dt, scaled=scale is not None,
                       device=device, values=values)


def _one_dimensional(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` as ``cat`` takes them, in order: 1-d, by a view where they are not (a step's loss,
    scale and inf flag: GradScaler's are 0-d). A view is host work only; stacking the 0-d ones
    would be one launch more on the device (``bench/ops.py``)."""
    return [t if t.dim() == 1 else t.reshape(-1) for t in tensors]


def extend_scalars(scalars: StepScalars, extra: list[tuple[str, torch.Tensor]]) -> StepScalars:
    """``scalars`` with device segments appended (a step's detail measured after it was packed):
    one ``cat`` in their dtype. The device path only."""
    dt = scalars.dtype
    layout, offset = dict(scalars.layout), scalars.nbytes // dt.itemsize
    parts = [scalars.device] if scalars.device is not None else []
    for key, t in extra:
        layout[key] = (offset, t.numel())
        offset += t.numel()
        parts.append(t.detach().reshape(-1).to(dt))
    return StepScalars(layout, dict(scalars.host_metrics), offset * dt.itemsize, dt, scaled=scalars.scaled,
                       device=torch.cat(parts) if len(parts) > 1 else parts[0])


def pack_step(watch: Any, scalars: StepScalars, now: float) -> StepPack:
    """The StepPack for the step that ends now (the observer starts its next step): ``scalars``
    from :func:`pack_scalars`, and the module stats as they stand."""
    state = watch.state
    flat, ready, loc = transfer_step(watch, scalars)
    lr = watch.optimizer.param_groups[0].get("lr") if watch.optimizer.param_groups else None
    if isinstance(lr, torch.Tensor) and "lr" in scalars.layout:
        lr = None  # a device tensor: in the pack (device_lr), read by the writer thread
    return StepPack(
        step=watch.step, time=now, duration_s=now - state.started, lr=None if lr is None else float(lr),
        micro_batches=max(state.backwards, state.scale_calls),
        skipped=None if (watch._fused or not scalars.scaled) else not state.stepped,
        flat=flat, ready=ready, layout=scalars.layout, host_metrics=scalars.host_metrics,
        norm_ids=watch.grads.norm_ids, detail_ids=watch.grads.detail_ids, param_numel=watch._param_numel,
        loc=loc, scalar_bytes=scalars.nbytes, pack_dtype=scalars.dtype,
        exact_counts=watch._reads_free,
        host_stats=watch.observer is not None and watch.observer.host_stats, scalars=scalars.values)


def transfer_step(watch: Any, scalars: StepScalars) -> tuple[Optional[torch.Tensor], Any, Optional[dict]]:
    """``scalars`` and the module stats as they stand, on their way to the host: (bytes, the CUDA
    event that marks them ready or None, the observer's structure of the step). The observer
    starts its next step."""
    observer, loc = watch.observer, None
    flat = ready = None
    if watch._reads_free:
        if observer is not None:
            flat, loc = _host_stats(observer)
    else:
        parts = [scalars.device] if scalars.device is not None else []
        if observer is not None:
            first = observer.first_bytes()
            loc = observer.take()  # folds what is pending into the buffer first
            if loc["observed"]:  # else the buffer is as reset and nothing reads it (packing._Analysis)
                if parts:  # joined as bytes; alone, the scalars stay in their dtype (the writer views them)
                    parts[0] = parts[0].view(torch.uint8)
                parts.extend(observer.stats_parts())
                parts.extend(first)
        if parts:
            flat, ready = _transfer(torch.cat(parts) if len(parts) > 1 else parts[0],
                                    fresh=scalars.device is not None or len(parts) > 1, kind=watch._device_kind)
    if observer is not None and (watch._reads_free or loc["observed"]):
        observer.reset_buffer(first=bool(loc and loc["first"]))  # stream-ordered after the copy above
    return flat, ready, loc
