"""Pure functions over torch objects: scaler state and gradient reductions.

All access to GradScaler's private attributes lives here, once, each with a public fallback
(a test pins the behaviour on the torch version we ship with). Nothing here syncs the host
unless its docstring says so.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import torch

# AMPWATCH_CPU_AS_ACCELERATOR=1 makes ampwatch treat the CPU like CUDA: no free host reads, the
# device-resident (foreach, one-transfer) path everywhere, so CI exercises the accelerator path.

# float64 keeps counts exact and scales like 2**24 exact; MPS has no float64.
def pack_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def reads_are_free(device: torch.device) -> bool:
    """True where reading a tensor's value costs no device sync (CPU tensors are computed eagerly),
    unless ``AMPWATCH_CPU_AS_ACCELERATOR=1`` asks for the accelerator path on the CPU."""
    return device.type == "cpu" and not cpu_as_accelerator()


def cpu_as_accelerator() -> bool:
    """Read at call time (tests switch it per test with monkeypatch.setenv)."""
    return os.environ.get("AMPWATCH_CPU_AS_ACCELERATOR", "") not in ("", "0")


# --- GradScaler -----------------------------------------------------------------------------

def scaler_enabled(scaler: Any) -> bool:
    return scaler is not None and bool(scaler.is_enabled())


def scaler_settings(scaler: Any) -> dict[str, Any]:
    """The scaler's configuration through its public getters (no sync)."""
    if scaler is None:
        return {"scaler_enabled": False, "init_scale": None, "growth_factor": None,
                "backoff_factor": None, "growth_interval": None}
    enabled = scaler_enabled(scaler)
    return {
        "scaler_enabled": enabled,
        "init_scale": float(getattr(scaler, "_init_scale", 0.0)) if enabled else None,
        "growth_factor": float(scaler.get_growth_factor()) if enabled else None,
        "backoff_factor": float(scaler.get_backoff_factor()) if enabled else None,
        "growth_interval": int(scaler.get_growth_interval()) if enabled else None,
    }


def scale_tensor(scaler: Any) -> Optional[torch.Tensor]:
    """A copy of the current scale as a device tensor, or None before the scaler's first use. No sync."""
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor):
        return scale.detach().reshape(()).clone()
    return None


def found_inf(scaler: Any, optimizer: Any) -> Optional[torch.Tensor]:
    """Sum of the scaler's per-device inf flags for ``optimizer`` (between step() and update()). No sync."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not states or id(optimizer) not in states:
        return None
    flags = list(states[id(optimizer)].get("found_inf_per_device", {}).values())
    if not flags:
        return None
    device = flags[0].device
    return torch.stack([f.to(device, non_blocking=True).reshape(()) for f in flags]).sum()


def optimizer_stage_unscaled(scaler: Any, optimizer: Any) -> bool:
    """Whether unscale_ already ran for ``optimizer`` this iteration (the scaler's OptState)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not states or id(optimizer) not in states:
        return False
    stage = states[id(optimizer)].get("stage")
    return getattr(stage, "name", str(stage)) in ("UNSCALED", "STEPPED")


def steps_inside_kernel(optimizer: Any) -> bool:
    """Fused optimizers take the scale themselves: GradScaler always calls their step()."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def at_backward_end(callback: Any) -> None:
    """Run ``callback`` once the current backward pass has finished (call from inside an autograd hook).

    The engine runs queued callbacks after syncing the leaf streams, so on CUDA the callback may read
    any gradient on the current stream. We queue a callback that queues ours: callbacks added while
    callbacks run go last, so ours runs after every callback queued during the pass, such as DDP's
    finalize_backward, which waits for the gradient all-reduce."""
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(callback))


# --- gradients ------------------------------------------------------------------------------

def _group_by_device(tensors: Sequence[torch.Tensor]) -> dict[torch.device, list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return groups


def tensor_norms(tensors: Sequence[torch.Tensor], out_device: torch.device) -> torch.Tensor:
    """L2 norm of each tensor, as one float32 vector on ``out_device`` (one foreach call per device).

    A norm is inf/NaN exactly when its tensor holds inf/NaN, so this also flags non-finite grads.
    No sync.
    """
    if not tensors:
        return torch.zeros(0, device=out_device)
    result: list[Optional[torch.Tensor]] = [None] * len(tensors)
    for device, idx in _group_by_device(tensors).items():
        group = [tensors[i] for i in idx]
        norms = _foreach_norm_f32(group)
        for i, n in zip(idx, norms):
            result[i] = n.to(out_device, non_blocking=True)
    return torch.stack(result)  # type: ignore[arg-type]


def _foreach_norm_f32(group: list[torch.Tensor]) -> list[torch.Tensor]:
    foreach_norm = getattr(torch, "_foreach_norm", None)
    if foreach_norm is not None:
        try:
            return list(foreach_norm(group, 2, dtype=torch.float32))
        except (TypeError, RuntimeError):
            pass
    return [torch.linalg.vector_norm(t, dtype=torch.float32) for t in group]


def tensor_details(grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                   out_device: torch.device, dtype: torch.dtype,
                   known_finite: Optional[Sequence[bool]] = None) -> torch.Tensor:
    """Per gradient: [max |g|, NaN count, inf count, zero count, param L2 norm], shape (n, 5). No sync.

    Paid only on ``layer_every`` steps and bad steps. ``aminmax`` instead of ``abs().amax()``
    or ``_foreach_norm(inf)``: 2-18x cheaper on CPU (shared/research/overhead-anchors.md).
    ``known_finite[i]`` (when the caller could read the norms for free) skips the two full passes
    that count NaN/inf in gradients already known to be finite.
    """
    rows = []
    zero_count = torch.zeros((), dtype=dtype, device=grads[0].device) if grads else None
    for i, (g, p) in enumerate(zip(grads, params)):
        mn, mx = torch.aminmax(g.detach())
        amax = torch.maximum(mn.abs(), mx.abs()).to(dtype)
        if known_finite is not None and known_finite[i]:
            nan = inf = zero_count.to(g.device)
        else:
            nan = torch.isnan(g).sum().to(dtype)
            inf = torch.isinf(g).sum().to(dtype)
        zero = (g.numel() - torch.count_nonzero(g)).to(dtype)
        pnorm = torch.linalg.vector_norm(p.detach(), dtype=torch.float32).to(dtype)
        rows.append(torch.stack([amax, nan, inf, zero, pnorm]).to(out_device, non_blocking=True))
    if not rows:
        return torch.zeros((0, 5), dtype=dtype, device=out_device)
    return torch.stack(rows)


def tensor_details_foreach(grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                           out_device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The accelerator path of :func:`tensor_details`: a handful of ``torch._foreach_*`` calls over
    all gradients at once, shape (n, 5). NaN/inf counts are not paid for here: they are -1
    ("not counted"); the writer knows a gradient with a finite norm has none. No sync."""
    if not grads:
        return torch.zeros((0, 5), dtype=dtype, device=out_device)
    device = grads[0].device
    if any(g.device != device for g in grads) or any(p.device != device for p in params):
        return tensor_details(grads, params, out_device, dtype)  # rare (model parallel): per tensor
    grads = [g.detach() for g in grads]
    amax = torch.stack(torch._foreach_norm(grads, float("inf"), dtype=torch.float32))
    nonzero = torch.stack(torch._foreach_norm(grads, 0, dtype=torch.float32))
    pnorm = torch.stack(torch._foreach_norm([p.detach() for p in params], 2, dtype=torch.float32))
    numel = torch.tensor([g.numel() for g in grads], dtype=torch.float32).to(device, non_blocking=True)
    unknown = torch.full_like(amax, -1.0)
    rows = torch.stack([amax, unknown, unknown, numel - nonzero, pnorm], dim=1)
    return rows.to(out_device, dtype, non_blocking=True)
