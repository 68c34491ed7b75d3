"""The doctor: a recorded run in, findings with evidence and a concrete fix out (issue 5).

Reads only the :class:`ampwatch.Run` it is given, read-only, and never imports torch. The rules, with
their thresholds and the reasons for them, live in :mod:`ampwatch.rules`; everything they read
comes through :class:`ampwatch.rules.facts.Facts`.

>>> for f in ampwatch.diagnose("sample_runs/diverged.sqlite"):
...     print(f.severity, f.title)
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

SEVERITIES = ("error", "warning", "info")

FP16_MAX = 65504.0


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
    """
    id: str
    severity: str
    title: str
    steps: tuple[int, int]
    evidence: str
    advice: str
    jump: tuple[int, int]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps"], d["jump"] = list(self.steps), list(self.jump)
        return d


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Errors first, then warnings, then info; within a severity by first step (stable otherwise)."""
    return sorted(findings, key=lambda f: (SEVERITIES.index(f.severity), f.steps[0]))


# -- formatting helpers -----------------------------------------------------------------------------

def num(x: Any) -> str:
    """1,234 for integers, 3 significant digits otherwise, 2^k for exact powers of two as a hint."""
    if x is None:
        return "n/a"
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    text = f"{int(x):,}" if x.is_integer() and abs(x) < 1e15 else f"{x:.3g}"
    if x > 0:
        k = math.log2(x)
        if k.is_integer() and abs(k) >= 4:
            text += f" (2^{int(k)})"
    return text


def pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"


def span(first: int, last: int) -> str:
    return f"step {first:,}" if first == last else f"steps {first:,}-{last:,}"


def diagnose(run: Any) -> list[Finding]:
    """Findings for a :class:`ampwatch.Run`, most severe first, then by step.

    :param run: an opened run (finished or still being written).

    Reads the steps table once and asks the per-layer and per-module tables only narrow questions
    (filters and aggregates run inside SQLite), so a 1,000,000-step run takes seconds.
    """
    from .rules import RULES, Facts
    findings: list[Finding] = []
    with Facts.open(run) as facts:
        for rule in RULES:
            findings.extend(rule(facts))
    return sort_findings(findings)


def _wrap(label: str, text: str, width: int = 100) -> list[str]:
    import textwrap
    pad = " " * (2 + len(label))
    return textwrap.wrap(text, width=width, initial_indent=f"  {label}", subsequent_indent=pad) or [f"  {label}"]


def format_report(run: Any, findings: list[Finding]) -> str:
    """A plain-text report: a header line for the run, then one block per finding."""
    info = run.info
    n = int(run.query("SELECT COUNT(*) AS n FROM steps")["n"].iloc[0])  # not run.steps: a 1M-row read
    scaler = "GradScaler on" if info.get("scaler_enabled") else "no GradScaler"
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    lines = [f"{run.name}  ({run.path})",
             f"{n:,} steps, {info.get('amp_dtype') or 'no autocast seen'}, {scaler}, {info.get('status')}",
             f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info"]
    if not findings:
        lines.append("")
        lines.append("No findings: nothing in this run needs attention.")
    for f in findings:
        first, last = f.steps
        where = f"step {first:,}" if first == last else f"steps {first:,}-{last:,}"
        lines.append("")
        lines.append(f"{f.severity.upper():<8}{f.id}  ({where})")
        lines.extend(_wrap("", f.title))
        lines.extend(_wrap("evidence: ", f.evidence))
        lines.extend(_wrap("advice:   ", f.advice))
    return "\n".join(lines)


__all__ = ["Finding", "diagnose", "format_report", "sort_findings", "SEVERITIES"]
