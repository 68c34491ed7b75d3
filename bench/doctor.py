"""How long the doctor takes: a 1,000,000-step run and each sample run.

The big run is the one bench/dashboard.py builds (200 parameter tensors, 150 modules, detail rows
every ``layer_every`` steps: 10M layer rows and 15M module rows), built here if ``--big`` does not
exist yet. Each timing opens the run afresh (``ampwatch.load``: no table cached in the Run object;
the OS file cache is warm after the first round) and calls ``ampwatch.diagnose``. The runs are
interleaved round by round, so drift on the shared machine hits them all alike; medians are printed.

    python bench/doctor.py [--big /tmp/dash/big.sqlite] [--repeat 3] [--samples sample_runs]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import ampwatch


def _time_diagnose(path: Path) -> tuple[float, int]:
    start = time.perf_counter()
    findings = ampwatch.diagnose(ampwatch.load(path))
    return time.perf_counter() - start, len(findings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", type=Path, default=Path("/tmp/dash/big.sqlite"),
                    help="the 1M-step run (built with bench/dashboard.py's build_run if missing)")
    ap.add_argument("--samples", type=Path, default=Path(__file__).parent.parent / "sample_runs")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not args.big.exists():
        from dashboard import build_run  # bench/ is on sys.path when this script runs
        args.big.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        build_run(args.big)
        print(f"built {args.big} in {time.perf_counter() - start:.0f} s")
    paths = [args.big] + sorted(args.samples.glob("*.sqlite"))
    times: dict[Path, list[float]] = {p: [] for p in paths}
    counts: dict[Path, int] = {}
    for _ in range(args.repeat):
        for p in paths:
            t, counts[p] = _time_diagnose(p)
            times[p].append(t)
    steps = {p: int(ampwatch.load(p).query("SELECT COUNT(*) AS n FROM steps")["n"].iloc[0]) for p in paths}
    print(f"| run (ampwatch.diagnose, {args.repeat} rounds) | steps | findings | median s | min s | max s |")
    print("|---|---|---|---|---|---|")
    for p in paths:
        ts = times[p]
        print(f"| {p.name} | {steps[p]:,} | {counts[p]} | {statistics.median(ts):.2f} | {min(ts):.2f} "
              f"| {max(ts):.2f} |")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
