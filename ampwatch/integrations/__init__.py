"""Zero-line recording inside training frameworks.

- ``ampwatch.integrations.transformers.AmpwatchCallback``: a ``transformers.TrainerCallback``.
- ``ampwatch.integrations.lightning.AmpwatchCallback``: a ``lightning.pytorch.Callback``.
- Accelerate needs no adapter: ``ampwatch.attach(model, optimizer, accelerator.scaler)`` on what
  ``accelerator.prepare`` returns.

Adapters only translate the framework's events into one :class:`ampwatch.Watch` per training run;
all recording logic stays in the Watch. Importing this package imports no framework.
"""
from __future__ import annotations

import importlib
import traceback
from types import ModuleType
from typing import Any, Optional

from ..record.options import resolve

_RUN_KEYWORDS = ("name", "config")


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise one clear ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"ampwatch.integrations.{extra} needs {module.split('.')[0]}, which is not installed "
                          f"({exc}): pip install 'ampwatch[{extra}]'") from None


def check_options(options: dict[str, Any], framework: str) -> dict[str, Any]:
    """Validate a callback's options now (same as ``attach``'s), not when training starts."""
    if "framework" in options:
        raise TypeError(f"AmpwatchCallback sets framework={framework!r} itself; do not pass it")
    config = options.get("config")
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"AmpwatchCallback: config must be a dict, got {type(config).__name__}")
    resolve({k: v for k, v in options.items() if k not in _RUN_KEYWORDS})
    return dict(options)


def attach_options(options: dict[str, Any], framework: str, framework_config: dict[str, Any],
                   global_step: Any = 0) -> dict[str, Any]:
    """Keyword arguments for ``attach``: the framework's settings under the user's own config keys,
    and the trainer's global step as ``first_step`` (a run resumed from a checkpoint goes on with
    the trainer's numbering) unless the user gave one."""
    merged = dict(options)
    merged["config"] = {**framework_config, **(options.get("config") or {})}
    merged["framework"] = framework
    if "first_step" not in merged and isinstance(global_step, int) and not isinstance(global_step, bool) \
            and global_step > 0:
        merged["first_step"] = global_step
    return merged


def run_path(path: Optional[str], first: Any) -> Optional[str]:
    """The path for a callback's next run: as given for its first (``attach`` refuses an existing
    file), then numbered siblings of the first run's file (``a-2.sqlite``), as documented: each
    ``train()``/``fit()`` gets its own file, and ``callback.watch.path`` says which."""
    if path is None or first is None:
        return path
    from ..record.runinfo import next_free
    return str(next_free(first))


def plain(value: Any) -> Any:
    """A JSON-able form of a framework setting (enums by value, the rest as is or as text)."""
    value = getattr(value, "value", value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def note_amp_dtype(watch: Any, dtype: Optional[str]) -> None:
    """Tell the run which autocast dtype the framework uses. Frameworks enter autocast inside the
    model call (accelerate wraps ``forward``) or around ``training_step`` (Lightning), where the
    watch's model pre-hook cannot see it."""
    writer = getattr(watch, "writer", None)
    if dtype and writer is not None and not watch.closed:
        writer.put_info(amp_dtype=dtype)


def format_error(exc: Optional[BaseException]) -> Optional[str]:
    if exc is None:
        return None
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


__all__ = ["require", "check_options", "attach_options", "run_path", "plain", "note_amp_dtype", "format_error"]
