"""File size and writer throughput of the real write path (PackReader -> RunWriter -> SQLite).

Feeds synthetic steps for a model with 200 parameter tensors and 150 hooked modules through the same
objects the recorder uses (no torch training: this isolates storage), then reports the file size of a
100,000-step run at the default ``layer_every`` and the writer's sustained rows per second.

    python bench/storage.py [--steps 100000] [--params 200] [--modules 150] [--layer-every 10]
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from ampwatch.record import observe
from ampwatch.record.packing import PackReader, StepPack
from ampwatch.record.options import DEFAULTS
from ampwatch.store.writer import RunWriter, create_run_file


def synthetic_stats(n_modules: int, rng: random.Random) -> tuple[torch.Tensor, dict]:
    """A healthy forward and backward as the hooks leave it: the stats buffer's bytes (fp16 output
    and input-gradient slots filled) and the observer's step structure (ModuleObserver.take)."""
    buffer = observe.StatsBuffer(observe.ROLES * n_modules, torch.device("cpu"))
    fp16 = buffer.views[observe.DTYPE_INDEX[torch.float16]]
    for m in range(n_modules):
        for role, high in ((observe.OUT, 50.0), (observe.GIN, 1e4)):
            v = rng.uniform(0.5, high)
            fp16[observe.ROLES * m + role] = torch.tensor([-v, v])
    loc = {"aliases": {}, "order": list(range(n_modules)), "counts": {}, "observed": True,
           "micro_batches": 1, "first": False, "fp32": {}}
    return torch.cat(buffer.as_bytes()), loc


def run(steps: int, n_params: int, n_modules: int, layer_every: int, folder: Path) -> dict:
    path = folder / "storage.sqlite"
    tensors = [{"id": i, "kind": "param", "name": f"layer{i}.weight", "type": "float32"} for i in range(n_params)]
    tensors += [{"id": n_params + m, "kind": "module", "name": f"mod{m}", "type": "Linear"} for m in range(n_modules)]
    info = {"name": "storage-bench", "status": "running", "started_at": time.time(), "layer_every": layer_every,
            "schema_version": 1}
    create_run_file(str(path), info, tensors)
    packs = PackReader([t["name"] for t in tensors[:n_params]], ["float32"] * n_params,
                       list(range(n_params, n_params + n_modules)), [f"mod{m}" for m in range(n_modules)],
                       layer_every)
    writer = RunWriter(str(path), packs.rows, DEFAULTS["flush_every_s"])
    rng = random.Random(0)
    stats, loc = synthetic_stats(n_modules, rng)
    ids = list(range(n_params))
    numel = {i: 4096 for i in ids}
    start = time.perf_counter()
    for step in range(steps):
        detail = step % layer_every == 0
        n = 2 + n_params + (5 * n_params if detail else 0)
        scalars = torch.rand(n, dtype=torch.float64)
        flat = torch.cat([scalars.view(torch.uint8), stats])
        layout = {"loss": (0, 1), "scale": (1, 1), "norms": (2, n_params)}
        if detail:
            layout["detail"] = (2 + n_params, 5 * n_params)
        writer.put_step(StepPack(step=step, time=time.time(), duration_s=0.1, lr=1e-3, micro_batches=1,
                                 skipped=False, flat=flat, layout=layout, norm_ids=ids,
                                 detail_ids=ids if detail else [], param_numel=numel, loc=loc,
                                 scalar_bytes=8 * n))
    queued = time.perf_counter() - start
    writer.close("finished", None)
    total = time.perf_counter() - start
    size = path.stat().st_size
    import sqlite3
    conn = sqlite3.connect(path)
    counts = {f"{t}_rows": conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("steps", "layers", "modules")}
    conn.close()
    rows = sum(counts.values())
    return {"steps": steps, "params": n_params, "modules": n_modules, "layer_every": layer_every,
            "size_mb": size / 1e6, "rows": rows, **counts, "seconds": total, "queue_s": queued,
            "rows_per_s": rows / total, "steps_per_s": steps / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--params", type=int, default=200)
    ap.add_argument("--modules", type=int, default=150)
    ap.add_argument("--layer-every", type=int, default=DEFAULTS["layer_every"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        r = run(args.steps, args.params, args.modules, args.layer_every, Path(tmp))
    print("| steps | param tensors | modules | layer_every | file MB | rows (steps/layers/modules) "
          "| writer rows/s | steps/s |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {r['steps']:,} | {r['params']} | {r['modules']} | {r['layer_every']} | {r['size_mb']:.1f} | "
          f"{r['rows']:,} ({r['steps_rows']:,}/{r['layers_rows']:,}/{r['modules_rows']:,}) | {r['rows_per_s']:,.0f} | "
          f"{r['steps_per_s']:,.0f} |")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
