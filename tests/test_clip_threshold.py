"""The clip threshold is learned from the clip_grad_norm_ call itself, whatever the loop's
config calls it, and drawn in the overview; torch's functions are restored when the last watch closes."""
from __future__ import annotations

import sqlite3

import pytest
import torch
from torch.nn.utils import clip_grad_norm_ as bound_before_attach

import ampwatch
from ampwatch.dashboard import rundata
from ampwatch.dashboard import figures
from ampwatch.store.reader import clip_threshold
from helpers.loops import data, mlp
from helpers.torch_compat import HAS_SPLIT_CLIP, total_norm

ORIGINALS = {name: getattr(torch.nn.utils, name) for name in ("clip_grad_norm_", "clip_grads_with_norm_")
             if hasattr(torch.nn.utils, name)}  # the second: torch >= 2.6


def _loop(path, clip, steps=3, **options):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.attach(model, opt, scaler, path=str(path), **options) as watch:
        for i in range(steps):
            x, y = data(i)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            clip(model, i)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return ampwatch.load(watch.path)


@pytest.mark.parametrize("how", ["literal", "generator", pytest.param(
    # before torch 2.6 clip_grad_norm_ calls nothing a wrapper can stand in for: a reference taken
    # before attach is not seen (the dashboard falls back to the run's config keys)
    "bound-before-attach", marks=pytest.mark.skipif(not HAS_SPLIT_CLIP, reason="torch >= 2.6")), pytest.param(
    "with-norm", marks=pytest.mark.skipif(not HAS_SPLIT_CLIP, reason="clip_grads_with_norm_: torch >= 2.6"))])
def test_max_norm_is_learned_from_the_call(tmp_path, how):
    def clip(model, i):
        if how == "literal":
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)
        elif how == "generator":  # nanoGPT passes model.parameters(): it must still clip every gradient
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        elif how == "bound-before-attach":
            bound_before_attach(model.parameters(), 0.5)
        else:
            params = list(model.parameters())
            norm = total_norm([p.grad for p in params])
            torch.nn.utils.clip_grads_with_norm_(params, 0.5, norm)
        total = total_norm([p.grad for p in model.parameters()])
        assert float(total) <= 0.5 + 1e-4  # the clip really happened
    run = _loop(tmp_path / "r.sqlite", clip)
    assert run.info["clip_max_norm"] == 0.5 and len(run.notices) == 0
    assert clip_threshold(run.info) == 0.5
    assert {n: getattr(torch.nn.utils, n) for n in ORIGINALS} == ORIGINALS  # restored on close


def test_a_changing_threshold_keeps_the_last_and_says_so(tmp_path):
    run = _loop(tmp_path / "r.sqlite", lambda m, i: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0 + i))
    assert run.info["clip_max_norm"] == 3.0
    assert list(run.notices["code"]) == ["clip-threshold-changed"] * 2


def test_another_models_clip_is_not_ours_and_two_watches_restore_torch(tmp_path):
    other = mlp(seed=1)
    other(torch.randn(2, 16)).sum().backward()

    def clip(model, i):
        torch.nn.utils.clip_grad_norm_(other.parameters(), 9.0)  # not the recorded model
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    run = _loop(tmp_path / "r.sqlite", clip)
    assert run.info["clip_max_norm"] == 0.25
    assert {n: getattr(torch.nn.utils, n) for n in ORIGINALS} == ORIGINALS


def test_the_overview_draws_the_observed_threshold_whatever_the_config_key(tmp_path):
    run = _loop(tmp_path / "r.sqlite", lambda m, i: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.75),
                config={"grad_clip": 99.0})  # nanoGPT's key, and a value the call contradicts
    ov = rundata.overview_data(run.path)
    assert ov.clip_threshold == 0.75
    lines = [s for s in figures.overview_figure(ov).layout.shapes if s.y0 == s.y1]
    assert [s.y0 for s in lines] == [0.75]


@pytest.mark.parametrize("config, expected", [({"max_grad_norm": 1.0}, 1.0), ({"grad_clip": 0.5}, 0.5),
                                              ({"gradient_clip_val": 2}, 2.0), ({"grad_clip": 0.0}, None),
                                              ({}, None), ({"max_grad_norm": True}, None)])
def test_without_an_observed_call_the_config_keys_are_the_fallback(config, expected):
    assert clip_threshold({"config": config, "clip_max_norm": None}) == expected


def test_a_run_from_before_schema_3_reads_as_written(tmp_path):
    """Older files lack loss_definition, clip_max_norm and tensors.aliases: they read as they were."""
    run = _loop(tmp_path / "r.sqlite", lambda m, i: None)
    conn = sqlite3.connect(run.path)
    for table, col in (("run", "loss_definition"), ("run", "clip_max_norm"), ("tensors", "aliases")):
        conn.execute(f"ALTER TABLE {table} DROP COLUMN {col}")
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()
    old = ampwatch.load(run.path)
    assert old.info["loss_definition"] == "scaled-mean" and old.info["clip_max_norm"] is None
    assert set(old.tensors["aliases"]) == {""} and list(old.steps["loss"]) == list(run.steps["loss"])
    assert rundata.overview_data(run.path).clip_threshold is None
