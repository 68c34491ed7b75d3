"""How fast the dashboard's data is ready on a big run (targets: overview < 1.5 s, heatmap < 3 s).

Builds a 1,000,000-step run with 200 parameter tensors and 150 modules in a file created by the real
writer (``create_run_file``: the real schema and run row), with per-layer and per-module rows at the
default ``layer_every`` exactly as the recorder writes them (every N steps, plus skipped steps), one
loss spike, a few NaN steps and a burst of skipped steps (at the same fractions of a run of another
``--steps``). Then times each dashboard data call cold (a fresh process-level cache: the
dashboard's ``st.cache_data`` is bypassed) several times, with the variants interleaved, and
prints medians.

    python bench/dashboard.py [--steps 1000000] [--params 200] [--modules 150] [--repeat 5] [--keep FILE]
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ampwatch.store.schema import LAYER_NAN_BITS, STEP_NAN_BITS
from ampwatch.record.options import DEFAULTS
from ampwatch.store.writer import _INSERTS, create_run_file

# Where the faults lie in the default 1,000,000-step run; a run of another length has them at the
# same fractions of its length (marks()), so --steps 2000 builds the same shape of run.
DEFAULT_STEPS = 1_000_000
SPIKE_STEP = 654_321
NAN_STEPS = (400_003, 777_777)
SKIP_BURST = (500_000, 500_050)
MIN_STEPS = 100  # below this the marks would crowd into each other


@dataclass(frozen=True)
class Marks:
    """The faults of a run of some length: a loss spike, NaN steps, a burst of skipped steps."""
    spike: int
    nan_steps: tuple[int, ...]
    skip_burst: tuple[int, int]  # [start, end)


def marks(steps: int) -> Marks:
    """The faults placed at the default run's fractions of ``steps`` (exactly the constants above
    at the default length); the skip burst keeps its 50 steps, shorter where the run is short."""
    at = lambda step: step * steps // DEFAULT_STEPS  # noqa: E731 (integers: exact at the default)
    burst = min(SKIP_BURST[1] - SKIP_BURST[0], max(1, steps // 20))
    return Marks(at(SPIKE_STEP), tuple(at(s) for s in NAN_STEPS), (at(SKIP_BURST[0]), at(SKIP_BURST[0]) + burst))


def _step_rows(steps: int, rng: np.random.Generator) -> list[tuple]:
    m = marks(steps)
    s = np.arange(steps)
    loss = 4.0 * np.exp(-s / (steps / 5)) + 0.5 + 0.05 * rng.random(steps)
    scale = 2.0 ** (16 + (s // 20_000) % 4)
    skipped = np.zeros(steps, dtype=np.int64)
    skipped[m.skip_burst[0]:m.skip_burst[1]] = 1
    norm = 0.5 + rng.random(steps)
    loss[m.spike] = 1e4
    mask = np.zeros(steps, dtype=np.int64)
    for st in m.nan_steps:
        mask[st] = STEP_NAN_BITS["loss"] | STEP_NAN_BITS["grad_norm"]
        skipped[st] = 1
    loss_col = [None if m else v for v, m in zip(loss.tolist(), mask.tolist())]
    norm_col = [None if m else v for v, m in zip(norm.tolist(), mask.tolist())]
    t0 = time.time() - steps * 0.1
    return list(zip(s.tolist(), (t0 + 0.1 * s).tolist(), [0.1] * steps, loss_col, scale.tolist(),
                    skipped.tolist(), norm_col, (3e-4 * np.minimum(1.0, s / 2000 + 1e-3)).tolist(),
                    [1] * steps, mask.tolist()))


def _detail_steps(steps: int, layer_every: int) -> np.ndarray:
    m = marks(steps)
    extra = list(range(*m.skip_burst)) + list(m.nan_steps)
    return np.union1d(np.arange(0, steps, layer_every), extra)


def _layer_rows(detail: np.ndarray, n_params: int, rng: np.random.Generator, nan_steps: tuple) -> list[tuple]:
    n = len(detail)
    step = np.repeat(detail, n_params)
    pid = np.tile(np.arange(n_params), n)
    norm = rng.random(n * n_params) * np.tile(np.logspace(-3, 1, n_params), n)
    mask = np.zeros(n * n_params, dtype=np.int64)
    bad = np.isin(step, nan_steps) & (pid == 7)
    mask[bad] = LAYER_NAN_BITS["grad_norm"]
    norm_col = norm.tolist()
    for i in np.flatnonzero(bad).tolist():
        norm_col[i] = None
    amax = (norm * 3).tolist()
    return list(zip(pid.tolist(), step.tolist(), norm_col, amax, (norm * 10).tolist(),
                    bad.astype(np.int64).tolist(), (rng.random(n * n_params) * 0.01).tolist(), mask.tolist()))


def _module_rows(detail: np.ndarray, n_params: int, n_modules: int, rng: np.random.Generator) -> list[tuple]:
    n = len(detail)
    step = np.repeat(detail, 2 * n_modules)
    mid = np.tile(np.repeat(np.arange(n_modules) + n_params, 2), n)
    phase = np.tile(np.array([0, 1] * n_modules), n)
    amax = rng.random(n * 2 * n_modules) * 1000.0
    return list(zip(mid.tolist(), phase.tolist(), step.tolist(), amax.tolist(), [0] * len(amax)))


def build_run(path: Path, steps: int = 1_000_000, n_params: int = 200, n_modules: int = 150,
              layer_every: int = DEFAULTS["layer_every"], seed: int = 0) -> Path:
    """Write a synthetic run with the real schema (fast: executemany in a few transactions)."""
    rng = np.random.default_rng(seed)
    tensors = [{"id": i, "kind": "param", "name": f"h.{i // 4}.w{i % 4}", "type": "float32",
                "shape": "64x64", "numel": 4096, "trainable": 1} for i in range(n_params)]
    tensors += [{"id": n_params + m, "kind": "module", "name": f"mod{m}", "type": "Linear"}
                for m in range(n_modules)]
    info = {"name": path.stem, "status": "finished", "started_at": time.time() - steps * 0.1,
            "ended_at": time.time(), "amp_dtype": "float16", "scaler_enabled": 1, "init_scale": 65536.0,
            "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "layer_every": layer_every,
            "localize": 1, "schema_version": 1, "config": {"max_grad_norm": 1.0}}
    create_run_file(str(path), info, tensors)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("BEGIN")
    conn.executemany(_INSERTS["steps"], _step_rows(steps, rng))
    detail = _detail_steps(steps, layer_every)
    for chunk in np.array_split(detail, max(1, len(detail) // 5000)):
        conn.executemany(_INSERTS["layers"], _layer_rows(chunk, n_params, rng, marks(steps).nan_steps))
        if n_modules:
            conn.executemany(_INSERTS["modules"], _module_rows(chunk, n_params, n_modules, rng))
    conn.execute("COMMIT")
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    return path


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(path: Path, repeat: int) -> dict[str, list[float]]:
    from ampwatch.dashboard import rundata
    from ampwatch.dashboard import layerdata
    tasks = {
        "run overview data ready": lambda: rundata.overview_data(path),
        "layers heatmap data ready": lambda: layerdata.layer_heatmap(path, "grad_norm"),
        "fp16 headroom + zero-grad data ready": lambda: (layerdata.module_headroom(path),
                                                         layerdata.zero_grad_fraction(path)),
        "runs table row": lambda: rundata.run_row(path),
    }
    times: dict[str, list[float]] = {k: [] for k in tasks}
    for _ in range(repeat):  # interleaved, so drift on the shared machine hits every variant alike
        for name, fn in tasks.items():
            times[name].append(_timed(fn))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--params", type=int, default=200)
    ap.add_argument("--modules", type=int, default=150)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--keep", type=Path, help="build (or reuse) the big run at this path instead of a temp file")
    args = ap.parse_args()
    if args.steps < MIN_STEPS:
        ap.error(f"--steps must be at least {MIN_STEPS} (the run holds a spike, NaN steps and a burst of skips)")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "big.sqlite"
        if not path.exists():
            t = _timed(lambda: build_run(path, args.steps, args.params, args.modules))
            print(f"built {path} in {t:.0f} s ({path.stat().st_size / 1e6:.0f} MB)")
        times = measure(path, args.repeat)
    print(f"| data (cold, {args.steps:,} steps, {args.params} param tensors, {args.modules} modules) "
          f"| median s | min s | max s |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {min(ts):.2f} | {max(ts):.2f} |")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
