"""Under DDP (gloo, 2 CPU processes) each rank records its own file."""
import subprocess
import sys
from pathlib import Path

import pytest

import ampwatch
from helpers.ports import free_port
from helpers.torch_compat import NEEDS_TRACED_HOOKS


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


@NEEDS_TRACED_HOOKS
def test_a_compiled_ddp_model_is_observed_on_the_steps_eager_observes(tmp_path):
    """DDP under ``torch.compile``, attached to the DDP module: Dynamo cannot trace DDP's own forward
    and runs parts of it eagerly around the compiled model. Each rank must still observe the modules
    inside the model on the steps the same eager run observes them (every ``layer_every`` step, and
    the replays of skipped steps): a graph traced between observed steps, without the hooks, must
    not run on one. The same with each Linear compiled on its own (torchtitan's way)."""
    worker = Path(__file__).parent / "helpers" / "ddp_worker.py"
    steps = {}
    for how in ("eager", "compiled", "blocks"):
        proc = subprocess.run([sys.executable, str(worker), str(tmp_path), free_port(), how],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        for rank in (0, 1):
            modules = ampwatch.load(tmp_path / f"ddp{how}.rank{rank}.sqlite").modules
            forward = modules[modules.phase == "forward"]
            steps[how, rank] = {name: sorted(forward[forward.module == name].step) for name in set(forward.module)}
    for rank in (0, 1):
        assert steps["compiled", rank] == steps["eager", rank]
        # each Linear compiled on its own: observed at its own call, under the same name, on the same steps
        assert steps["blocks", rank] == steps["eager", rank]
        assert {0, 3, 6} <= set(steps["eager", rank]["module.0"]) and len(steps["eager", rank]) >= 4
