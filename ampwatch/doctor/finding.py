"""The doctor's vocabulary: :class:`Finding`, its severities, and how numbers are written in it.

Every rule module imports from here (and nothing imports back), so the type has no circle.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

SEVERITIES = ("error", "warning", "info")

FP16_MAX = 65504.0
# The largest finite value of each autocast dtype (torch.finfo(dtype).max), by the name events store.
DTYPE_MAX = {"float16": FP16_MAX, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}


@dataclass(frozen=True)
class Finding:
    """One thing the doctor noticed about a run.

    :param id: stable identifier, e.g. ``scale-collapse`` (see docs/doctor.md for the list).
    :param severity: ``'error'``, ``'warning'`` or ``'info'``.
    :param title: one line.
    :param steps: ``(first, last)`` step the finding concerns.
    :param evidence: the numbers that triggered it.
    :param advice: what to change, concretely.
    :param jump: ``(start, end)`` step range for a UI to show.
    :param cause: the ``id`` of the root finding this one is a consequence of (skips, a collapsed
        scale, divergence explained by an origin), or None when it is a root itself.
    """
    id: str
    severity: str
    title: str
    steps: tuple[int, int]
    evidence: str
    advice: str
    jump: tuple[int, int]
    cause: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps"], d["jump"] = list(self.steps), list(self.jump)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Finding":
        """The finding :meth:`to_dict` (or ``ampwatch doctor --json``) wrote."""
        return cls(**{**d, "steps": tuple(d["steps"]), "jump": tuple(d["jump"])})


def severity_rank(severity: str) -> int:
    return SEVERITIES.index(severity)


def worst(findings: list[Finding]) -> Optional[str]:
    """The most severe severity among ``findings`` (None for none)."""
    return min((f.severity for f in findings), key=severity_rank, default=None)


# -- formatting helpers -----------------------------------------------------------------------------

def num(x: Any) -> str:
    """1,234 for integers and for values from 1,000 to 100,000, 3 significant digits otherwise, 2^k
    for exact powers of two as a hint."""
    if x is None:
        return "n/a"
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x.is_integer() and abs(x) < 1e15:
        text = f"{int(x):,}"
    elif 1e3 <= abs(x) < 1e5:  # 1,697, not 1.7e+03: as many digits, read at a glance
        text = f"{x:,.0f}"
    else:
        text = f"{x:.3g}"
    if x > 0:
        k = math.log2(x)
        if k.is_integer() and abs(k) >= 4:
            text += f" (2^{int(k)})"
    return text


def times(ratio: float) -> str:
    """73.1x, 1,071x: whole thousands read at a glance, not as 1.07e+03x."""
    return f"{ratio:,.0f}x" if ratio >= 1000 else f"{ratio:.3g}x"


def size_text(n: float) -> str:
    """Bytes as a reader takes them in: 393 MiB, 2.01 MiB, 1.5 GiB."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:,.3g} {unit}" if abs(n) / size < 1000 else f"{n / size:,.0f} {unit}"
    return f"{n:,.0f} B"


def counted(n: int, noun: str, plural: str = "") -> str:
    """"1 step", "2 steps", "1,024 values": the count and its noun, agreeing."""
    return f"{n:,} {noun if n == 1 else (plural or noun + 's')}"


def num_range(low: Any, high: Any) -> str:
    """``num(low)`` alone when both ends read the same, else "low to high" (a dash would run into
    the 2^k hint)."""
    a, b = num(low), num(high)
    return a if a == b else f"{a} to {b}"


def pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"


def span(first: int, last: int) -> str:
    return f"step {first:,}" if first == last else f"steps {first:,}-{last:,}"


def health(findings: list[Finding]) -> str:
    """``ok`` when nothing is above info, else the worst severity and the first root cause's title:
    ``error: Inf born in h.0.mlp.fc (Linear, forward) at step 40``."""
    sev = worst(findings)
    if sev in (None, "info"):
        return "ok"
    first = next(f for f in findings if f.cause is None and f.severity == sev)
    return f"{sev}: {first.title}"
