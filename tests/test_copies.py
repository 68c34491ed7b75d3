"""Copies and pickles of watched objects: EMA/SWA copies, whole-module checkpoints, scaler and
optimizer copies, made while a watch is attached.

Each copy must work, carry none of ampwatch's hooks or patches (so it records nothing, whatever
runs through it), and keep the user's own hooks; the original keeps recording. Checked on real
runs: a NaN sent through a copy must leave the run file as if it never happened, while the same
NaN sent through the watched model is recorded (so the check could fail).
"""
from __future__ import annotations

import copy
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import ampwatch
from helpers.loops import amp_step, data, mlp

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
              "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
              "_backward_pre_hooks")


def _hooks(module: torch.nn.Module) -> list:
    """Every hook entry left on ``module`` and its children, with the dict it sits in."""
    return [(name, d, k) for name, m in module.named_modules() for d in HOOK_DICTS
            for k in getattr(m, d, {})]


def _user_hook(module, args, output):  # module-level: pickle can name it
    return None


def _nan_through(model: torch.nn.Module) -> None:
    """A forward and backward pass with NaN inputs, under autocast, outside any optimizer step."""
    x = torch.full((8, 16), float("nan"))
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    out.float().sum().backward()


def _watched(tmp_path, name="run", **options):
    model, (x, y) = mlp(), data(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / f"{name}.sqlite"), layer_every=1, **options)
    return model, opt, scaler, watch, x, y


@pytest.mark.parametrize("make", ["deepcopy", "AveragedModel", "pickle", "none"])
def test_a_nan_through_a_copy_is_not_recorded(tmp_path, make):
    """3 steps, then a NaN forward/backward through a copy, then 3 more steps. With "none" the NaN
    goes through the watched model itself: the control that shows such a NaN is recorded."""
    model, opt, scaler, watch, x, y = _watched(tmp_path)
    user_hook = model[2].register_forward_hook(_user_hook)  # the user's own: copies keep it
    for _ in range(3):
        amp_step(model, opt, scaler, x, y)
    if make == "deepcopy":
        other = copy.deepcopy(model)
    elif make == "AveragedModel":
        other = torch.optim.swa_utils.AveragedModel(model)
    elif make == "pickle":
        other = pickle.loads(pickle.dumps(model))
    else:
        other = model
    if other is not model:
        assert [(n, d) for n, d, _ in _hooks(other)] == [("2" if make != "AveragedModel" else "module.2",
                                                         "_forward_hooks")]
        assert all("__getstate__" not in vars(m) for m in other.modules())
        assert not any(p._post_accumulate_grad_hooks for p in other.parameters()
                       if getattr(p, "_post_accumulate_grad_hooks", None) is not None)
    _nan_through(other)
    if make == "AveragedModel":
        other.update_parameters(model)
    for _ in range(3):
        amp_step(model, opt, scaler, x, y)
    watch.close()
    user_hook.remove()
    run = ampwatch.load(watch.path)
    assert list(run.steps["step"]) == list(range(6))
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters()
                   if getattr(p, "_post_accumulate_grad_hooks", None) is not None)
    if make == "none":  # the NaN reached the watched model: its gradients, a skipped step, events
        assert run.steps["skipped"].tolist() == [False] * 3 + [True] + [False] * 2
        assert len(run.events) > 0
    else:  # the original kept recording, module values included, and saw nothing of the copy
        assert not run.steps["skipped"].any()
        assert run.events.empty
        assert set(run.modules["step"]) == set(range(6))
        assert not run.modules["nonfinite"].any()


def test_copies_while_attached_do_not_touch_the_original(tmp_path):
    model, opt, scaler, watch, x, y = _watched(tmp_path)
    amp_step(model, opt, scaler, x, y)
    hooks_before = _hooks(model)
    patched = {k for k in ("scale", "unscale_", "step", "update") if k in vars(scaler)}
    assert patched == {"scale", "unscale_", "step", "update"}
    copy.deepcopy(model), pickle.dumps(model), copy.copy(model), copy.deepcopy(scaler)
    assert _hooks(model) == hooks_before and {k for k in patched if k in vars(scaler)} == patched
    out = model(x)  # the copies share nothing with it: same result as a fresh, unwatched copy gives
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin(x), out, rtol=0, atol=0)
    watch.close()
    assert all("__getstate__" not in vars(m) for m in model.modules())
    assert not {"scale", "unscale_", "step", "update", "__getstate__"} & set(vars(scaler))


def test_scaler_copy_records_nothing(tmp_path):
    model, opt, scaler, watch, x, y = _watched(tmp_path)
    for _ in range(2):
        amp_step(model, opt, scaler, x, y)
    twin = copy.deepcopy(scaler)
    assert not {"scale", "unscale_", "step", "update", "__getstate__"} & set(vars(twin))
    assert twin.get_scale() == scaler.get_scale()
    # the copy drives a training step of its own (a NaN one): the watch must not see it
    other = copy.deepcopy(model)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.01)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = other(torch.full((8, 16), float("nan"))).float().sum()
    twin.scale(loss).backward()
    twin.step(other_opt)
    twin.update()
    assert twin.get_scale() == scaler.get_scale() / 2  # it really skipped, and backed off its own scale
    amp_step(model, opt, scaler, x, y)
    watch.close()
    run = ampwatch.load(watch.path)
    assert list(run.steps["step"]) == [0, 1, 2] and not run.steps["skipped"].any()
    assert run.steps["loss_scale"].nunique() == 1


def test_optimizer_copy_records_nothing(tmp_path):
    """Without a scaler an optimizer step ends a recorded step: a copied optimizer that kept our
    step hooks would add rows."""
    model, (x, y) = mlp(), data(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with ampwatch.attach(model, opt, None, path=str(tmp_path / "r.sqlite")) as watch:
        for _ in range(2):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        twin = copy.deepcopy(opt)
        assert not twin._optimizer_step_pre_hooks and not twin._optimizer_step_post_hooks
        for p in (p for g in twin.param_groups for p in g["params"]):
            p.grad = torch.ones_like(p)
        twin.step()
        twin.step()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert list(ampwatch.load(watch.path).steps["step"]) == [0, 1, 2]


def test_two_watches_on_one_model_share_the_copy_guard(tmp_path):
    model, opt, scaler, first, x, y = _watched(tmp_path, "a")
    second = ampwatch.attach(model, opt, scaler, path=str(tmp_path / "b.sqlite"))
    amp_step(model, opt, scaler, x, y)
    assert _hooks(copy.deepcopy(model)) == [] and not set(vars(copy.deepcopy(scaler))) & {"scale", "step"}
    first.close()
    assert _hooks(copy.deepcopy(model)) == [] and not set(vars(copy.deepcopy(scaler))) & {"scale", "step"}
    second.close()
    assert all("__getstate__" not in vars(m) for m in model.modules())
    assert "forward" not in vars(model)  # both forward wrappers gone (record/compiled.py), the first's too
    assert "__getstate__" not in vars(scaler)
    assert [len(ampwatch.load(w.path).steps) for w in (first, second)] == [1, 1]


# A process that cannot import ampwatch (an installed one included: the editable install is on
# sys.path through a .pth file), loading what torch.save wrote while the watch was attached.
_LOADER = textwrap.dedent("""
    import importlib.abc, json, sys
    class NoAmpwatch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "ampwatch" or name.startswith("ampwatch."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
    sys.meta_path.insert(0, NoAmpwatch())
    import torch
    folder = sys.argv[1]
    ckpt = torch.load(folder + "/ckpt.pt", weights_only=False)
    model, x = ckpt["model"], torch.load(folder + "/x.pt")
    hooks = [d for m in model.modules() for d in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")
             if getattr(m, d)]
    torch.save(model(x).detach(), folder + "/out.pt")
    print(json.dumps({"ampwatch_loaded": [m for m in sys.modules if m.split(".")[0] == "ampwatch"],
                      "hooks": hooks, "scaler_dict": sorted(vars(ckpt["scaler"])),
                      "scale": ckpt["scaler"].get_scale(), "optimizer": type(ckpt["optimizer"]).__name__}))
""")


def test_torch_save_loads_where_ampwatch_is_not_installed(tmp_path):
    model, opt, scaler, watch, x, y = _watched(tmp_path)
    for _ in range(3):
        amp_step(model, opt, scaler, x, y)
    torch.save({"model": model, "optimizer": opt, "scaler": scaler}, tmp_path / "ckpt.pt")
    torch.save(x, tmp_path / "x.pt")
    buffer = io.BytesIO()
    torch.save(model, buffer)  # to a stream too, and the watch goes on
    amp_step(model, opt, scaler, x, y)
    watch.close()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    done = subprocess.run([sys.executable, "-I", "-c", _LOADER, str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ampwatch_loaded"] == [] and report["hooks"] == []
    assert not {"scale", "unscale_", "step", "update", "__getstate__"} & set(report["scaler_dict"])
    assert report["optimizer"] == "SGD"
    # the saved weights are those of step 3: compare with a reload here, made before step 4 changed them
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    expected = saved(x).detach()
    assert report["scale"] == pytest.approx(scaler.get_scale())  # no step since: unchanged
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(model(x), expected)  # step 4 did train the original
