"""The doctor: a recorded run in, root causes with their consequences, evidence and a fix out.

Reads only the :class:`ampwatch.Run` it is given, read-only, and never imports torch. The package
owns its vocabulary (:mod:`.finding`); the rules, with their thresholds and the reasons for them,
live next to it (:mod:`.skips`, :mod:`.scale`, :mod:`.numerics`, :mod:`.signals`, :mod:`.misuse`);
everything they read comes through :class:`.facts.Facts`; :mod:`.causes` attaches consequences to
their root cause; :mod:`ampwatch.cli.report` writes it as text.

>>> for f in ampwatch.diagnose("sample_runs/diverged.sqlite"):
...     print(f.severity, f.cause or "ROOT", f.title)
"""
from __future__ import annotations

from typing import Any

from .finding import FP16_MAX, SEVERITIES, Finding, health, num, pct, span, worst


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Errors first, then warnings, then info; within a severity by first step (stable otherwise)."""
    return sorted(findings, key=lambda f: (SEVERITIES.index(f.severity), f.steps[0]))


def diagnose(run: Any) -> list[Finding]:
    """Findings for a :class:`ampwatch.Run`: each root cause (most severe, then earliest) followed by
    the consequences it explains (``cause`` = the root's id).

    :param run: an opened run (finished or still being written).

    Reads the steps table once and asks the per-layer and per-module tables only narrow questions
    (filters and aggregates run inside SQLite), so a 1,000,000-step run takes seconds.
    """
    from .causes import group
    from .facts import Facts
    from .rules import RULES
    findings: list[Finding] = []
    with Facts.open(run) as facts:
        for rule in RULES:
            findings.extend(rule(facts))
        return group(sort_findings(findings), facts)


__all__ = ["Finding", "diagnose", "sort_findings", "health", "worst",
           "SEVERITIES", "FP16_MAX", "num", "pct", "span"]
