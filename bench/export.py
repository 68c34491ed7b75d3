"""Speed of ``ampwatch export --to tensorboard|mlflow`` on a 100,000-step run.

The run is synthetic but written by the real write path (bench/storage.py: PackReader -> RunWriter
-> SQLite, 200 parameter tensors and 150 modules by default, fp16), then exported in this process
with the same code the CLI runs, timed in two parts: the series (every step, per-layer norms and
headroom on ``layer_every`` steps) and the doctor's findings.

    python bench/export.py [--steps 100000] [--params 200] [--modules 150] [--to tensorboard]
    MLFLOW_TRACKING_URI=file:///tmp/mlruns MLFLOW_ALLOW_FILE_STORE=true python bench/export.py --to mlflow --steps 10000
"""
from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import storage  # noqa: E402  (bench/storage.py: the synthetic run)

from ampwatch.reader import Run, connect  # noqa: E402
from ampwatch.trackers import export_sink, series  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--params", type=int, default=200)
    ap.add_argument("--modules", type=int, default=150)
    ap.add_argument("--layer-every", type=int, default=20)
    ap.add_argument("--to", default="tensorboard", choices=["tensorboard", "mlflow", "wandb"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        made = storage.run(args.steps, args.params, args.modules, args.layer_every, Path(tmp))
        path = Path(tmp) / "storage.sqlite"
        with sqlite3.connect(path) as conn:  # the synthetic modules are fp16 Linear layers: headroom applies
            conn.execute("UPDATE run SET amp_dtype = 'float16'")
        print(f"made {args.steps:,}-step run ({made['size_mb']:.0f} MB, {made['rows']:,} rows) in "
              f"{time.perf_counter() - t0:.0f} s")
        run = Run(path)
        sink = export_sink(args.to, logdir=str(Path(tmp) / "tb"), name="bench")
        t0 = time.perf_counter()
        steps = values = 0
        with connect(path) as conn:
            for points in series.read_points(conn):
                sink.scalars(points)
                steps += len(points)
                values += sum(len(p.values) for p in points)
        sink.flush()
        t_series = time.perf_counter() - t0
        t0 = time.perf_counter()
        from ampwatch.doctor import diagnose
        texts = series.finding_texts(diagnose(run))
        if texts:
            sink.texts(series.FINDINGS, texts)
        sink.close()
        t_findings = time.perf_counter() - t0
        read = made["steps_rows"] + made["layers_rows"] + made["modules_rows"]
        print(f"| tracker | steps | values written | series s | rows read/s | values/s | findings s |")
        print(f"|---|---|---|---|---|---|---|")
        print(f"| {args.to} | {steps:,} | {values:,} | {t_series:.1f} | {read / t_series:,.0f} | "
              f"{values / t_series:,.0f} | {t_findings:.1f} |")


if __name__ == "__main__":
    main()
