"""Libraries that hold the GradScaler in an object of their own, and models that hold their EMA.

timm drives AMP through ``timm.utils.NativeScaler`` (the GradScaler is its ``._scaler``);
Lightning's precision plugin and Accelerate's Accelerator keep theirs as ``.scaler``. attach takes
such an object and hooks the scaler inside, or says in one line what to pass. A task object
holding the model and its EMA copy counts the model's parameters once.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampwatch
from ampwatch.errors import ArgumentTypeError
from loops import data, mlp


class LossScaler:
    """The shape of timm's NativeScaler (timm/utils/cuda.py): one call does scale, backward,
    optional unscale_ + clip, step and update on the GradScaler it holds as ``_scaler``."""

    def __init__(self, scaler=None, **kwargs):
        self._scaler = scaler if scaler is not None else torch.amp.GradScaler("cpu", **kwargs)

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None):
        self._scaler.scale(loss).backward()
        if clip_grad is not None:
            self._scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        self._scaler.step(optimizer)
        self._scaler.update()


class _NoScaler:
    _scaler = None  # a wrapper made for a run without fp16


def _train(model, optimizer, loss_scaler, steps, seed=0, clip=None, ema=None, forward=None):
    """timm's train_one_epoch, reduced: autocast forward, loss_scaler(...), EMA update. Returns per
    step whether the weights changed (ground truth for skipped) and the loss as computed."""
    applied, losses = [], []
    for i in range(steps):
        x, y = data(seed + i)
        before = [p.detach().clone() for p in model.parameters()]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = forward(x, y) if forward else F.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        loss_scaler(loss, optimizer, clip_grad=clip, parameters=model.parameters() if clip else None)
        if ema is not None:
            ema.update(model, step=i) if hasattr(ema, "update") else ema.update_parameters(model)
        applied.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
        losses.append(loss.item())
    return applied, losses


def test_an_object_holding_the_scaler_as__scaler_is_recorded_through_it(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_scaler = LossScaler(init_scale=2.0 ** 24, growth_interval=5)  # overflows at first: real skips
    with ampwatch.attach(model, opt, loss_scaler, path=str(tmp_path / "r.sqlite")) as watch:
        assert watch.scaler is loss_scaler._scaler and "step" in vars(loss_scaler._scaler)
        applied, losses = _train(model, opt, loss_scaler, 30, clip=1.0)
    assert not {"scale", "unscale_", "step", "update"} & set(vars(loss_scaler._scaler))
    run = ampwatch.load(watch.path)
    assert sum(not a for a in applied) >= 3, "the storm must skip steps"
    assert run.steps["skipped"].tolist() == [not a for a in applied]
    assert run.steps["loss"].tolist() == pytest.approx(losses, rel=1e-6)
    assert run.info["init_scale"] == 2.0 ** 24 and run.info["clip_max_norm"] == 1.0


def test_lightning_precision_plugin_scaler_is_recorded_through_it(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch.plugins.precision import MixedPrecision
    plugin = MixedPrecision("16-mixed", "cpu")
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampwatch.attach(model, opt, plugin, path=str(tmp_path / "r.sqlite")) as watch:
        assert watch.scaler is plugin.scaler
        applied, _ = _train(model, opt, LossScaler(plugin.scaler), 3)
    assert ampwatch.load(watch.path).steps["skipped"].tolist() == [not a for a in applied]


@pytest.mark.parametrize("make, says", [
    (lambda: object(), "scaler must be a torch.amp.GradScaler (or an object that holds one as ._scaler, like "
                       "timm's NativeScaler), or None for bf16/fp32 runs, got object"),
    (lambda: _NoScaler(), "the _NoScaler passed as scaler holds no GradScaler (its ._scaler is None): pass "
                          "scaler=None for a bf16/fp32 run"),
])
def test_what_holds_no_scaler_is_refused_in_one_line(tmp_path, make, says):
    model = mlp()
    with pytest.raises(ArgumentTypeError) as err:
        ampwatch.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), make(), path=str(tmp_path / "r.sqlite"))
    assert str(err.value).startswith(f"ampwatch.attach: {says}") and "\n" not in str(err.value)
    assert not model._forward_hooks and not list(tmp_path.iterdir())


def test_accelerator_without_a_scaler_is_refused_with_what_to_pass(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)  # no fp16 here: its .scaler is None
    model = mlp()
    with pytest.raises(ArgumentTypeError, match=r"holds no GradScaler \(its \.scaler is None\): pass scaler=None"):
        ampwatch.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), accelerator, path=str(tmp_path / "r.sqlite"))


class Task(nn.Module):
    """A training task that holds the model and its EMA copy (timm's TrainingTask.setup_ema shape)."""

    def __init__(self, model):
        super().__init__()
        self.trainable_module = model
        self.trainable_module_ema = torch.optim.swa_utils.AveragedModel(model)

    def forward(self, x, y):
        return F.mse_loss(self.trainable_module(x).float(), y)


def test_task_holding_model_and_ema_counts_the_model_once(tmp_path):
    model = mlp()
    model[0].weight.requires_grad_(False)  # frozen: still the model's, still counted
    task = Task(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loss_scaler = LossScaler()
    with ampwatch.attach(task, opt, loss_scaler, path=str(tmp_path / "r.sqlite")) as watch:
        applied, _ = _train(model, opt, loss_scaler, 4, ema=task.trainable_module_ema, forward=task)
    info = ampwatch.load(watch.path).info
    assert info["param_count"] == sum(p.numel() for p in model.parameters()) == 1732
    assert sum(p.numel() for p in task.parameters()) == 2 * 1732  # what was counted before
    assert ampwatch.load(watch.path).steps["skipped"].tolist() == [not a for a in applied]


def _timm():
    try:
        import timm
        from timm.task import ClassificationTask
        from timm.utils import ModelEmaV3, NativeScaler
    except Exception as exc:  # not installed, or its torchvision does not load beside this torch
        pytest.skip(f"timm is not usable here ({type(exc).__name__}: {str(exc)[:120]}); "
                    "it needs a torchvision built for this torch")
    return timm, ClassificationTask, ModelEmaV3, NativeScaler


def test_timm_native_scaler_loop_with_model_ema(tmp_path):
    """timm's own loop pieces: NativeScaler, ModelEmaV3 built after attach (a deepcopy of the
    watched model), the EMA evaluated on NaN inputs, then a task object holding model and EMA."""
    timm, ClassificationTask, ModelEmaV3, NativeScaler = _timm()
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", pretrained=False, num_classes=4)
    x = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_scaler = NativeScaler(device="cpu")
    applied, losses = [], []
    with ampwatch.attach(model, optimizer, loss_scaler, path=str(tmp_path / "timm.sqlite")) as watch:
        assert watch.scaler is loss_scaler._scaler
        model_ema = ModelEmaV3(model, decay=0.9)
        for step in range(4):
            before = [p.detach().clone() for p in model.parameters()]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss_scaler(loss, optimizer, clip_grad=5.0, parameters=model.parameters())
            model_ema.update(model, step=step)
            applied.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
            losses.append(loss.item())
            with torch.no_grad():  # validation of the EMA, on inputs gone bad
                model_ema.module(torch.full_like(x, float("nan")))
    run = ampwatch.load(watch.path)
    assert run.steps["skipped"].tolist() == [not a for a in applied]
    assert run.steps["loss"].tolist() == pytest.approx(losses, rel=1e-5)
    assert run.info["clip_max_norm"] == 5.0  # timm's dispatch_clip_grad calls clip_grad_norm_
    assert run.events.empty  # the EMA's NaN forward passes reached no hook of ours
    assert not any(getattr(m, d) for m in model_ema.modules() for d in ("_forward_hooks", "_forward_pre_hooks"))
    n_model = sum(p.numel() for p in model.parameters())
    assert run.info["param_count"] == n_model

    task = ClassificationTask(model, verbose=False)
    task.setup_ema(decay=0.9)
    with ampwatch.attach(task, optimizer, loss_scaler, path=str(tmp_path / "task.sqlite")) as watch:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = task(x, y)["loss"]
        optimizer.zero_grad()
        loss_scaler(loss, optimizer)
        task.update_ema(step=0)
    info = ampwatch.load(watch.path).info
    assert sum(p.numel() for p in task.parameters()) == 2 * n_model  # model + EMA
    assert info["param_count"] == n_model
