"""Gradient measurement: per-parameter norms every step, per-parameter detail on some steps.

Norms are one ``torch._foreach_norm`` over all gradients. Detail (max |g|, zero fraction, parameter
norm, and NaN/inf counts where they are needed) runs on ``layer_every`` steps and on bad steps:
on an accelerator through ``torch._foreach_*`` calls over all gradients at once; where reads are
free (CPU), per tensor with ``aminmax``, which is cheaper there, and with exact counts.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch

from . import torch_access


class GradMeter:
    """One step's gradient measurements; ``reset`` starts the next step."""

    def __init__(self, params: list[torch.Tensor], device: torch.device, pack_dtype: torch.dtype) -> None:
        self.params = params
        self.device = device
        self.pack_dtype = pack_dtype
        self.reads_free = torch_access.reads_are_free(device)
        self.reset()

    def reset(self) -> None:
        # device tensors, or where reads are free plain lists of floats (read as they are made:
        # a multiply or a stack on the host costs more than reading a few numbers)
        self.norms: Optional[Union[torch.Tensor, list[float]]] = None
        self.norm_ids: list[int] = []
        self.detail: Optional[Union[torch.Tensor, list[float]]] = None
        self.detail_ids: list[int] = []
        self.at_backward = False  # measured when backward ended (before any clipping)
        self._bad = False  # where reads are free: a measured norm is non-finite

    def measure(self, detail_step: bool, inv_scale: Optional[Union[torch.Tensor, float]] = None) -> None:
        """Per-parameter grad norms (one foreach call), and detail on detail steps. No sync, except
        that where reads are free the norms are read to decide whether detail is needed."""
        if self.norms is not None:
            return
        ids, grads = [], []
        for i, p in enumerate(self.params):  # each .grad read makes a Python object: once
            g = p.grad
            if g is not None:
                ids.append(i)
                grads.append(g)
        known_finite = None
        if self.reads_free:
            norms = torch_access.tensor_norms_read(grads, self.device)
            known_finite = [math.isfinite(v) for v in norms]
            if not all(known_finite):  # rare: a float32 norm overflows on finite values (see below)
                norms = _remeasured(grads, norms)
                known_finite = [math.isfinite(v) for v in norms]
            if inv_scale is not None:
                norms = [v * inv_scale for v in norms]  # in float64
            self._bad = not all(known_finite)
        else:
            norms = torch_access.tensor_norms(grads, self.device)
            if inv_scale is not None:
                norms = norms * inv_scale
        self.norms, self.norm_ids = norms, ids
        if detail_step or self._bad:
            self.measure_detail(known_finite, inv_scale, counts=bool(known_finite))

    def take(self, ids: list[int], norms: torch.Tensor, detail_step: bool,
             inv_scale: Optional[torch.Tensor] = None) -> None:
        """Norms another call computed already (the user's ``clip_grad_norm_``, before it clipped):
        a float32 device vector, one per parameter in ``ids``, instead of a foreach norm of every
        gradient; detail on detail steps as :meth:`measure` would. No sync."""
        self.norms, self.norm_ids = (norms * inv_scale if inv_scale is not None else norms), ids
        self.at_backward = True  # taken before the clip changed anything
        if detail_step:
            self.measure_detail(None, inv_scale, counts=False)

    def known_bad(self) -> bool:
        """Where reads are free: a measured gradient norm is non-finite (the gradient holds NaN/inf,
        or its float32 norm overflowed). False where the norms stay on the device (unknown)."""
        return self._bad

    def measure_detail(self, known_finite: Optional[list] = None,
                       inv_scale: Optional[Union[torch.Tensor, float]] = None,
                       counts: bool = True) -> None:
        """``counts``: pay for exact NaN/inf counts (bad steps) instead of leaving them unknown."""
        if self.detail is not None or not self.norm_ids:
            return
        params = [self.params[i] for i in self.norm_ids]
        grads = [p.grad for p in params]
        if self.reads_free:
            detail: Any = torch_access.tensor_details_read(grads, params, known_finite)
            if inv_scale is not None:
                detail[0::5] = [v * inv_scale for v in detail[0::5]]
        else:
            if counts:
                detail = torch_access.tensor_details(grads, params, self.device, self.pack_dtype, known_finite)
            else:
                detail = torch_access.tensor_details_foreach(grads, params, self.device, self.pack_dtype)
            if inv_scale is not None:
                detail[:, 0] *= inv_scale
        self.detail, self.detail_ids = detail, list(self.norm_ids)

    def shrank(self) -> Optional[tuple[float, float]]:
        """(before, after) total norm if the gradients shrank since backward measured them, else
        None. Two host reads: called on ``layer_every`` steps only, right before scaler.step syncs."""
        if not self.at_backward or self.norms is None:
            return None
        grads = [self.params[i].grad for i in self.norm_ids]
        if any(g is None for g in grads):
            return None
        if isinstance(self.norms, list):
            before = math.sqrt(sum(v * v for v in self.norms))
        else:
            before = float(self.norms.double().norm())
        after = float(torch_access.tensor_norms(grads, self.device).double().norm())
        if math.isfinite(before) and math.isfinite(after) and after < 0.99 * before:
            return before, after
        return None


def _remeasured(grads: list[torch.Tensor], norms: list[float]) -> list[float]:
    """``norms`` with each non-finite one measured again in float64. A float32 norm squares and sums
    in float32, so a gradient of finite elements above ~1.8e19 (fewer, larger ones: its sum of
    squares past 3.4e38; a scaled gradient gets there first) reads inf and would be recorded as a
    NaN/Inf gradient. Only on a step where some norm read non-finite; one op per such gradient, read
    at once (reads are free here)."""
    return [v if math.isfinite(v) else
            float(torch.linalg.vector_norm(torch_access.local(g).detach(), dtype=torch.float64))
            for g, v in zip(grads, norms)]


def segments(meter: GradMeter) -> list[tuple[str, Any]]:
    """The step pack's gradient segments: device tensors, or lists of floats where reads are free."""
    out: list[tuple[str, Any]] = []
    if meter.norms is not None:
        out.append(("norms", meter.norms))
    if meter.detail is not None:
        out.append(("detail", meter.detail if isinstance(meter.detail, list) else meter.detail.reshape(-1)))
    return out
