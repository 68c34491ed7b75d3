"""The ranks of one job read back together (load_group), which rank did it, and the CLI.

One real 4-rank DDP job (gloo, CPU; tests/helpers/group_worker.py) with a forward overflow injected into
rank 2's batch at one step is spawned once per module and shared by the tests that read it.
Synthetic jobs (sharded norms, several jobs in a folder) are written with the run writer directly.
"""
from __future__ import annotations

import math
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import ampwatch
from ampwatch.cli.main import cli
from ampwatch.jobs.group import load_groups
from ampwatch.doctor.job import diagnose_group

from helpers.group_worker import BAD_RANK, BAD_STEP, STEPS, WORLD
from helpers.ports import free_port
from helpers.synthetic_job import step_rows, write_rank


def _sql(path: Path, sql: str, params: tuple = ()) -> list:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp_job")
    worker = Path(__file__).parent / "helpers" / "group_worker.py"
    proc = subprocess.run([sys.executable, str(worker), str(out), free_port()],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("*.sqlite")) == [f"ddp.rank{r}.sqlite" for r in range(WORLD)]
    return out


def test_group_names_the_rank_module_phase_and_step(ddp_job):
    group = ampwatch.load_group(ddp_job)
    assert group.ranks == list(range(WORLD)) and group.missing == [] and group.unreadable == []
    first = group.first_nonfinite()
    # ground truth from rank 2's own file: its forward origin at the injected step
    (module,) = _sql(ddp_job / f"ddp.rank{BAD_RANK}.sqlite",
                     "SELECT module FROM events WHERE step = ? AND phase = 'forward' AND origin = 1", (BAD_STEP,))[0]
    assert (first.step, first.rank, first.module, first.phase) == (BAD_STEP, BAD_RANK, module, "forward")
    assert module.endswith("0")  # the first Linear, whose fp16 input overflowed
    assert first.micro_batch in (None, 1)  # the second micro-batch, once the recorder writes it
    assert first.forward_ranks == [BAD_RANK] and first.ranks == list(range(WORLD))
    for r in range(WORLD):
        path = ddp_job / f"ddp.rank{r}.sqlite"
        forward = _sql(path, "SELECT COUNT(*) FROM events WHERE step = ? AND phase = 'forward'", (BAD_STEP,))[0][0]
        assert (forward > 0) == (r == BAD_RANK)  # the other ranks' forward passes were clean
        skipped = [s for (s,) in _sql(path, "SELECT step FROM steps WHERE skipped = 1")]
        assert skipped == [BAD_STEP]  # all-reduced gradients: every rank skips that step, only it


def test_group_steps_and_global_steps_against_the_files(ddp_job):
    group = ampwatch.load_group(str(ddp_job / "ddp.rank*.sqlite"))  # a glob picks the same job
    steps = group.steps
    assert len(steps) == WORLD * STEPS and sorted(steps["rank"].unique()) == list(range(WORLD))
    g = group.global_steps.set_index("step")
    assert list(g.index) == list(range(STEPS)) and (g["ranks"] == WORLD).all()
    truth = {r: dict(_sql(ddp_job / f"ddp.rank{r}.sqlite", "SELECT step, loss FROM steps")) for r in range(WORLD)}
    norm0 = dict(_sql(ddp_job / "ddp.rank0.sqlite", "SELECT step, grad_norm FROM steps"))
    for step in range(STEPS):
        losses = [truth[r][step] for r in range(WORLD)]
        if step == BAD_STEP:  # rank 2's loss is NaN (stored as NULL + nan_mask): so is the mean
            assert math.isnan(g.loc[step, "loss_mean"]) and g.loc[step, "nonfinite_ranks"] == WORLD
            continue
        assert g.loc[step, "loss_mean"] == pytest.approx(np.mean(losses), rel=1e-12)
        assert g.loc[step, "loss_std"] == pytest.approx(np.std(losses), rel=1e-9)
        assert (g.loc[step, "loss_min"], g.loc[step, "loss_max"]) == (min(losses), max(losses))
        assert g.loc[step, "grad_norm"] == norm0[step]  # replicated (DDP): any rank's norm is global
    assert g["skipped_agree"].all() and g["skipped"].tolist() == [s == BAD_STEP for s in range(STEPS)]
    assert group.grad_sharding == "replicated"


def test_group_doctor_says_a_bad_batch_on_rank_2(ddp_job):
    found = {f.id: f for f in diagnose_group(ampwatch.load_group(ddp_job))}
    f = found["rank-origin"]
    assert f.title.startswith(f"A bad batch on rank {BAD_RANK}:") and f"step {BAD_STEP}" in f.title
    assert "ranks 0, 1 and 3 were clean in their forward passes" in f.evidence
    assert f.steps == (BAD_STEP, BAD_STEP) and set(found) == {"rank-origin"}


def test_cli_reports_the_job_once(ddp_job):
    res = CliRunner().invoke(cli, ["summary", str(ddp_job)])
    assert res.exit_code == 0, res.output
    assert res.output.count("job      ddp  (4 of 4 ranks, replicated gradients (DDP), finished)") == 1
    assert f"nonfinite first at step {BAD_STEP} on rank {BAD_RANK}" in res.output
    assert "ranks    all 4 agree" in res.output and "run      " not in res.output
    res = CliRunner().invoke(cli, ["doctor", str(ddp_job)])
    assert res.exit_code == 1  # error findings
    assert res.output.count("rank-origin") == 1 and res.output.count("job      ddp") == 1
    assert f"A bad batch on rank {BAD_RANK}" in res.output
    assert f"nonfinite-origin  (step {BAD_STEP})  [rank {BAD_RANK}]" in res.output


def test_missing_and_truncated_ranks_are_reported_not_fatal(ddp_job, tmp_path):
    for r in (0, 2, 3):
        shutil.copy(ddp_job / f"ddp.rank{r}.sqlite", tmp_path)
    cut = tmp_path / "ddp.rank3.sqlite"
    with open(cut, "r+b") as fh:
        fh.truncate(cut.stat().st_size // 3)
    group = ampwatch.load_group(tmp_path)
    assert group.ranks == [0, 2] and group.missing == [1] and group.world_size == WORLD
    assert [(u.rank, u.path.name) for u in group.unreadable] == [(3, "ddp.rank3.sqlite")]
    assert "truncated" in group.unreadable[0].reason
    full = ampwatch.load_group(ddp_job).steps
    assert group.steps.reset_index(drop=True).equals(full[full["rank"].isin([0, 2])].reset_index(drop=True))
    first = group.first_nonfinite()
    assert (first.step, first.rank, first.phase) == (BAD_STEP, BAD_RANK, "forward")
    assert (group.global_steps["ranks"] == 2).all()
    found = {f.id: f for f in diagnose_group(group)}
    assert "rank 0 was clean in its forward pass" in found["rank-origin"].evidence
    assert "ranks 1 and 3 could not be read" in found["rank-origin"].evidence
    assert found["rank-missing"].title == "2 of 4 ranks readable"
    res = CliRunner().invoke(cli, ["summary", str(tmp_path)])
    assert res.exit_code == 2 and "missing  rank 1: no file" in res.output
    assert "unreadable rank 3:" in res.output and "(2 of 4 ranks" in res.output
    assert "Traceback" not in res.output


# -- synthetic jobs written with the writer directly ------------------------------------------------------

def test_sharded_global_norm_is_the_root_of_summed_squares(tmp_path):
    rng = np.random.default_rng(0)
    norms, losses = rng.random((3, 50)), rng.random((3, 50))
    for r in range(3):
        write_rank(tmp_path, f"fsdp_{r}", r, 3, step_rows(norms[r], losses[r], {7} if r != 1 else {7, 9}),
                    sharding="sharded")
    group = ampwatch.load_group(tmp_path)
    g = group.global_steps
    assert group.name == "fsdp" and group.grad_sharding == "sharded"
    np.testing.assert_allclose(g["grad_norm"], np.sqrt((norms ** 2).sum(axis=0)), rtol=1e-12)
    assert g.loc[g["step"] == 9, "skipped_agree"].item() is False and g["skipped_agree"].sum() == 49
    found = {f.id: f for f in diagnose_group(group)}
    assert found["rank-skip-disagreement"].steps == (9, 9) and "1 of 3 ranks skipped" in found[
        "rank-skip-disagreement"].evidence
    (tmp_path / "fsdp_1.sqlite").unlink()  # a shard missing: the global norm cannot be rebuilt
    assert ampwatch.load_group(tmp_path).global_steps["grad_norm"].isna().all()


def test_overview_samples_but_keeps_every_skip_and_is_exact_there(tmp_path):
    rng = np.random.default_rng(1)
    n, skips = 1000, {3, 333, 334, 999}
    for r in range(2):  # the recorder writes a param_grad event for every non-finite gradient: each skip
        events = tuple((s, "param_grad", "w", "inf", 1, None, "float32", 0, None) for s in sorted(skips))
        write_rank(tmp_path, f"job.rank{r}", r, 2, step_rows(rng.random(n), rng.random(n), skips), events=events)
    group = ampwatch.load_group(tmp_path)
    ov = group.overview(points=50)
    full = group.global_steps.set_index("step")
    shown = ov.global_steps.set_index("step")
    assert ov.every == 20 and skips <= set(shown.index) and set(range(0, n, 20)) <= set(shown.index)
    assert len(shown) == len(set(range(0, n, 20)) | skips)
    cols = ["loss_mean", "loss_std", "grad_norm", "skipped"]
    assert shown[cols].equals(full.loc[shown.index, cols])
    assert ov.ranks["skipped"].tolist() == [4, 4] and ov.disagree_steps == []


def test_several_jobs_in_one_folder(tmp_path):
    flat = np.ones(5)
    for r in range(2):  # the same script twice, an hour apart, and a job named by its job id
        write_rank(tmp_path, f"ddp.rank{r}", r, 2, step_rows(flat, flat, set()), started=1000.0)
        write_rank(tmp_path, f"ddp.rank{r}-2", r, 2, step_rows(flat, flat, set()), started=4600.0)
        write_rank(tmp_path, f"node{r}_x", r, 2, step_rows(flat, flat, set()), job_id="elastic-42")
    write_rank(tmp_path, "single", 0, 1, step_rows(flat, flat, set()))
    groups = load_groups(tmp_path)
    assert sorted((g.name, g.ranks) for g in groups) == [("ddp", [0, 1]), ("ddp-2", [0, 1]),
                                                         ("node_x", [0, 1]), ("single", [0])]
    with pytest.raises(ampwatch.RunError, match=r"holds 4 jobs: .*pick one with load_group\(\.\.\., job=NAME\)"):
        ampwatch.load_group(tmp_path)
    assert ampwatch.load_group(tmp_path, job="elastic-42").job_id == "elastic-42"
    assert ampwatch.load_group(tmp_path, job="ddp-2").paths[1].name == "ddp.rank1-2.sqlite"
    with pytest.raises(ampwatch.RunError, match="no job 'nope'"):
        ampwatch.load_group(tmp_path, job="nope")
    res = CliRunner().invoke(cli, ["summary", str(tmp_path)])
    assert res.exit_code == 0 and res.output.count("job      ") == 3 and res.output.count("run      single") == 1


def test_bad_group_input_is_one_line(tmp_path):
    for arg in (tmp_path / "absent", str(tmp_path / "*.sqlite")):
        with pytest.raises(ampwatch.RunError) as exc:
            ampwatch.load_group(arg)
        assert "\n" not in str(exc.value)
    (tmp_path / "junk.sqlite").write_bytes(b"not sqlite")
    with pytest.raises(ampwatch.RunError, match="junk.sqlite.*not an ampwatch run") as exc:
        ampwatch.load_group(tmp_path)  # the one file's own reason, not a vague "failed to open"
    assert "\n" not in str(exc.value)
    (tmp_path / "junk2.sqlite").write_bytes(b"")
    with pytest.raises(ampwatch.RunError, match="no readable run .*every file failed to open .first: "):
        ampwatch.load_group(tmp_path)


def test_the_rank_that_was_killed_first_leads_the_job_report(tmp_path):
    """Rank 1 SIGKILLs itself in step 6, as the OOM killer would (tests/helpers/dying_rank_worker.py);
    rank 0's next all-reduce fails and it ends with gloo's exception. Per rank, that exception is the
    only error, so the report used to lead with it ("fix the exception"). The job finding names rank 1,
    and rank 0's crash is marked as following from it."""
    from helpers.dying_rank_worker import DEATH_STEP, DYING_RANK
    worker = Path(__file__).parent / "helpers" / "dying_rank_worker.py"
    port = free_port()
    procs = {r: subprocess.Popen([sys.executable, str(worker), str(r), str(tmp_path), port],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in (0, 1)}
    codes = {r: p.wait(timeout=300) for r, p in procs.items()}
    assert codes[DYING_RANK] == -9 and codes[0] != 0, procs[0].stderr.read()[-2000:]
    dying = tmp_path / f"job.rank{DYING_RANK}.sqlite"
    (last,), = _sql(dying, "SELECT MAX(step) FROM steps")
    assert last == DEATH_STEP - 1  # every completed step was flushed before the kill
    group = ampwatch.load_group(tmp_path)
    job = diagnose_group(group)
    assert job[0].id == "rank-stopped-first" and job[0].severity == "error"
    assert job[0].title == f"Rank {DYING_RANK} was killed or lost first, after step {last}"
    assert job[0].evidence.startswith(f"rank {DYING_RANK}: killed or lost (no exception), last heartbeat ")
    assert "; rank 0: crashed at " in job[0].evidence and "s later)" in job[0].evidence
    res = CliRunner().invoke(cli, ["doctor", str(tmp_path)])
    assert res.exit_code == 1
    assert res.output.splitlines()[0].split(None, 1)[1].strip() == (
        f"error: Rank {DYING_RANK} was killed or lost first, after step {last}")
    assert f"run-crashed  (step {DEATH_STEP})  [rank 0]  (follows rank-stopped-first)" in res.output
    assert f"run-interrupted  (step {DEATH_STEP})  [rank {DYING_RANK}]\n" in res.output  # its own, no cause
