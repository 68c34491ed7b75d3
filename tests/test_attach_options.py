"""attach's options and arguments: a wrong one is a one-line error that hooks nothing and writes
nothing; no path means runs/<name>.sqlite under the working directory."""
from __future__ import annotations

import pytest
import torch

import ampwatch
from helpers.loops import mlp, train

# every test runs on both recorder paths: the CPU's free reads and the accelerator path
pytestmark = pytest.mark.usefixtures("record_path")


def test_bad_options_are_one_line_errors(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="layer_every=0 is invalid"):
        ampwatch.attach(model, opt, path=str(tmp_path / "x.sqlite"), layer_every=0)
    with pytest.raises(ValueError, match="unknown ampwatch option 'layer_evry'"):
        ampwatch.attach(model, opt, path=str(tmp_path / "x.sqlite"), layer_evry=3)
    with pytest.raises(TypeError, match="optimizer must be"):
        ampwatch.attach(model, "adam", path=str(tmp_path / "x.sqlite"))


@pytest.mark.parametrize("argument, value, says", [
    ("model", "model", "model must be the torch.nn.Module being trained, got str 'model'"),
    ("model", None, "model must be the torch.nn.Module being trained, got NoneType None"),
    ("optimizer", "adam", "optimizer must be a torch.optim.Optimizer"),
    ("scaler", "x", "scaler must be a torch.amp.GradScaler (or an object that holds one as ._scaler, like timm's "
                    "NativeScaler), or None for bf16/fp32 runs, got str 'x'"),
    ("path", 123, "path must be a str or pathlib.Path, got int 123"),
    ("name", 5, "name must be None or a str, got int 5"),
    ("config", "lr=1", "config must be None or a dict of hyper-parameters, got str 'lr=1'"),
])
def test_wrong_argument_types_are_one_line_errors_and_hook_nothing(tmp_path, monkeypatch, argument, value, says):
    from ampwatch.errors import ArgumentTypeError, OptionError
    monkeypatch.chdir(tmp_path)  # a default path would land here
    model = mlp()
    args = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                scaler=torch.amp.GradScaler("cpu"), path=str(tmp_path / "x.sqlite"))
    scaler = args["scaler"]
    args[argument] = value
    with pytest.raises(ArgumentTypeError) as err:
        ampwatch.attach(args.pop("model"), args.pop("optimizer"), args.pop("scaler"), **args)
    assert isinstance(err.value, TypeError) and isinstance(err.value, OptionError)  # old and new catchers
    assert str(err.value).startswith(f"ampwatch.attach: {says}")
    assert "\n" not in str(err.value) and list(tmp_path.iterdir()) == []
    assert not {"scale", "step", "update", "unscale_"} & set(scaler.__dict__) and not model._forward_hooks


@pytest.mark.parametrize("path, says", [("", "path is an empty string"), ("a\x00b.sqlite", "contains a NUL character")])
def test_an_empty_or_nul_path_is_an_option_error(tmp_path, monkeypatch, path, says):
    from ampwatch.errors import OptionError
    monkeypatch.chdir(tmp_path)
    model = mlp()
    with pytest.raises(OptionError, match=says) as err:  # '' is not the current folder
        ampwatch.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), path=path)
    assert "\n" not in str(err.value) and list(tmp_path.iterdir()) == []


def test_default_path_under_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, watch, _ = train(1, attach=lambda m, o, s: ampwatch.attach(m, o, s, name="exp7"))
    assert watch.path == tmp_path / "runs" / "exp7.sqlite"
    assert ampwatch.load(watch.path).info["name"] == "exp7"
