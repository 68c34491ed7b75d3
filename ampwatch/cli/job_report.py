"""Plain-text reports of a distributed job for the CLI: ``summary`` and ``doctor`` on a folder.

A job is reported once: its figures across ranks, then one line per rank only where the ranks
differ (status, steps, skips, first NaN/Inf; the loss differs by design, each rank has its own data).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..doctor import SEVERITIES, Finding
from ..doctor.finding import counted
from ..doctor.warmup import WARMUP_NOTE, expected_overflow
from .report import numbered, wrap
from ..jobs.group import RunGroup, rank_list
from ..jobs.combine import first_nonfinite

SHARDING_TEXT = {"sharded": "sharded gradients (FSDP)", "replicated": "replicated gradients (DDP)",
                 "none": "one process"}


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.{digits}g}"


def _status(group: RunGroup, ov: Any) -> str:
    statuses = sorted(set(ov.ranks["status"]))
    return statuses[0] if len(statuses) == 1 else "/".join(statuses)


def job_header(group: RunGroup, ov: Any) -> str:
    folder = next(iter(group.paths.values())).parent if group.paths else "?"
    return (f"job      {group.name}  ({len(group.ranks)} of {group.world_size} ranks, "
            f"{SHARDING_TEXT.get(group.grad_sharding, group.grad_sharding)}, {_status(group, ov)})  {folder}")


def rank_lines(group: RunGroup, ov: Any) -> list[str]:
    """Per-rank lines when the ranks differ in status, steps, skips or first NaN/Inf; else one line."""
    r = ov.ranks
    differ = any(r[c].astype(str).nunique() > 1 for c in ("status", "steps", "skipped", "first_nonfinite_step"))
    lines = []
    if not differ:
        lines.append(f"ranks    all {len(r)} agree on status, steps, skips and first NaN/inf")
    else:
        for row in r.itertuples():
            bad = "-" if row.first_nonfinite_step is None or row.first_nonfinite_step != row.first_nonfinite_step \
                else int(row.first_nonfinite_step)
            lines.append(f"rank {row.rank:<4}{row.file:<28} {row.status:<12} steps {row.steps:<8} skipped "
                         f"{row.skipped:<6} first NaN/inf {bad}  last loss {_fmt(row.last_loss)}")
    if group.missing:
        lines.append(f"missing  rank{'s' if len(group.missing) > 1 else ''} {rank_list(group.missing)}: no file")
    for u in group.unreadable:
        who = f"rank {u.rank}" if u.rank is not None else u.path.name
        lines.append(f"unreadable {who}: {u.reason}")
    return lines


def format_job_summary(group: RunGroup) -> str:
    """Headline figures of a job across its ranks (uses the fast overview)."""
    ov = group.overview()
    g = ov.global_steps
    n = int(ov.ranks["steps"].max()) if len(ov.ranks) else 0
    skipped = int(ov.ranks["skipped"].max()) if len(ov.ranks) else 0
    agree = "every rank agrees on every skip" if not ov.disagree_steps else \
        f"ranks DISAGREE on {counted(len(ov.disagree_steps), 'step')}, first {ov.disagree_steps[0]}"
    sampled = f" (sampled every {ov.every} steps)" if ov.every > 1 else ""
    finite = g[np.isfinite(g["loss_mean"].astype(float))]
    norms = g["grad_norm"].astype(float)
    norms = norms[np.isfinite(norms)]
    scale = g["loss_scale"].dropna().astype(float)
    lines = [job_header(group, ov),
             f"steps    {n}{numbered(*g['step'].iloc[[0, -1]]) if len(g) else ''}  skipped {skipped} ({100.0 * skipped / n if n else 0.0:.1f}%)  {agree}"]
    if len(g):
        last = g.iloc[-1]
        lines.append(f"loss     mean over ranks: first {_fmt(g['loss_mean'].iloc[0])}  last {_fmt(last['loss_mean'])}  "
                     f"min {_fmt(finite['loss_mean'].min() if len(finite) else None)}  "
                     f"spread at last step {_fmt(last['loss_min'])}..{_fmt(last['loss_max'])}")
    if len(scale):
        lines.append(f"scale    start {_fmt(scale.iloc[0])}  min {_fmt(scale.min())}  final {_fmt(scale.iloc[-1])}")
    lines.append(_first_line(group))
    if len(norms):
        q = norms.quantile([0.5, 0.9, 0.99])
        lines.append(f"gradnorm global{sampled}: p50 {_fmt(q.iloc[0])}  p90 {_fmt(q.iloc[1])}  "
                     f"p99 {_fmt(q.iloc[2])}  max {_fmt(norms.max())}")
    return "\n".join(lines + rank_lines(group, ov))


def _first_line(group: RunGroup) -> str:
    first = first_nonfinite(group)
    if first is None:
        return "nonfinite none"
    where = (f": the model's input batch{_mb(first.micro_batch)}" if first.phase == "input" else
             f": {first.module} ({first.phase}{_mb(first.micro_batch)})" if first.module else "")
    text = f"nonfinite first at step {first.step} on rank {first.rank}{where}"
    if expected_overflow(group.paths[first.rank], first.step, first.phase):
        # every rank skips the warm-up's steps: rank 0 comes first only because it sorts first
        others = [r for r in first.ranks if r != first.rank]
        also = f", also rank{'s' if len(others) > 1 else ''} {rank_list(others)} at that step" if others else ""
        return "\n".join([text + also + ":"] + wrap("", WARMUP_NOTE, indent=9))
    if first.forward_ranks:
        readable = "" if group.complete else " readable"
        text += f"; forward pass non-finite on rank {rank_list(first.forward_ranks)} of {len(group.ranks)}{readable}"
    return text


def _mb(mb: Any) -> str:
    return "" if mb is None else f", micro-batch {mb}"


def format_job_doctor(group: RunGroup, job: list[Finding], per_rank: list[tuple[Finding, list[int]]]) -> str:
    """The doctor's report for a job: the job's findings, then the per-rank findings once each."""
    ov = group.overview()
    every = set(group.ranks)
    all_f = job + [f for f, _ in per_rank]
    counts = {s: sum(f.severity == s for f in all_f) for s in SEVERITIES}
    lines = [job_header(group, ov),
             f"{counted(counts['error'], 'error')}, {counted(counts['warning'], 'warning')}, {counts['info']} info"]
    if not all_f:
        lines += ["", "No findings: nothing in this job needs attention."]
    for f, ranks in [(f, None) for f in job] + per_rank:
        who = "" if ranks is None else "  [every rank]" if set(ranks) == every else f"  [rank {rank_list(ranks)}]"
        follows = f"  (follows {f.cause})" if ranks is not None and f.cause and f.cause.startswith("rank-") else ""
        lines += ["", f"{f.severity.upper():<8}{f.id}  ({_span(f)}){who}{follows}"]
        lines += wrap("", f.title) + wrap("evidence: ", f.evidence) + wrap("advice:   ", f.advice)
    return "\n".join(lines)


def _span(f: Finding) -> str:
    first, last = f.steps
    return f"step {first:,}" if first == last else f"steps {first:,}-{last:,}"


def job_doctor_json(group: RunGroup, job: list[Finding], per_rank: list[tuple[Finding, list[int]]]) -> dict:
    return {"job": group.name, "job_id": group.job_id, "world_size": group.world_size, "ranks": group.ranks,
            "missing": group.missing,
            "unreadable": [{"rank": u.rank, "path": str(u.path), "reason": u.reason} for u in group.unreadable],
            "paths": {str(r): str(p) for r, p in group.paths.items()},
            "findings": [f.to_dict() for f in job] + [dict(f.to_dict(), ranks=ranks) for f, ranks in per_rank]}


__all__ = ["format_job_summary", "format_job_doctor", "job_doctor_json", "rank_lines", "job_header"]
