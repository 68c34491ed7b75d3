"""GradScaler hooks: ``scale``/``unscale_``/``step``/``update`` wrapped on that one instance.

The wrappers call the original first (or around it) and hand the moments to the watch; a user's
error from the scaler propagates untouched. ``unpatch`` restores exactly what was there, unless a
later watch wrapped ours (then ours stays in its chain as a pass-through).
"""
from __future__ import annotations

from typing import Any

import torch

from . import copies

METHODS = ("scale", "unscale_", "step", "update")
_MISSING = copies.MISSING


class ScalerHooks:
    def __init__(self, watch: Any, scaler: Any) -> None:
        self.watch, self.scaler = watch, scaler
        self._patched: dict[str, Any] = {}
        self._wrappers: dict[str, Any] = {}
        self.inside_step = False  # an unscale_ now comes from scaler.step, not from the user
        self._copy_safe: list[Any] = []

    def install(self) -> None:
        for method in METHODS:
            original = getattr(self.scaler, method)
            self._patched[method] = self.scaler.__dict__.get(method, _MISSING)
            # a Patch: copies and pickles of the scaler get the method it replaced (copies.py)
            wrapper = copies.patch(self._patched[method], getattr(self, f"_{method}"), original)
            self._wrappers[method] = wrapper
            setattr(self.scaler, method, wrapper)
        self._copy_safe = copies.leave_out_of_copies([self.scaler])

    def unpatch(self) -> None:
        copies.release(self._copy_safe)
        self._copy_safe = []
        for method, previous in self._patched.items():
            if self.scaler.__dict__.get(method) is not self._wrappers.get(method):
                continue  # another watch wrapped ours: unlinking would drop its wrapper
            if previous is _MISSING:
                self.scaler.__dict__.pop(method, None)
            else:
                setattr(self.scaler, method, previous)
        self._patched.clear()
        self._wrappers.clear()

    # Each wrapper guards the watch's call itself (as Watch.call_guarded would): these run on every
    # step, and a frame for the check and one for the guard cost more than the call they guard
    def _scale(self, original: Any, outputs: Any) -> Any:
        watch = self.watch
        if isinstance(outputs, torch.Tensor) and not (watch._failed or watch.closed):
            watch.on_scale(outputs)  # appends to a list and counts: cannot fail
        return original(outputs)

    def _unscale_(self, original: Any, optimizer: Any) -> None:
        original(optimizer)
        watch = self.watch
        if optimizer is watch.optimizer and not (watch._failed or watch.closed):
            try:
                watch.on_unscaled(self.inside_step)
            except Exception as exc:
                watch._fail(exc)

    def _step(self, original: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        watch = self.watch
        ours = optimizer is watch.optimizer and not (watch._failed or watch.closed)
        if ours:
            try:
                watch.before_scaler_step()
            except Exception as exc:
                watch._fail(exc)
        self.inside_step = ours
        try:
            result = original(optimizer, *args, **kwargs)
        finally:
            self.inside_step = False
        if ours and not (watch._failed or watch.closed):
            try:
                watch.after_scaler_step()
            except Exception as exc:
                watch._fail(exc)
        return result

    def _update(self, original: Any, new_scale: Any = None) -> None:
        watch, before = self.watch, None
        if not (watch._failed or watch.closed):
            try:
                before = watch.before_update()
            except Exception as exc:
                watch._fail(exc)
        original(new_scale)
        if before is not None and not (watch._failed or watch.closed):
            try:
                watch.end_step(*before)
            except Exception as exc:
                watch._fail(exc)
