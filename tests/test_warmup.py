"""The scaler's warm-up: one rule, read with SQL (the dashboard's runs table and events, `ampwatch
summary`) and from frames (the doctor), which must agree on every sample run and on real runs made
for the rule's cases; each case's truth is computed here from the steps table and the loop itself.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import ampwatch
from ampwatch.dashboard import rundata
from ampwatch.doctor.facts import Facts
from ampwatch.doctor.summary import summarize
from ampwatch.doctor.warmup import warmup_in_file, warmup_of
from ampwatch.store.reader import Run, open_run
from loops import data, mlp

SAMPLES = Path(__file__).resolve().parent.parent / "sample_runs"


def _all_forms(path: Path):
    with open_run(path) as conn:
        sql = warmup_in_file(conn, bool(conn.run_row.get("scaler_enabled")))
    run = Run(path)
    frames = warmup_of(run.steps, run.events, run.info["scaler_enabled"])
    with Facts.open(run) as facts:
        doctor = facts.warmup
    return sql, frames, doctor


@pytest.mark.parametrize("sample", sorted(p.name for p in SAMPLES.glob("*.sqlite")))
def test_sql_and_frames_agree_on_every_sample_run(sample):
    sql, frames, doctor = _all_forms(SAMPLES / sample)
    assert sql == frames == doctor


def _record(path: Path, steps: int, *, init_scale: float = 2.0 ** 24, scaler: bool = True,
            forward_inf_at: tuple = (), nan_loss_from: int = 10 ** 9, dtype=torch.float16) -> list[bool]:
    """A real fp16 MLP run; returns, per step, whether the update was skipped (the loop's truth)."""
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gs = torch.amp.GradScaler("cpu", init_scale=init_scale) if scaler else None
    step = {"i": 0}

    def blow_up(_m, _inp, out):
        return out * float("inf") if step["i"] in forward_inf_at else out

    model[2].register_forward_hook(blow_up)
    watch = ampwatch.attach(model, opt, gs, path=str(path))
    skipped = []
    for i in range(steps):
        step["i"] = i
        x, y = data(i)
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
        loss = F.mse_loss(out.float(), y) * (float("nan") if i >= nan_loss_from else 1.0)
        before = [p.detach().clone() for p in model.parameters()]
        if gs is not None:
            gs.scale(loss).backward()
            gs.step(opt)
            gs.update()
        else:
            loss.backward()
            watch.log(loss=loss)
            opt.step()
        opt.zero_grad()
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
    watch.close()
    return skipped


def _leading(skipped: list[bool]) -> int:
    n = 0
    while n < len(skipped) and skipped[n]:
        n += 1
    return n


def test_a_scale_backing_off_from_a_high_start_is_the_warm_up(tmp_path):
    path = tmp_path / "warm.sqlite"
    skipped = _record(path, 30)
    n = _leading(skipped)
    assert 0 < n < 30  # the truth: 2**24 overflows fp16 gradients for a few steps, then they fit
    scales = [r[0] for r in sqlite3.connect(path).execute("SELECT loss_scale FROM steps ORDER BY step")]
    assert all(b == a / 2 for a, b in zip(scales[:n], scales[1:n + 1]))  # halved on every skip
    sql, frames, doctor = _all_forms(path)
    assert sql == frames == doctor
    assert sql.skips == list(range(n)) and sql.end == n and sql.scale_from == 2.0 ** 24
    assert rundata.run_row(path)["first_nonfinite_step"] == summarize(Run(path))["first_nonfinite_step"]
    assert summarize(Run(path))["warmup_end_step"] == n


def test_leading_skips_born_in_the_forward_pass_are_not_a_warm_up(tmp_path):
    """The old 'leading skips until the first clean step' called these warm-up; the doctor never did."""
    path = tmp_path / "forward.sqlite"
    skipped = _record(path, 12, init_scale=2.0 ** 8, forward_inf_at=(0, 1))
    assert skipped[0] and skipped[1]  # the truth: an inf output skips the step whatever the scale
    sql, frames, doctor = _all_forms(path)
    assert sql is None and frames is None and doctor is None
    row, summary = rundata.run_row(path), summarize(Run(path))
    assert row["first_nonfinite_step"] == summary["first_nonfinite_step"] == 0
    events = rundata.events(path)
    assert not events["warmup"].any()


def test_no_scaler_no_warm_up_and_a_diverged_start_is_none(tmp_path):
    bf16 = tmp_path / "bf16.sqlite"
    _record(bf16, 6, scaler=False, dtype=torch.bfloat16)
    assert _all_forms(bf16) == (None, None, None)
    nan = tmp_path / "nan.sqlite"
    skipped = _record(nan, 8, nan_loss_from=0)  # NaN loss on every step: a diverged tail, not a warm-up
    assert all(skipped)
    assert _all_forms(nan) == (None, None, None)
    assert rundata.run_row(nan)["first_nonfinite_step"] == summarize(Run(nan))["first_nonfinite_step"] == 0
