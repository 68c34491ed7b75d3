"""Recording under hostile conditions, with real subprocesses and real signals: disk full,
the run's folder removed, readers polling a live run, SIGKILL inside a commit and inside the close-time
checkpoint. After each, the file reads with every step up to the last completed commit."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import ampwatch
from ampwatch.store import reader
from ampwatch.store.guard import damaged_tables
from helpers.loops import amp_step, data, mlp, snapshot, changed

TESTS = str(Path(__file__).parent)
PAUSE_ENV = "AMPWATCH_TEST_WRITER_PAUSE"  # the writer's test-only hook (ampwatch/writer.py: _test_pause)


def _committed(stderr_lines: list[str]) -> int:
    """The last step the writer reported committed (-1 if none)."""
    done = [int(l.split()[2]) for l in stderr_lines if l.startswith("ampwatch-writer committed")]
    return max(done, default=-1)


def _contiguous(path: Path) -> int:
    """Reads the run; its steps must be 0..n-1 with finite losses. Returns n."""
    steps = ampwatch.load(path).steps
    assert list(steps["step"]) == list(range(len(steps)))
    assert steps["loss"].notna().all()
    return len(steps)


# -- disk full and lost folder ------------------------------------------------------------------------

DISK_FULL = textwrap.dedent("""
    import json, resource, signal, sys, warnings, torch, ampwatch
    sys.path.insert(0, {tests!r})
    from helpers.loops import amp_step, changed, data, mlp, snapshot
    torch.set_num_threads(1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails (EFBIG) instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=1e-3); scaler = torch.amp.GradScaler("cpu")
    updated = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch = ampwatch.attach(model, opt, scaler, path={path!r}, flush_every_s=0.02, layer_every=1)
        for i in range({steps}):
            before = snapshot(model)
            amp_step(model, opt, scaler, *data(i % 7))
            updated += changed(before, model)
        watch.close()
    ours = [str(w.message) for w in caught if "ampwatch" in str(w.message)]
    print(json.dumps({{"updated": updated, "warnings": ours}}))
""")


def test_disk_full_mid_run_warns_once_training_goes_on_file_reads_to_last_commit(tmp_path):
    path = tmp_path / "full.sqlite"
    steps = 400
    script = DISK_FULL.format(tests=TESTS, path=str(path), limit=400_000, steps=steps)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, **{PAUSE_ENV: "none:0"}))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["updated"] == steps  # training went on: every step updated the weights
    assert len(out["warnings"]) == 1 and "stopped recording" in out["warnings"][0], out["warnings"]
    last = _committed(proc.stderr.splitlines())
    assert 0 <= last < steps - 1  # the limit was hit mid-run
    assert _contiguous(path) == last + 1  # every committed step, nothing torn
    assert ampwatch.load(path).info["status"] == "interrupted"  # never 'finished'
    assert damaged_tables(path) == []


def test_run_folder_removed_mid_run_warns_once_and_training_goes_on(tmp_path):
    folder = tmp_path / "runs"
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    updated = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch = ampwatch.attach(model, opt, scaler, path=str(folder / "gone.sqlite"), flush_every_s=0.02)
        amp_step(model, opt, scaler, *data(0))
        shutil.rmtree(folder)
        for i in range(40):
            before = snapshot(model)
            amp_step(model, opt, scaler, *data(i))
            updated += changed(before, model)
            time.sleep(0.005)
        watch.close()
    ours = [w for w in caught if "ampwatch" in str(w.message)]
    assert len(ours) == 1 and "removed" in str(ours[0].message)
    assert updated == 40 and not folder.exists()  # nothing recreated it behind the user's back


# -- readers polling a live run ---------------------------------------------------------------------------

READER = textwrap.dedent("""
    import os, sys, time, ampwatch
    from ampwatch.doctor.summary import summarize
    path, stop = sys.argv[1], sys.argv[2]
    print("ready", flush=True)
    while not os.path.exists(stop):
        if os.path.exists(path):
            try:
                print(summarize(ampwatch.load(path))["steps"], flush=True)
            except Exception as exc:
                print(f"error {type(exc).__name__}: {exc}", flush=True)
        time.sleep(0.1)
""")


def test_reader_polling_every_100ms_never_fails_the_writer(tmp_path):
    path, stop = tmp_path / "live.sqlite", tmp_path / "stop"
    reader = subprocess.Popen([sys.executable, "-c", READER, str(path), str(stop)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "ready"
    polls: list[str] = []
    threading.Thread(target=lambda: polls.extend(l.strip() for l in reader.stdout), daemon=True).start()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ampwatch.attach(model, opt, scaler, path=str(path), flush_every_s=0.05, layer_every=1):
            n, deadline = 0, time.time() + 300
            while (n < 100 or len(polls) < 15) and time.time() < deadline:  # >= 15 reads while training writes
                amp_step(model, opt, scaler, *data(n % 7))
                n += 1
        time.sleep(0.5)  # the reader keeps polling across close (checkpoint and journal switch)
    stop.touch()
    reader.wait(timeout=120)
    assert not [w for w in caught if "ampwatch" in str(w.message)]
    errors = [p for p in polls if p.startswith("error")]
    assert errors == [], errors[:3]
    seen = [int(p) for p in polls]
    assert len(seen) >= 15 and seen == sorted(seen) and len(set(seen)) >= 3, seen  # it saw the run grow
    assert _contiguous(path) == n and ampwatch.load(path).info["status"] == "finished"
    assert not Path(f"{path}-wal").exists()  # the close-time checkpoint still folded the WAL in


# -- SIGKILL inside a commit and inside the close-time checkpoint -----------------------------------------

TRAIN_FOREVER = textwrap.dedent("""
    import sys, torch, ampwatch
    sys.path.insert(0, {tests!r})
    from helpers.loops import amp_step, data, mlp
    torch.set_num_threads(1)
    model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    watch = ampwatch.attach(model, opt, scaler, path={path!r}, flush_every_s=0.05, layer_every=1)
    i = 0
    while True:
        amp_step(model, opt, scaler, *data(i % 7))
        i += 1
""")


def _kill_after(proc: subprocess.Popen, marker: str, after: int, delay: float) -> list[str]:
    """Read the writer's phase lines until ``marker`` has appeared ``after`` times; SIGKILL ``delay``
    seconds later. Returns every line read (the rest drained after the kill)."""
    lines: list[str] = []
    hits = 0
    for raw in proc.stderr:
        lines.append(raw.strip())
        if raw.startswith(f"ampwatch-writer {marker} ") or raw.strip() == f"ampwatch-writer {marker}":
            hits += 1
            if hits >= after:
                break
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    lines += [l.strip() for l in proc.stderr]
    return lines


def test_sigkill_inside_a_commit_keeps_every_earlier_commit(tmp_path):
    path = tmp_path / "killed.sqlite"
    # every commit sleeps 1 s inside its open transaction (rows inserted, COMMIT not yet run)
    proc = subprocess.Popen([sys.executable, "-c", TRAIN_FOREVER.format(tests=TESTS, path=str(path))],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, **{PAUSE_ENV: "commit:1.0"}))
    lines = _kill_after(proc, "commit", after=4, delay=0.3)  # killed inside the 4th commit
    last = _committed(lines)
    assert last >= 0 and "ampwatch-writer committed" not in lines[-1]
    assert _contiguous(path) == last + 1  # the three completed commits, none of the torn fourth
    assert ampwatch.load(path).info["status"] == "interrupted"
    assert damaged_tables(path) == []
    # the doctor says the run was killed, after the last committed step, not "health: ok"
    ended = next(f for f in ampwatch.diagnose(path) if f.id == "run-interrupted")
    assert ended.severity == "warning" and ended.title.startswith(f"The run stopped after step {last:,} ")
    assert f"process {proc.pid} on {socket.gethostname()} is gone" in ended.evidence
    assert f"the file holds {last + 1:,} steps" in ended.evidence and "OOM killer" in ended.advice


def test_a_process_that_hangs_is_told_apart_from_one_that_was_killed(tmp_path, monkeypatch):
    """SIGSTOP: the process lives on, its heartbeat goes silent. The reader's threshold for silence
    (30 s) is lowered in this process only; the run file is the real one, still open by the writer."""
    path = tmp_path / "hung.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", TRAIN_FOREVER.format(tests=TESTS, path=str(path))],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, **{PAUSE_ENV: "none:0"}))
    try:
        hits = 0
        for raw in proc.stderr:
            hits += raw.startswith("ampwatch-writer committed")
            if hits >= 3:
                break
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(1.5)
        monkeypatch.setattr(reader, "STALE_AFTER_S", 1.0)
        assert ampwatch.load(path).info["status"] == "interrupted"
        ended = next(f for f in ampwatch.diagnose(path) if f.id == "run-interrupted")
        assert f"process {proc.pid} on {socket.gethostname()} is still alive" in ended.evidence
        assert f"py-spy dump --pid {proc.pid}" in ended.advice and "OOM" not in ended.advice
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


STALLS = textwrap.dedent("""
    import sys, time, torch, ampwatch
    sys.path.insert(0, {tests!r})
    from helpers.loops import amp_step, data, mlp
    torch.set_num_threads(1)
    model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    watch = ampwatch.attach(model, opt, scaler, path={path!r}, flush_every_s=0.05)
    for i in range(20):
        amp_step(model, opt, scaler, *data(i % 7))
    print("stalling", flush=True)
    time.sleep(600)  # a hang: the process and its writer live on, training does not step
""")


def test_a_live_run_whose_training_hangs_is_reported_stalled(tmp_path, monkeypatch):
    """The writer stamps its heartbeat on a timer, so a hung training thread reads 'running' forever;
    the steps' own end times show the stall. The least silence worth a warning (60 s) is lowered in
    this process only."""
    from ampwatch.doctor import ending
    path = tmp_path / "stalled.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", STALLS.format(tests=TESTS, path=str(path))],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == "stalling"
        time.sleep(1.5)
        run = ampwatch.load(path)
        assert run.info["status"] == "running" and len(run.steps) == 20  # alive, every step flushed
        assert "run-stalled" not in {f.id for f in ampwatch.diagnose(path)}  # 1.5 s is no stall
        monkeypatch.setattr(ending, "STALL_MIN_S", 1.0)
        stalled = next(f for f in ampwatch.diagnose(path) if f.id == "run-stalled")
        assert stalled.severity == "warning" and stalled.title.startswith("No step has finished for ")
        assert stalled.steps == (19, 19) and stalled.evidence.startswith("the last step, 19, ended at ")
        assert "the writer is alive" in stalled.evidence and f"py-spy dump --pid {proc.pid}" in stalled.advice
    finally:
        proc.kill()
        proc.wait()


BIG_CLOSE = textwrap.dedent("""
    import os, socket, time, torch
    from ampwatch.record.packing import PackReader, StepPack
    from ampwatch.store.schema import SCHEMA_VERSION
    from ampwatch.store.writer import RunWriter, create_run_file
    P, N, path = 200, {steps}, {path!r}
    names = [{{"id": i, "kind": "param", "name": f"p{{i}}", "type": "float32", "numel": 10, "trainable": 1}}
             for i in range(P)]
    create_run_file(path, {{"name": "big", "status": "running", "started_at": time.time(), "pid": os.getpid(),
                           "hostname": socket.gethostname(), "layer_every": 1, "localize": 0,
                           "schema_version": SCHEMA_VERSION}}, names)
    writer = RunWriter(path, PackReader([n["name"] for n in names], ["float32"] * P, [], [], 1).rows, 1e9)
    g = torch.Generator().manual_seed(0)
    for i in range(N):
        writer.put_step(StepPack(step=i, time=time.time(), duration_s=1e-3, lr=1e-3, micro_batches=1,
                                 skipped=False, flat=torch.rand(2 + P, generator=g, dtype=torch.float64).view(torch.uint8),
                                 layout={{"loss": (0, 1), "scale": (1, 1), "norms": (2, P)}}, norm_ids=list(range(P)),
                                 scalar_bytes=8 * (2 + P)))
    writer.close("finished", None)
""")


@pytest.mark.parametrize("delay", [0.0, 0.02])
def test_sigkill_inside_the_close_time_checkpoint_loses_nothing(tmp_path, delay):
    path = tmp_path / "big.sqlite"
    steps = 1500  # 300,000 layer rows committed at close: a WAL of ~15 MB to fold into the file
    proc = subprocess.Popen([sys.executable, "-c", BIG_CLOSE.format(steps=steps, path=str(path))],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, **{PAUSE_ENV: "none:0"}))
    lines = _kill_after(proc, "checkpoint", after=1, delay=delay)
    assert _committed(lines) == steps - 1  # every row was committed before the checkpoint began
    wal = Path(f"{path}-wal")
    if delay == 0.0:  # killed as the checkpoint began: the WAL still holds the rows
        assert "ampwatch-writer checkpoint-end" not in lines and wal.exists() and wal.stat().st_size > 0
    run = ampwatch.load(path)
    assert len(run.steps) == steps and list(run.steps["step"]) == list(range(steps))
    assert len(run.layers) == steps * 200 and run.info["status"] == "finished"
    assert damaged_tables(path) == []


def test_close_leaves_wal_mode_once_a_reader_lets_go(tmp_path):
    # SQLite refuses to leave WAL mode at once (no busy handler) while any other connection has the
    # file open: close must retry, not give up on the first try while a reader is between polls.
    path = tmp_path / "held.sqlite"
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    watch = ampwatch.attach(model, opt, scaler, path=str(path), flush_every_s=0.05)
    for i in range(5):
        amp_step(model, opt, scaler, *data(i))
    reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    assert reader.execute("SELECT COUNT(*) FROM steps").fetchone()[0] >= 0  # opened: holds the file
    threading.Timer(0.5, reader.close).start()
    start = time.monotonic()
    watch.close()
    assert 0.4 < time.monotonic() - start < 5  # it waited for the reader, within the busy timeout
    assert not Path(f"{path}-wal").exists()
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert _contiguous(path) == 5 and ampwatch.load(path).info["status"] == "finished"


def test_a_copy_of_a_live_run_without_its_wal_holds_the_steps_so_far(tmp_path, monkeypatch):
    """User review: ``cp run.sqlite`` while training goes on, without ``run.sqlite-wal``, read as an
    empty run (SQLite folds the WAL into the file only every 1,000 pages). The writer now folds it in
    every CHECKPOINT_EVERY_S: the copy holds every step up to the last checkpoint."""
    from ampwatch.store import writer
    monkeypatch.setattr(writer, "CHECKPOINT_EVERY_S", 0.2)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    path = tmp_path / "live.sqlite"
    copy = tmp_path / "copy" / "live.sqlite"
    copy.parent.mkdir()
    with ampwatch.attach(model, opt, scaler, path=str(path), flush_every_s=0.05) as watch:
        for i in range(5):
            amp_step(model, opt, scaler, *data(i))
        time.sleep(1.0)  # a few commits and checkpoints later
        assert Path(str(path) + "-wal").exists()  # still recording, in WAL mode
        shutil.copyfile(path, copy)  # the file alone
        amp_step(model, opt, scaler, *data(5))
    assert not (copy.parent / "live.sqlite-wal").exists()
    assert _contiguous(copy) == 5
    assert _contiguous(Path(watch.path)) == 6
