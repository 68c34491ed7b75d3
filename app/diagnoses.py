"""The doctor's findings on each version of a run file, worked out once per server process.

The Runs page wants every run's health, and the doctor takes seconds on a long run (~7 s at 1M steps,
bench/doctor.py): one run after another, a folder of long runs would keep the table from showing.
So the page hands the runs it has no verdict on to one background thread (:func:`start`) and draws
the table at once; verdicts fill in as they come. A page that needs one run's findings now
(:func:`result`: the overview) waits for that run's job if it is under way, or takes it out of the
queue and works it out on its own thread, never behind the other runs.

Jobs are keyed on (path, stamp): a file that changed is diagnosed again, one that did not is not,
even when the doctor failed on it (a file it cannot read fails the same way until it changes). Only
the doctor runs here: no Streamlit call, so the thread needs no script context.
"""
from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable, Optional

KEEP = 256  # finished verdicts kept (findings are small: a few dicts a run)

_lock = threading.Lock()
_jobs: "OrderedDict[tuple[str, tuple], Future]" = OrderedDict()
_latest: dict[str, Future] = {}  # per file: the job that finished last, whatever version it read
_queue: "queue.SimpleQueue[tuple[Future, str, Callable[[str], list]]]" = queue.SimpleQueue()
_worker: Optional[threading.Thread] = None


def _serve() -> None:
    while True:
        _run(*_queue.get())


def _submit(future: Future, path: str, work: Callable[[str], list]) -> None:
    """Queue a job for the one background thread. A daemon: stopping the server does not wait for
    a long run's diagnosis (a thread pool's worker would be joined at exit). One thread, as the
    doctor spreads its own long scans over the cores."""
    global _worker
    _queue.put((future, path, work))
    with _lock:
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_serve, name="ampwatch-doctor", daemon=True)
            _worker.start()


def _run(future: Future, path: str, work: Callable[[str], list]) -> None:
    """Work the findings of ``path`` out into ``future`` (a failure too: its waiters see it)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(work(path))
    except BaseException as exc:
        future.set_exception(exc)
    with _lock:
        _latest[path] = future


def _trim() -> None:
    """Forget the oldest finished jobs past KEEP (never one queued or running: a page waits on it)."""
    for job in [j for j, f in _jobs.items() if f.done()][:max(0, len(_jobs) - KEEP)]:
        del _jobs[job]
    if len(_latest) > KEEP:  # files seen over a long session: the oldest verdicts go
        for path in list(_latest)[:len(_latest) - KEEP]:
            del _latest[path]


def start(path: str, key: tuple, work: Callable[[str], list]) -> Future:
    """The job for this version of the file: the one already known, else a new one queued behind the others."""
    job = (path, key)
    with _lock:
        future = _jobs.get(job)
        if future is not None:
            _jobs.move_to_end(job)
            return future
        for old in [j for j, f in _jobs.items() if j[0] == path and f.cancel()]:
            del _jobs[old]  # an older version of the file still queued: superseded
        future = _jobs[job] = Future()
        _trim()
    _submit(future, path, work)
    return future


def finished(path: str, key: tuple) -> Optional[Future]:
    """The job of this version of the file if it has finished (with findings or with what it
    raised), else None (queued, running or never asked)."""
    with _lock:
        future = _jobs.get((path, key))
    return future if future is not None and future.done() and not future.cancelled() else None


def latest(path: str) -> Optional[Future]:
    """The job on this file that finished last, whichever version of it the job read (a live run's
    verdict a flush behind while the next is worked out), or None."""
    with _lock:
        return _latest.get(path)


def result(path: str, key: tuple, work: Callable[[str], list]) -> list:
    """The findings now: a finished or running job's, else worked out on the caller's thread (a
    queued job is taken out of the queue). Raises what the doctor raised."""
    job = (path, key)
    with _lock:
        future = _jobs.get(job)
        if future is not None and future.cancel():  # still queued behind other runs: not waited for
            future = None
        if future is None:
            future = _jobs[job] = Future()
            mine = True
        else:
            _jobs.move_to_end(job)
            mine = False
        _trim()
    if mine:
        _run(future, path, work)
    return future.result()

