"""The run file's only writer: a background thread, batched commits in WAL mode.

The training thread only appends each step's pack to a deque: no lock, no wake-up. Waking the
thread per step cost the MLP benchmark ~0.5 ms a step in GIL hand-offs; instead the thread wakes
every ``_POLL_S`` and turns everything waiting into rows in one burst. Info and notices go on a
queue. The thread commits at least every ``flush_every_s`` (and stamps a heartbeat, so readers
can tell a dead run from a live one), and on close checkpoints the WAL and switches back to a rollback journal so a finished run is one file.
Bulk rows go through a few multi-row ``INSERT`` statements (:func:`_insert_many`: ``executemany``
steps one statement a row, and takes the GIL back after each; ``insert_all`` is ~4x slower still,
research/overhead-anchors.md): GIL time stolen from training. Schema and run rows go through sqlite-utils.
"""
from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from typing import Any, Callable, Optional

from sqlite_utils import Database

from . import schema
from .rows import Rows

log = logging.getLogger("ampwatch")

_STOP = object()
_POLL_S = 0.1  # how often the thread drains the step deque; bounds what a reader sees late
CHECKPOINT_EVERY_S = 2.0  # how often the WAL is folded into the run file while recording (_checkpoint)

# table -> (statement verb, columns), in the order of the tuples in Rows
_TABLES = {
    "steps": ("INSERT OR REPLACE", ("step", "time", "duration_s", "loss", "loss_scale", "skipped", "grad_norm",
                                    "lr", "micro_batches", "nan_mask")),
    "layers": ("INSERT OR REPLACE", ("param_id", "step", "grad_norm", "grad_amax", "param_norm",
                                     "grad_nonfinite", "grad_zero_frac", "nan_mask")),
    "modules": ("INSERT OR REPLACE", ("module_id", "phase", "step", "amax", "nonfinite")),
    "events": ("INSERT", ("step", "phase", "module", "kind", "count", "amax", "dtype", "origin", "micro_batch",
                          "fp32_amax", "fp32_nan", "flows_into", "lowp_amax", "lowp_nan")),
    "metrics": ("INSERT OR REPLACE", ("key", "step", "value")),
    "fp8_layers": ("INSERT OR REPLACE", ("step", "module", "role", "dtype", "scaling", "amax", "scale", "p99",
                                         "flush_frac", "sat_frac", "rel_err", "numel", "nonfinite")),
    "memory": ("INSERT OR REPLACE", ("step", "host_rss", "device_allocated", "device_reserved")),
    "batches": ("INSERT OR REPLACE", ("step", "micro_batch", "name", "dtype", "shape", "nbytes", "sha256", "data")),
}
# bound variables a statement may hold: 32766 since SQLite 3.32, 999 before
_MAX_VARIABLES = 32766 if sqlite3.sqlite_version_info >= (3, 32, 0) else 999
_ROWS_PER_STATEMENT = 256


def _insert_many(conn: sqlite3.Connection, table: str, rows: list[tuple]) -> None:
    """Insert ``rows`` with a few multi-row statements (``VALUES (..), (..), ...``) instead of
    ``executemany``'s one statement a row. Python's sqlite3 lets go of the GIL around every
    statement it steps and takes it back after: a row at a time, a commit of an observed step's
    ~450 rows was ~450 hand-offs of the GIL with the training thread, which waits for each (on
    ``bench/hostcost.py``'s model the commits cost the training thread several times their own CPU
    time: docs/performance.md, "The writer thread's commits"). Rows are
    applied in order, as ``executemany`` applies them (a later row replaces an earlier one)."""
    verb, columns = _TABLES[table]
    per = max(1, min(_ROWS_PER_STATEMENT, _MAX_VARIABLES // len(columns)))
    for start in range(0, len(rows), per):
        chunk = rows[start:start + per]
        conn.execute(_statement(verb, table, columns, len(chunk)), list(itertools.chain.from_iterable(chunk)))


_STATEMENTS: dict[tuple[str, int], str] = {}


def _statement(verb: str, table: str, columns: tuple, n: int) -> str:
    sql = _STATEMENTS.get((table, n))
    if sql is None:
        one = "(" + ",".join("?" * len(columns)) + ")"
        sql = f"{verb} INTO {table} ({', '.join(columns)}) VALUES " + ",".join([one] * n)
        if len(_STATEMENTS) < 512:  # the chunk sizes a run sees: full ones and a few remainders
            _STATEMENTS[(table, n)] = sql
    return sql


# one row's statement per table (tests and tools that write rows as the writer does)
_INSERTS = {table: _statement(verb, table, columns, 1) for table, (verb, columns) in _TABLES.items()}


def create_run_file(path: str, info: dict[str, Any], tensors: list[dict[str, Any]]) -> None:
    """Create the file with its schema, run row and name tables. Runs on the caller's thread so
    an unwritable location is reported at attach time. Made whole under a name of its own beside
    ``path`` and renamed into place: a reader polling the folder (a live dashboard, ``ampwatch
    summary``) never opens it empty or half made (SQLite creates the file empty on connect)."""
    making = f"{path}.{os.getpid()}-{threading.get_ident()}.making"  # no run suffix: no reader lists it
    try:
        conn = sqlite3.connect(making)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            db = Database(conn)
            schema.create(db)
            row = dict(info)
            row["config_json"] = json.dumps(row.pop("config", None) or {}, default=str, sort_keys=True)
            row["id"] = 1
            db["run"].insert(row)
            if tensors:
                db["tensors"].insert_all(tensors)
            conn.commit()
        finally:
            conn.close()  # the last connection: SQLite folds the WAL into the file and removes it
        os.replace(making, path)
    finally:
        for suffix in ("", "-wal", "-shm", "-journal"):  # left only where something failed
            try:
                os.unlink(making + suffix)
            except FileNotFoundError:
                pass


class RunWriter:
    """Owns the SQLite connection on its own thread. ``failure`` is set if it dies.

    ``to_rows`` turns one handed-over step (opaque to the writer) into :class:`Rows`; it runs on
    this thread, so whatever the conversion waits for (a device transfer) never stalls training.

    ``on_commit(rows, info, notices)``: called on this thread after each commit with what it
    committed (the last call's ``info`` holds ``status``); it must not raise (a mirror to a tracker
    guards itself)."""

    def __init__(self, path: str, to_rows: Callable[[Any], Rows], flush_every_s: float,
                 on_commit: Optional[Callable[[Rows, dict, list], None]] = None,
                 sample: Optional[Callable[[int], Rows]] = None) -> None:
        """``sample(step)``: rows read on this thread before each commit that holds new steps, for
        the commit's last step (the process's memory)."""
        self.path = path
        self._on_commit = on_commit
        self._sample = sample
        self.failure: Optional[BaseException] = None
        self._to_rows = to_rows
        self._flush_every_s = flush_every_s
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._steps: "collections.deque[Any]" = collections.deque()  # append/popleft are atomic
        self._inode = os.stat(path).st_ino
        self._thread = threading.Thread(target=self._run, name="ampwatch-writer", daemon=True)
        self._thread.start()

    def put_step(self, pack: Any) -> None:
        self._steps.append(pack)

    def put_info(self, **fields: Any) -> None:
        self._queue.put(("info", fields))

    def put_notice(self, step: Optional[int], code: str, message: str) -> None:
        self._queue.put(("notice", (step, code, message)))

    def put_rows(self, rows: Rows) -> None:
        """Rows made on the training thread (a bad step's saved inputs), committed with the next flush."""
        self._queue.put(("rows", rows))

    def wait_rows(self, timeout_s: Optional[float] = None) -> bool:
        """Block until every step put so far has been turned into rows (committed or not: they
        are, within ``flush_every_s``). False if ``timeout_s`` passed first. For a caller that
        must not let this thread's work fall into what it times next (``bench/hostcost.py``)."""
        done = threading.Event()
        self._queue.put(("caught up", done))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not done.wait(0.05):  # wakes at once when set
            if not self._thread.is_alive() or (deadline is not None and time.monotonic() >= deadline):
                return done.is_set()  # a writer that failed or closed: nothing more comes
        return True

    def close(self, status: str, error: Optional[str]) -> None:
        """Drain, mark the run ended, checkpoint. Blocks until the thread is done."""
        self._queue.put(("info", {"status": status, "error": error, "ended_at": time.time()}))
        self._queue.put(_STOP)
        self._thread.join()

    # -- thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        conn = None
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a killed process loses nothing committed
            self._loop(conn)
            self._finish(conn)
        except BaseException as exc:  # reported to the training thread, which warns once
            self.failure = exc
            self._drain()
        finally:
            if conn is not None:
                conn.close()

    def _finish(self, conn: sqlite3.Connection) -> None:
        """Fold the WAL into the file and leave WAL mode: a finished run is one self-contained file.

        Every row is already committed, so a reader holding the file past the busy timeout (5 s)
        is not a failure: the WAL then stays beside the file and readers still see everything."""
        _test_pause("checkpoint")
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            _leave_wal(conn)
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            log.info("%s stays in WAL mode (a reader held it at close): %s", self.path, exc)
        _test_pause("checkpoint-end")

    def _drain(self) -> None:
        self._steps.clear()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is _STOP:
                return

    def _loop(self, conn: sqlite3.Connection) -> None:
        pending = Rows()
        info: dict[str, Any] = {}
        notices: list[tuple] = []
        last_flush = last_checkpoint = time.monotonic()
        stop = False
        while not stop:
            timeout = min(_POLL_S, max(0.0, self._flush_every_s - (time.monotonic() - last_flush)))
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            # steps first: everything put before this item (or before close's _STOP) is in the deque
            while self._steps:
                pending.extend(self._to_rows(self._steps.popleft()))
                # hand the GIL back between steps: a training thread waiting for it would otherwise
                # wait for the whole burst (up to the 5 ms switch interval) instead of one step's rows
                time.sleep(0)
            if item is _STOP:
                stop = True
            elif item is not None:
                kind, payload = item
                if kind == "info":
                    info.update(payload)
                elif kind == "caught up":  # wait_rows: every step put before it is rows now
                    payload.set()
                elif kind == "rows":
                    pending.extend(payload)
                else:
                    notices.append(payload)
            if stop or time.monotonic() - last_flush >= self._flush_every_s or pending.count() > 200_000:
                if self._sample is not None and pending.steps:
                    pending.extend(self._sample(pending.steps[-1][0]))
                self._commit(conn, pending, info, notices)
                if self._on_commit is not None:
                    self._on_commit(pending, info, notices)
                pending, info, notices = Rows(), {}, []
                last_flush = time.monotonic()
                if not stop and last_flush - last_checkpoint >= CHECKPOINT_EVERY_S:
                    _checkpoint(conn)
                    last_checkpoint = last_flush

    def _commit(self, conn: sqlite3.Connection, rows: Rows, info: dict[str, Any], notices: list) -> None:
        self._check_file()
        conn.execute("BEGIN")
        try:
            for table in _TABLES:
                batch = getattr(rows, table)
                if batch:
                    _insert_many(conn, table, batch)
            if notices:
                conn.executemany("INSERT INTO notices (step, code, message) VALUES (?,?,?)", notices)
            info = dict(info, heartbeat_at=time.time())
            cols = ", ".join(f"{k} = ?" for k in info)
            conn.execute(f"UPDATE run SET {cols} WHERE id = 1", list(info.values()))
            _test_pause("commit")
            conn.execute("COMMIT")
        except BaseException:
            # SQLite may already have rolled back (disk full): the original error is the one to report
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            raise
        if rows.steps:
            _test_pause("committed", rows.steps[-1][0])

    def _check_file(self) -> None:
        # SQLite keeps writing to an unlinked file without complaint; we must notice ourselves.
        try:
            inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            raise RuntimeError(f"run file {self.path!r} was removed while recording") from None
        if inode != self._inode:
            raise RuntimeError(f"run file {self.path!r} was replaced while recording")


def _checkpoint(conn: sqlite3.Connection) -> None:
    """Copy what the WAL holds into the run file itself, as far as readers allow, without waiting
    for them (PASSIVE). A run file copied while training goes on, without its ``-wal`` beside it
    (docs/reliability.md: "copy it, open it"), then holds every step up to the last checkpoint instead of
    none: SQLite folds the WAL in by itself only every 1,000 pages, which a small run never fills."""
    try:
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
    except sqlite3.OperationalError:  # busy: the next one will do
        pass


def _leave_wal(conn: sqlite3.Connection, timeout_s: float = 5.0) -> None:
    """Switch back to a rollback journal, retrying for up to ``timeout_s``.

    SQLite fails this switch at once, without calling the busy handler, while any other connection
    has the file open; a reader polling every 100 ms (the Live page) leaves gaps, so retry briefly."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn.execute("PRAGMA journal_mode=DELETE")
            return
        except sqlite3.OperationalError as exc:
            if time.monotonic() >= deadline or ("locked" not in str(exc) and "busy" not in str(exc)):
                raise
            time.sleep(0.01)


def _test_pause(phase: str, detail: Any = "") -> None:
    """For the crash tests only (tests/test_reliability.py): with AMPWATCH_TEST_WRITER_PAUSE set
    (``phase:seconds,...``), announce each phase on stderr and sleep in the named ones, so a real
    SIGKILL can land inside a commit's open transaction or the close-time checkpoint."""
    spec = os.environ.get("AMPWATCH_TEST_WRITER_PAUSE")
    if not spec:
        return
    import sys
    sys.stderr.write(f"ampwatch-writer {phase} {detail}\n")
    sys.stderr.flush()
    pauses = dict(item.split(":") for item in spec.split(",") if ":" in item)
    if phase in pauses:
        time.sleep(float(pauses[phase]))
