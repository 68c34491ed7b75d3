"""Under DDP (gloo, 2 CPU processes) each rank records its own file."""
import subprocess
import sys
from pathlib import Path

import pytest

import ampwatch
from helpers.ports import free_port


def test_each_rank_records_its_own_file(tmp_path):
    worker = Path(__file__).parent / "helpers" / "ddp_worker.py"
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path), free_port()],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = sorted(p.name for p in tmp_path.glob("*.sqlite"))
    assert files == ["ddp.rank0.sqlite", "ddp.rank1.sqlite"]
    runs = [ampwatch.load(tmp_path / f) for f in files]
    assert [r.info["rank"] for r in runs] == [0, 1]
    assert all(r.info["world_size"] == 2 and r.info["config"] == {"world": 2} for r in runs)
    # DDP's gradients are replicas; both ranks name the same job (agreed without a collective)
    assert [r.info["grad_sharding"] for r in runs] == ["replicated"] * 2
    assert runs[0].info["job_id"] == runs[1].info["job_id"] and runs[0].info["job_id"].startswith("127.0.0.1:")
    for r in runs:
        assert len(r.steps) == 12
    # gradients are all-reduced, so both ranks agree on every step's skip and scale
    a, b = (r.steps for r in runs)
    assert list(a["skipped"]) == list(b["skipped"]) and a["skipped"].any()
    assert list(a["loss_scale"]) == list(b["loss_scale"])
    # the norm is measured after DDP's all-reduce has finished (its callback runs before ours), so
    # the ranks, which see different data, agree on it too
    assert a["grad_norm"].tolist() == pytest.approx(b["grad_norm"].tolist(), rel=1e-5, nan_ok=True)
