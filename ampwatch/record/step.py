"""Step packing: one step's device values into one flat byte tensor, and one transfer.

Layout: the step's scalars (loss, scale, found_inf, grad norms, detail, tensor metrics) in the pack
dtype, then the module stats buffer as it stands at the step's end, then (steps of several
micro-batches only) the per-slot micro-batch marks. On CUDA the copy to the host is
non-blocking and an event marks when the writer thread may read it; nothing here waits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .. import probes
from . import grads
from .packing import StepPack


@dataclass
class StepState:
    """What the hooks collect during one optimizer step (host-side, no device values read)."""
    started: float
    previous: Optional["StepState"] = None
    losses: list = field(default_factory=list)          # what scaler.scale() saw (summed)
    logged_losses: list = field(default_factory=list)   # watch.log(loss=...): wins over the above
    metrics: dict = field(default_factory=dict)
    scale_calls: int = 0
    backwards: int = 0
    stepped: bool = False         # optimizer.step() ran
    scaler_stepped: bool = False  # scaler.step() ran (update() closes the step)

    def __post_init__(self) -> None:
        self.previous = None  # keep no chain of old steps alive


def _transfer(flat: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The step's one device-to-host copy; on CUDA not waited on here (the writer waits on ``ready``)."""
    if flat.device.type == "cuda":
        host = flat.to("cpu", non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready
    if flat.device.type != "cpu":
        return flat.cpu(), None  # sync point: other accelerators have no event API we rely on
    return flat.clone(), None   # the stats buffer is reset for the next step: keep this step's values


def step_loss(watch: Any) -> Optional[torch.Tensor]:
    """The loss a user means (issue 13): the mean of what ``watch.log(loss=...)`` got, else the SUM of
    what ``scaler.scale()`` got over the step's micro-batches, i.e. the objective whose gradient the
    step applies (with nanoGPT's ``loss / k`` that is the mean micro-batch loss). No sync."""
    state, dev = watch.state, watch._device
    losses = state.logged_losses or state.losses
    if not losses:
        return None
    if state.logged_losses and watch.scaler is not None and not watch._loss_logged:
        watch._loss_logged = True
        watch.writer.put_info(loss_definition="logged-mean")
    if len(losses) == 1:
        return losses[0].float().mean().to(dev)
    stacked = torch.stack([l.float().mean().to(dev) for l in losses])
    return stacked.mean() if state.logged_losses else stacked.sum()


def _scalar_segments(watch: Any, scale: Optional[torch.Tensor], found: Optional[torch.Tensor],
                     host_metrics: dict) -> list[tuple[str, torch.Tensor]]:
    state = watch.state
    segments: list[tuple[str, torch.Tensor]] = []
    loss = step_loss(watch)
    if loss is not None:
        segments.append(("loss", loss.reshape(1)))
    if scale is not None:
        segments.append(("scale", scale.reshape(1)))
    if found is not None and watch._fused:
        segments.append(("found_inf", found.reshape(1)))
    segments.extend(grads.segments(watch.grads))
    for key, value in state.metrics.items():
        if isinstance(value, torch.Tensor):
            segments.append((f"metric:{key}", value.detach().float().reshape(-1)[:1]))
        else:
            host_metrics[key] = float(value)
    return segments


def pack_step(watch: Any, scale: Optional[torch.Tensor], found: Optional[torch.Tensor], now: float) -> StepPack:
    """The StepPack for the step that ends now (the observer starts its next step)."""
    state, dev, dt = watch.state, watch._device, watch._pack_dtype
    host_metrics: dict[str, float] = {}
    segments = _scalar_segments(watch, scale, found, host_metrics)
    layout, offset = {}, 0
    for key, t in segments:
        layout[key] = (offset, t.numel())
        offset += t.numel()
    parts = [torch.cat([t.to(dev, dt) for _, t in segments]).view(torch.uint8)] if segments else []
    scalar_bytes = offset * torch.empty((), dtype=dt).element_size()
    observer, loc = watch.observer, None
    if observer is not None:
        parts.extend(observer.buffer.as_bytes())
        parts.extend(observer.first_bytes())
        loc = observer.take()
    flat = ready = None
    if parts:
        flat, ready = _transfer(torch.cat(parts) if len(parts) > 1 else parts[0])
    if observer is not None:
        observer.reset_buffer(first=bool(loc and loc["first"]))  # stream-ordered after the copy above
    lr = watch.optimizer.param_groups[0].get("lr") if watch.optimizer.param_groups else None
    return StepPack(
        step=watch.step, time=now, duration_s=now - state.started, lr=None if lr is None else float(lr),
        micro_batches=max(state.backwards, state.scale_calls),
        skipped=None if (watch._fused or scale is None) else not state.stepped,
        flat=flat, ready=ready, layout=layout, host_metrics=host_metrics,
        norm_ids=watch.grads.norm_ids, detail_ids=watch.grads.detail_ids, param_numel=watch._param_numel,
        loc=loc, scalar_bytes=scalar_bytes, pack_dtype=dt,
        exact_counts=probes.reads_are_free(dev))
