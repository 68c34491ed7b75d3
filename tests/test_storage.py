"""Storage: crash safety with real subprocesses, failure isolation, read-only bad input."""
from __future__ import annotations

import hashlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

import ampwatch
from ampwatch.store.reader import STALE_AFTER_S, effective_status
from ampwatch.store.schema import SCHEMA_VERSION
from helpers.loops import amp_step, data, mlp, train

TRAIN_FOREVER = textwrap.dedent("""
    import sys, torch, ampwatch
    sys.path.insert(0, {tests!r})
    from helpers.loops import amp_step, data, mlp
    torch.set_num_threads(1)
    model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    watch = ampwatch.attach(model, opt, scaler, path={path!r}, flush_every_s=0.05)
    i = 0
    while True:
        amp_step(model, opt, scaler, *data(i % 7))
        i += 1
        if i == 5:
            print("started", flush=True)
""")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("delay", [0.2, 0.7, 1.5])
def test_sigkill_leaves_readable_run_with_flushed_steps(tmp_path, delay):
    path = tmp_path / "killed.sqlite"
    script = TRAIN_FOREVER.format(tests=str(Path(__file__).parent), path=str(path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout.readline().strip() == b"started"
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    run = ampwatch.load(path)
    steps = run.steps
    assert len(steps) >= 1
    assert list(steps["step"]) == list(range(len(steps)))  # every step up to the last flush, no holes
    assert steps["loss"].notna().all()
    assert run.info["status"] == "interrupted"  # dead writer, not "running forever"


def test_exception_in_with_block_marks_crashed(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ZeroDivisionError):
        with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "c.sqlite")) as watch:
            amp_step(model, opt, scaler, *data(0))
            1 / 0
    info = ampwatch.load(watch.path).info
    assert info["status"] == "crashed"
    assert "ZeroDivisionError" in info["error"] and "test_storage.py" in info["error"]


def test_unclosed_watch_closed_at_exit_and_uncaught_exception_is_crashed(tmp_path):
    ok, bad = tmp_path / "ok.sqlite", tmp_path / "bad.sqlite"
    for path, tail in ((ok, ""), (bad, "raise RuntimeError('boom')")):
        script = textwrap.dedent(f"""
            import sys, torch, ampwatch
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from helpers.loops import amp_step, data, mlp
            model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            scaler = torch.amp.GradScaler("cpu")
            watch = ampwatch.attach(model, opt, scaler, path={str(path)!r})
            for i in range(3):
                amp_step(model, opt, scaler, *data(i))
            {tail}
        """)
        subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert ampwatch.load(ok).info["status"] == "finished" and len(ampwatch.load(ok).steps) == 3
    info = ampwatch.load(bad).info
    assert info["status"] == "crashed" and "boom" in info["error"]


def test_stale_heartbeat_is_interrupted():
    now = time.time()
    row = {"status": "running", "hostname": "another-host", "pid": 1, "heartbeat_at": now - STALE_AFTER_S - 1}
    assert effective_status(row, now) == "interrupted"
    assert effective_status(dict(row, heartbeat_at=now - 1), now) == "running"


def test_reader_sees_flushed_rows_while_writer_is_open(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.attach(model, opt, scaler, path=str(tmp_path / "live.sqlite"), flush_every_s=0.05) as watch:
        for i in range(4):
            amp_step(model, opt, scaler, *data(i))
        deadline = time.time() + 10
        while time.time() < deadline and len(ampwatch.load(watch.path).steps) < 4:
            time.sleep(0.05)
        live = ampwatch.load(watch.path)
        assert len(live.steps) == 4 and live.info["status"] == "running"
    assert ampwatch.load(watch.path).info["status"] == "finished"
    assert not Path(f"{watch.path}-wal").exists()  # a finished run is one self-contained file


def test_unwritable_directory_warns_once_and_training_goes_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.warns(RuntimeWarning, match="ampwatch stopped recording"):
        _, watch, applied = train(5, attach=lambda m, o, s: ampwatch.attach(m, o, s, path=str(blocker / "r.sqlite")),
                                  scaler_factory=lambda: torch.amp.GradScaler("cpu"))
    assert all(applied)


def test_strict_raises_instead(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    model = mlp()
    with pytest.raises(OSError):
        ampwatch.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), path=str(blocker / "r.sqlite"), strict=True)


def test_run_file_removed_mid_run_warns_once_and_training_goes_on(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    path = tmp_path / "gone.sqlite"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch = ampwatch.attach(model, opt, scaler, path=str(path), flush_every_s=0.02)
        amp_step(model, opt, scaler, *data(0))
        path.unlink()
        for i in range(40):
            amp_step(model, opt, scaler, *data(i))
            time.sleep(0.01)
        watch.close()
    ours = [w for w in caught if "ampwatch stopped recording" in str(w.message)]
    assert len(ours) == 1 and "removed" in str(ours[0].message)
    assert "step" not in scaler.__dict__  # patches removed on close even after a failure


# --- bad input: RunError with one line, file untouched --------------------------------------------------

def _foreign_sqlite(path: Path) -> Path:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, url TEXT)")
    conn.commit()
    conn.close()
    return path


def _newer_schema(tmp_path: Path) -> Path:
    _, watch, _ = train(2, attach=lambda m, o, s: ampwatch.attach(m, o, s, path=str(tmp_path / "new.sqlite")))
    conn = sqlite3.connect(watch.path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    return watch.path


def _truncated(tmp_path: Path, keep: float = 1 / 3) -> Path:
    _, watch, _ = train(30, attach=lambda m, o, s: ampwatch.attach(m, o, s, path=str(tmp_path / "t.sqlite"), layer_every=1))
    data_ = watch.path.read_bytes()
    target = tmp_path / "truncated.sqlite"
    target.write_bytes(data_[: int(len(data_) * keep)])
    return target


def _header_says(path: Path) -> str:
    """What the SQLite header says the file's size is, read here independently of ampwatch."""
    head = path.read_bytes()[:100]
    page_size = int.from_bytes(head[16:18], "big")
    return f"shorter than the {int.from_bytes(head[28:32], 'big') * (page_size if page_size != 1 else 65536):,} its header says"


def _corrupt(tmp_path: Path) -> Path:
    _, watch, _ = train(30, attach=lambda m, o, s: ampwatch.attach(m, o, s, path=str(tmp_path / "c.sqlite"), layer_every=1))
    raw = bytearray(watch.path.read_bytes())
    for i in range(4096, len(raw), 512):
        raw[i:i + 64] = b"\xff" * 64
    target = tmp_path / "corrupt.sqlite"
    target.write_bytes(bytes(raw))
    return target


BAD_INPUTS = {
    "missing": (lambda tmp: tmp / "nope.sqlite", "no run file"),
    "folder": (lambda tmp: tmp, "is a folder"),
    "text": (lambda tmp: (tmp / "notes.txt").write_text("hello") and tmp / "notes.txt", "not a SQLite file"),
    "empty": (lambda tmp: (tmp / "empty.sqlite").write_bytes(b"") or tmp / "empty.sqlite", "empty file"),
    "foreign": (lambda tmp: _foreign_sqlite(tmp / "photos.sqlite"), "another tool"),
    "newer": (_newer_schema, "newer ampwatch"),
    "truncated": (_truncated, "its header says"),
    "cut_3_percent_short": (lambda tmp: _truncated(tmp, keep=0.97), "its header says"),
    "corrupt": (_corrupt, "corrupt or truncated"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_run_error_and_file_unchanged(tmp_path, case):
    make, message = BAD_INPUTS[case]
    path = make(tmp_path)
    before = _digest(path) if path.is_file() else None
    with pytest.raises(ampwatch.RunError) as err:
        run = ampwatch.load(path)
        run.steps, run.layers, run.events  # noqa: B018 - force every table read
        ampwatch.diagnose(run)  # reads the rest (the 3%-short copy loses a page only the doctor reads)
    assert message in str(err.value) and "\n" not in str(err.value)
    if message == "its header says":  # the sizes, as the file and its header say them
        assert f"is truncated: {path.stat().st_size:,} bytes, {_header_says(path)}" in str(err.value)
    if before is not None:
        assert _digest(path) == before
    # the 3%-short copy still holds every page `summary` reads (complete, so it answers): the doctor reads more
    command = "doctor" if case == "cut_3_percent_short" else "summary"
    cli = subprocess.run([sys.executable, "-m", "ampwatch", command, str(path)], capture_output=True, text=True)
    assert cli.returncode == 2
    if case == "folder":  # `summary DIR` reads a folder as runs or jobs: an empty one has none
        message = "no runs in"
    assert cli.stderr.strip().count("\n") == 0 and message in cli.stderr and "Traceback" not in cli.stderr
    if before is not None:
        assert _digest(path) == before


@pytest.mark.parametrize("value, says", [
    (123, "must be a str or pathlib.Path, got int 123"),
    (None, "must be a str or pathlib.Path, got NoneType None"),
    (["run.sqlite"], "must be a str or pathlib.Path, got list ['run.sqlite']"),
    ("", "is an empty string"),
    ("runs/a\x00b.sqlite", "contains a NUL character"),
])
def test_a_path_of_the_wrong_type_is_one_line_run_error(value, says):
    for read in (ampwatch.load, ampwatch.load_group):
        with pytest.raises(ampwatch.RunError, match=re.escape(says)) as err:
            read(value)
        assert "\n" not in str(err.value)
    with pytest.raises(ampwatch.RunError) as err:
        ampwatch.diagnose(value)
    # diagnose also takes a Run, and says so; a path-like value gets load's line
    expected = f"needs a Run (from ampwatch.load) or a run file path, got {type(value).__name__}"
    assert (expected if not isinstance(value, str) else says) in str(err.value)


def test_a_bytes_path_reads_like_its_str(tmp_path):
    _, watch, _ = train(3, attach=lambda m, o, s: ampwatch.attach(m, o, s, path=os.fsencode(tmp_path / "b.sqlite")))
    assert watch.path == tmp_path / "b.sqlite"
    run = ampwatch.load(os.fsencode(watch.path))
    assert run.path == watch.path and len(run.steps) == 3 == _sql_count(watch.path)
    assert isinstance(ampwatch.diagnose(os.fsencode(watch.path)), list)


def _sql_count(path: Path) -> int:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
    finally:
        conn.close()


def test_reader_cannot_write(tmp_path):
    from ampwatch.store.reader import connect
    _, watch, _ = train(2, attach=lambda m, o, s: ampwatch.attach(m, o, s, path=str(tmp_path / "r.sqlite")))
    before = _digest(watch.path)
    with pytest.raises(ampwatch.RunError, match="readonly"):  # one line, like every read failure
        with connect(watch.path) as conn:
            conn.execute("DELETE FROM steps")
    assert _digest(watch.path) == before and len(ampwatch.load(watch.path).steps) == 2


def test_writer_wait_rows_returns_once_every_step_put_is_rows(tmp_path):
    """RunWriter.wait_rows (what bench/hostcost.py waits on between variants): every step put
    before the call has been turned into rows when it returns, though the thread polls every
    0.1 s and each step here takes it 5 ms; a closed writer answers at once."""
    import socket
    import threading
    from ampwatch.record.packing import PackReader, StepPack
    from ampwatch.store.writer import RunWriter, create_run_file
    path = str(tmp_path / "w.sqlite")
    names = [{"id": i, "kind": "param", "name": f"p{i}", "type": "float32", "numel": 10, "trainable": 1}
             for i in range(3)]
    create_run_file(path, {"name": "w", "status": "running", "started_at": time.time(), "pid": os.getpid(),
                           "hostname": socket.gethostname(), "layer_every": 1, "localize": 0,
                           "schema_version": SCHEMA_VERSION}, names)
    reader = PackReader([n["name"] for n in names], ["float32"] * 3, [], [], 1)
    made, thread = [], []

    def rows(pack):
        time.sleep(0.005)
        made.append(pack.step)
        thread.append(threading.current_thread().name)
        return reader.rows(pack)

    writer = RunWriter(path, rows, 1e9)
    try:
        for i in range(20):
            writer.put_step(StepPack(step=i, time=time.time(), duration_s=1e-3, lr=1e-3, micro_batches=1,
                                     skipped=False, flat=torch.rand(5, dtype=torch.float64).view(torch.uint8),
                                     layout={"loss": (0, 1), "scale": (1, 1), "norms": (2, 3)},
                                     norm_ids=[0, 1, 2], scalar_bytes=40))
            if i == 9:
                assert writer.wait_rows(timeout_s=10) and made == list(range(10))
        assert writer.wait_rows(timeout_s=10) and made == list(range(20))
        assert set(thread) == {"ampwatch-writer"}
    finally:
        writer.close("finished", None)
    started = time.monotonic()
    assert writer.wait_rows(timeout_s=5) is False and time.monotonic() - started < 1
    assert len(ampwatch.load(path).steps) == 20


@pytest.mark.parametrize("per", [1, 3, 256])
def test_multi_row_inserts_equal_executemany(tmp_path, monkeypatch, per):
    """The writer's multi-row INSERTs (few GIL hand-offs) against executemany, row for row: chunk
    edges, a later row replacing an earlier one with the same key (inside a chunk and across two),
    NULLs, and a table without a key (events)."""
    import random
    from ampwatch.store import schema, writer
    monkeypatch.setattr(writer, "_ROWS_PER_STATEMENT", per)
    rng = random.Random(per)
    layers = [(rng.randrange(4), rng.randrange(6), rng.random(), None if rng.random() < 0.2 else rng.random(),
               rng.random(), rng.randrange(2), rng.random(), rng.randrange(8)) for _ in range(40)]
    events = [(i, "forward", f"m{i % 3}", "inf", None, 1e5, "float16", 1, 0, None, None, None, None, None)
              for i in range(7)]
    got, want = tmp_path / "got.sqlite", tmp_path / "want.sqlite"
    for path in (got, want):
        from sqlite_utils import Database
        schema.create(Database(str(path)))
    with sqlite3.connect(got) as conn:
        writer._insert_many(conn, "layers", layers)
        writer._insert_many(conn, "events", events)
    with sqlite3.connect(want) as conn:
        for table, rows in (("layers", layers), ("events", events)):
            conn.executemany(writer._INSERTS[table], rows)
    read = "SELECT * FROM layers ORDER BY step, param_id", "SELECT * FROM events ORDER BY id"
    with sqlite3.connect(got) as a, sqlite3.connect(want) as b:
        for sql in read:
            assert a.execute(sql).fetchall() == b.execute(sql).fetchall()
        assert a.execute("SELECT count(*) FROM layers").fetchone()[0] < len(layers)  # some rows replaced others


_CONNECTS: list = []  # (database, whether the run path existed then) while a test listens


def _audit(event: str, args: tuple) -> None:
    if event == "sqlite3.connect" and _CONNECTS and _CONNECTS[0] is not None:
        _CONNECTS.append((str(args[0]), os.path.exists(_CONNECTS[0])))


def test_a_run_file_appears_whole_never_empty_and_a_failed_creation_leaves_nothing(tmp_path):
    """A reader polling a folder (a live dashboard) must never open a run being created: SQLite
    creates its file empty on connect, so the file is made under another name and renamed into
    place. Python's audit events tell which file each ``sqlite3.connect`` opened, and whether the
    run's path existed at that moment. A creation that fails leaves neither the run nor its
    temporary file behind."""
    from ampwatch.store.writer import create_run_file
    path = tmp_path / "run.sqlite"
    if not getattr(sys, "_ampwatch_audit", False):  # an audit hook cannot be removed: one per process
        sys.addaudithook(_audit)
        sys._ampwatch_audit = True
    _CONNECTS[:] = [str(path)]
    try:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        with ampwatch.attach(model, opt, torch.amp.GradScaler("cpu"), path=str(path)):
            made = list(_CONNECTS[1:])
    finally:
        _CONNECTS[:] = [None]
    creating = [(db, existed) for db, existed in made if db != str(path) and "making" in db]
    assert len(creating) == 1 and creating[0][1] is False, made  # made elsewhere while the path did not exist
    assert all(db != str(path) for db, _ in made[:made.index(creating[0]) + 1]), made
    assert ampwatch.load(path).info["status"] == "finished"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.sqlite"]  # nothing else left beside it

    bad = tmp_path / "bad.sqlite"
    with pytest.raises(sqlite3.Error):  # a name table that breaks its insert (no such column)
        create_run_file(str(bad), {"name": "b", "status": "running"}, [{"no_such_column": 1}])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.sqlite"]
