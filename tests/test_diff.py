"""Where two runs part (``ampwatch diff``): real CPU training recorded twice, with the ground truth
(the step and layer changed, the updates applied, the weights' norms) taken in the loops themselves."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch._dynamo
from click.testing import CliRunner

import ampwatch
from ampwatch.cli.main import cli
from ampwatch.doctor.diff import diff_runs, parting, rel_diff
from helpers.loops import amp_step, changed, data, mlp, snapshot

FAULT_STEP, FAULT_LAYER = 6, "2"
SAMPLES = Path(__file__).resolve().parent.parent / "sample_runs"


def record(path, *, steps=12, dtype=torch.float16, scaler=True, init_scale=2.0 ** 10, compiled=False,
           scale_at=None, layer_every=1):
    """Train the seeded MLP and record it; returns (run, truth) where truth has, per step, whether
    the update was applied and each layer's parameter norm entering the step."""
    torch._dynamo.reset()
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale) if scaler else None
    watch = ampwatch.attach(model, opt, sc, path=str(path), layer_every=layer_every)
    net = torch.compile(model, backend="aot_eager") if compiled else model
    applied, norms = [], []
    for step in range(steps):
        if step == scale_at:
            with torch.no_grad():
                model.get_submodule(FAULT_LAYER).weight.mul_(1.05)
        norms.append({n: float(torch.linalg.vector_norm(p.detach().double())) for n, p in model.named_parameters()})
        x, y = data(step)
        before = snapshot(model)
        amp_step(net, opt, sc, x, y, dtype=dtype, watch=watch)
        applied.append(changed(before, model))
    watch.close()
    return ampwatch.load(watch.path), {"applied": applied, "norms": pd.DataFrame(norms)}


def invoke(*args):
    return CliRunner().invoke(cli, ["diff", *map(str, args)])


def test_a_weight_scaled_at_step_n_parts_there_and_names_the_layer(tmp_path):
    a, truth_a = record(tmp_path / "a.sqlite")
    b, truth_b = record(tmp_path / "b.sqlite", scale_at=FAULT_STEP)
    truth_ratio = truth_b["norms"].at[FAULT_STEP, "2.weight"] / truth_a["norms"].at[FAULT_STEP, "2.weight"]
    # the loops themselves: the weights are identical before the fault step, apart from it on
    assert truth_a["norms"].iloc[:FAULT_STEP].equals(truth_b["norms"].iloc[:FAULT_STEP])
    assert truth_ratio == pytest.approx(1.05, rel=1e-6)

    d = diff_runs(a, b)
    assert d.parted and d.parting_step == FAULT_STEP
    assert (d.first_layer.where, d.first_layer.figure, d.first_layer.step) == ("2.weight", "param_norm", FAULT_STEP)
    assert d.first_layer.ratio == pytest.approx(truth_ratio, rel=1e-5)
    assert (d.first_module.where, d.first_module.phase, d.first_module.step) == (FAULT_LAYER, "forward", FAULT_STEP)
    assert all(g.step == FAULT_STEP for g in d.first_step)
    assert d.settings == [] and d.rtol_source == "float16"

    result = invoke(a.path, b.path)
    assert result.exit_code == 1, result.output
    assert f"THE RUNS PART AT STEP {FAULT_STEP}" in result.output
    assert f"at step {FAULT_STEP}: 2.weight parameter norm" in result.output
    assert "b/a 1.05" in result.output


def test_the_same_run_twice_does_not_part(tmp_path):
    a, truth_a = record(tmp_path / "a.sqlite")
    b, truth_b = record(tmp_path / "b.sqlite")
    assert truth_a["norms"].equals(truth_b["norms"])  # one process, one seed: bitwise the same training
    d = diff_runs(a, b)
    assert not d.parted and d.largest == [] and d.first_layer is None and d.first_module is None
    assert d.steps_shared == 12 and d.detail_steps == {"layers": 12, "modules": 12}
    result = invoke(a.path, b.path)
    assert result.exit_code == 0, result.output
    assert "NO PARTING" in result.output
    same_file = invoke(a.path, a.path)
    assert same_file.exit_code == 0


def test_eager_and_compiled_do_not_part(tmp_path):
    eager, truth_e = record(tmp_path / "eager.sqlite", steps=8)
    compiled, truth_c = record(tmp_path / "compiled.sqlite", steps=8, compiled=True)
    # truth: the loops' own parameter norms stay within the float16 tolerance of each other
    gap = rel_diff(truth_e["norms"].to_numpy(), truth_c["norms"].to_numpy())
    assert gap.max() < 2.0 ** -10 * 10
    d = diff_runs(eager, compiled)
    assert d.first_layer is None and d.first_module is None and not d.parted
    assert d.detail_steps["layers"] == 8 and d.detail_steps["modules"] == 8  # compared, not skipped
    assert invoke(eager.path, compiled.path).exit_code == 0


def test_float16_and_bfloat16_name_the_dtype_and_where_the_skips_part(tmp_path):
    # a scale of 2**24 overflows float16's gradients for the first steps; bfloat16 needs no scaler
    f16, truth16 = record(tmp_path / "f16.sqlite", init_scale=2.0 ** 24)
    bf16, truthbf = record(tmp_path / "bf16.sqlite", dtype=torch.bfloat16, scaler=False)
    first_skip = next(i for i, (x, y) in enumerate(zip(truth16["applied"], truthbf["applied"])) if x != y)
    d = diff_runs(f16, bf16)
    assert ("amp_dtype", "float16", "bfloat16") in d.settings
    assert ("scaler_enabled", True, False) in d.settings
    assert d.rtol_source == "bfloat16" and d.rtol == pytest.approx(10 * 2.0 ** -7)
    assert d.parting_step == first_skip
    skipped = {g.figure: g for g in d.first_step}["skipped"]
    assert (skipped.step, skipped.a, skipped.b) == (first_skip, True, False)
    assert "loss_scale" not in {g.figure for g in d.first_step}  # bfloat16 has no scale to compare

    result = invoke(f16.path, bf16.path, "--json")
    assert result.exit_code == 1
    payload = json.loads(result.output)
    assert {"field": "amp_dtype", "a": "float16", "b": "bfloat16"} in payload["settings"]
    assert payload["parting_step"] == first_skip


def _first_grads(dtype):
    """Each parameter's gradient norm at step 0 (the same weights and batch), without ampwatch."""
    model = mlp(0)
    x, y = data(0)
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    torch.nn.functional.mse_loss(out.float(), y).backward()
    return np.array([float(torch.linalg.vector_norm(p.grad.double())) for p in model.parameters()])


def test_rounding_between_dtypes_parts_only_when_asked_to_see_it(tmp_path):
    f16, truth16 = record(tmp_path / "f16.sqlite")
    bf16, truthbf = record(tmp_path / "bf16.sqlite", dtype=torch.bfloat16, scaler=False)
    assert truth16["applied"] == truthbf["applied"] == [True] * 12  # no skip on either side
    # truth: the same weights at step 0, drifting apart after it by far less than bfloat16's ten units
    drift = rel_diff(truth16["norms"].to_numpy(), truthbf["norms"].to_numpy())
    assert drift[0].max() == 0 and 0 < drift[1:].max() < 10 * 2.0 ** -7

    default = diff_runs(f16, bf16)
    assert ("amp_dtype", "float16", "bfloat16") in default.settings
    assert default.first_layer is None and default.first_module is None  # rounding noise names no layer
    # with a tolerance below rounding, they part at step 0, in the gradients (the weights are the same):
    # at the last layer in model order whose gradient differs, where backward starts
    grads = rel_diff(_first_grads(torch.float16), _first_grads(torch.bfloat16))
    names = list(truth16["norms"].columns)
    strict = diff_runs(f16, bf16, rtol=1e-9)
    assert strict.parting_step == 0
    assert (strict.first_layer.step, strict.first_layer.figure) == (0, "grad_norm")
    assert strict.first_layer.where == names[int(np.flatnonzero(grads > 0)[-1])]
    assert strict.first_layer.others == int((grads > 0).sum()) - 1
    result = invoke(f16.path, bf16.path, "--rtol", "1e-9")
    assert result.exit_code == 1 and "tolerance  1e-09 relative (as given)" in result.output


def test_a_spike_that_comes_back_does_not_part_but_a_grown_one_does():
    frame = pd.DataFrame({"step": [0, 1, 2, 3, 4, 5]})
    spike = np.array([0, 0.5, 0, 0, 0, 0])
    grown = np.array([0, 0, 0.5, 0.6, 0.7, 0.8])
    nan_once = np.array([0, 0, 0, np.inf, 0, 0])
    assert not parting(frame, spike, 0.1).any()
    assert parting(frame, grown, 0.1).tolist() == [False, False, True, True, True, True]
    assert parting(frame, nan_once, 0.1).tolist() == [False, False, False, True, False, False]
    assert rel_diff([1.0, np.nan, np.inf, 0.0, 2.0], [1.0, np.nan, np.inf, 0.0, np.nan]).tolist() == \
        [0, 0, 0, 0, np.inf]


def test_bad_input_is_one_line_exit_2(tmp_path):
    run, _ = record(tmp_path / "a.sqlite", steps=2)
    text = tmp_path / "notes.txt"
    text.write_text("not a run")
    for args in ([tmp_path / "missing.sqlite", run.path], [run.path, text], [run.path, tmp_path]):
        result = invoke(*args)
        assert result.exit_code == 2
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ampwatch: "), result.output
    assert invoke(run.path, run.path, "--rtol", "-1").exit_code == 2


def test_sample_runs_of_another_init_scale_part_at_the_first_step():
    a, b = ampwatch.load(SAMPLES / "healthy_fp16.sqlite"), ampwatch.load(SAMPLES / "diverged.sqlite")
    d = diff_runs(a, b)
    assert ("init_scale", a.info["init_scale"], b.info["init_scale"]) in d.settings
    sa, sb = a.steps.set_index("step"), b.steps.set_index("step")
    truth = next(s for s in sb.index if sa.at[s, "loss_scale"] != sb.at[s, "loss_scale"]
                 or sa.at[s, "skipped"] != sb.at[s, "skipped"])
    assert d.parting_step == truth
    assert d.steps_only == ([50, 250, 299], [0, 0, 0])


def test_the_docs_example_is_real_output(monkeypatch):
    monkeypatch.chdir(SAMPLES.parent)
    command = "ampwatch diff sample_runs/healthy_fp16.sqlite sample_runs/bf16_noscaler.sqlite"
    page = (SAMPLES.parent / "docs" / "doctor.md").read_text()
    shown = page.split(f"$ {command}\n", 1)[1].split("```", 1)[0].splitlines()
    result = invoke("sample_runs/healthy_fp16.sqlite", "sample_runs/bf16_noscaler.sqlite")
    assert result.exit_code == 1
    assert len([line for line in shown if line != "..."]) >= 6
    for line in shown:
        if line != "...":
            assert line in result.output.splitlines(), line


def test_layers_the_runs_do_not_share_are_not_compared_nor_said_to_agree():
    """The Lightning sample names its layers "model.h.0...", the hand-written one "h.0...": no layer
    or module is in both runs, so none is compared, which is not "no layer parts"."""
    a, b = SAMPLES / "healthy_fp16.sqlite", SAMPLES / "lightning_fp16.sqlite"
    layers = [set(ampwatch.load(p).layers["name"]) for p in (a, b)]
    assert layers[0] and layers[1] and not layers[0] & layers[1]  # the truth, from the files
    result = invoke(str(a), str(b))
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert "  layer    not compared: no layer recorded under the same name on a step both runs recorded" in lines
    assert "  module   not compared: no module recorded under the same name on a step both runs recorded" in lines
    assert f"           layers: {len(layers[0])} only in a, {len(layers[1])} only in b (none compared: no name " \
           "in both runs on a step both recorded it)" in lines
    assert "no layer parts" not in result.output and "compared on the names both have" not in result.output
