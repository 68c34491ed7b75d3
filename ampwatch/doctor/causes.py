"""Root causes: consequences (skips, a collapsed scale, divergence, underflow) are attached to the
finding that explains them, and the report leads with the causes.

A consequence belongs to a cause when both name the same origin (module and phase, as the rules
record them in ``Facts.claims``), or when the cause is of a kind that explains it by itself (a crash
explains an empty run; a collapsed scale explains underflow at a low scale). A cause takes the
severity of its worst consequence, so a warning whose consequence is an error leads as an error.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .facts import Facts
from .finding import Finding, severity_rank

# Findings that can be a cause, most fundamental first (an origin explains a recurring overflow,
# which explains a collapse, which explains underflow; a loss spike and a gradient explosion that
# name the same overwritten weight are one event, led by the spike; memory that keeps growing explains
# a run the OOM killer ended, or one that crashed out of memory).
CAUSES = ("run-crashed", "run-interrupted", "nonfinite-origin", "recurring-overflow", "scale-collapse", "loss-spike",
          "memory-growth")
# What each kind of consequence may be explained by, beyond a shared origin.
EXPLAINED_BY = {"no-steps": ("run-crashed", "run-interrupted"), "run-interrupted": ("memory-growth",),
                "grad-underflow": ("scale-collapse",),
                "divergence": ("nonfinite-origin",),
                "scale-falling": ("nonfinite-origin", "recurring-overflow", "scale-collapse"),
                "run-crashed": ("nonfinite-origin",)}
# ... and only while it lasts: a crash inside the steps of a NaN/Inf (a loop that raises on a NaN
# loss, its last step recorded as far as it got) follows from it; one long after it need not
WITHIN = ("run-crashed",)
CONSEQUENCES = ("nonfinite-origin", "recurring-overflow", "scale-collapse", "divergence", "grad-underflow", "late-skips",
                "loss-spike", "grad-norm-explosion", "no-steps", "scale-falling", "run-interrupted", "run-crashed")


def _rank(f: Finding) -> tuple[int, int]:
    """Causes come before what they explain: earlier first, then the more fundamental kind. A
    finding only points at one of smaller rank, so the links never form a circle."""
    return f.steps[0], CAUSES.index(f.id) if f.id in CAUSES else len(CAUSES)


def _cause_of(f: Finding, by_id: dict[str, Finding], facts: Facts) -> Optional[str]:
    if f.id not in CONSEQUENCES:
        return None
    claim = facts.claims.get(f.id)
    candidates = []
    for cause in CAUSES:
        if cause == f.id or cause not in by_id:
            continue
        same_origin = claim is not None and facts.claims.get(cause) == claim
        if same_origin and _rank(by_id[cause]) < _rank(f):
            candidates.append(by_id[cause])
        elif (cause in EXPLAINED_BY.get(f.id, ()) and by_id[cause].steps[0] <= f.steps[0]
              and (f.id not in WITHIN or f.steps[0] <= by_id[cause].steps[1])):
            candidates.append(by_id[cause])  # e.g. an origin born before the divergence began
    return min(candidates, key=_rank).id if candidates else None


def group(findings: list[Finding], facts: Facts) -> list[Finding]:
    """``findings`` with ``cause`` set, ordered: each root (most severe, then earliest) followed by
    its consequences. Chains are flattened: a consequence points at its root."""
    by_id = {f.id: f for f in findings}
    cause = {f.id: _cause_of(f, by_id, facts) for f in findings}
    def root(fid: str) -> str:
        seen = set()
        while cause.get(fid) and fid not in seen:
            seen.add(fid)
            fid = cause[fid]
        return fid
    members: dict[str, list[Finding]] = {}
    for f in findings:
        r = root(f.id) if cause.get(f.id) else f.id
        members.setdefault(r, []).append(replace(f, cause=None if r == f.id else r))
    out: list[Finding] = []
    roots = []
    for rid, group_ in members.items():
        head = next(f for f in group_ if f.id == rid)
        worst = min((f.severity for f in group_), key=severity_rank)
        roots.append((replace(head, severity=worst), [f for f in group_ if f.id != rid]))
    roots.sort(key=lambda r: (severity_rank(r[0].severity), r[0].steps[0]))
    for head, rest in roots:
        out.append(head)
        out.extend(sorted(rest, key=lambda f: (severity_rank(f.severity), f.steps[0])))
    return out


def root_causes(findings: list[Finding]) -> list[Finding]:
    """The findings that are causes (``cause`` is None), in report order."""
    return [f for f in findings if f.cause is None]


def consequences(findings: list[Finding], cause_id: str) -> list[Finding]:
    return [f for f in findings if f.cause == cause_id]
