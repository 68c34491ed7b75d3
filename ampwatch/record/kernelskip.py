"""Without a scaler (bf16), a fused optimizer's step skipped in its kernel when the check says bad.

Nothing skips a bad bf16 step: its update writes NaN into the weights a replay needs, so the host
must know whether the step went bad before the update (``Watch._replay_if_bad``). Read before
``optimizer.step()``, that check leaves the GPU nothing queued while the host runs the optimizer's
Python and launches the next kernels: GPT-2 small (eager, fused AdamW, an H200) paid 1.113x a step
for it, against 1.049x for a fused fp16 step whose flag is read with the clip and the optimizer's
kernel queued behind it; handed to the kernel as below, 1.016x (docs/performance.md, "On a GPU").
An optimizer that cannot skip in its kernel has the step's weights kept instead (keptweights.py).

A fused Adam or AdamW can skip its own update: it takes GradScaler's inf flag as the optimizer's
``found_inf`` attribute for the step (and leaves weights, moments and step counts as they were when
it is set). So the check's result is handed to it the same way: 0 on a healthy step, which then
updates exactly as it would without it (the same kernel, the step counts less 0.0), and the host
reads the flag after ``step()`` returned, with the optimizer's kernel queued behind the read. A bad
step (1) left everything as it was: it is replayed then, on the weights it ran with, and its update
is applied again without the flag: the same gradients, state and hyperparameters, nothing of the
loop having run in between, so the weights end as training alone would have left them
(``tests/test_replay.py``). The optimizer's own step hooks run twice on that one step.
"""
from __future__ import annotations

from typing import Any

import torch

from .skipflag import EarlyFlag

# the notice code of a run whose steps read the check before the update (Watch._note_check_wait)
CHECK_BEFORE_UPDATE = "check-read-before-update"


def applies(watch: Any, optimizer: Any) -> bool:
    """A fused Adam/AdamW on a device path (reads not free), with no flag of another's set."""
    return (not watch._reads_free and watch._fused
            and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
            and getattr(optimizer, "_step_supports_amp_scaling", False)
            and getattr(optimizer, "found_inf", None) is None
            and getattr(optimizer, "grad_scale", None) is None)


class KernelSkip:
    """One step's check, handed to the optimizer as its skip flag and on its way to the host."""
    __slots__ = ("optimizer", "found", "flag")

    def __init__(self, optimizer: Any, check: torch.Tensor) -> None:
        """``check``: max |x| of the step's loss and gradient norms, NaN or inf when one of them is."""
        # 0 where finite, 1 where NaN or inf (x * 0 is NaN exactly then): three ops, where
        # isfinite().logical_not() took six; a float32, as the kernels read it
        self.found = check.mul(0).nan_to_num_(nan=1.0).to(torch.float32)
        self.flag = EarlyFlag()
        self.flag.start(self.found)
        self.optimizer = optimizer
        optimizer.found_inf = self.found  # last: nothing after it can fail before step() runs

    def withdraw(self) -> None:
        """Take the flag off the optimizer (its step ran, or will not run)."""
        if getattr(self.optimizer, "found_inf", None) is self.found:
            del self.optimizer.found_inf

    def read(self) -> bool:
        """Whether the step was bad (its update skipped). Sync point: the check only, with the
        optimizer's kernel queued behind it."""
        try:
            value = self.flag.read()
        except Exception:  # whatever happens, the caller must know whether to apply the update
            value = None
        return bool(self.found.item()) if value is None else value
