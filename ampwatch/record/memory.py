"""The process's memory, read by the writer thread at each commit: what a run that grows until the
OOM killer ends it shows, and what the doctor's ``memory-growth`` rule reads (the ``memory`` table).

Read off the training thread, about once per ``flush_every_s``, against the last step of the
commit: a reading at some moment inside a step, not a step's peak (a peak needs resetting the CUDA
allocator's peak counter, which is the user's to reset). In bytes: the process's resident set
(Linux: ``/proc/self/statm``; NULL elsewhere) and, on CUDA, the caching allocator's bytes in
tensors and bytes held, on the watched model's device (NULL off CUDA).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from ..store.rows import Rows

_STATM = "/proc/self/statm"


def memory_sampler(device: torch.device) -> Optional[Callable[[int], Rows]]:
    """A function of the step that reads the figures above into a ``memory`` row, for the writer
    thread; None where there is nothing to read. It never raises: a reading that fails is NULL."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    host = page > 0 and os.path.exists(_STATM)
    cuda = device.type == "cuda"
    if not (host or cuda):
        return None

    def sample(step: int) -> Rows:
        rss = allocated = reserved = None
        if host:
            try:
                with open(_STATM, "rb") as f:  # "size resident shared ...", in pages
                    rss = float(int(f.read().split()[1]) * page)
            except (OSError, ValueError, IndexError):
                pass
        if cuda:
            try:  # the allocator's own counters: no sync, safe from another thread
                allocated = float(torch.cuda.memory_allocated(device))
                reserved = float(torch.cuda.memory_reserved(device))
            except Exception:
                pass
        return Rows(memory=[(step, rss, allocated, reserved)])
    return sample
