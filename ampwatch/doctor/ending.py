"""How the run ended, when it did not end well: a Python exception (crashed), or a process ended from
outside without one (interrupted: killed, out of memory, preempted)."""
from __future__ import annotations

import socket
import time
from typing import Optional

import pandas as pd

from .finding import Finding, counted
from .facts import Facts
from ..store.reader import pid_alive


def traceback_tail(error: Optional[str], lines: int = 3) -> list[str]:
    """The last ``lines`` non-empty lines of a stored traceback (the exception's line last)."""
    # Python 3.11's markers under the failing expression (^^^^, ~~~^^^) point at nothing here
    kept = [line.rstrip() for line in (error or "").strip().splitlines() if line.strip(" ^~")]
    return kept[-lines:]


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
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def run_crashed(facts: Facts) -> list[Finding]:
    """Error: the training loop raised (status crashed): the exception's last line and its step."""
    if facts.info.get("status") != "crashed":
        return []
    tail = traceback_tail(facts.info.get("error"))
    last = tail[-1].strip() if tail else "no traceback was stored"
    step = facts.last_step + 1 if len(facts.steps) else 0
    done = f"after {counted(len(facts.steps), 'recorded step')}" if len(facts.steps) else "before its first recorded step"
    return [facts.finding(
        "run-crashed", "error", f"The run crashed at step {step:,}: {last}", step, step,
        f"status crashed {done}; the traceback ends: " + " | ".join(t.strip() for t in tail),
        "Fix the exception (ampwatch summary prints the traceback's last lines; the whole text is in run.error) "
        "and resume from the last checkpoint.", jump=facts.jump(step, step))]
