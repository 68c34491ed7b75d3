"""What ampwatch's per-layer detail costs a run, read from the run's own step times.

Every ``layer_every``-th step is observed: per-layer gradient norms and per-module values (on an
accelerator with replay, the module hooks run on those steps only). Those steps' times against the
steps between them, in the same run, say what the detail costs on the user's own machine, model and
loop, with nothing measured while training: ``steps.duration_s`` is there already. Left out:

- the first block of ``layer_every`` steps: compiling, the allocator's first requests, the scaler's
  warm-up;
- skipped steps: no update, and a replay on an accelerator.

What this cannot see is what the recorder adds to every step alike (docs/performance.md measures
that against a copy of the loop without ampwatch); so it is the cost of the detail, not of ampwatch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from .facts import Facts
    from .finding import Finding

# Fewer observed steps than this give a median that one slow step (a garbage collection, a
# checkpoint save) moves: no figure rather than a wrong one
MIN_OBSERVED = 3
MIN_BETWEEN = 10
# The share of a run's time above which the doctor says what the detail costs: the 1% that users
# do not notice (an H100 step of GPT-2 small varies by more than that from run to run)
SHARE_NOTE = 0.01
RECENT_STEPS = 20_000


@dataclass(frozen=True)
class DetailCost:
    """Median step times (seconds) with and without per-layer detail, past the first block."""
    every: int
    observed_s: float
    between_s: float
    noise_s: float  # two standard errors of the observed steps' median, from the others' spread
    n_observed: int
    n_between: int

    @property
    def extra_s(self) -> float:
        return self.observed_s - self.between_s

    @property
    def ratio(self) -> float:
        return self.observed_s / self.between_s

    @property
    def share(self) -> float:
        """Of the run's time: one step in ``every`` pays ``extra_s``."""
        return self.extra_s / (self.every * self.between_s)

    @property
    def measurable(self) -> bool:
        """The difference stands out of the steps' own spread."""
        return abs(self.extra_s) > self.noise_s

    def every_for(self, share: float) -> int:
        """The smallest ``layer_every`` whose detail costs at most ``share`` of the run's time."""
        return max(self.every, math.ceil(self.extra_s / (share * self.between_s)))


def detail_cost(steps: pd.DataFrame, every: Optional[int], first: Optional[int] = None) -> Optional[DetailCost]:
    """The cost of the detail steps, or None where the run has too few steps to say. ``steps``:
    step, skipped, duration_s (all of a run's, or its last ones: ``first`` is then the run's first
    step, whose block is left out)."""
    if not every or every < 2 or not len(steps) or "duration_s" not in steps:
        return None
    step = steps["step"].to_numpy(dtype=np.int64)
    first = int(step.min()) if first is None else first
    duration = pd.to_numeric(steps["duration_s"], errors="coerce").to_numpy(dtype=float)
    keep = (step >= first + every) & ~steps["skipped"].astype(bool).to_numpy() \
        & np.isfinite(duration) & (duration > 0)
    detail = step % every == 0
    observed, between = duration[keep & detail], duration[keep & ~detail]
    if len(observed) < MIN_OBSERVED or len(between) < MIN_BETWEEN:
        return None
    middle = float(np.median(between))
    spread = 1.4826 * float(np.median(np.abs(between - middle)))  # the MAD as a standard deviation
    # the standard error of a median is ~1.25 sigma / sqrt(n)
    noise = 2 * 1.2533 * spread / math.sqrt(len(observed))
    return DetailCost(every, float(np.median(observed)), middle, noise, len(observed), len(between))


def recent_cost(ask: Callable[[str, tuple], pd.DataFrame], first: int, last: int,
                every: Optional[int]) -> tuple[Optional[DetailCost], pd.DataFrame]:
    """:func:`detail_cost` over the last RECENT_STEPS steps, read with ``ask`` (SQL and parameters to
    a DataFrame): plenty for two medians (1,000 detail steps at the default), and a range of the
    primary key reads in milliseconds where all of a 1,000,000-step run's step times take a second."""
    recent = ask("SELECT step, skipped, duration_s FROM steps WHERE step >= ? ORDER BY step",
                 (max(first, last - RECENT_STEPS),))
    return detail_cost(recent, every, first=first), recent


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def ordinal(n: int) -> str:
    """2nd, 3rd, 11th, 20th, 21st."""
    tail = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n:,}{tail}"


def cost_line(cost: Optional[DetailCost]) -> Optional[str]:
    """The summary's line: ``+1.13 ms on every 20th step (1.027x): 0.14% of the run's time``."""
    if cost is None:
        return None
    if not cost.measurable:
        return (f"every {ordinal(cost.every)} step (per-layer detail) within the steps' noise: "
                f"{cost.extra_s * 1e3:+,.2f} ms on {ms(cost.between_s)}, +/-{ms(cost.noise_s)}")
    return (f"{cost.extra_s * 1e3:+,.2f} ms on every {ordinal(cost.every)} step (per-layer detail, "
            f"{cost.ratio:.3f}x): {cost.share:.2%} of the run's time")


def detail_cost_share(facts: "Facts") -> list["Finding"]:
    """Info: the per-layer detail costs more than SHARE_NOTE of the run's time, and the
    ``layer_every`` that would bring it under."""
    cost, recent = recent_cost(facts.ask, facts.first_step, facts.last_step, facts.info.get("layer_every"))
    if cost is None or not cost.measurable or cost.share <= SHARE_NOTE:
        return []
    every = cost.every
    detail = recent["step"][(recent["step"] % every == 0) & (recent["step"] >= facts.first_step + every)]
    first, last = int(detail.min()), int(detail.max())
    better = cost.every_for(SHARE_NOTE)
    return [facts.finding(
        "detail-cost", "info",
        f"ampwatch's per-layer detail costs {cost.share:.1%} of this run's time "
        f"(every {ordinal(every)} step, {cost.extra_s * 1e3:+,.1f} ms)",
        first, last,
        f"{_which_steps(facts, recent, every)}, the {cost.n_observed:,} steps with per-layer and per-module detail "
        f"(every {ordinal(every)}) took a median {ms(cost.observed_s)}, the {cost.n_between:,} steps between "
        f"them {ms(cost.between_s)} ({cost.ratio:.3f}x; the steps' noise +/-{ms(cost.noise_s)}); skipped steps "
        f"left out",
        f"To pay under {SHARE_NOTE:.0%}, attach with layer_every={better:,} (per-layer figures every {better:,} "
        f"steps: {cost.extra_s / (better * cost.between_s):.2%} of the run's time). Skipped and non-finite steps "
        f"keep their full detail at any layer_every, so nothing is lost in localizing a fault.",
        jump=(first, min(last, first + every)))]


def _which_steps(facts: "Facts", recent: pd.DataFrame, every: int) -> str:
    if len(recent) and int(recent["step"].iloc[0]) > facts.first_step:
        return f"over the last {len(recent):,} steps"
    return f"after the first {every:,} steps"
