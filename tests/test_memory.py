"""The process's memory, read by the writer thread at each commit (the ``memory`` table), and the
doctor's ``memory-growth``: a real loop that keeps 2 MiB from every step, in its own process (its
resident set is then the loop's alone), against the same loop that keeps nothing."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import ampwatch
from ampwatch.doctor import memory as memory_rule

LEAK = 2 * 2 ** 20  # bytes kept from every step

LOOP = textwrap.dedent("""
    import os, signal, sys, time, torch, ampwatch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    kept = []
    watch = ampwatch.attach(model, opt, scaler, path={path!r}, flush_every_s=0.02)
    x, y = torch.randn(64, 64), torch.randn(64, 1)
    for i in range(200):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
        if {leak}:
            kept.append(torch.ones({leak} // 4))  # a reference kept from every step: the leak
        time.sleep(0.01)  # several commits, so several readings, a step
    time.sleep(0.3)
    with open("/proc/self/statm") as f:  # the truth at the end, read here, not by the writer
        print(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), flush=True)
    if {kill}:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer ends a process
    watch.close()
""")

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="host memory is read on Linux")


def _train(path, leak: int, kill: bool = False) -> int:
    proc = subprocess.run([sys.executable, "-c", LOOP.format(path=str(path), leak=leak, kill=kill)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == (-signal.SIGKILL if kill else 0), proc.stderr[-2000:]
    return int(proc.stdout.split()[-1])


def test_memory_is_read_at_each_commit_and_a_steady_loop_is_not_a_leak(tmp_path):
    path = tmp_path / "steady.sqlite"
    rss_at_end = _train(path, 0)
    memory = ampwatch.load(path).memory
    assert len(memory) >= 20 and memory["step"].is_monotonic_increasing and memory["step"].max() <= 199
    assert memory["device_allocated"].isna().all() and memory["device_reserved"].isna().all()  # no CUDA
    last = memory["host_rss"].iloc[-1]
    assert 0.8 * rss_at_end <= last <= 1.2 * rss_at_end  # the process's own figure, read independently
    assert "memory-growth" not in {f.id for f in ampwatch.diagnose(path)}


def test_a_loop_that_keeps_memory_from_every_step_is_a_leak_that_explains_the_kill(tmp_path):
    path = tmp_path / "leak.sqlite"
    _train(path, LEAK, kill=True)
    findings = ampwatch.diagnose(path)
    grown = next(f for f in findings if f.id == "memory-growth")
    assert grown.severity == "warning" and grown.cause is None
    first, last = grown.steps
    memory = ampwatch.load(path).memory.set_index("step")["host_rss"]
    # the truth: 2 MiB a step kept; the floor the doctor reports rose by about that much a step
    rise = memory.loc[last] - memory.loc[first]
    assert 0.7 * LEAK * (last - first) <= rise <= 1.3 * LEAK * (last - first)
    rate = float(grown.evidence.split("about ")[1].split(" MiB a step")[0])
    assert rate == pytest.approx(LEAK / 2 ** 20, rel=0.3)
    assert "total += loss keeps each step's graph" in grown.advice
    assert grown.evidence.endswith("the run was then killed or lost, as the OOM killer ends a process")
    killed = next(f for f in findings if f.id == "run-interrupted")
    assert killed.cause == "memory-growth"  # the kill follows from the growth
    assert [f.id for f in findings if f.cause is None] == ["memory-growth"]


def test_the_floor_must_rise_in_every_fifth():
    """A one-time jump (a cache filled once, a recompile) lifts the floor in one fifth only."""
    steps = torch.arange(400).numpy()
    step_up = (1e9 + 5e8 * (steps >= 200)).astype(float)
    assert memory_rule.floor_growth(steps, step_up) is None
    ramp = (1e9 + 4e6 * steps).astype(float)
    floors, per_step = memory_rule.floor_growth(steps, ramp)
    assert [s for s, _ in floors] == [40, 112, 184, 256, 328] and per_step == pytest.approx(4e6)


def test_on_cuda_the_allocators_bytes_are_judged_and_a_crash_out_of_memory_follows(tmp_path):
    """A run file as a CUDA run leaves it (written with the run writer's own statements; no GPU
    here): the allocator's bytes in tensors rise by 8 MiB a step while the host's stay flat, and the
    run crashed with torch's out-of-memory error. The device's figure is the one judged, and the crash
    is attached to the growth."""
    import sqlite3
    import numpy as np
    from ampwatch.store.writer import _INSERTS, create_run_file
    from helpers.synthetic_job import step_rows
    path = tmp_path / "cuda.sqlite"
    create_run_file(str(path), {"name": "cuda", "status": "crashed", "started_at": 1000.0,
                                "error": "Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of "
                                         "memory. Tried to allocate 2.00 GiB."}, [])
    conn = sqlite3.connect(path)
    conn.executemany(_INSERTS["steps"], step_rows(np.full(400, 0.5), np.full(400, 1.0), set()))
    conn.executemany(_INSERTS["memory"], [(s, 3.0 * 2 ** 30, 2.0 * 2 ** 30 + 8 * 2 ** 20 * s + (s % 7) * 2 ** 28,
                                           40.0 * 2 ** 30) for s in range(0, 400, 2)])
    conn.commit()
    conn.close()
    findings = ampwatch.diagnose(path)
    grown = next(f for f in findings if f.id == "memory-growth")
    assert grown.evidence.startswith("device memory held by tensors (CUDA allocator): ")
    assert "about 8 MiB a step" in grown.evidence and grown.evidence.endswith("; the run then crashed")
    crash = next(f for f in findings if f.id == "run-crashed")
    assert crash.cause == "memory-growth" and "CUDA out of memory" in crash.title


def test_every_reader_of_the_memory_table_asks_the_store_whether_the_file_has_one(tmp_path):
    """Run.memory, the dashboard's memory_data and the trackers' read_points each asked SQLite
    themselves whether a run file has the ``memory`` table (files before schema 7 lack it); they
    now ask one helper of the store, and agree with each other and with SQLite read directly,
    with the table and without it."""
    import shutil
    import sqlite3
    from ampwatch.dashboard.rundata import memory_data
    from ampwatch.store.reader import has_table
    from ampwatch.trackers.series import MEMORY, read_points
    from helpers.loops import train
    path = tmp_path / "run.sqlite"
    train(12, scaler_factory=lambda: torch.amp.GradScaler("cpu"),
          attach=lambda m, o, s: ampwatch.attach(m, o, s, path=str(path), flush_every_s=0.01))
    older = tmp_path / "older.sqlite"
    shutil.copy(path, older)
    conn = sqlite3.connect(older)
    with conn:
        conn.execute("DROP TABLE memory")  # as a file written before the table existed
    conn.close()
    for file, expected in ((path, True), (older, False)):
        conn = sqlite3.connect(f"file:{file}?mode=ro", uri=True)
        try:
            truth = conn.execute("SELECT step, host_rss FROM memory ORDER BY step").fetchall() if expected else []
            assert has_table(conn, "memory") is expected and has_table(conn, "steps")
            read = [(p.step, p.values[MEMORY + "host_rss"]) for chunk in read_points(conn) for p in chunk
                    if MEMORY + "host_rss" in p.values]
        finally:
            conn.close()
        assert bool(truth) is expected
        assert read == [(s, float(v)) for s, v in truth]
        assert list(zip(ampwatch.load(file).memory["step"], ampwatch.load(file).memory["host_rss"])) == truth
        assert list(zip(memory_data(file)["step"].astype(int), memory_data(file)["host_rss"])) == truth
