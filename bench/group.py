"""How long reading a distributed job takes: 64 ranks x 100,000 steps.

Builds the job's files with the run writer directly (``create_run_file`` plus the writer's own
INSERT statements; no training), once, under ``--dir``: every rank has 100,000 steps (loss, scale,
grad norm), a warm-up of 3 skipped steps with backward events on every rank, and at step 73,456 a
forward overflow on rank 37 alone (forward events there; parameter-gradient events and a skip on
every rank, as DDP's all-reduce spreads it). A second job of 64 x 25,000 steps shows how the cost
grows with steps; globs over the first 16 and 32 ranks show how it grows with ranks.

Timed, interleaved round by round (medians): ``load_group`` + ``overview()`` (the group overview:
per-rank figures, skipped agreement, the sampled global steps), ``first_nonfinite()``, and with
``--full`` the full-resolution ``global_steps`` too. The OS file cache is warm after the first round.

    python bench/group.py [--dir /tmp/groupbench] [--repeat 5] [--full]
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import time
from pathlib import Path

import numpy as np

import ampwatch
from ampwatch.store.writer import _INSERTS, create_run_file

BAD_RANK, BAD_STEP, WARMUP = 37, 73_456, (0, 1, 2)
_EVENT = ("INSERT INTO events (step, phase, module, kind, count, amax, dtype, origin, micro_batch)"
          " VALUES (?,?,?,?,?,?,?,?,?)")


def build_rank(path: Path, rank: int, world: int, steps: int) -> None:
    create_run_file(str(path), {"name": path.stem, "status": "finished", "started_at": 1.7e9 + rank * 0.01,
                                "rank": rank, "world_size": world, "job_id": f"bench-{world}x{steps}",
                                "grad_sharding": "sharded", "amp_dtype": "float16", "scaler_enabled": 1},
                    [{"id": i, "kind": "module", "name": f"h.{i}.fc", "type": "Linear"} for i in range(4)])
    rng = np.random.default_rng(rank)
    loss = 4.0 * np.exp(-np.arange(steps) / 30_000) + 0.05 * rng.random(steps)
    norm = 0.5 + 0.1 * rng.random(steps)
    skipped = set(WARMUP) | {BAD_STEP}
    scale = 2.0 ** 16
    rows = []
    for i in range(steps):
        rows.append((i, 1.7e9 + i, 0.1, float(loss[i]), scale, int(i in skipped), float(norm[i]), 3e-4, 1, 0))
        if i in WARMUP:
            scale /= 2
    conn = sqlite3.connect(path)
    conn.executemany(_INSERTS["steps"], rows)
    events = [(s, "backward", "h.3.fc", "inf", 10, None, "float16", 1, None) for s in WARMUP]
    if steps > BAD_STEP:
        if rank == BAD_RANK:
            events.append((BAD_STEP, "forward", "h.1.fc", "inf", 512, None, "float16", 1, 1))
        events.append((BAD_STEP, "param_grad", "h.0.fc.weight", "nan", 64, None, "float32", 0, None))
    conn.executemany(_EVENT, events)
    conn.commit()
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()


def build_job(folder: Path, world: int, steps: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if len(list(folder.glob("*.sqlite"))) != world:
        start = time.perf_counter()
        for r in range(world):
            p = folder / f"job.rank{r}.sqlite"
            if p.exists():
                p.unlink()
            build_rank(p, r, world, steps)
        print(f"built {world} x {steps:,} steps in {folder} ({time.perf_counter() - start:.0f} s)")
    return folder


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/groupbench"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--full", action="store_true", help="also time the full-resolution global_steps")
    args = ap.parse_args()
    big = build_job(args.dir / "64x100k", 64, 100_000)
    short = build_job(args.dir / "64x25k", 64, 25_000)
    jobs = {"64 ranks x 100,000": str(big), "32 ranks x 100,000": _subset(big, 32, args.dir),
            "16 ranks x 100,000": _subset(big, 16, args.dir), "64 ranks x 25,000": str(short)}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeat):
        for label, where in jobs.items():
            t, ov = _timed(lambda: ampwatch.load_group(where).overview())
            times.setdefault((label, "load_group + overview()"), []).append(t)
            group = ampwatch.load_group(where)
            t, first = _timed(group.first_nonfinite)
            times.setdefault((label, "first_nonfinite()"), []).append(t)
            if args.full and label.startswith("64 ranks x 100"):
                t, _ = _timed(lambda: ampwatch.load_group(where).global_steps)
                times.setdefault((label, "global_steps (full)"), []).append(t)
    assert (first.step, first.rank, first.phase) == (0, 0, "backward")  # the warm-up comes first
    g = ampwatch.load_group(big)
    from ampwatch.jobs.combine import first_nonfinite
    fwd = first_nonfinite(g, phases=("forward", "loss"))
    assert (fwd.step, fwd.rank, fwd.module, fwd.micro_batch) == (BAD_STEP, BAD_RANK, "h.1.fc", 1), fwd
    print(f"overview: {len(ov.global_steps):,} sampled steps (every {ov.every}), ranks {len(ov.ranks)}")
    print(f"| job | what | median s | min s | max s |  ({args.repeat} rounds, interleaved)")
    print("|---|---|---|---|---|")
    for (label, what), ts in times.items():
        print(f"| {label} | {what} | {statistics.median(ts):.2f} | {min(ts):.2f} | {max(ts):.2f} |")


def _subset(big: Path, n: int, root: Path) -> str:
    """A folder of symlinks to the first ``n`` ranks (a glob cannot say 0-31)."""
    sub = root / f"first{n}"
    sub.mkdir(exist_ok=True)
    for r in range(n):
        link = sub / f"job.rank{r}.sqlite"
        if not link.exists():
            link.symlink_to(big / f"job.rank{r}.sqlite")
    return str(sub)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
