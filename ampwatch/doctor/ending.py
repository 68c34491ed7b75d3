"""How the run ended, when it did not end well: a Python exception (crashed), a process ended from
outside without one (interrupted: killed, out of memory, preempted), or a live process whose training
stopped stepping (stalled: a hang its still-beating writer would otherwise hide)."""
from __future__ import annotations

import socket
import time
from typing import Optional

import pandas as pd

from .finding import Finding, counted
from .facts import Facts
from ..store.reader import pid_alive

# A running run is stalled when no step has ended for STALL_FACTOR x its median recent step and at
# least STALL_MIN_S (a first compile, an evaluation or a checkpoint save take a while: a minute is
# the least silence worth a warning). The writer stamps its heartbeat on a timer, so a hung training
# thread leaves the run "running" forever: the steps' own times are what show it.
STALL_FACTOR = 20.0
STALL_MIN_S = 60.0
STALL_RECENT = 100
# the notice on a step the run closed inside, written as far as it got (ampwatch/record/unfinished.py)
UNFINISHED = "step-unfinished"


def traceback_tail(error: Optional[str], lines: int = 3) -> list[str]:
    """The last ``lines`` non-empty lines of a stored traceback (the exception's line last)."""
    # Python 3.11's markers under the failing expression (^^^^, ~~~^^^) point at nothing here
    kept = [line.rstrip() for line in (error or "").strip().splitlines() if line.strip(" ^~")]
    return kept[-lines:]


def run_stalled(facts: Facts, now: Optional[float] = None) -> list[Finding]:
    """Warning: the run is running (its writer is alive) but no step has ended for far longer than
    its steps take: training hangs (a collective waiting for a rank, a data loader, a deadlock)."""
    info = facts.info
    if info.get("status") != "running" or not len(facts.steps):
        return []
    recent = facts.ask("SELECT time, duration_s FROM steps WHERE step > ? ORDER BY step",
                       (facts.last_step - STALL_RECENT,))
    last_time = recent["time"].iloc[-1]
    typical = recent["duration_s"].median()
    if pd.isna(last_time):
        return []
    typical = float(typical) if pd.notna(typical) and typical > 0 else 0.0
    silence = (now if now is not None else time.time()) - float(last_time)
    if silence < max(STALL_MIN_S, STALL_FACTOR * typical):
        return []
    beat = info.get("heartbeat_at")
    alive = (f"; the writer is alive (heartbeat {_duration(max(0.0, float(beat) - float(last_time)))} after that step), "
             f"so the process lives but training is not stepping" if isinstance(beat, (int, float)) else "")
    pid, host = info.get("pid"), info.get("hostname")
    at = f"on {host}: " if host and host != socket.gethostname() else ""
    return [facts.finding(
        "run-stalled", "warning",
        f"No step has finished for {_duration(silence)} (its steps take {_duration(typical)})",
        facts.last_step, facts.last_step,
        f"the last step, {facts.last_step:,}, ended at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(float(last_time)))}, "
        f"{_duration(silence)} ago; the median of the last {counted(len(recent), 'step')} took {_duration(typical)}"
        f"{alive}",
        f"Training is stalled, not dead: see where it waits with {at}py-spy dump --pid {pid} (a collective waiting "
        f"for a rank that died or took another branch, a data loader worker that hangs, a deadlock). A long "
        f"evaluation or checkpoint save between steps looks the same: then it ends by itself.",
        jump=facts.jump(facts.last_step, facts.last_step))]


def run_interrupted(facts: Facts) -> list[Finding]:
    """Warning: the run stopped without closing and without a Python exception (status interrupted:
    its process is gone or its heartbeat went silent): killed (SIGKILL, the OOM killer, a
    preemption, a lost node). What the file holds ends at the writer's last flush."""
    info = facts.info
    if info.get("status") != "interrupted":
        return []
    beat = info.get("heartbeat_at") or info.get("started_at")
    when = (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(beat)) if isinstance(beat, (int, float))
            else "an unknown time")
    host, pid = info.get("hostname"), info.get("pid")
    here = host == socket.gethostname() and bool(pid)
    hung = here and pid_alive(pid)
    if hung:
        gone = (f"process {pid} on {host} is still alive, but its writer has not flushed since: it hangs or "
                f"was stopped")
    elif here:
        gone = f"process {pid} on {host} is gone"
    else:
        gone = f"no heartbeat since (the writer stamps one every flush; {host or 'its host'} is not this machine)"
    if len(facts.steps):
        step = facts.last_step + 1
        last = facts.ask("SELECT time FROM steps WHERE step = ?", (facts.last_step,))["time"].iloc[0]
        held = (f"the file holds {counted(len(facts.steps), 'step')}, the last (step {facts.last_step:,}) ending "
                f"{_duration(float(beat) - float(last))} before that heartbeat" if beat and pd.notna(last)
                else f"the file holds {counted(len(facts.steps), 'step')}, the last step {facts.last_step:,}")
    else:
        step, held = 0, "no step was recorded"
    if hung:
        advice = (f"The process is alive but recording stopped: see where it waits with py-spy dump --pid {pid} "
                  f"(a deadlock, a collective waiting for a rank that died, a process stopped with SIGSTOP)")
    else:
        advice = ("Something ended the process from outside: the kernel's OOM killer (look for 'Killed process' in "
                  "dmesg or 'OOMKilled' in the scheduler's log), a SIGKILL or time limit from the scheduler, a "
                  "preemption, or a lost node")
    title = f"after step {step - 1:,}" if step else "before its first step"
    return [facts.finding(
        "run-interrupted", "warning", f"The run stopped {title} without closing or raising", step, step,
        f"status interrupted: it never closed and raised no Python exception; last heartbeat {when}, and {gone}; {held}",
        f"{advice}. Every step up to the writer's last flush is in the file; resume from the last checkpoint, and "
        f"wrap training in `with ampwatch.attach(...)` (or call watch.close()) so that a clean end reads 'finished'.",
        jump=facts.jump(max(step - 1, 0), max(step - 1, 0)))]


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def ended_inside(facts: Facts) -> bool:
    """Whether the run's last recorded step did not end: it closed inside it (a loop that raised
    on a NaN loss), and the recorder wrote the step as far as it got (notice ``step-unfinished``)."""
    n = facts.notices
    return bool(len(facts.steps) and len(n)
                and ((n["code"] == UNFINISHED) & (n["step"] == facts.last_step)).any())


def run_crashed(facts: Facts) -> list[Finding]:
    """Error: the training loop raised (status crashed): the exception's last line and its step."""
    if facts.info.get("status") != "crashed":
        return []
    tail = traceback_tail(facts.info.get("error"))
    last = tail[-1].strip() if tail else "no traceback was stored"
    if "out of memory" in last.lower() or "MemoryError" in last:
        facts.claims["run-crashed"] = ("memory",)  # memory-growth, when found, explains it
    step = facts.last_step + 1 if len(facts.steps) else 0
    done = f"after {counted(len(facts.steps), 'recorded step')}" if len(facts.steps) else "before its first recorded step"
    if ended_inside(facts):  # its last row is the step it raised in, recorded as far as it got
        step = facts.last_step
        done = (f"in step {step:,}, recorded as far as it got, after {counted(len(facts.steps) - 1, 'finished step')}"
                if len(facts.steps) > 1 else f"in step {step:,}, its first, recorded as far as it got")
    return [facts.finding(
        "run-crashed", "error", f"The run crashed at step {step:,}: {last}", step, step,
        f"status crashed {done}; the traceback ends: " + " | ".join(t.strip() for t in tail),
        "Fix the exception (ampwatch summary prints the traceback's last lines; the whole text is in run.error) "
        "and resume from the last checkpoint." + _crash_inputs(facts), jump=facts.jump(step, step))]


def _crash_inputs(facts: Facts) -> str:
    """The saved inputs of the step the crash stopped (the last one saved, at or after the last
    recorded step), pointed at."""
    saved = facts.saved_input_steps
    last = facts.last_step if len(facts.steps) else 0
    if not saved or saved[-1] < last:
        return ""
    bad = facts.nonfinite_inputs(saved[-1])
    held = "; ".join(f"{name} holds {nan + inf:,} NaN/inf of {numel:,} values" for name, _, nan, inf, numel in bad)
    return ((f" The step's input batch itself is not finite ({held}): the data is the cause, fix or drop that "
             f"sample." if bad else "") + facts.saved_inputs_text(saved[-1]))
