"""The one table of recorder options: name, default, check and help.

``attach`` validates against it, ``docs`` and the CLI read it, so the three never disagree.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ArgumentTypeError, OptionError
from ..userpath import short_repr


@dataclass(frozen=True)
class Setting:
    name: str
    default: Any
    check: Callable[[Any], bool]
    expected: str
    help: str


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _natural(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _positive_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_mirror(v: Any) -> bool:
    """None, a log folder, "mlflow", "wandb", or an object with SummaryWriter's add_scalar."""
    return v is None or (isinstance(v, (str, os.PathLike)) and os.fspath(v) != "") or \
        callable(getattr(v, "add_scalar", None))


SETTINGS: tuple[Setting, ...] = (
    # 20 keeps a 100k-step run of 200 parameter tensors and 150 modules at ~95 MB (10 would be
    # ~190 MB, over the 150 MB budget; bench/storage.py) and
    # costs < 1% per step on the reference transformer (bench/overhead.py, docs/performance.md).
    Setting("layer_every", 20, _positive_int, "an int >= 1",
            "per-layer/per-module detail every N steps (always on skipped or non-finite steps)"),
    Setting("localize", True, _is_bool, "True or False",
            "hook modules to find where NaN/Inf is born (forward and backward) and track fp16 headroom"),
    Setting("replay", True, _is_bool, "True or False",
            "with localize, on an accelerator with a GradScaler: measure module values on layer_every "
            "steps and localize a skipped step by replaying it, not on every step (False: every step)"),
    Setting("keep_weights", True, _is_bool, "True or False",
            "with replay, without a GradScaler, on an accelerator, with an optimizer that cannot skip in its "
            "kernel: keep a device copy of the weights (where the device has room) so that each step's check "
            "is read a step late instead of waiting before its update (False: no copy, one wait a step)"),
    Setting("fp32_check", True, _is_bool, "True or False",
            "with localize: recompute a forward origin's module in fp32 on bad steps (events.fp32_amax)"),
    Setting("save_batches", True, _is_bool, "True or False",
            "save the model's inputs of the first 8 steps whose loss or outputs went NaN/Inf in the run file "
            "(at most 16 MiB a step, 64 MiB a run; Run.batches, ampwatch.load_batch, 'ampwatch batch')"),
    Setting("first_step", 0, _natural, "an int >= 0",
            "the number of the first step recorded: a run resumed from a checkpoint taken after step N-1 "
            "passes N, so that its rows, the doctor and the trackers use the loop's own step numbers "
            "(the framework callbacks pass the trainer's global step)"),
    Setting("flush_every_s", 1.0, _positive_number, "a number of seconds > 0",
            "commit buffered rows at least this often"),
    Setting("strict", False, _is_bool, "True or False",
            "raise recorder errors instead of warning once and stopping recording"),
    Setting("rank", None, lambda v: v is None or (isinstance(v, int) and v >= 0), "None or an int >= 0",
            "process rank (default: torch.distributed rank when initialised, else 0)"),
    Setting("overwrite", False, _is_bool, "True or False",
            "replace an existing file at an explicit path (default: refuse, so a run is never silently redirected)"),
    Setting("mirror", None, _is_mirror,
            "None, a TensorBoard log folder, 'mlflow', 'wandb' or a SummaryWriter",
            "also send the AMP series and doctor findings to a tracker, from the writer thread: a TensorBoard "
            "log folder, 'mlflow' or 'wandb' (their active run) or a SummaryWriter (docs/trackers.md)"),
    Setting("framework", None, lambda v: v is None or isinstance(v, str), "None or a str",
            "set by integrations: which framework recorded the run"),
)

DEFAULTS = {s.name: s.default for s in SETTINGS}


def resolve(options: dict[str, Any]) -> dict[str, Any]:
    """Merge ``options`` over the defaults, raising :class:`OptionError` on an unknown or bad value."""
    by_name = {s.name: s for s in SETTINGS}
    unknown = sorted(set(options) - set(by_name))
    if unknown:
        raise OptionError(
            f"unknown ampwatch option {unknown[0]!r}; valid options: {', '.join(sorted(by_name))}"
        )
    merged = dict(DEFAULTS)
    for name, value in options.items():
        setting = by_name[name]
        if not setting.check(value):
            raise OptionError(f"ampwatch option {name}={value!r} is invalid: expected {setting.expected}")
        merged[name] = value
    return merged


# What attach needs of a scaler: the four calls it wraps, and is_enabled (bf16/fp32 runs pass None).
_SCALER_METHODS = ("scale", "unscale_", "step", "update", "is_enabled")
# Where libraries that drive AMP through an object of their own keep its GradScaler: timm's
# NativeScaler (``loss_scaler._scaler``); Accelerate's Accelerator and Lightning's precision plugin
# (``.scaler``). Their calls go through that scaler's methods, which is what the watch wraps.
_HELD_AS = ("_scaler", "scaler")


def _is_scaler(obj: Any) -> bool:
    return all(callable(getattr(obj, m, None)) for m in _SCALER_METHODS)


def held_scaler(scaler: Any) -> Any:
    """The GradScaler to hook: ``scaler`` itself (or None), else the one it holds the way timm's
    ``NativeScaler`` does (``._scaler``) or ``.scaler``. Anything else comes back unchanged, for
    :func:`check_arguments` to refuse."""
    if scaler is None or _is_scaler(scaler):
        return scaler
    for attr in _HELD_AS:
        inner = getattr(scaler, attr, None)
        if inner is not None and _is_scaler(inner):
            return inner
    return scaler


def check_arguments(model: Any, optimizer: Any, scaler: Any, name: Any, config: Any) -> None:
    """Raise :class:`ArgumentTypeError` (one line: what was passed, what is expected) when attach's
    arguments have the wrong type, before anything is hooked or read from them. ``path`` is checked
    where it is resolved (:func:`ampwatch.record.runinfo.resolve_path`)."""
    import torch  # only attach gets here: the CLI and the docs read SETTINGS without torch

    def wrong(what: str, value: Any, expected: str) -> ArgumentTypeError:
        return ArgumentTypeError(f"ampwatch.attach: {what} must be {expected}, got "
                                 f"{type(value).__name__} {short_repr(value)}")

    if not isinstance(model, torch.nn.Module):
        raise wrong("model", model, "the torch.nn.Module being trained")
    # Accelerate and Lightning wrap the optimizer; the wrapper's .optimizer is what gets hooked
    if not isinstance(optimizer, torch.optim.Optimizer) and \
            not isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        raise wrong("optimizer", optimizer, "a torch.optim.Optimizer (e.g. torch.optim.AdamW(model.parameters()))")
    if scaler is not None and not _is_scaler(held_scaler(scaler)):
        held = [a for a in _HELD_AS if hasattr(scaler, a)]
        if held and getattr(scaler, held[0]) is None:  # an Accelerator without fp16: no scaler at all
            raise ArgumentTypeError(f"ampwatch.attach: the {type(scaler).__name__} passed as scaler holds no "
                                    f"GradScaler (its .{held[0]} is None): pass scaler=None for a bf16/fp32 run")
        raise wrong("scaler", scaler, "a torch.amp.GradScaler (or an object that holds one as ._scaler, "
                    "like timm's NativeScaler), or None for bf16/fp32 runs")
    if name is not None and not isinstance(name, str):
        raise wrong("name", name, "None or a str")
    if config is not None and not isinstance(config, dict):
        raise wrong("config", config, "None or a dict of hyper-parameters")
