"""The recorder under FSDP2 (DTensor shards) and FSDP1 with ShardedGradScaler.

Two real gloo processes on the CPU (tests/helpers/fsdp_worker.py), spawned once for every test here; the
harness's own numbers (full-tensor norms through its own collectives, parameters compared before
and after each step) are the ground truth. The global gradient norm is rebuilt from the two rank
files as sqrt(sum over ranks of grad_norm^2), as a reader must do for 'sharded' runs.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ampwatch
from helpers.ports import free_port

WORKER = Path(__file__).parent / "helpers" / "fsdp_worker.py"
FSDP2_SCENARIOS = ("fp16", "mp_fp16", "mp_bf16")
BAD_STEP, BAD_RANK = 4, 1  # as in helpers/fsdp_worker.py


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out), port, str(rank), "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode != 0 and "all_gather_copy_in_stream = torch.cuda.Stream" in log for p, log in zip(procs, logs)):
        pytest.skip("FSDP2 of this torch needs CUDA streams: it does not run on the CPU (seen on torch 2.4.1)")
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    for log in logs:
        assert "stopped recording" not in log, log[-3000:]
    truth = [json.loads((out / f"truth.rank{rank}.json").read_text()) for rank in range(2)]
    return out, port, truth


def _runs(out: Path, scenario: str) -> list:
    return [ampwatch.load(out / f"{scenario}_{rank}.sqlite") for rank in range(2)]


def _rebuilt(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values))


@pytest.mark.parametrize("scenario", FSDP2_SCENARIOS + ("fsdp1",))
def test_every_step_on_both_ranks_matches_the_harness(job, scenario):
    out, port, truth = job
    runs = _runs(out, scenario)
    for rank, run in enumerate(runs):
        t = truth[rank][scenario]
        steps = run.steps
        assert steps["step"].tolist() == list(range(10))
        # skipped is the ground truth on every rank: parameters unchanged <=> skipped
        assert steps["skipped"].tolist() == [not a for a in t["applied"]]
        assert steps["loss_scale"].tolist() == t["scale"]
        assert steps["loss"].tolist() == pytest.approx(t["loss"], rel=1e-6, nan_ok=True)
        assert run.info["grad_sharding"] == "sharded" and run.info["world_size"] == 2
    assert any(truth[0][scenario]["applied"]) and not all(truth[0][scenario]["applied"])
    applied = truth[0][scenario]["applied"]
    rebuilt = [_rebuilt(norms) for norms in zip(*(run.steps["grad_norm"] for run in runs))]
    for step, ok in enumerate(applied):
        if ok:
            assert rebuilt[step] == pytest.approx(truth[0][scenario]["norm"][step], rel=1e-4), step
        else:
            assert not math.isfinite(rebuilt[step])
    # the same job id on both ranks, without a collective: torchrun's rendezvous id where it
    # names the job, else the rendezvous address and the first rank's attach time
    ids = {run.info["job_id"] for run in runs}
    expected = "elastic-42" if scenario == "fsdp1" else f"127.0.0.1:{port}@"
    assert len(ids) == 1 and ids.pop().startswith(expected)


@pytest.mark.parametrize("scenario", FSDP2_SCENARIOS)
def test_per_layer_shard_norms_rebuild_the_full_tensor_norms(job, scenario):
    out, _, truth = job
    layers = [run.layers.set_index(["step", "name"])["grad_norm"] for run in _runs(out, scenario)]
    for step, per_param in enumerate(truth[0][scenario]["param_norms"]):
        if not truth[0][scenario]["applied"][step]:
            continue
        for name, norm in per_param.items():
            # rank 1 holds empty shards of the last layer: its norm there is 0
            assert _rebuilt([layer.loc[(step, name)] for layer in layers]) == pytest.approx(norm, rel=1e-4)


def test_the_rank_with_the_bad_sample_localizes_it(job):
    out, _, truth = job
    for scenario in FSDP2_SCENARIOS:
        events = [run.query("SELECT step, phase, module, origin, micro_batch FROM events") for run in _runs(out, scenario)]
        bad = events[BAD_RANK]
        forward = bad[(bad.step == BAD_STEP) & (bad.phase == "forward")]
        assert set(bad[bad.phase == "forward"]["step"]) == {BAD_STEP} and set(forward["micro_batch"]) == {0}
        origin = forward[forward.origin == 1]["module"].tolist()
        # under autocast the fp16 cast inside layer 0 makes the inf; with fp16 parameters
        # FSDP casts the root's inputs before any module runs, so no module is its origin
        assert origin == ([] if scenario == "mp_fp16" else ["0"]), scenario
        clean = events[1 - BAD_RANK]
        assert clean[clean.phase == "forward"].empty  # the other rank's forward passes stayed finite
        assert not truth[BAD_RANK][scenario]["applied"][BAD_STEP]  # and every rank skipped the step
        assert all(not run.modules.empty for run in _runs(out, scenario))


def test_attaching_adds_no_collective_and_changes_nothing(job):
    _, _, truth = job
    for rank in range(2):
        fp16 = truth[rank]["fp16"]
        # counted by the profiler around every training step: FSDP's all-gathers and
        # reduce-scatters and the scaler's found-inf all-reduce, nothing of ampwatch's
        assert fp16["collectives"] == fp16["plain_collectives"] and min(fp16["collectives"]) > 0
        assert fp16["bitwise_equal"]


def test_fsdp2_with_compiled_layers_records_what_eager_records(job):
    """FSDP2 with each layer compiled and then sharded (aot_eager; torchtitan's order, block by
    block). The layers run as compiled graphs, no graph break; the watch observes each compiled
    layer at its own call, outside its graph (FSDP2 gives it a class of its own: still seen as
    compiled). Training is bitwise that of the same job without ampwatch, and the files say what
    the eager job's say: the same skips, module rows and events, the bad sample localized to the
    same module and phase."""
    out, _, truth = job
    eager, compiled = _runs(out, "fp16"), _runs(out, "compiled")
    for rank in range(2):
        t = truth[rank]["compiled"]
        assert t["graphs"] > 0 and t["graph_breaks"] == 0, t
        assert t["bitwise_equal"], rank
        assert t["loss"] == pytest.approx(truth[rank]["fp16"]["loss"], rel=1e-5, nan_ok=True)
        e, c = eager[rank], compiled[rank]
        assert c.steps["skipped"].tolist() == [not a for a in t["applied"]]
        assert c.steps["skipped"].tolist() == e.steps["skipped"].tolist()
        assert not c.query("SELECT * FROM notices WHERE code LIKE 'recording%' OR code LIKE 'replay%'").shape[0]
        modules = [set(map(tuple, run.modules[["step", "module"]].values.tolist())) for run in (e, c)]
        assert modules[0] and modules[1] == modules[0], rank
        query = "SELECT step, phase, module, kind, origin FROM events"
        # parameters keep their names, which pass through the compiled module's `_orig_mod`
        events = [{(s, p, m.replace("._orig_mod", ""), k, o) for s, p, m, k, o in run.query(query).values.tolist()}
                  for run in (e, c)]
        assert events[1] == events[0], rank
    origins = "SELECT module FROM events WHERE step = ? AND phase = 'forward' AND origin = 1"
    assert compiled[BAD_RANK].query(origins, (BAD_STEP,))["module"].tolist() == ["0"]
