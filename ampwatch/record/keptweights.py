"""Without a scaler, a step's weights kept on the device, so that its check is read a step late.

Nothing skips a bad bf16 step: its update writes NaN into the weights a replay needs. A fused
Adam/AdamW is handed the check as its skip flag (kernelskip.py); any other optimizer (the default
foreach AdamW, SGD, a fused SGD) cannot be told. Reading the check before ``optimizer.step()``
makes the host wait for the whole backward with nothing queued behind it, and the device then
idles while the host launches the optimizer and the next forward: GPT-2 small (eager, foreach
AdamW, bf16, an H100) paid 1.160x a step for that read (docs/performance.md, "On a GPU").

So the weights the update is about to change are copied first, on the device, in one
``_foreach_copy_`` (a memory-bound copy: ~0.3 ms for GPT-2 small's 124M fp32 weights on an H100),
the check goes to the host on an event (skipflag.py), and the step is held (deferred.py): read
at the next step's ``optimizer.step()``, or at the end of that step when it is a ``layer_every``
step (observed live: a replay must not mix with its values), where the device is long past it.
A bad step is then replayed on its own weights, swapped in for the replay (``.data``: no copy) and
swapped out after; its update was applied as training alone applies it, so nothing training
produces changes. The copy lives for the run (the weights' bytes once more on the device) and is
taken only where the device has room for it (``deferred.may_hold``), and not at all with the
option ``keep_weights=False``; elsewhere the check is read before the update, as before, and the
run says so once.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch


class KeptWeights:
    """A device copy of the parameters an optimizer updates, taken before each held step's update."""
    __slots__ = ("params", "nbytes", "copies", "groups")

    def __init__(self, optimizer: Any) -> None:
        seen: set[int] = set()
        self.params = [p for group in optimizer.param_groups for p in group["params"]
                       if p.requires_grad and not (id(p) in seen or seen.add(id(p)))]
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params)
        self.groups = len(optimizer.param_groups)  # add_param_group() later: made again (fits())
        self.copies: Optional[list[torch.Tensor]] = None  # allocated at the first take, kept after

    def fits(self, optimizer: Any) -> bool:
        """Whether these are still the optimizer's parameters (no group added since)."""
        return len(optimizer.param_groups) == self.groups

    @property
    def allocated(self) -> bool:
        return self.copies is not None

    def take(self) -> None:
        """Copy the weights as they are now (stream-ordered after the step's backward; no wait)."""
        with torch.no_grad():
            if self.copies is None:
                self.copies = [torch.empty_like(p.detach()) for p in self.params]
            torch._foreach_copy_(self.copies, self.params)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The kept weights in the parameters while the block runs (for a replay), then the
        current ones back: the same tensors, storage swapped, nothing copied."""
        if self.copies is None:
            yield
            return
        current = [p.data for p in self.params]
        try:
            for p, kept in zip(self.params, self.copies):
                p.data = kept
            yield
        finally:
            for p, data in zip(self.params, current):
                p.data = data
