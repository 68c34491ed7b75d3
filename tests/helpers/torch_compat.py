"""What the tests take from newer torch, on any torch the project accepts (>= 2.4)."""
from __future__ import annotations

import pytest
import torch

from ampwatch.record.torch_access import TRACES_TENSOR_HOOKS

# torch 2.6 split clip_grad_norm_ into get_total_norm and clip_grads_with_norm_: a loop can call them
HAS_SPLIT_CLIP = hasattr(torch.nn.utils, "clip_grads_with_norm_")


def total_norm(grads: list) -> torch.Tensor:
    """The L2 norm of ``grads`` as ``torch.nn.utils.get_total_norm`` computes it (per-tensor norms,
    then the norm of those), also where torch is older than 2.6 and has no such function."""
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


# Before torch 2.11 Dynamo traces no hook on a tensor made inside the graph (and replays run compiled
# code before torch 2.6): what these tests check of torch.compile needs it. The fallback on older
# torch: test_compile.py's test_before_torch_2_11_a_compiled_model_is_recorded_without_gradient_hooks
NEEDS_TRACED_HOOKS = pytest.mark.skipif(not TRACES_TENSOR_HOOKS, reason="observing inside torch.compile: torch >= 2.11")
