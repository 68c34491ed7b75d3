"""Memory that keeps growing: the leak that ends a run in the OOM killer's hands.

The recorder reads the process's resident memory (and, on CUDA, the caching allocator's bytes in
tensors) at each commit, at whatever moment of a step that falls (the ``memory`` table). A reading inside a step swings with the activations it holds, so the
rule reads the lower envelope: the lowest reading in each fifth of the run, after the first tenth (an
allocator's pools, compile caches and the optimizer's state fill up there). Memory that a training
step frees comes back to that floor; memory kept from every step (a loss tensor summed with its
graph, outputs appended to a list, a cache keyed by step) lifts it, fifth after fifth.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .facts import Facts
from .finding import Finding, counted, size_text, span

HOST_RSS, DEVICE_ALLOCATED = "host_rss", "device_allocated"  # columns of the memory table
LABELS = {DEVICE_ALLOCATED: "device memory held by tensors (CUDA allocator)",
          HOST_RSS: "host memory of the process (resident set)"}

WARMUP_FRACTION = 0.1  # the first tenth of the readings is left out
PARTS = 5              # the rest in fifths: each must lift the floor
MIN_READINGS = 20
GROWTH_MIN_BYTES = 256 * 2 ** 20  # and by at least this much ...
GROWTH_MIN_FRACTION = 0.25        # ... and a quarter of where the floor started


def floor_growth(steps: np.ndarray, values: np.ndarray) -> Optional[tuple[list[tuple[int, float]], float]]:
    """The lowest reading (step, bytes) of each of PARTS equal parts of the readings after the
    first WARMUP_FRACTION, and the bytes a step the floor rose by, when it rose in every part and in
    all by GROWTH_MIN_BYTES and GROWTH_MIN_FRACTION; else None."""
    keep = np.isfinite(values)
    steps, values = steps[keep], values[keep]
    start = int(len(values) * WARMUP_FRACTION)
    steps, values = steps[start:], values[start:]
    if len(values) < MIN_READINGS:
        return None
    floors = []
    for part_steps, part_values in zip(np.array_split(steps, PARTS), np.array_split(values, PARTS)):
        low = int(np.argmin(part_values))
        floors.append((int(part_steps[low]), float(part_values[low])))
    lows = [v for _, v in floors]
    rise = lows[-1] - lows[0]
    if not all(b > a for a, b in zip(lows, lows[1:])) or rise < max(GROWTH_MIN_BYTES, GROWTH_MIN_FRACTION * lows[0]):
        return None
    between = floors[-1][0] - floors[0][0]
    return floors, rise / between if between > 0 else float("nan")


def memory_growth(facts: Facts) -> list[Finding]:
    """Warning: the floor of the process's memory rose in every fifth of the run: something keeps
    a reference from every step."""
    if not facts.has_table("memory"):
        return []
    readings = facts.ask("SELECT step, host_rss, device_allocated FROM memory ORDER BY step")
    for key in (DEVICE_ALLOCATED, HOST_RSS):  # the device's, where recorded: that is what runs out first
        rows = readings[readings[key].notna()]
        grown = floor_growth(rows["step"].to_numpy(), rows[key].to_numpy(dtype=float)) if len(rows) else None
        if grown is None:
            continue
        floors, per_step = grown
        (first, low), (last, high) = floors[0], floors[-1]
        steps = ", ".join(size_text(v) for _, v in floors)
        evidence = (f"{LABELS[key]}: its lowest reading rose in each fifth of the run after the first tenth "
                    f"({steps}), from {size_text(low)} at step {first:,} to {size_text(high)} at step {last:,}, about "
                    f"{size_text(per_step)} a step over {counted(len(rows), 'reading')}")
        status = facts.info.get("status")
        ended = {"interrupted": "; the run was then killed or lost, as the OOM killer ends a process",
                 "crashed": "; the run then crashed"}.get(str(status), "")
        facts.claims["memory-growth"] = ("memory",)
        return [facts.finding(
            "memory-growth", "warning",
            f"Memory keeps growing: {size_text(low)} -> {size_text(high)} ({span(first, last)})", first, last,
            evidence + ended,
            f"Something keeps about {size_text(per_step)} from every step. The usual suspects: a running total of "
            f"the loss tensor (total += loss keeps each step's graph: add loss.item() or loss.detach()), "
            f"outputs or losses appended to a list, a cache keyed by step or batch, a profiler or hook that "
            f"records every step. Find it with torch.cuda.memory._record_memory_history() (device) or "
            f"tracemalloc (host); if it is a cache you fill on purpose, bound it.")]
    return []


__all__ = ["memory_growth", "floor_growth"]
