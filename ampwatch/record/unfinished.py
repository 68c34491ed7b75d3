"""The step a run ends in, written as far as it got when the run closes before the step ended.

A loop that checks its loss and raises (``if not torch.isfinite(loss): raise ...``) ends the run
inside a step: its forward ran, maybe its backward, and no ``scaler.update()`` or
``optimizer.step()`` closed it. That step is the one a post-mortem needs, so on close (a crash, or
``watch.close()`` after the loop caught the error) the recorder packs what the step already holds,
as a step's end would: the loss if the scaler or ``watch.log`` saw it, the gradient norms if a
backward ended, and the module values, from which the writer names where NaN/Inf was born. Between
``layer_every`` steps on an accelerator nobody observed the modules (replay.py): the step's kept
micro-batches are run forward again, observed. A ``step-unfinished`` notice marks the row, so the
doctor reads the step as the one the run ended in, not as a finished one.

Nothing here runs during training: only from :meth:`ampwatch.record.watch.Watch.close`, where reads
(syncs) cost nothing that matters.
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from . import torch_access
from .step import pack_scalars, pack_step

CODE = "step-unfinished"


def close_step(watch: Any, crashed: bool) -> None:
    """Hand the step in progress to the writer, if one began (see the module docstring). A forward
    alone (an evaluation in train mode after the last step) makes a step only on a crash or where
    its module values went non-finite."""
    state, observer, replayer = watch.state, watch.observer, watch.replayer
    began = bool(state.losses or state.logged_losses or state.scale_calls or state.backwards
                 or state.stepped or state.scaler_stepped)
    forward = (observer is not None and observer.root_calls > 0) or (replayer is not None and bool(replayer.batches))
    if not (began or forward):
        return
    if watch._scaling and state.stepped and not state.scaler_stepped:
        # the optimizer stepped outside scaler.step(): with the scaler on, no step of this loop ever
        # ends (a misuse the doctor names: no-steps); what piled up is not one step
        return
    if observer is not None and replayer is not None and not observer.observing and replayer.batches:
        observer.set_observing(True)  # the hooks were out this step: its forwards, run again, observed
        with observer.inside_compiled_blocks():
            replayer.forwards_again()
    origin = observer.forward_origin(observer.names) if observer is not None and observer.root_calls else None
    if not (began or crashed or origin is not None):
        return
    _measure(watch)
    scale = found = None
    if watch._scaling:
        scale = watch._scale_reads.value(watch.scaler) if watch._reads_free else torch_access.live_scale(watch.scaler)
        if watch._fused and state.scaler_stepped:
            found = torch_access.found_inf(watch.scaler, watch.optimizer)
    pack = pack_step(watch, pack_scalars(watch, scale, found), time.time())
    if not state.scaler_stepped:
        pack.skipped = False  # it never reached scaler.step(): not skipped, unfinished
    watch.writer.put_step(pack)
    watch.writer.put_notice(watch.step, CODE, _message(watch, crashed))


def _measure(watch: Any) -> None:
    """What a bad step pays for, where the step holds it: its gradients' NaN/inf counts (a norm
    that is not finite) and the fp32 recompute of a forward origin."""
    grads = watch.grads
    norms = grads.norms
    if norms is not None and grads.norm_ids and all(watch._params[i].grad is not None for i in grads.norm_ids):
        finite = all(map(math.isfinite, norms)) if isinstance(norms, list) else bool(torch.isfinite(norms).all())
        if not finite:
            grads.measure_detail(None)
    watch._fp32_check(False)


def _message(watch: Any, crashed: bool) -> str:
    state = watch.state
    reached = ("its optimizer step" if state.stepped else "scaler.step()" if state.scaler_stepped
               else "its backward" if state.backwards else "its loss" if state.losses or state.logged_losses
               else "its forward")
    end = "the run crashed" if crashed else "the run was closed"
    return (f"step {watch.step} did not end: {end} after {reached}; its row holds what the step had "
            f"recorded by then")
