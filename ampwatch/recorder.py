"""Watch: attaches to an unchanged training loop and records every optimizer step.

The step is learned from the scaler's own calls (``scale``/``unscale_``/``step``/``update`` wrapped
on that one instance) and from optimizer step hooks; nothing is asked of the loop. Per step the
training thread does a handful of device ops and one transfer; the writer thread does the rest.
"""
from __future__ import annotations

import atexit
import functools
import json
import logging
import math
import sys
import time
import traceback
import warnings
import weakref
from typing import Any, Optional

import torch

from . import clipwatch, probes
from .backward import BackwardEnd
from .localize import Localizer
from .packing import StepPack
from .runinfo import describe_run, module_aliases, parameter_table, resolve_path, tied_owners
from .settings import resolve
from .writer import RunWriter

log = logging.getLogger("ampwatch")
if not log.handlers:  # say once where the run goes, even when the user configured no logging
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("ampwatch: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False
_SCALER_METHODS = ("scale", "unscale_", "step", "update")
_MISSING = object()


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """1/scale on the device (in float64: a scale need not be a power of two), for unscaling norms."""
    return scale.double().reciprocal().float()


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """Accelerate/Lightning wrap the optimizer; GradScaler is handed the inner one, so hook that."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"ampwatch.attach: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


class Watch:
    """A recording in progress. Use :func:`ampwatch.attach` to make one; close it (or use ``with``)."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, scaler: Any = None, *,
                 path: Optional[str] = None, name: Optional[str] = None,
                 config: Optional[dict] = None, **options: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ampwatch.attach: model must be a torch.nn.Module, got {type(model).__name__}")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"ampwatch.attach: config must be a dict, got {type(config).__name__}")
        self.options = resolve(options)
        self.model, self.optimizer, self.scaler = model, _unwrap_optimizer(optimizer), scaler
        self.closed = False
        self._failed = False
        self._handles: list[Any] = []
        self._patched: dict[str, Any] = {}
        self._wrappers: dict[str, Any] = {}  # what we installed, to tell it from a later watch's wrapper
        self._amp_handles: list[Any] = []
        self._amp_seen = False             # autocast dtype recorded (looked for during step 0 only)
        self._inside_scaler_step = False   # an unscale_ now comes from scaler.step, not from the user
        self._clip_noticed = False         # the clip-before-unscale notice is written once per run
        self._max_norm: Optional[float] = None  # clip_grad_norm_'s max_norm, as last seen (clipwatch)
        self._loss_logged = False          # a watch.log(loss=...) decided this run's loss definition
        self._params, names = parameter_table(model, self.optimizer)
        self._param_numel = {i: probes.local(p).numel() for i, p in enumerate(self._params)}  # this rank's
        self._param_index = {id(p): i for i, p in enumerate(self._params)}
        self._device = self._params[0].device if self._params else torch.device("cpu")
        self._pack_dtype = probes.pack_dtype(self._device)
        self._fused = probes.steps_inside_kernel(self.optimizer)
        self._new_step(time.time())
        self.step = 0
        info = describe_run(model, self.optimizer, scaler, name, config, self.options, self._params)
        self.path, note = resolve_path(path, info["name"], info["rank"], info["world_size"],
                                       self.options["overwrite"])
        if note:
            log.info("%s", note)
        info["loss_definition"] = "scaled-sum" if scaler is not None else "logged-mean"
        info["name"] = info["name"] or self.path.stem
        self.name = info["name"]
        self.localizer: Optional[Localizer] = None
        self._trigger: Optional[BackwardEnd] = None
        try:
            self._open_writer(info, names)
        except Exception as exc:  # unwritable directory, full disk: training goes on unrecorded
            self._fail(exc)
            return
        self._install()
        _open_watches.add(self)

    # -- setup ----------------------------------------------------------------------------------
    def _open_writer(self, info: dict, names: list[dict]) -> None:
        from .packing import PackReader
        from .writer import create_run_file
        module_names: list[str] = []
        if self.options["localize"]:
            self.localizer = Localizer(self.model, self._device, lambda: self.model.training)
            module_names = self.localizer.names
            if self.options["fp32_check"]:
                from .counterfactual import InputKeeper
                self.localizer.keeper = InputKeeper(self.localizer)
        shared = module_aliases(self.model) if module_names else {}
        tensors = list(names) + [
            {"id": len(names) + i, "kind": "module", "name": n, "type": t,
             "aliases": json.dumps(shared[n]) if n in shared else None}
            for i, (n, t) in enumerate(zip(module_names, self.localizer.types if self.localizer else []))
        ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        create_run_file(str(self.path), info, tensors)
        packs = PackReader([n["name"] for n in names], [n["type"] for n in names],
                           [len(names) + i for i in range(len(module_names))], module_names,
                           self.options["layer_every"],
                           tied_owners(self.model, self._params, module_names) if module_names else {})
        self.writer = RunWriter(str(self.path), packs, self.options["flush_every_s"])
        log.info("recording to %s", self.path)

    def _install(self) -> None:
        opt = self.optimizer
        self._handles.append(opt.register_step_pre_hook(self._guarded(self._before_optimizer_step)))
        self._handles.append(opt.register_step_post_hook(self._guarded(self._after_optimizer_step)))
        # autocast may be entered inside the model's forward (Accelerate wraps model.forward), so
        # the children look too; these hooks are removed when the first step ends
        self._amp_handles = [m.register_forward_pre_hook(self._guarded(self._on_first_forward))
                             for m in (self.model, *self.model.children())]
        self._handles.extend(self._amp_handles)
        self._trigger = BackwardEnd(self.model, self._params, self._guarded(self._on_backward),
                                         self._guarded(self._on_backward_end))
        if self.scaler is not None:
            for method in _SCALER_METHODS:
                original = getattr(self.scaler, method)
                self._patched[method] = self.scaler.__dict__.get(method, _MISSING)
                wrapper = functools.partial(getattr(self, f"_scaler_{method}"), original)
                self._wrappers[method] = wrapper
                setattr(self.scaler, method, wrapper)
        clipwatch.listen(self)

    def _guarded(self, fn: Any) -> Any:
        def hook(*args: Any, **kwargs: Any) -> None:
            if self._failed or self.closed:
                return None
            try:
                fn(*args, **kwargs)
            except Exception as exc:
                self._fail(exc)
            return None
        return hook

    def _fail(self, exc: BaseException) -> None:
        """Recording must never take training down: warn once, stop recording (strict: raise)."""
        if self.options.get("strict"):
            raise exc
        if not self._failed:
            self._failed = True
            warnings.warn(f"ampwatch stopped recording {str(getattr(self, 'path', ''))!r}: "
                          f"{type(exc).__name__}: {exc}. Training continues.", RuntimeWarning, stacklevel=3)
        if self.localizer is not None:
            self.localizer.remove()

    def on_clip(self, parameters: Any, max_norm: Any) -> None:
        """clipwatch: a clip call on (some of) our parameters; remember its threshold. No sync."""
        self._guarded(self._on_clip)(parameters, max_norm)  # inside the user's clip call: never raises

    def _on_clip(self, parameters: Any, max_norm: Any) -> None:
        first = parameters if isinstance(parameters, torch.Tensor) else next(iter(parameters), None)
        if id(first) not in self._param_index:
            return  # another model's clip
        if isinstance(max_norm, torch.Tensor):
            if not probes.reads_are_free(max_norm.device):
                return  # reading it would sync; the dashboard falls back to the config keys
            max_norm = max_norm.item()
        if not isinstance(max_norm, (int, float)) or max_norm == self._max_norm:
            return
        max_norm = float(max_norm)
        if self._max_norm is not None:
            self.writer.put_notice(self.step, "clip-threshold-changed",
                                   f"clip_grad_norm_ max_norm changed from {self._max_norm:g} to {max_norm:g}")
        self._max_norm = max_norm
        self.writer.put_info(clip_max_norm=max_norm)

    # -- per-step state -------------------------------------------------------------------------
    def _new_step(self, now: float) -> None:
        self._losses: list[torch.Tensor] = []         # what scaler.scale() saw
        self._logged_losses: list[torch.Tensor] = []  # watch.log(loss=...): wins over the above
        self._scale_calls = 0
        self._backwards = 0
        self._norms: Optional[torch.Tensor] = None
        self._norms_at_backward = False
        self._norm_ids: list[int] = []
        self._detail: Optional[torch.Tensor] = None
        self._detail_ids: list[int] = []
        self._stepped = False
        self._scaler_stepped = False
        self._metrics: dict[str, Any] = {}
        self._step_started = getattr(self, "_step_ended", now)
        self._step_ended = now

    def _on_first_forward(self, module: Any, args: Any) -> None:
        if self._amp_seen:
            return
        kind = self._device.type
        try:
            if torch.is_autocast_enabled(kind):
                self._amp_seen = True
                self.writer.put_info(amp_dtype=str(torch.get_autocast_dtype(kind)).replace("torch.", ""))
        except (TypeError, RuntimeError, AttributeError):
            self._amp_seen = True

    def _stop_looking_for_autocast(self) -> None:
        for handle in self._amp_handles:
            handle.remove()
        self._amp_handles = []

    def _on_backward(self) -> None:
        self._backwards += 1

    def _on_backward_end(self) -> None:
        """Measure gradients as backward leaves them: before any user clipping, with or without a
        scaler (dividing by the scale they carry). With accumulation the last micro-batch wins."""
        scaling = self.scaler is not None and probes.scaler_enabled(self.scaler)
        if scaling and probes.optimizer_stage_unscaled(self.scaler, self.optimizer):
            return  # backward after unscale_ (unusual): leave it to the step-time measurement
        scale = probes.scale_tensor(self.scaler) if scaling else None
        if scaling and scale is None:
            return
        self._norms = self._detail = None
        self._measure_grads(inv_scale=None if scale is None else _inverse(scale))
        self._norms_at_backward = True

    def _measure_grads(self, inv_scale: Optional[torch.Tensor] = None) -> None:
        """Per-parameter grad norms (one foreach call), and detail on layer/bad steps. No sync,
        except that on CPU the norms are read for free to decide whether detail is needed."""
        if self._norms is not None:
            return
        ids = [i for i, p in enumerate(self._params) if p.grad is not None]
        grads = [self._params[i].grad for i in ids]
        norms = probes.tensor_norms(grads, self._device)
        if inv_scale is not None:
            norms = norms * inv_scale
        self._norms, self._norm_ids = norms, ids
        known_finite = None
        if probes.reads_are_free(norms.device):
            known_finite = torch.isfinite(norms).tolist()
        if self.step % self.options["layer_every"] == 0 or (known_finite and not all(known_finite)):
            self._measure_detail(known_finite, inv_scale)

    def _measure_detail(self, known_finite: Optional[list], inv_scale: Optional[torch.Tensor] = None) -> None:
        if self._detail is not None or not self._norm_ids:
            return
        params = [self._params[i] for i in self._norm_ids]
        detail = probes.tensor_details([p.grad for p in params], params, self._device,
                                       self._pack_dtype, known_finite)
        if inv_scale is not None:
            detail[:, 0] *= inv_scale
        self._detail, self._detail_ids = detail, list(self._norm_ids)

    # -- scaler wrappers (original first argument; user errors propagate untouched) -------------
    def _scaler_scale(self, original: Any, outputs: Any) -> Any:
        if isinstance(outputs, torch.Tensor) and not (self._failed or self.closed):
            self._losses.append(outputs.detach())
            self._scale_calls += 1
        return original(outputs)

    def _scaler_unscale_(self, original: Any, optimizer: Any) -> None:
        original(optimizer)
        if optimizer is self.optimizer:
            if self._inside_scaler_step:  # the user did not call unscale_ first
                self._guarded(self._check_clip_before_unscale)()
            self._guarded(self._measure_grads)()

    def _scaler_step(self, original: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        ours = optimizer is self.optimizer and not (self._failed or self.closed)
        if ours:
            self._guarded(self._before_scaler_step)()
        self._inside_scaler_step = ours
        try:
            result = original(optimizer, *args, **kwargs)
        finally:
            self._inside_scaler_step = False
        if ours:
            self._guarded(self._after_scaler_step)()
        return result

    def _check_clip_before_unscale(self) -> None:
        """Notice (once per run) gradients that shrank between backward and scaler.step's own unscale_:
        clip_grad_norm_ on still-scaled gradients, which clips scale-times too hard."""
        if (self._clip_noticed or not self._norms_at_backward or self._norms is None
                or self.step % self.options["layer_every"]):
            return
        grads = [self._params[i].grad for i in self._norm_ids]
        if any(g is None for g in grads):
            return
        # Two host reads, on layer_every steps only: scaler.step syncs on found_inf right after anyway.
        before = float(self._norms.double().norm())
        after = float(probes.tensor_norms(grads, self._device).double().norm())
        if math.isfinite(before) and math.isfinite(after) and after < 0.99 * before:
            self._clip_noticed = True
            self.writer.put_notice(self.step, "clip-before-unscale",
                                   f"gradients shrank {before / after:.3g}x between backward and scaler.step "
                                   f"without scaler.unscale_: clipped while still scaled?")

    def _scaler_update(self, original: Any, new_scale: Any = None) -> None:
        scale = found = None
        if not (self._failed or self.closed) and probes.scaler_enabled(self.scaler):
            scale = probes.scale_tensor(self.scaler)       # the scale this step's grads carried
            found = probes.found_inf(self.scaler, self.optimizer)
        original(new_scale)
        if self._scaler_stepped:
            self._guarded(self._end_step)(scale, found)

    def _before_scaler_step(self) -> None:
        if self._scaler_stepped:  # step() twice without update(): close the previous step ourselves
            self.writer.put_notice(self.step, "step-without-update",
                                   "scaler.step() was called again before scaler.update()")
            self._end_step(None, None)
        self._scaler_stepped = True
        if (self._fused and probes.scaler_enabled(self.scaler)
                and not probes.optimizer_stage_unscaled(self.scaler, self.optimizer)):
            # Fused kernels unscale internally: our grads are still scaled, so divide the norms.
            scale = probes.scale_tensor(self.scaler)
            if scale is not None:
                self._measure_grads(inv_scale=_inverse(scale))

    def _after_scaler_step(self) -> None:
        skipped = probes.scaler_enabled(self.scaler) and not self._fused and not self._stepped
        if skipped:  # known without a sync: GradScaler did not call optimizer.step()
            self._measure_grads()
            self._measure_detail(None)
        self._fp32_check(bool(skipped))

    def _fp32_check(self, skipped: bool) -> None:
        """The fp32 recompute of a forward origin (counterfactual.py), before weights change."""
        if self.localizer is not None and self.localizer.keeper is not None:
            from .counterfactual import check_step
            check_step(self.localizer, skipped)

    # -- optimizer hooks --------------------------------------------------------------------------
    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._stepped = True
        self._measure_grads()
        self._fp32_check(False)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.scaler is None:
            self._end_step(None, None)

    # -- step end -----------------------------------------------------------------------------------
    def _end_step(self, scale: Optional[torch.Tensor], found: Optional[torch.Tensor]) -> None:
        now = time.time()
        segments: list[tuple[str, torch.Tensor]] = []
        dt, dev = self._pack_dtype, self._device
        loss = self._step_loss()
        if loss is not None:
            segments.append(("loss", loss.reshape(1)))
        if scale is not None:
            segments.append(("scale", scale.reshape(1)))
        if found is not None and self._fused:
            segments.append(("found_inf", found.reshape(1)))
        if self._norms is not None:
            segments.append(("norms", self._norms))
        if self._detail is not None:
            segments.append(("detail", self._detail.reshape(-1)))
        host_metrics = {}
        for key, value in self._metrics.items():
            if isinstance(value, torch.Tensor):
                segments.append((f"metric:{key}", value.detach().float().reshape(-1)[:1]))
            else:
                host_metrics[key] = float(value)
        loc = self.localizer.take() if self.localizer is not None else None
        if self.localizer is not None and self.localizer.keeper is not None:
            self.localizer.keeper.clear()  # the step's kept inputs are released here
        if loc is not None and loc.device_stats:
            segments.append(("loc", torch.cat(loc.device_stats)))
        layout, offset = {}, 0
        for key, t in segments:
            layout[key] = (offset, t.numel())
            offset += t.numel()
        flat = torch.cat([t.to(dev, dt) for _, t in segments]) if segments else None
        ready = None
        if flat is not None and flat.device.type == "cuda":
            flat = flat.to("cpu", non_blocking=True)  # the step's one transfer, not waited on here
            ready = torch.cuda.Event()
            ready.record()
        elif flat is not None and flat.device.type != "cpu":
            flat = flat.cpu()  # sync point: other accelerators have no event API we rely on
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer.param_groups else None
        self.writer.put_step(StepPack(
            step=self.step, time=now, duration_s=now - self._step_ended, lr=None if lr is None else float(lr),
            micro_batches=max(self._backwards, self._scale_calls),
            skipped=None if (self._fused or scale is None) else not self._stepped,
            flat=flat, ready=ready, layout=layout, host_metrics=host_metrics,
            norm_ids=self._norm_ids, detail_ids=self._detail_ids, param_numel=self._param_numel, loc=loc))
        if self.writer.failure is not None:
            raise RuntimeError(f"writer failed: {self.writer.failure}")
        if self.step == 0:
            self._stop_looking_for_autocast()
        self.step += 1
        self._new_step(now)

    def _step_loss(self) -> Optional[torch.Tensor]:
        """The loss a user means (issue 13): the mean of what ``watch.log(loss=...)`` got, else the
        SUM of what ``scaler.scale()`` got over the step's micro-batches, i.e. the objective whose
        gradient the step applies (with nanoGPT's ``loss / k`` that is the mean micro-batch loss)."""
        dev = self._device
        if self._logged_losses:
            if not self._loss_logged and self.scaler is not None:
                self._loss_logged = True
                self.writer.put_info(loss_definition="logged-mean")
            return torch.stack([l.float().mean().to(dev) for l in self._logged_losses]).mean()
        if self._losses:
            return torch.stack([l.float().mean().to(dev) for l in self._losses]).sum()
        return None

    # -- public API -----------------------------------------------------------------------------------
    def log(self, **scalars: Any) -> None:
        """Record extra scalars for the current step (tensors are not read here: no sync).

        Without a scaler, ``watch.log(loss=loss)`` is how the loss arrives. With one, the step's loss
        is the sum of what ``scaler.scale()`` saw over its micro-batches (with ``loss / k`` for
        accumulation: the mean micro-batch loss); logged losses replace it (their mean).
        """
        if self._failed or self.closed:
            return
        for key, value in scalars.items():
            if key == "loss" and isinstance(value, (torch.Tensor, float, int)):
                self._logged_losses.append(value.detach() if isinstance(value, torch.Tensor)
                                           else torch.tensor(float(value), device=self._device))
            else:
                self._metrics[key] = value

    def close(self, *, status: str = "finished", error: Optional[str] = None) -> None:
        """Flush, mark the run ended and remove every hook and patch. Idempotent."""
        if self.closed:
            return
        self.closed = True
        _open_watches.discard(self)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        clipwatch.stop(self)
        if self._trigger is not None:
            self._trigger.remove()
        for method, previous in self._patched.items():
            if self.scaler.__dict__.get(method) is not self._wrappers.get(method):
                # another watch wrapped ours: unlinking would drop its wrapper. Ours stays in its
                # chain as a pass-through (every wrapper checks self.closed).
                continue
            if previous is _MISSING:
                self.scaler.__dict__.pop(method, None)
            else:
                setattr(self.scaler, method, previous)
        self._patched.clear()
        self._wrappers.clear()
        if self.localizer is not None:
            self.localizer.remove()
        writer = getattr(self, "writer", None)
        if writer is not None:
            writer.close(status, error)
            if writer.failure is not None and not self._failed:
                self._fail(writer.failure)

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.close(status="crashed", error="".join(traceback.format_exception(exc_type, exc, tb)))

    def __repr__(self) -> str:
        return f"<ampwatch.Watch {self.name!r} step={self.step} path={str(self.path)!r}>"


_open_watches: "weakref.WeakSet[Watch]" = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    crashed = getattr(sys, "last_value", None)
    for watch in list(_open_watches):
        if crashed is not None:
            error = "".join(traceback.format_exception(type(crashed), crashed, crashed.__traceback__))
            watch.close(status="crashed", error=error)
        else:
            watch.close()
