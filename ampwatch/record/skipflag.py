"""A fused optimizer's skip, told to the host without waiting for the optimizer's own kernel.

A fused optimizer (``AdamW(fused=True)``) skips inside its kernel: only the scaler's inf flag tells
the host that a step was skipped, and a replay of that step must start before the weights change.
Reading the flag right after ``scaler.step()`` (``.item()``) waits for all the work queued so far,
the optimizer's kernel included, and the device then idles while the host launches the next step.
So the flag is copied to the host where it is made: when ``unscale_`` returns, or (no
``unscale_``) when the optimizer's step begins, after the scaler checked the gradients. An event
marks that copy. A read waits for that event only, and the clip, the optimizer and ``update()``
keep running on the device meanwhile; read at the next step's optimizer step (deferred.py), the
copy is usually done and the read does not wait at all. Without a scaler the same way carries a
step's check (max |x| of its loss and gradient norms: bad where not finite) to the host.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


class EarlyFlag:
    """One step's inf flag on its way to the host: :meth:`start` where it is made, :meth:`read`
    once the host must know."""
    __slots__ = ("_host", "_ready", "_flag", "_check", "started", "found")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._host: Optional[torch.Tensor] = None
        self._ready: Optional[torch.cuda.Event] = None
        self._flag: Optional[torch.Tensor] = None
        self._check = False
        self.started = False  # a flag is on its way (read() then tells it)
        self.found: Optional[torch.Tensor] = None  # the scaler's inf flag it started from (no check)

    def start(self, flag: torch.Tensor, check: bool = False) -> None:
        """Copy ``flag`` (a 0-d device tensor) to the host behind the work that makes it; no wait.
        ``check``: ``flag`` is a value that is bad where not finite, not a 0/1 flag."""
        self._check = check
        self.started = True
        self.found = None if check else flag
        if flag.device.type == "cuda":
            self._host = flag.to("cpu", non_blocking=True)  # pinned: the copy is queued, not waited on
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:  # other devices have no event API we rely on: read where it stands, in read()
            self._flag = flag

    def read(self, again: bool = True) -> Optional[bool]:
        """Whether the flag was set (the step skipped), or None when none was started. ``again``:
        cleared for another start (False: read once, then dropped)."""
        if self._ready is not None:
            if not self._ready.query():  # read a step late (deferred.py), the copy is usually done
                self._ready.synchronize()  # sync point: only as far as the flag, not the optimizer's kernel
            value = self._host.item()  # a host tensor: no device read
        elif self._flag is not None:
            value = self._flag.item()  # sync point on an accelerator without events
        else:
            return None
        bad = not math.isfinite(value) if self._check else bool(value)
        if again:
            self.clear()
        return bad
