"""What the tests take from newer torch, on any torch the project accepts (>= 2.4)."""
from __future__ import annotations

import torch

# torch 2.6 split clip_grad_norm_ into get_total_norm and clip_grads_with_norm_: a loop can call them
HAS_SPLIT_CLIP = hasattr(torch.nn.utils, "clip_grads_with_norm_")


def total_norm(grads: list) -> torch.Tensor:
    """The L2 norm of ``grads`` as ``torch.nn.utils.get_total_norm`` computes it (per-tensor norms,
    then the norm of those), also where torch is older than 2.6 and has no such function."""
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
