"""Gradient measurement: per-parameter norms every step, per-parameter detail on some steps.

Norms are one ``torch._foreach_norm`` over all gradients. Detail (max |g|, zero fraction, parameter
norm, and NaN/inf counts where they are needed) runs on ``layer_every`` steps and on bad steps:
on an accelerator through ``torch._foreach_*`` calls over all gradients at once; where reads are
free (CPU), per tensor with ``aminmax``, which is cheaper there, and with exact counts.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .. import probes


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """1/scale on the device (in float64: a scale need not be a power of two), for unscaling norms."""
    return scale.double().reciprocal().float()


class GradMeter:
    """One step's gradient measurements; ``reset`` starts the next step."""

    def __init__(self, params: list[torch.Tensor], device: torch.device, pack_dtype: torch.dtype) -> None:
        self.params = params
        self.device = device
        self.pack_dtype = pack_dtype
        self.reads_free = probes.reads_are_free(device)
        self.reset()

    def reset(self) -> None:
        self.norms: Optional[torch.Tensor] = None
        self.norm_ids: list[int] = []
        self.detail: Optional[torch.Tensor] = None
        self.detail_ids: list[int] = []
        self.at_backward = False  # measured when backward ended (before any clipping)

    def measure(self, detail_step: bool, inv_scale: Optional[torch.Tensor] = None) -> None:
        """Per-parameter grad norms (one foreach call), and detail on detail steps. No sync, except
        that where reads are free the norms are read to decide whether detail is needed."""
        if self.norms is not None:
            return
        ids = [i for i, p in enumerate(self.params) if p.grad is not None]
        norms = probes.tensor_norms([self.params[i].grad for i in ids], self.device)
        if inv_scale is not None:
            norms = norms * inv_scale
        self.norms, self.norm_ids = norms, ids
        known_finite = torch.isfinite(norms).tolist() if self.reads_free else None
        if detail_step or (known_finite and not all(known_finite)):
            self.measure_detail(known_finite, inv_scale, counts=bool(known_finite))

    def measure_detail(self, known_finite: Optional[list] = None, inv_scale: Optional[torch.Tensor] = None,
                       counts: bool = True) -> None:
        """``counts``: pay for exact NaN/inf counts (bad steps) instead of leaving them unknown."""
        if self.detail is not None or not self.norm_ids:
            return
        params = [self.params[i] for i in self.norm_ids]
        grads = [p.grad for p in params]
        if self.reads_free or counts:
            detail = probes.tensor_details(grads, params, self.device, self.pack_dtype, known_finite)
        else:
            detail = probes.tensor_details_foreach(grads, params, self.device, self.pack_dtype)
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
        before = float(self.norms.double().norm())
        after = float(probes.tensor_norms(grads, self.device).double().norm())
        if math.isfinite(before) and math.isfinite(after) and after < 0.99 * before:
            return before, after
        return None


def segments(meter: GradMeter) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, Any]] = []
    if meter.norms is not None:
        out.append(("norms", meter.norms))
    if meter.detail is not None:
        out.append(("detail", meter.detail.reshape(-1)))
    return out
