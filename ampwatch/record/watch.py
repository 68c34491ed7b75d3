"""Watch: attaches to an unchanged training loop and records every optimizer step.

The step is learned from the scaler's own calls (:mod:`.scaler`) and from optimizer step hooks;
nothing is asked of the loop. Gradients are measured by :mod:`.grads`, modules observed by
:mod:`.observe`, and the step is handed over as one flat byte tensor (one transfer) by
:mod:`.step`; the writer thread does the rest.
"""
from __future__ import annotations

import atexit
import json
import math
import numbers
import logging
import operator
import sys
import time
import traceback
import warnings
import weakref
from typing import Any, Callable, Optional

import torch

from . import clipping, torch_access

from .backward import BackwardEnd
from .compiled import uncompiled
from .recompute import check_step
from .runinfo import describe_run, module_aliases, parameter_table, resolve_path, steps_taken, tied_owners
from .options import resolve
from ..store.rows import Rows
from ..store.writer import RunWriter
from .grads import GradMeter
from .memory import memory_sampler
from . import copies, deferred, fp8, kernelskip, keptweights, replay, unfinished
from .batches import BatchSaver, RootInputs, bad_losses
from .observe import ModuleObserver, never_a_frame_of_its_own
from .scaler import ScalerHooks
from .skipflag import EarlyFlag
from .step import StepScalars, StepState, pack_scalars, pack_step

log = logging.getLogger("ampwatch")
if not log.handlers:  # say once where the run goes, even when the user configured no logging
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("ampwatch: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """Accelerate/Lightning wrap the optimizer; GradScaler is handed the inner one, so hook that."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"ampwatch.attach: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


_GRAD = operator.attrgetter("grad")


class Watch:
    """A recording in progress. Use :func:`ampwatch.attach` to make one; close it (or use ``with``)."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, scaler: Any = None, *,
                 path: Optional[str] = None, name: Optional[str] = None,
                 config: Optional[dict] = None, open_mirror: Optional[Callable] = None, **options: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ampwatch.attach: model must be a torch.nn.Module, got {type(model).__name__}")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"ampwatch.attach: config must be a dict, got {type(config).__name__}")
        self._open_mirror = open_mirror  # how to reach a tracker: given by ampwatch.attach (a face)
        self.options = resolve(options)
        self.model, self.optimizer, self.scaler = model, _unwrap_optimizer(optimizer), scaler
        # whether the scaler scales (GradScaler(enabled=False) does not): asked again once a step,
        # at its end, not at each of the ~7 places a step needs it (two frames each)
        self._scaling = torch_access.scaler_enabled(scaler)
        self.closed = False
        self._failed = False
        self._bad_log_keys: set[str] = set()  # watch.log keys already warned about
        self._handles: list[Any] = []
        self._copy_safe: list[Any] = []  # modules whose copies leave our hooks out (copies.py)
        self._amp_seen = False             # autocast dtype recorded (looked for during step 0 only)
        self._max_norm: Optional[float] = None  # clip_grad_norm_'s max_norm, as last seen (clipwatch)
        # the user's clip_grad_norm_ measured every gradient's norm last step: take its norms this
        # step instead of measuring at backward end (clipping.py); once they do not fit, never again
        self._clip_norms_expected = False
        self._clip_norms_taken = False
        self._clip_norms_refused = False
        self._other_clip = False  # the clip being heard is over another model's parameters (_on_clip)
        self._loss_logged = False          # a watch.log(loss=...) decided this run's loss definition
        self._trigger: Optional[BackwardEnd] = None
        self._probes: list[Any] = []         # the autocast probes' handles (step 0 only, in eager)
        self._probe_objects: list[_AutocastProbe] = []
        self._params, names = parameter_table(model, self.optimizer)
        self._param_numel = {i: torch_access.local(p).numel() for i, p in enumerate(self._params)}  # this rank's
        self._param_index = {id(p): i for i, p in enumerate(self._params)}
        self._device = self._params[0].device if self._params else torch.device("cpu")
        self._device_kind = self._device.type  # a str made anew at each read of .type (~3k instructions)
        self._pack_dtype = torch_access.pack_dtype(self._device)
        self._reads_free = torch_access.reads_are_free(self._device)  # fixed for the run: asked once
        # a gradient has its parameter's dtype, device and tensor type: which parameters' norms fit
        self._clip_order: Optional[list] = None  # see _clip_gradient_ids
        self._clip_ids: list = []
        self._clip_norms_fit = frozenset(i for i, p in enumerate(self._params)
                                         if type(p) in (torch.nn.Parameter, torch.Tensor)
                                         and p.dtype is torch.float32 and p.device == self._device)
        self._scale_reads = torch_access.ScaleReads()  # the scale as a float, read again only when it changed
        self._fused = torch_access.steps_inside_kernel(self.optimizer)
        self._fused_inv_scale: Any = None  # a fused step's 1/scale, for the detail of a skipped step
        self._fused_found: Optional[torch.Tensor] = None  # this step's summed inf flags, once read
        self._skip_flag = EarlyFlag()  # a fused step's inf flag, on its way to the host (skipflag.py)
        self._held: Optional[deferred.HeldStep] = None  # a fused step not settled yet (deferred.py)
        self._hold_step = False  # the step now ending is to be held
        self._kept_weights: Optional[keptweights.KeptWeights] = None  # without a scaler: a held step's weights
        self._hold_weights: Optional[keptweights.KeptWeights] = None  # the step now ending keeps them
        self._noted: set[str] = set()  # notices a run gets once (_note_once): why its steps wait
        self._early_scalars: Optional[StepScalars] = None  # without a scaler: packed for the check (_replay_if_bad)
        self._kernel_skip: Optional[kernelskip.KernelSkip] = None  # that check, handed to a fused optimizer
        self._reapplying = False  # a bad step's update applied again (kernelskip.py): our hooks stand aside
        self.grads = GradMeter(self._params, self._device, self._pack_dtype)
        self.state = StepState(time.time())
        self.step = self._first_step = self.options["first_step"]  # a resumed run goes on numbering
        self.observer: Optional[ModuleObserver] = None
        self.replayer: Optional[replay.Replayer] = None
        self._batch_saver = BatchSaver() if self.options["save_batches"] else None
        self._root_inputs: Optional[RootInputs] = None  # where no replay keeps a step's inputs
        self._observed_inputs: list = []  # an observed step's latest micro-batch, past the replay's release
        self.fp8: Optional[fp8.Fp8Recorder] = None
        self._scaler_hooks = ScalerHooks(self, scaler) if scaler is not None else None
        info = describe_run(model, self.optimizer, scaler, name, config, self.options, self._params)
        info["loss_definition"] = "scaled-sum" if scaler is not None else "logged-mean"
        fp8_layers = fp8.find_layers(uncompiled(model))
        if fp8_layers:  # an fp8 run: amp_dtype says float8, not the autocast dtype of its other ops
            info.update(fp8.describe(fp8_layers))
            self._amp_seen = True
        self._place(path, info)
        try:
            self._open_writer(info, names)
        except Exception as exc:  # unwritable directory, full disk: training goes on unrecorded
            self._fail(exc)
            return
        self._install()
        if "first_step" not in options:
            self._note_resumed_from_zero()
        if self.replayer is not None and not self._detail_step():  # a resumed run's first step
            self.observer.set_observing(False)  # is observed only where its number says so
        self._watch_fp8(fp8_layers)
        _open_watches.add(self)

    def _note_resumed_from_zero(self) -> None:
        """An optimizer that already made updates (a loaded checkpoint) and no first_step: the
        run's rows start at 0 where the loop's own count does not. Said once, in the run."""
        taken = steps_taken(self.optimizer)
        if taken > 0:
            self.writer.put_notice(self.step, "resume-numbered-from-0",
                                   f"the optimizer had made {taken:,} updates before ampwatch attached (its "
                                   f"state's step count), and this run is numbered from step 0: a run resumed "
                                   f"from a checkpoint passes first_step=<the step it resumes at>")

    def _place(self, path: Optional[str], info: dict) -> None:
        """Where the run goes (an explicit existing path is refused unless overwrite=True) and its name."""
        # a framework callback's resumed run: its script names the file the run before it wrote
        resumed_by = self.options["framework"] if self._first_step > 0 else None
        self.path, note = resolve_path(path, info["name"], info["rank"], info["world_size"],
                                       self.options["overwrite"], resumed_by)
        if note:
            log.info("%s", note)
        info["name"] = info["name"] or self.path.stem
        self.name = info["name"]

    @property
    def localizer(self) -> Optional[ModuleObserver]:  # the old name, kept for callers
        return self.observer

    # -- setup ----------------------------------------------------------------------------------
    def _open_writer(self, info: dict, names: list[dict]) -> None:
        from ..store.writer import create_run_file
        from .packing import PackReader
        module_names: list[str] = []
        if self.options["localize"]:
            self.observer = ModuleObserver(uncompiled(self.model), self._device)
            self.observer.on_error = self._fail
            module_names = self.observer.names
            if self.options["fp32_check"]:
                from .recompute import InputKeeper
                self.observer.keeper = InputKeeper(self.observer)
            if self.options["replay"] and replay.possible(uncompiled(self.model), self._params, self.scaler,
                                                          self._reads_free):
                self.replayer = replay.Replayer(uncompiled(self.model), self._device)
                if self.observer.keeper is not None:  # inputs kept in replays only (recompute.py)
                    self.observer.keeper.replayer = self.replayer
            else:
                self._keep_root_inputs()
        shared = module_aliases(uncompiled(self.model)) if module_names else {}
        tensors = list(names) + [
            {"id": len(names) + i, "kind": "module", "name": n, "type": t,
             "aliases": json.dumps(shared[n]) if n in shared else None}
            for i, (n, t) in enumerate(zip(module_names, self.observer.types if self.observer else []))
        ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        create_run_file(str(self.path), info, tensors)
        tied = tied_owners(uncompiled(self.model), self._params, module_names) if module_names else {}
        checked = frozenset(self._param_index[id(p)] for group in self.optimizer.param_groups
                            for p in group["params"] if id(p) in self._param_index) if self.scaler is not None else frozenset()
        packs = PackReader([n["name"] for n in names], [n["type"] for n in names],
                           [len(names) + i for i in range(len(module_names))], module_names,
                           self.options["layer_every"], tied, scaler_checked=checked)
        packs.batch_saver = self._batch_saver  # the module values decide an observed step's inputs there
        mirror = None
        if self.options["mirror"] is not None and self._open_mirror is not None:
            # the tracker is fed from the writer thread; the faces hand us how to open it
            mirror = self._open_mirror(self.options["mirror"], packs.param_names, packs.module_ids,
                                 self.observer.types if self.observer else [], str(self.path))
        self.writer = RunWriter(str(self.path), packs.rows, self.options["flush_every_s"], on_commit=mirror,
                                sample=memory_sampler(self._device))
        log.info("recording to %s", self.path)

    def _keep_root_inputs(self) -> None:
        """Keep each micro-batch's root arguments until the step ends, for a bad step's saved inputs
        (batches.py): where modules are observed on every step, so no replay keeps them."""
        if self._batch_saver is not None and self._root_inputs is None:
            self._root_inputs = RootInputs(uncompiled(self.model), keep_all=self._reads_free)

    def _save_inputs(self, calls: list) -> None:
        """Write ``calls`` (micro-batch, args, kwargs) of this step to the ``batches`` table. A
        failure here loses the saved inputs only, never the step or the recording."""
        if not calls or self._batch_saver is None or self._batch_saver.full:
            return
        try:
            rows = self._batch_saver.rows(self.step, calls)
        except Exception as exc:  # an input that cannot be copied to the host
            self.writer.put_notice(self.step, "batch-not-saved", f"the inputs of step {self.step} were not saved: "
                                   f"{type(exc).__name__}: {exc}")
            return
        if rows:
            self.writer.put_rows(Rows(batches=rows))

    def _save_bad_live_inputs(self, in_progress: bool = False, crashed: bool = False, loss_bad: bool = False
                              ) -> Optional[list]:
        """The step ends (or the run closes mid-step, ``in_progress``): when its loss is non-finite,
        save the micro-batches whose loss was. The losses are read where reads are free, on a step
        the scaler skipped (the host knows already) and at close; a healthy step reads nothing
        (``loss_bad``: the step's loss, read for the pack where reads are free, is not finite). A
        run that ``crashed`` mid-step saves every micro-batch the step ran: a loop that raises on
        the NaN loss it saw raises before the scaler sees it, and any crash is reproduced from them.
        Returns the kept micro-batches where the host cannot tell without a read (a step the scaler
        did not skip, on an accelerator): the step's module values may tell, at the writer
        (``packing.PackReader``)."""
        kept = self._root_inputs.calls if self._root_inputs is not None else \
            [(i, b.args, b.kwargs) for i, b in enumerate(self.replayer.batches)] if self.replayer is not None else []
        kept = kept or self._observed_inputs
        if not kept or self._batch_saver is None or self._batch_saver.full:
            return None
        if in_progress and crashed:
            self._save_inputs(kept)
            return None
        skipped = self._scaling and not self._fused and self.state.scaler_stepped and not self.state.stepped
        if not (in_progress or skipped or loss_bad or (self._reads_free and self.grads.known_bad())):
            return None if self._reads_free else kept
        losses = self.state.logged_losses or self.state.losses
        bad = bad_losses(losses)
        if bad is None and not self._scaling and self._reads_free and self.grads.known_bad():
            # no loss to tell (no scaler, none logged) and non-finite gradients, which no scale made:
            # every micro-batch kept, as with one loss logged for the step
            bad, losses = [0], [None]
        if not bad:
            return None
        # a loss per forward: the micro-batches whose loss went bad; else (one loss logged for the
        # step) every micro-batch kept
        calls = self._root_inputs.count if self._root_inputs is not None else len(kept)
        picked = set(bad) if len(losses) == calls else None
        self._save_inputs([call for call in kept if picked is None or call[0] in picked])
        return None

    def _install(self) -> None:
        opt, model = self.optimizer, uncompiled(self.model)
        self._copy_safe = copies.leave_out_of_copies(model.modules())
        self._handles.append(opt.register_step_pre_hook(self.guarded(self._before_optimizer_step)))
        # not guarded, and before the step's end: an update the kernel skipped is applied again even
        # if recording stopped meanwhile; and first, before the loop's own post-hooks see the weights
        settle = opt.register_step_post_hook(self._settle_kernel_skip)
        torch_access.run_hook_first(opt, settle)
        self._handles.append(settle)
        self._handles.append(opt.register_step_post_hook(self.guarded(self._after_optimizer_step)))
        # autocast may be entered inside the model's forward (Accelerate wraps model.forward), so
        # the children look too. They are a no-op after the first step: removed then, unless Dynamo
        # traced them (removing a hook would make torch.compile recompile the model). A model handed
        # over compiled gets the root's alone: traced, a probe returns at once and learns nothing,
        # and each child's would cost its guards on every call (~8 us on GPT-2 small's tree)
        looking = (model,) if uncompiled(self.model) is not self.model else (model, *model.children())
        probes_ = [copies.ours(_AutocastProbe(self, root=i == 0)) for i in range(len(looking))]
        self._probes = [m.register_forward_pre_hook(probe) for m, probe in zip(looking, probes_)]
        self._probe_objects = probes_
        self._trigger = BackwardEnd(model, self._params, self.guarded(self._on_backward),
                                    self.guarded(self._on_backward_end),
                                    self.replayer.outputs if self.replayer is not None else None)
        if self._scaler_hooks is not None:
            self._scaler_hooks.install()
        clipping.listen(self)

    def _watch_fp8(self, layers: list) -> None:
        if not layers:
            return
        if uncompiled(self.model) is not self.model:  # hooks added per step would recompile the model
            self.writer.put_notice(self.step, "fp8-not-measured", "the model is compiled: its fp8 casts are not "
                                   "measured (attach to the model before torch.compile to measure them)")
            return
        self.fp8 = fp8.Fp8Recorder(layers, self.guarded)
        if self._detail_step():
            self.fp8.arm()

    def guarded(self, fn: Any) -> Any:
        """``fn`` made safe for training: an internal failure warns once and stops recording."""
        def hook(*args: Any, **kwargs: Any) -> Any:
            if self._failed or self.closed:
                return None
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                self._fail(exc)
            return None
        return hook

    def call_guarded(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` as :meth:`guarded` would run it, without making a closure per call."""
        if self._failed or self.closed:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            self._fail(exc)
        return None

    def _fail(self, exc: BaseException) -> None:
        """Recording must never take training down: warn once, stop recording (strict: raise)."""
        if self.options.get("strict"):
            raise exc
        if not self._failed:
            self._failed = True
            warnings.warn(f"ampwatch stopped recording {str(getattr(self, 'path', ''))!r}: "
                          f"{type(exc).__name__}: {exc}. Training continues.", RuntimeWarning, stacklevel=3)
            writer = getattr(self, "writer", None)
            if writer is not None and writer.failure is None and not self.closed:  # the file says so too
                writer.put_notice(self.step, "recording-stopped",
                                  f"ampwatch stopped recording at step {self.step} ({type(exc).__name__}: {exc}): "
                                  f"later steps are not in this file")
        if self.observer is not None:
            self.observer.remove()
        if self.replayer is not None:
            self.replayer.remove()
        if self._root_inputs is not None:
            self._root_inputs.remove()
        self._observed_inputs = []
        if self.fp8 is not None:
            self.fp8.disarm()
        # nothing held is settled any more: a kept copy of the weights goes now, not with the watch
        self._held = self._kept_weights = self._hold_weights = None

    def _detail_step(self) -> bool:
        return self.step % self.options["layer_every"] == 0

    def on_autocast(self) -> None:
        if self._amp_seen or self.step != self._first_step or self._failed or self.closed:
            return
        kind = self._device_kind
        try:
            if torch.is_autocast_enabled(kind):
                self._amp_seen = True
                self.writer.put_info(amp_dtype=str(torch.get_autocast_dtype(kind)).replace("torch.", ""))
        except (TypeError, RuntimeError, AttributeError):
            self._amp_seen = True

    def on_clip(self, parameters: Any, max_norm: Any) -> None:
        """clipwatch: a clip call on (some of) our parameters; remember its threshold. No sync."""
        if self._failed or self.closed:  # as call_guarded, without its frame: on every clip call
            return
        try:  # inside the user's clip call: never raises
            self._on_clip(parameters, max_norm)
        except Exception as exc:
            self._fail(exc)

    def _on_clip(self, parameters: Any, max_norm: Any) -> None:
        first = parameters if isinstance(parameters, torch.Tensor) else next(iter(parameters), None)
        # the norms this clip is about to compute (on_clip_norms) are another model's: not mapped
        self._other_clip = id(first) not in self._param_index
        if self._other_clip:
            return
        if isinstance(max_norm, torch.Tensor):
            if not torch_access.reads_are_free(max_norm.device):
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

    def on_clip_norms(self, tensors: list, norms: list, vector: Optional[torch.Tensor],
                      parameters: Optional[list] = None) -> None:
        """The per-gradient norms a clip computed (clipping.py; ``vector``: the same stacked, or
        None; ``parameters``: clip_grad_norm_'s parameter list, whose gradients ``tensors`` are, or
        None): this step's norms, if they are exactly ours (every gradient of ours, float32 plain
        tensors on our device). No sync."""
        if self._failed or self.closed:  # as call_guarded, without its frame: on every clipped step
            return
        try:
            self._on_clip_norms(tensors, norms, vector, parameters)
        except Exception as exc:
            self._fail(exc)

    def _on_clip_norms(self, tensors: list, norms: list, vector: Optional[torch.Tensor],
                       parameters: Optional[list] = None) -> None:
        if self._reads_free or self._clip_norms_refused or not tensors:
            return  # where reads are free the norms are read at backward end, to decide on detail
        order = self._clip_order  # the last clip's parameters, in its order, when it covered all of ours
        if order is not None and len(order) == len(tensors) and (
                # the clip's parameters are those, and each gave one gradient (as many as they):
                # the gradients are theirs, in order, without reading 148 .grad (~90k instructions)
                (type(parameters) is list and len(parameters) == len(order)
                 and all(map(operator.is_, parameters, order)))
                or all(map(operator.is_, tensors, map(_GRAD, order)))):
            ids = self._clip_ids  # the same parameters as last step: half the time of mapping them again
        elif self._other_clip:
            # another watched model's clip (every watch hears every clip): mapping its gradients
            # against ours cost ~50 us a step per other watch, to learn they are not ours
            return
        else:
            ids = self._clip_gradient_ids(tensors)
            if ids is None:
                return
        self._clip_norms_taken = True
        if self.grads.norms is not None:
            return  # measured at backward end (the first clipped step, or after a mismatch)
        inv_scale = None
        if self._scaling and not torch_access.optimizer_stage_unscaled(self.scaler, self.optimizer):
            # clipped before unscale_: the norms still carry the scale
            inv_scale = torch_access.inverse_scale(self.scaler, self._reads_free, self._scale_reads)
            if inv_scale is None:
                return
        self.grads.take(ids, vector if vector is not None else torch.stack(norms), self._detail_step(), inv_scale)

    def _clip_gradient_ids(self, tensors: list) -> Optional[list]:
        """Our parameter index of each clipped gradient, or None (refusing for good where the clip
        covers part of our gradients, or ones in another dtype, or sharded)."""
        where = {}
        for i, p in enumerate(self._params):  # each .grad read makes a Python object: once
            g = p.grad
            if g is not None:
                where[id(g)] = i
        ids = [where.get(id(t)) for t in tensors]
        if all(i is None for i in ids):
            return None  # another model's gradients, or not gradients at all
        if None in ids or len(ids) != len(where) or not self._clip_norms_fit.issuperset(ids):
            # a clip over part of the gradients, in another dtype, or sharded: measure them ourselves
            self._clip_norms_refused = True
            self._clip_norms_expected = False
            return None
        # every parameter of ours, each with a gradient: next step the same parameters in the same
        # order are checked by identity alone (a parameter without a gradient would break the match)
        full = len(ids) == len(self._params)
        self._clip_order = [self._params[i] for i in ids] if full else None
        self._clip_ids = ids
        return ids

    # -- backward ---------------------------------------------------------------------------------
    def _on_backward(self) -> None:  # BackwardEnd: a backward pass reached the model (once per pass)
        self.state.backwards += 1

    def _on_backward_end(self) -> None:
        """Measure gradients as backward leaves them: before any user clipping, with or without a
        scaler (dividing by the scale they carry). With accumulation the last micro-batch wins."""
        if self._clip_norms_expected:
            self.grads.reset()  # the user's clip measures them before the step: taken from it
            return
        scaling = self._scaling
        if scaling and torch_access.optimizer_stage_unscaled(self.scaler, self.optimizer):
            return  # backward after unscale_ (unusual): leave it to the step-time measurement
        inv_scale = torch_access.inverse_scale(self.scaler, self._reads_free, self._scale_reads) if scaling else None
        if scaling and inv_scale is None:
            return
        detail = self._detail_step()
        self.grads.reset()
        self.grads.measure(detail, inv_scale)
        self.grads.at_backward = True
        if self.observer is not None and self._reads_free:
            self.observer.backward_done(detail or self.grads.known_bad() or self._loss_bad())

    def _loss_bad(self) -> bool:
        """Where reads are free: whether this micro-batch's loss (as scaled or logged) is non-finite."""
        losses = self.state.logged_losses or self.state.losses
        if not losses:
            return False
        loss = losses[-1]
        if loss.numel() == 1:
            return not math.isfinite(loss.item())
        return not bool(torch.isfinite(loss).all())

    # -- scaler moments (called by ScalerHooks) ---------------------------------------------------------
    def on_scale(self, outputs: torch.Tensor) -> None:
        self.state.losses.append(outputs.detach())
        self.state.scale_calls += 1

    def on_unscaled(self, inside_step: bool) -> None:
        if not inside_step:
            self._start_skip_flag()
        # the user did not unscale_ first. Checked on every layer_every step (two host reads, right
        # before scaler.step syncs anyway), a notice on each that shows it: the doctor tells a loop
        # that always clips scaled gradients from one that did it once
        if inside_step and self._detail_step():
            shrank = self.grads.shrank()
            if shrank is not None:
                self.writer.put_notice(self.step, "clip-before-unscale",
                                       f"gradients shrank {shrank[0] / shrank[1]:.3g}x between backward and "
                                       f"scaler.step without scaler.unscale_ at step {self.step}: clipped while "
                                       f"still scaled?")
        if not inside_step and self._clip_norms_expected:
            return  # the user's unscale_ before their clip: the clip measures the norms next
        self.grads.measure(self._detail_step())

    def before_scaler_step(self) -> None:
        if self.state.scaler_stepped:  # step() twice without update(): close the previous step ourselves
            self.writer.put_notice(self.step, "step-without-update",
                                   "scaler.step() was called again before scaler.update()")
            self.end_step()
        self.state.scaler_stepped = True
        self._fused_inv_scale = self._fused_found = None
        if (self._fused and self._scaling
                and not torch_access.optimizer_stage_unscaled(self.scaler, self.optimizer)):
            # Fused kernels unscale internally: our grads are still scaled, so divide the norms.
            inv_scale = torch_access.inverse_scale(self.scaler, self._reads_free, self._scale_reads)
            if inv_scale is not None:
                self._fused_inv_scale = inv_scale
                self.grads.measure(self._detail_step(), inv_scale=inv_scale)

    def _replays_fused_skips(self) -> bool:
        return self._fused and self.replayer is not None and not self.observer.observing

    def _start_skip_flag(self) -> None:
        """Where a fused step's inf flag is made (unscale_ returned, or the optimizer's step begins):
        send it to the host now, so that its read (after_scaler_step, or a step late: deferred.py)
        waits for it and not for the optimizer."""
        if self._scaling and not self._skip_flag.started and self._replays_fused_skips():
            flag = torch_access.found_inf(self.scaler, self.optimizer)
            if flag is not None:
                self._skip_flag.start(flag)

    def after_scaler_step(self) -> None:
        skipped = self._scaling and not self._fused and not self.state.stepped
        if self._replays_fused_skips():
            # the flag sent to the host where it was made (unscale_, or the optimizer's step) is
            # this step's: not looked up again
            started = self._skip_flag.found
            flag = self._fused_found = started if started is not None else \
                torch_access.found_inf(self.scaler, self.optimizer)
            if deferred.may_hold(self) and self._scaling:
                # read at the next step's optimizer step instead, where the device is long past it
                if not self._skip_flag.started and flag is not None:
                    self._skip_flag.start(flag)
                self._hold_step = self._skip_flag.started
                if self._hold_step:
                    self._fp32_check(False)
                    return
            # sync point, once per step before a layer_every step: a fused optimizer skips inside
            # its kernel, so only the scaler's inf flag tells the host (a non-fused GradScaler loop
            # pays this read in step()). It was sent where it was made: waiting for it leaves the
            # optimizer's kernel running
            bad = self._skip_flag.read()
            if bad is None and flag is not None:
                bad = bool(flag.item())
            if bad:
                self.grads.measure_detail(None, inv_scale=self._fused_inv_scale)
                self._replay()
            self._fp32_check(False)
            return
        if skipped:
            # known without a sync: GradScaler did not call optimizer.step(). A bad step: pay for counts.
            self.grads.measure(self._detail_step())
            self.grads.measure_detail(None)
            if self.replayer is not None and not self.observer.observing:
                self._replay()
        self._fp32_check(skipped)

    def _losses_finite(self) -> Optional[list[bool]]:
        """Per kept micro-batch of this step, whether its loss was finite (a read each: a step about
        to be replayed only); None where the losses do not match the micro-batches one to one (one
        loss logged for the step, ...), unless that one loss was finite: then all were."""
        losses = self.state.logged_losses or self.state.losses
        kept = len(self.replayer.batches) if self.replayer is not None else 0
        bad = bad_losses(losses)
        if bad is None or not kept:
            return None
        if len(losses) == kept:
            return [i not in bad for i in range(kept)]
        return [True] * kept if not bad else None

    def _replay(self, batches: Optional[list] = None, grads_out: Optional[list] = None) -> None:
        """Run the skipped step again with the module hooks on (replay.py), before update(). A replay
        that does not reproduce the skip (the model keeps Python state, the loss takes gradients
        from outside the model's outputs) says so once, and modules are observed live from then on.
        ``batches``, ``grads_out``: a held step's (deferred.py), see ``Replayer.replay``."""
        self._trigger.pause(True)
        self.observer.set_observing(True)
        # the replay ran on the same weights, inputs, RNG and autocast state: the doctor reads "came out finite"
        reproduced, why = False, ("it came out finite: state the model keeps in Python, a fault outside the "
                                  "model's outputs, or a transient fault")
        try:
            with self.observer.inside_compiled_blocks():
                reproduced = self.replayer.replay(self._params, batches, grads_out,
                                                  self._losses_finite() if batches is None else None)
        except replay.NotReplayable as exc:
            why = str(exc)
        except Exception as exc:  # a model that cannot run again this way (reentrant checkpointing
            why = f"{type(exc).__name__}: {exc}"  # refuses autograd.grad): observe it live instead
        finally:
            self._trigger.pause(False)
            if reproduced:
                self.observer.set_observing(False)
        if reproduced and self.replayer.loss_unclear:
            self.writer.put_notice(self.step, "replay-outputs-gone",
                                   "replayed on the same weights and inputs, the model's outputs came out finite "
                                   "and the gradient its loss handed them was not; the step's own outputs were "
                                   "gone (the loop did not hold them), so it is not known whether they were finite")
        unclear = self.replayer.loss_unclear if reproduced else []
        if reproduced and (self.replayer.forward_bad or self.replayer.loss_made or unclear):
            # its forward went bad, or its loss did on outputs that were finite (a NaN target): the
            # step's inputs, to run it again
            kept = batches if batches is not None else self.replayer.batches
            bad = sorted(set(self.replayer.forward_bad) | set(self.replayer.loss_made) | set(unclear))
            self._save_inputs([(i, kept[i].args, kept[i].kwargs) for i in bad if i < len(kept)])
        if not reproduced and self.replayer.norm_overflow:
            # reproduced as what it was: finite gradients whose float32 norm overflows
            # (PackReader._overflowed), nothing non-finite to localize and no transient fault
            self.observer.discard()
            self.observer.set_observing(False)
            return
        if not reproduced:
            self.observer.discard()  # the replay's values are not this step's
            self.replayer.remove()
            self.replayer = None
            if self.observer.keeper is not None:  # observed live from now on: inputs kept live too
                self.observer.keeper.replayer = None
            self._keep_root_inputs()
            self.writer.put_notice(self.step, "replay-not-reproduced",
                                   f"a replay of this skipped step did not reproduce it from the model's inputs "
                                   f"and output gradients ({why}), so it is not localized; module values are "
                                   f"measured on every step from now on")

    def _fp32_check(self, skipped: bool) -> None:
        """The fp32 recompute of a forward origin (counterfactual.py), before weights change."""
        if self.observer is not None and self.observer.keeper is not None:
            check_step(self.observer, skipped)

    def before_update(self) -> Optional[tuple]:
        """The step's scalars, packed now (``update()`` changes the scale in place): ``(scalars,)``
        for :meth:`end_step` once ``update()`` returned, or None when no step is open."""
        if not self.state.scaler_stepped:
            return None
        if not self._scaling:
            return (self._take_early_scalars(),)
        # the scale this step's grads carried, and with fused optimizers the inf flags: device
        # tensors, copied into the pack by its one cat, no sync
        found = None
        if self._fused:  # summed once a step: after_scaler_step may have summed it already
            found = self._fused_found if self._fused_found is not None else \
                torch_access.found_inf(self.scaler, self.optimizer)
            self._fused_found = None
        scale = self._scale_reads.value(self.scaler) if self._reads_free else torch_access.live_scale(self.scaler)
        return (pack_scalars(self, scale, found),)

    # -- optimizer hooks --------------------------------------------------------------------------
    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._reapplying:
            return
        if self._kernel_skip is not None:  # an earlier step() raised before its post-hooks ran
            self._kernel_skip.withdraw()
            self._kernel_skip = None
        if self._held is not None and (self._held.weights is None or not self.observer.observing):
            # before this step changes a weight: a skipped one is replayed (one whose weights are
            # kept waits for the end of an observed step, so that its replay mixes with nothing)
            deferred.settle(self)
        self.state.stepped = True
        if self._fused:  # the scaler checked the gradients: the flag is made (no unscale_ before)
            self._start_skip_flag()
        self._early_scalars = None
        if self.observer is not None:  # a backward's pending gradients, out of the optimizer's peak
            self.observer.flush_pending()
        self.grads.measure(self._detail_step())
        if self.replayer is not None and not self.observer.observing and not self._scaling:
            # torch hands the hooks step()'s arguments with the optimizer first; Accelerate passes
            # closure=None
            self._replay_if_bad(optimizer, all(v is None for v in kwargs.values())
                                and all(a is optimizer or a is None for a in args))
        self._fp32_check(False)
        if (self.replayer is not None and (not self._fused or self.observer.observing)
                and self._hold_weights is None):
            # this step's update is about to happen, so it will not be replayed: its kept inputs
            # and output gradients (a large vocabulary's logits gradient) go now, not at the step's
            # end, and stay out of the optimizer's peak. A fused optimizer may still skip inside
            # its kernel: its step keeps them, unless it is observed live (then never replayed)
            if self.observer.observing and self.replayer.batches and self._batch_saver is not None:
                # observed live: its module values say at the writer whether its forward went bad
                # (the latest micro-batch only, its arguments only: nothing the loop had freed)
                b = self.replayer.batches[-1]
                self._observed_inputs = [(len(self.replayer.batches) - 1, b.args, b.kwargs)]
            self.replayer.release()

    def _replay_if_bad(self, optimizer: Any, plain_call: bool = True) -> None:
        """Without a GradScaler nothing skips a bad step: its update is about to happen. Before it
        does (the weights are still the ones the step ran with), a non-finite gradient norm or
        logged loss has the step replayed, observed, as a skipped one would be. When ``step()`` is
        called without arguments (a closure would run again with the update, or run forwards on
        weights the step changes), the host does not wait for the check here: a fused Adam/AdamW
        is handed it as its skip flag, read once its kernel is queued (kernelskip.py,
        :meth:`_settle_kernel_skip`); any other optimizer's weights are kept on the device and the
        step is held, its check read a step late (keptweights.py, deferred.py), where the device
        has room for them."""
        scalars, flat = None, None
        if isinstance(self.grads.norms, torch.Tensor) and not self._reads_free:
            # the step's pack, made now (nothing it holds changes before the step ends): its loss
            # and norms lie first and together, and the check reads them there, one op for both
            scalars = pack_scalars(self, None, None)
            offset, n = scalars.layout["norms"]
            flat = scalars.device[:offset + n]
        else:
            values = [v.detach().reshape(-1).float() for v in self.state.logged_losses[-1:]
                      if isinstance(v, torch.Tensor)]
            if not values:
                return
            flat = values[0]
        # One op: max |x| is NaN or inf exactly when some value is (a sum or an L2 norm could
        # overflow on finite values), where isfinite().all() took two
        check = torch.linalg.vector_norm(flat, math.inf)
        if plain_call and kernelskip.applies(self, optimizer):
            self._early_scalars = scalars
            self._kernel_skip = kernelskip.KernelSkip(optimizer, check)
            return
        if plain_call and not self._reads_free and self.options["keep_weights"]:
            # a step's weights kept instead, the check read a step late
            if self._kept_weights is None or not self._kept_weights.fits(optimizer):
                self._kept_weights = keptweights.KeptWeights(optimizer)
            if deferred.may_hold(self, self._kept_weights):
                self._early_scalars = scalars
                self._skip_flag.start(check, check=True)
                self._kept_weights.take()
                self._hold_weights = self._kept_weights
                self._hold_step = True
                return
        if kernelskip.CHECK_BEFORE_UPDATE not in self._noted and not self._reads_free:  # a read waits
            self._note_check_wait(optimizer, plain_call)
        # sync point, once per step and only without a scaler: the host must know before the update
        if not math.isfinite(check.item()):
            self.grads.measure_detail(None)  # packed again at the step's end, with the detail
            self._replay()
        else:
            self._early_scalars = scalars

    def _note_check_wait(self, optimizer: Any, plain_call: bool) -> None:
        """Tell the run, once, that its steps wait for the device before each update, and why."""
        if not plain_call:
            why = "step() is called with arguments (a closure would run again with the update)"
        else:
            why = (f"the optimizer ({type(optimizer).__name__}) is not a fused Adam or AdamW, whose kernel "
                   f"takes the check as its skip flag")
            if not self.options["keep_weights"]:
                why += ", and keep_weights=False (no copy of the weights to read it a step late)"
        self._note_once(kernelskip.CHECK_BEFORE_UPDATE,
                       f"without a GradScaler, each step's check of its loss and gradient norms is read "
                       f"before optimizer.step(), where the host waits for the device: {why}")

    def _note_hooks_left_out(self) -> None:
        """Tell the run, once, what a compiled model's observed steps leave out before torch 2.11."""
        self.observer.hooks_left_out = False
        where = ("on the CPU, modules are not observed inside the compiled graph"
                 if self.observer.host_stats else "modules are observed in the forward only inside the compiled graph")
        self._note_once("compiled-hooks-left-out",
                        f"torch {torch.__version__} cannot trace a hook on a tensor made inside a compiled graph "
                        f"(torch 2.11 and later can): {where}. A NaN/Inf born in the backward shows on the "
                        f"parameters' gradients without its module; to localize it, train with torch >= 2.11 "
                        f"or run the bad step uncompiled on its saved inputs (ampwatch batch)")

    def _note_once(self, code: str, message: str) -> None:
        """A notice for this step that the run gets once (callers test ``code in self._noted``
        before composing its message, on paths every step runs)."""
        if code not in self._noted:
            self._noted.add(code)
            self.writer.put_notice(self.step, code, message)

    def _take_early_scalars(self) -> Optional[StepScalars]:
        scalars, self._early_scalars = self._early_scalars, None
        return scalars

    def _settle_kernel_skip(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """A step handed its check to the optimizer (kernelskip.py): read it now that the kernel is
        queued. A bad step left its weights as they were: replayed (as recording allows), then its
        update applied again, without the flag, whatever happened to recording meanwhile."""
        pending, self._kernel_skip = self._kernel_skip, None
        if pending is None or self._reapplying:
            return
        pending.withdraw()
        if not pending.read():  # sync point: the check, with the optimizer's kernel queued behind it
            return
        try:
            self.call_guarded(self._localize_skipped_update)
        finally:
            self._reapplying = True
            try:
                optimizer.step()  # the update training would have made (a call without arguments)
            finally:
                self._reapplying = False

    def _localize_skipped_update(self) -> None:
        self._early_scalars = None  # packed again at the step's end, with the detail
        self.grads.measure_detail(None)
        self._replay()
        self._fp32_check(False)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._reapplying:
            return
        if self.scaler is None or not (self._scaling or self.state.scaler_stepped):
            # no scaler, or a disabled one (GradScaler(enabled=False)) the loop did not step through:
            # optimizer.step() closes the step. A disabled scaler's step() calls optimizer.step()
            # itself; that step is closed by its update() instead, so it is counted once
            self.end_step(self._take_early_scalars())

    # -- step end -----------------------------------------------------------------------------------
    def end_step(self, scalars: Optional[StepScalars] = None) -> None:
        """Close the step: hand its pack to the writer. ``scalars``: packed before ``update()``
        (:meth:`before_update`); None packs them now, without a scale."""
        now = time.time()
        if self.observer is not None and self.observer.hooks_left_out:
            self._note_hooks_left_out()
        if self._trigger is not None:
            self._trigger.step_ended(bool(self.state.scale_calls or self.state.stepped))
        if scalars is None:
            scalars = pack_scalars(self, None, None)
        pack = pack_step(self, scalars, now)
        if (self._root_inputs is not None and self._root_inputs.calls) or self._observed_inputs or (
                not self.state.stepped and self.replayer is not None and self.observer.observing):
            # a live step's (a replayed one's are saved by the replay)
            undecided = self._save_bad_live_inputs(loss_bad=_host_loss_bad(scalars))
            if undecided and self.observer is not None and self.observer.observing and pack.loc:
                # the writer reads the module values anyway: it saves them if the forward went bad
                pack.inputs = list(undecided)
            self._observed_inputs = []
        if self.fp8 is not None and self.fp8.armed:  # a layer_every step: its fp8 values, disarmed
            pack.fp8 = self.fp8.take(self.step)
        if self._held is not None:  # no optimizer step settled it: it goes first, as late as it can
            deferred.settle(self)
        if self._hold_step:
            self._hold_step = False
            weights, self._hold_weights = self._hold_weights, None
            deferred.hold(self, pack, scalars, weights)
        else:
            self.writer.put_step(pack)
        if self.writer.failure is not None:
            raise RuntimeError(f"writer failed: {self.writer.failure}")
        self.step += 1
        if self._skip_flag.started:  # an unscale_ without scaler.step() left one behind
            self._skip_flag.clear()
        if self.fp8 is not None and self._detail_step():
            self.fp8.arm()
        self._clip_norms_expected = self._clip_norms_taken and not self._clip_norms_refused
        self._clip_norms_taken = False
        if self._trigger is not None:  # _on_backward_end has nothing to do while the clip hands the norms
            self._trigger.ends_needed = not self._clip_norms_expected
        if self._root_inputs is not None:
            self._root_inputs.clear()
        if self.replayer is not None:  # module values measured live on layer_every steps only
            self.replayer.clear()
            self.observer.set_observing(self._detail_step())
        if (self._probes and all(probe.eager_calls for probe in self._probe_objects)
                and not (self.observer is not None and self.observer.traced)):  # a replay's eager calls
            # every probe ran in eager, none was compiled into a graph (removing it would make
            # torch.compile recompile): a pre-hook per child costs a few us a forward for nothing
            self._remove_probes()
        self.grads.reset()
        self._scaling = torch_access.scaler_enabled(self.scaler)
        self.state = StepState(now)

    def _drop_child_probes(self) -> None:
        for handle in self._probes[1:]:
            handle.remove()
        self._probes, self._probe_objects = self._probes[:1], self._probe_objects[:1]

    def _remove_probes(self) -> None:
        for handle in self._probes:
            handle.remove()
        self._probes = []

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
            problem = _not_a_scalar(value, allow_many=key == "loss")
            if problem is not None:  # told at the call, once per key; the rest is recorded
                if key not in self._bad_log_keys:
                    self._bad_log_keys.add(key)
                    warnings.warn(f"ampwatch: watch.log({key}=...) ignored: expected a number or a one-element "
                                  f"tensor, got {problem}", RuntimeWarning, stacklevel=2)
                continue
            if key == "loss":
                self.state.logged_losses.append(value.detach() if isinstance(value, torch.Tensor)
                                                else torch.tensor(float(value), device=self._device))
            else:
                self.state.metrics[key] = value

    def close(self, *, status: str = "finished", error: Optional[str] = None) -> None:
        """Flush, mark the run ended and remove every hook and patch. Idempotent.

        A step the loop did not end (it raised inside it: a NaN loss checked before ``backward``)
        is written first, as far as it got, with a ``step-unfinished`` notice (unfinished.py); that
        may read device values (sync) and run the step's forward again, here only."""
        if self.closed:
            return
        if getattr(self, "_held", None) is not None:  # the last step: settled (replayed) now, also on a
            self.call_guarded(deferred.settle, self)   # crash: a loop may raise on the NaN it just saw
        if getattr(self, "writer", None) is not None:  # the step it raised in, as far as it got
            self.call_guarded(unfinished.close_step, self, status == "crashed")
        self._held = self._kept_weights = self._hold_weights = None  # the weights' copy goes
        if getattr(self, "_kernel_skip", None) is not None:  # its step() raised: no flag left behind
            self._kernel_skip.withdraw()
            self._kernel_skip = None
        if not self._failed:  # a step in progress: a loop that raises on the NaN loss it just saw stops here
            self.call_guarded(self._save_bad_live_inputs, True, status == "crashed")
        self.closed = True
        _open_watches.discard(self)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._remove_probes()
        self._probe_objects = []
        clipping.stop(self)
        if self._trigger is not None:
            self._trigger.remove()
        if self._scaler_hooks is not None:
            self._scaler_hooks.unpatch()
        if self.observer is not None:
            self.observer.remove()
        if self.replayer is not None:
            self.replayer.remove()
        if self._root_inputs is not None:
            self._root_inputs.remove()
        self._observed_inputs = []
        if self.fp8 is not None:
            self.fp8.disarm()
        copies.release(self._copy_safe)
        self._copy_safe = []
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


class _AutocastProbe:
    """Forward pre-hook of the first step: which autocast dtype is on. Holds the watch weakly and
    reads no module state, so Dynamo traces it as a no-op when the model is compiled. In eager
    (every probe counted a call of its own) the watch removes them after the first step; the
    root's removes the children's as soon as it sees a compiled call (``torch.compile(model)`` or
    ``model.compile()``), before the forward is traced."""

    def __init__(self, watch: Watch, root: bool = False) -> None:
        self._watch = weakref.ref(watch)
        self.root = root
        self.eager_calls = 0  # none: it runs in a compiled graph (or its module did not run)

    def __call__(self, module: Any, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        self.eager_calls += 1
        watch = self._watch()
        if watch is None:
            return
        if self.root and len(watch._probes) > 1 and torch_access.call_is_compiled(module):
            # the root's hooks run eagerly, before Dynamo traces the forward: the children's
            # probes leave now, before they are traced into its graph, where they would learn
            # nothing and add their guards to every call
            watch._drop_child_probes()
        if not watch._amp_seen and watch.step == watch._first_step:
            watch.guarded(watch.on_autocast)()


never_a_frame_of_its_own(_AutocastProbe.__call__)

_open_watches: "weakref.WeakSet[Watch]" = weakref.WeakSet()


def _host_loss_bad(scalars: StepScalars) -> bool:
    """Where reads are free: whether the step's loss, as read into the pack, is NaN or inf."""
    at = scalars.layout.get("loss") if scalars.values is not None else None
    return at is not None and not math.isfinite(scalars.values[at[0]])


def _not_a_scalar(value: Any, allow_many: bool = False) -> Optional[str]:
    """What is wrong with a value given to ``watch.log`` (None when it is a number or a one-element
    tensor; ``allow_many``: a tensor of any size, as a loss is averaged)."""
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            return "a complex tensor"
        return None if allow_many or value.numel() == 1 else f"a tensor of {value.numel()} elements"
    if isinstance(value, numbers.Real):
        return None
    return type(value).__name__


@atexit.register
def _close_at_exit() -> None:
    crashed = getattr(sys, "last_value", None)
    for watch in list(_open_watches):
        if crashed is not None:
            error = "".join(traceback.format_exception(type(crashed), crashed, crashed.__traceback__))
            watch.close(status="crashed", error=error)
        else:
            watch.close()
