"""The doctor's findings as text for the command line: the report of one run (causes first,
consequences under them) and the one-line health of a run for triage (``ampwatch ls``, ``ampwatch doctor DIR``)."""
from __future__ import annotations

import textwrap
from typing import Any

from ..doctor.finding import SEVERITIES, Finding, counted, health, span


def numbered(first: Any, last: Any) -> str:
    """" (steps 500-749)" for a run or a job that does not start at step 0 (resumed: first_step)."""
    return f" (steps {int(first):,}-{int(last):,})" if first else ""


def health_line(run: Any, findings: list[Finding], width: int = 28) -> str:
    """One line per run: name, then its health."""
    return f"{run.name:<{width}} {health(findings)}"


def wrap(label: str, text: str, indent: int = 2, width: int = 100) -> list[str]:
    pad = " " * (indent + len(label))
    return textwrap.wrap(text, width=width, initial_indent=" " * indent + label,
                         subsequent_indent=pad) or [" " * indent + label]


def _block(f: Finding, indent: int) -> list[str]:
    head = "-> " if f.cause else ""
    lines = [" " * (indent - 2) + f"{head}{f.severity.upper():<8}{f.id}  ({span(*f.steps)})"]
    lines.extend(wrap("", f.title, indent))
    lines.extend(wrap("evidence: ", f.evidence, indent))
    lines.extend(wrap("advice:   ", f.advice, indent))
    return lines


def format_report(run: Any, findings: list[Finding]) -> str:
    """A plain-text report: a header for the run, then each root cause with its consequences
    indented under it (``findings`` in :func:`ampwatch.diagnose` order)."""
    info = run.info
    n = int(run.query("SELECT COUNT(*) AS n FROM steps")["n"].iloc[0])  # not run.steps: a 1M-row read
    scaler = "GradScaler on" if info.get("scaler_enabled") else "no GradScaler"
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    # the problems' root causes: an info finding (a normal warm-up) is not one
    roots = [f for f in findings if f.cause is None and f.severity != "info"]
    lines = [f"{run.name}  ({run.path})",
             f"{n:,} steps, {info.get('amp_dtype') or 'no autocast seen'}, {scaler}, {info.get('status')}",
             f"health: {health(findings)}",
             f"{counted(len(roots), 'root cause')}; {counted(counts['error'], 'error')}, "
             f"{counted(counts['warning'], 'warning')}, {counts['info']} info"]
    if not findings:
        lines += ["", "No findings: nothing in this run needs attention."]
    for f in findings:
        if f.cause is None:
            lines.append("")
            lines.extend(_block(f, 2))
        else:
            lines.extend(_block(f, 6))
    return "\n".join(lines)
