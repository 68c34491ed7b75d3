"""A reader polling a live run every 100 ms (what the dashboard's Live page and `ampwatch summary` do):
does it slow the training thread, or let the WAL grow without bound?

Part 1, step time: a small MLP trains with ampwatch attached (default flush, 1 s) in blocks of
``--block`` steps, alternating without / with a reader process (`Run` + `summarize` every 100 ms) —
A B A B, one torch thread — and reports the median of the paired ratios of median step times, plus
the slowest step of each variant (a lock wait would show there).

Part 2, WAL size: 100,000 steps pushed through the run file's real writer (RunWriter, 20 parameter
tensors, layer rows every 20 steps, commits every 0.1 s) while the reader polls; the WAL's largest
size and the file's size at the end.

    python bench/live_reader.py            # about 2 minutes on an idle 2-core machine
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import ampwatch

READER = textwrap.dedent("""
    import os, sys, time, ampwatch
    from ampwatch.doctor.summary import summarize
    path, go, stop = sys.argv[1:4]
    polls = errors = 0
    while not os.path.exists(stop):
        if os.path.exists(go) and os.path.exists(path):
            try:
                summarize(ampwatch.load(path))
                polls += 1
            except Exception as exc:
                errors += 1
                print(f"reader error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        time.sleep(0.1)
    print(polls, errors, flush=True)
""")


def _reader(path: Path, go: Path, stop: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", READER, str(path), str(go), str(stop)],
                            stdout=subprocess.PIPE, text=True)


def _finish(reader: subprocess.Popen, stop: Path) -> tuple[int, int]:
    stop.touch()
    out, _ = reader.communicate(timeout=300)
    polls, errors = out.split()
    return int(polls), int(errors)


def step_times(folder: Path, pairs: int, block: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(64, 64), torch.randn(64, 8)
    path, go, stop = folder / "live.sqlite", folder / "go", folder / "stop"
    reader = _reader(path, go, stop)
    time.sleep(3)  # let the reader import pandas before anything is timed
    medians: dict[str, list[float]] = {"alone": [], "reader": []}
    worst = {"alone": 0.0, "reader": 0.0}
    with ampwatch.attach(model, opt, scaler, path=str(path)):
        for i in range(2 * pairs):
            variant = "reader" if i % 2 else "alone"
            go.touch() if variant == "reader" else go.unlink(missing_ok=True)
            time.sleep(0.3)
            times = []
            for _ in range(block):
                t = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                scaler.scale(F.mse_loss(out.float(), y)).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - t)
            medians[variant].append(statistics.median(times))
            worst[variant] = max(worst[variant], max(times))
    polls, errors = _finish(reader, stop)
    ratios = [b / a for a, b in zip(medians["alone"], medians["reader"])]
    return {"ratio": statistics.median(ratios), "alone_ms": 1e3 * statistics.median(medians["alone"]),
            "reader_ms": 1e3 * statistics.median(medians["reader"]), "worst_alone_ms": 1e3 * worst["alone"],
            "worst_reader_ms": 1e3 * worst["reader"], "polls": polls, "reader_errors": errors,
            "status": ampwatch.load(path).info["status"], "wal_left": Path(f"{path}-wal").exists()}


def wal_growth(folder: Path, steps: int) -> dict:
    from ampwatch.record.packing import PackReader, StepPack
    from ampwatch.store.schema import SCHEMA_VERSION
    from ampwatch.store.writer import RunWriter, create_run_file
    path, go, stop = folder / "wal.sqlite", folder / "go2", folder / "stop2"
    n_params = 20
    names = [{"id": i, "kind": "param", "name": f"p{i}", "type": "float32", "numel": 100, "trainable": 1}
             for i in range(n_params)]
    create_run_file(str(path), {"name": "wal", "status": "running", "started_at": time.time(), "pid": os.getpid(),
                                "hostname": socket.gethostname(), "layer_every": 20, "localize": 0,
                                "schema_version": SCHEMA_VERSION}, names)
    go.touch()
    reader = _reader(path, go, stop)
    time.sleep(3)
    writer = RunWriter(str(path), PackReader([n["name"] for n in names], ["float32"] * n_params, [], [], 20).rows, 0.1)
    wal, biggest = Path(f"{path}-wal"), 0
    g = torch.Generator().manual_seed(0)
    start = time.time()
    for i in range(steps):
        writer.put_step(StepPack(step=i, time=time.time(), duration_s=1e-3, lr=1e-3, micro_batches=1, skipped=False,
                                 flat=torch.rand(2 + n_params, generator=g, dtype=torch.float64).view(torch.uint8),
                                 layout={"loss": (0, 1), "scale": (1, 1), "norms": (2, n_params)},
                                 norm_ids=list(range(n_params)), scalar_bytes=8 * (2 + n_params)))
        if i % 500 == 0:
            time.sleep(0.05)  # ~100k steps in about 10-20 s: many commits while the reader polls
            biggest = max(biggest, wal.stat().st_size if wal.exists() else 0)
    time.sleep(1.5)  # the last commits land
    biggest = max(biggest, wal.stat().st_size if wal.exists() else 0)
    before_close = wal.stat().st_size if wal.exists() else 0
    writer.close("finished", None)
    polls, errors = _finish(reader, stop)
    return {"steps": steps, "seconds": time.time() - start, "wal_max_mb": biggest / 2**20,
            "wal_before_close_mb": before_close / 2**20, "file_mb": path.stat().st_size / 2**20,
            "polls": polls, "reader_errors": errors, "writer_failure": repr(writer.failure),
            "rows": len(ampwatch.load(path).steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--block", type=int, default=300)
    ap.add_argument("--steps", type=int, default=100_000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        s = step_times(Path(tmp), args.pairs, args.block)
        print(f"step time: alone {s['alone_ms']:.3f} ms, with a reader polling every 100 ms {s['reader_ms']:.3f} ms"
              f" (median of {args.pairs} paired ratios: {s['ratio']:.3f}x); slowest step alone "
              f"{s['worst_alone_ms']:.1f} ms, with the reader {s['worst_reader_ms']:.1f} ms; {s['polls']} polls, "
              f"{s['reader_errors']} reader errors; status {s['status']}, WAL left after close: {s['wal_left']}")
        w = wal_growth(Path(tmp), args.steps)
        print(f"WAL: {w['steps']:,} steps in {w['seconds']:.1f} s with a reader polling ({w['polls']} polls, "
              f"{w['reader_errors']} errors): WAL at most {w['wal_max_mb']:.2f} MB, {w['wal_before_close_mb']:.2f} MB "
              f"before close; file {w['file_mb']:.2f} MB, {w['rows']:,} step rows; writer failure: {w['writer_failure']}")


if __name__ == "__main__":
    main()
