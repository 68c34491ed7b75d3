"""The doctor for a distributed job: which rank did it.

Under DDP the gradients are all-reduced, so every rank sees an inf born anywhere and every rank
skips the step: the per-rank doctor cannot tell a bad batch from a bad model. The forward pass is
not all-reduced: a NaN/Inf born in a forward pass is born on the rank whose batch caused it. So:

* ``rank-origin``: the first step at which any rank's forward pass (or loss) went non-finite, which
  rank(s) it was, their micro-batch when recorded, and whether the other ranks were clean in their
  forward passes: "a bad batch on rank 3" versus "every rank".
* ``rank-skip-disagreement``: steps some ranks skipped and others did not (the replicas diverge).
* ``rank-missing``: ranks whose file is absent or unreadable (what the job view cannot see).
* ``rank-stopped-first``: the rank that crashed or was killed first, when the job did not finish: a
  collective cannot complete without every rank, so the others' errors (a closed connection, a
  timeout) or hangs follow from it, and the per-rank crash that the report would otherwise lead
  with is usually theirs.

Findings use the doctor's :class:`~ampwatch.doctor.Finding`; :func:`diagnose_ranks` runs the
single-run doctor on every rank and merges what the ranks share, so a job is reported once.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Optional

from . import Finding, diagnose, sort_findings
from .ending import traceback_tail
from .finding import counted
from ..jobs.group import RunGroup, rank_list
from ..jobs.combine import RANK_LOCAL_PHASES, first_nonfinite, group_overview, phase_steps


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {rank_list(ranks)}"


def _where(ev: Any) -> str:
    mb = ev.get("micro_batch")
    mb_text = "" if mb is None or mb != mb else f", micro-batch {int(mb)}"
    if ev["phase"] == "input":
        return f"the model's input batch{' (' + mb_text[2:] + ')' if mb_text else ''}"
    return f"{ev['module']} ({ev['phase']}{mb_text})"


def _origin_rows(first: Any) -> dict[int, Any]:
    """The first forward/loss event of each rank at the step (origin rows first)."""
    ev = first.events
    ev = ev[ev["phase"].isin(RANK_LOCAL_PHASES)]
    return {int(r): rows.iloc[0] for r, rows in ev.groupby("rank", sort=True)}


def rank_origin(group: RunGroup) -> list[Finding]:
    """Which rank's forward pass went non-finite first, and whether the others were clean."""
    first = first_nonfinite(group, phases=RANK_LOCAL_PHASES)
    if first is None:
        return []
    step, bad = first.step, sorted(first.forward_ranks)
    rows = _origin_rows(first)
    top = rows[first.rank]
    clean = [r for r in group.ranks if r not in bad]
    unseen = sorted(set(group.missing) | {u.rank for u in group.unreadable if u.rank is not None})
    later = {r: [s for s in steps if s > step] for r, steps in phase_steps(group).items()}
    recurring = {r: len(s) for r, s in later.items() if s}
    kind = "Inf" if top["kind"] == "inf" else "NaN" if top["kind"] == "nan" else "NaN/Inf"
    where = ", ".join(f"rank {r}: {_where(rows[r])}" for r in bad[:8])
    evidence = f"step {step:,}: the forward pass went non-finite on {_ranks(bad)} ({where})"
    if clean:
        were = "were clean in their forward passes" if len(clean) > 1 else "was clean in its forward pass"
        evidence += f"; {_ranks(clean)} {were} at that step"
    if unseen:
        evidence += f"; {_ranks(unseen)} could not be read (missing or unreadable)"
    if recurring:
        evidence += "; forward NaN/Inf later on " + ", ".join(f"rank {r} at {counted(n, 'more step')}"
                                                             for r, n in sorted(recurring.items())[:8])
    if clean:
        title = f"A bad batch on {_ranks(bad)}: {kind} born in {_where(top)} at step {step:,}"
        advice = (f"The same weights gave finite forward passes on {_ranks(clean)}, so the input is the "
                  f"suspect, not the model: look at the batch rank {bad[0]} loaded for step {step:,}"
                  f"{_mb(top)} (with a DistributedSampler, rank r reads every world_size-th index of the epoch's "
                  "permutation, starting at r). Check it for extreme or corrupt values; filter or clamp inputs, "
                  "or skip bad samples in the data pipeline.")
        severity = "error"
    else:
        title = f"Every rank: {kind} born in {_where(top)} at step {step:,} on all {len(bad)} ranks"
        advice = ("Not one bad batch: every rank's forward pass overflowed at the same step, so the weights or "
                  "the model's numerics are at fault. See the per-rank findings (nonfinite-origin) for the module "
                  "and what changed before it.")
        severity = "error"
    return [Finding("rank-origin", severity, title, (step, step), evidence, advice, (max(0, step - 10), step + 10))]


def _mb(ev: Any) -> str:
    mb = ev.get("micro_batch")
    return "" if mb is None or mb != mb else f" (micro-batch {int(mb)})"


def skip_disagreement(group: RunGroup, overview: Optional[Any] = None) -> list[Finding]:
    """Steps where some ranks skipped the update and others applied it."""
    ov = overview or group_overview(group)
    steps = ov.disagree_steps
    if not steps:
        return []
    g = ov.global_steps.set_index("step")
    first = steps[0]
    return [Finding(
        "rank-skip-disagreement", "error",
        f"Ranks disagree on skipping {counted(len(steps), 'step')}, first at step {first:,}",
        (steps[0], steps[-1]),
        f"step {first:,}: {int(g.loc[first, 'skipped_ranks'])} of {int(g.loc[first, 'ranks'])} ranks skipped; "
        f"steps: {', '.join(f'{s:,}' for s in steps[:10])}{' ...' if len(steps) > 10 else ''}",
        "The replicas now hold different weights. Every rank must see the same found-inf: under DDP the "
        "gradients are all-reduced before the scaler looks at them; under FSDP use ShardedGradScaler (it "
        "all-reduces found-inf). A per-rank GradScaler on sharded or unsynchronised gradients causes this.",
        (max(0, first - 10), steps[-1] + 10))]


def missing_ranks(group: RunGroup) -> list[Finding]:
    """Ranks the job view cannot see."""
    if not group.missing and not group.unreadable:
        return []
    parts = []
    if group.missing:
        parts.append(f"no file for rank{'s' if len(group.missing) > 1 else ''} {rank_list(group.missing)}")
    for u in group.unreadable[:8]:
        who = f"rank {u.rank}" if u.rank is not None else "a file"
        parts.append(f"{who} unreadable ({u.path.name}: {u.reason})")
    seen = len(group.ranks)
    return [Finding("rank-missing", "warning", f"{seen} of {group.world_size} ranks readable",
                    (0, 0), "; ".join(parts),
                    "Copy every rank's file into the folder (one per rank, as written under torchrun). The job "
                    "figures cover only the readable ranks; a sharded job's global grad norm needs every rank.",
                    (0, 0))]


def _ending(run: Any) -> tuple[str, Optional[float], int, Optional[int]]:
    """(status, when it ended or last showed life, steps recorded, last step) of one rank's run."""
    info, steps = run.info, run.steps
    status = str(info.get("status") or "running")
    when = info.get("ended_at") if status in ("crashed", "finished") else info.get("heartbeat_at")
    last = int(steps["step"].max()) if len(steps) else None
    return status, (float(when) if isinstance(when, (int, float)) else None), len(steps), last


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 10)} UTC"


def _rank_state(rank: int, status: str, when: Optional[float], n: int, error: Any, first: Optional[float]) -> str:
    what = {"interrupted": "killed or lost (no exception)", "crashed": "crashed", "running": "still running",
            "finished": "finished"}.get(status, status)
    at = "" if when is None else (f", last heartbeat {_clock(when)}" if status in ("interrupted", "running")
                                  else f" at {_clock(when)}")
    later = f" ({when - first:,.1f} s later)" if when is not None and first is not None and when > first else ""
    tail = traceback_tail(error, 1) if status == "crashed" else []
    raised = f": {_short(tail[0].strip(), 160)}" if tail else ""
    return f"rank {rank}: {what}{at}{later}, {counted(n, 'step')} recorded{raised}"


def first_to_stop(group: RunGroup) -> Optional[int]:
    """The rank that crashed or was killed first (by its end, or a killed rank's last heartbeat),
    when the job has several readable ranks and some did not finish; else None."""
    if group.world_size < 2 or len(group.runs) < 2:
        return None
    stopped = {r: e for r, e in ((r, _ending(run)) for r, run in group.runs.items())
               if e[0] in ("crashed", "interrupted") and e[1] is not None}
    return min(stopped, key=lambda r: (stopped[r][1], r)) if stopped else None


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def stopped_first(group: RunGroup) -> list[Finding]:
    """The rank that crashed or was killed first, when some rank did not finish."""
    first = first_to_stop(group)
    if first is None:
        return []
    endings = {r: _ending(run) for r, run in group.runs.items()}
    status, when, n, last = endings[first]
    errors = {r: group.runs[r].info.get("error") for r in endings}
    others = sorted(r for r in endings if r != first)
    states = [_rank_state(first, status, when, n, errors[first], None)] + \
             [_rank_state(r, *endings[r][:3], errors[r], when) for r in others]
    how = "was killed or lost" if status == "interrupted" else "crashed"
    after = f"after step {last:,}" if last is not None else "before its first step"
    if status == "crashed":
        tail = traceback_tail(errors[first], 1)
        after = f"at step {last + 1 if last is not None else 0:,}" + (f" ({_short(tail[0].strip(), 80)})" if tail else "")
    running = [r for r in others if endings[r][0] == "running"]
    wait = (f" {_ranks(running)} {'are' if len(running) > 1 else 'is'} still running: likely waiting in a collective "
            f"for rank {first} (it will hang until the collective's timeout)." if running else "")
    see = "run-interrupted" if status == "interrupted" else "run-crashed"
    step = (last + 1) if last is not None else 0
    return [Finding(
        "rank-stopped-first", "error",
        f"Rank {first} {how} first, {after}", (step, step), "; ".join(states[:9]),
        f"Start with rank {first}: a collective cannot finish without every rank, so what the other ranks report "
        f"after it (a closed connection, a timeout, a hang) follows from it.{wait} Rank {first}'s own {see} finding "
        f"says what to look at; its stderr and the node's kernel log (dmesg) say which it was.",
        (max(0, step - 10), step))]


def diagnose_group(group: RunGroup, overview: Optional[Any] = None) -> list[Finding]:
    """Findings about the job as a whole (rank-stopped-first, rank-origin, rank-skip-disagreement,
    rank-missing)."""
    return sort_findings(stopped_first(group) + rank_origin(group) + skip_disagreement(group, overview)
                         + missing_ranks(group))


def diagnose_ranks(group: RunGroup, job: Optional[list[Finding]] = None) -> list[tuple[Finding, list[int]]]:
    """The single-run doctor on every readable rank, merged: ``(finding, ranks)`` once per
    ``(id, steps)`` shared by several ranks (the first rank's wording is kept).

    :param job: the job's findings (:func:`diagnose_group`): a clean rank reads a skip caused by
        another rank's bad batch as warm-up; with a ``rank-origin`` at that step it is not reported.
        With a ``rank-stopped-first``, the other ranks' crash or interruption names it as its cause."""
    origins = [f.steps[0] for f in job or [] if f.id == "rank-origin"]
    first = first_to_stop(group) if any(f.id == "rank-stopped-first" for f in job or []) else None
    merged: dict[tuple, tuple[Finding, list[int]]] = {}
    for rank, run in group.runs.items():
        for f in diagnose(run):
            if f.id == "warmup-skips" and any(f.steps[0] <= s <= f.steps[1] for s in origins):
                continue
            if first is not None and rank != first and f.id in ("run-crashed", "run-interrupted", "run-stalled"):
                f = replace(f, cause="rank-stopped-first")  # its end follows the first rank's
            key = (f.id, f.steps)
            if key in merged:
                merged[key][1].append(rank)
            else:
                merged[key] = (f, [rank])
    order = {id(f): i for i, f in enumerate(sort_findings([f for f, _ in merged.values()]))}
    return sorted(merged.values(), key=lambda fr: order[id(fr[0])])


__all__ = ["diagnose_group", "diagnose_ranks", "stopped_first", "rank_origin", "skip_disagreement", "missing_ranks"]
