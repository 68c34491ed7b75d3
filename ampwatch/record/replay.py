"""Localizing a skipped step by replaying it, so that healthy steps observe no module at all.

On an accelerator, observing every module on every step is what recording costs: a Python hook per
module call and per gradient, and reductions that read every activation and gradient once (GPT-2
small on an H100: 1.14x, eager). Yet on most steps nothing is written from them: module rows are
written on ``layer_every`` steps and on bad ones. With a GradScaler, a bad step is a skipped one:
any non-finite gradient makes ``scaler.step`` skip ``optimizer.step``, which the host learns
without a sync (the scaler read its inf flags itself). The parameters are then exactly those the
step ran with, so the step can be run again, observed, before ``scaler.update``.

So between ``layer_every`` steps the module hooks are off (removed, so torch's module call takes
its no-hook path; compiled, Dynamo runs the graph it traced without them, which holds nothing of
ampwatch's) and each forward of the root module only keeps references (no copy) to what
a replay needs: its arguments, the RNG states, the autocast state, and the gradients that reached
its outputs from outside the model (the loss's gradient, scaled). A skipped step is then replayed micro-batch by micro-batch in eager mode with
the hooks on: the same forward, and ``torch.autograd.grad`` from the same output gradients, which
computes and discards the parameters' gradients (their ``.grad`` is untouched). Buffers
(BatchNorm's running stats) and the RNG states are restored afterwards, so training goes on with
the same numbers as without ampwatch.

What is given up against observing every step: a non-finite module value that reaches neither
the loss nor any gradient (masked) is seen on ``layer_every`` steps only, as on the CPU path; and a
replay is a second run of the step, so a step that is not reproducible (a compiled model replayed
in eager, nondeterministic kernels) is localized from the replay's values. It needs the skip known
on the host: a fused optimizer skips inside its kernel, so there the watch reads the scaler's inf
flag once per step (between ``layer_every`` steps a step late, at the next step's optimizer
step, where the device is usually past it: deferred.py);
without a scaler (bf16, fp32) nothing skips, so the watch checks the step's gradient norms (and
the logged loss) before ``optimizer.step()`` changes the weights: handed to a fused Adam/AdamW as
its skip flag (kernelskip.py), or read a step late with the step's weights kept on the device
(keptweights.py), and only where neither applies read before the update, one sync per step; a bad
step is replayed on the weights it ran with. Not under DDP/FSDP (a replay would start collectives on one rank): there the module
hooks observe every step, as before.
"""
from __future__ import annotations

import contextlib
import math
import weakref
from functools import partial
from typing import Any, Iterator, Optional

import torch

from . import torch_access
from .compiled import run_eagerly
from .copies import ours
from .observe import add_grad_hook
from .recompute import autocast_state

MAX_BATCHES = 1024  # root forwards kept per step, at most


def possible(model: torch.nn.Module, params: list[torch.Tensor], scaler: Any, reads_free: bool) -> bool:
    """Whether a skipped step of this training can be replayed (see the module docstring)."""
    if reads_free:
        return False
    wrapped = {"DistributedDataParallel", "FullyShardedDataParallel", "DataParallel"}
    if any(type(m).__name__ in wrapped or type(m).__name__.startswith("FSDP") for m in model.modules()):
        return False
    return all(type(p) is torch.nn.Parameter for p in params)


class NotReplayable(Exception):
    """A kept micro-batch cannot be run again as it ran (its message says why)."""


class _MicroBatch:
    """What one forward of the root module needs to run again: references, no copies, and the
    version counters of the tensors among its arguments, which tell whether they still hold what
    the forward saw (a loop that reuses one input buffer, ``x_buf.copy_(batch)``, overwrites them)."""
    __slots__ = ("args", "kwargs", "rng", "autocast", "grads", "versions", "outputs")

    def __init__(self, args: Any, kwargs: Any, rng: tuple, autocast: tuple) -> None:
        self.args, self.kwargs, self.rng, self.autocast = args, kwargs, rng, autocast
        self.grads: dict[int, torch.Tensor] = {}  # output position -> the gradient it received
        self.versions = [(t, t._version) for t in _arg_tensors(args, kwargs)]
        # output position -> (a weak reference to the output the forward made, its version): no
        # memory held; while the loop still holds its outputs (``logits = model(x)``), a replay can
        # ask whether they were finite
        self.outputs: dict[int, tuple] = {}

    def outputs_were_finite(self, positions: list[int]) -> Optional[bool]:
        """Whether this forward's own outputs at ``positions`` were all finite (a read: on a skipped
        step only); None where one is gone or was changed in place since."""
        tensors = []
        for pos in positions:
            ref, version = self.outputs.get(pos, (None, None))
            t = ref() if ref is not None else None
            if t is None or t._version != version:
                return None
            tensors.append(t.detach())
        return _finite(tensors) if tensors else None

    def check_unchanged(self, index: int) -> None:
        for t, version in self.versions:
            if t._version != version:
                raise NotReplayable(f"an input of micro-batch {index} was changed in place after its forward "
                                    f"(a reused input buffer?)")


def _arg_tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    tensors = torch_access.tensors_in(args)
    return tensors + torch_access.tensors_in(kwargs) if kwargs else tensors


def _grad_outputs(output: Any) -> list[torch.Tensor]:
    """The root's output tensors that carry gradient (as the backward-end trigger finds them),
    each once, in a fixed order."""
    outputs = [t for t in torch_access.tensors_in(output) if t.requires_grad and t.grad_fn is not None]
    if len(outputs) < 2:
        return outputs
    seen: set[int] = set()
    return [t for t in outputs if not (id(t) in seen or seen.add(id(t)))]


def _internal(outputs: list[torch.Tensor]) -> set[int]:
    """Positions of outputs computed from other outputs (HF's logits, from which the model computes
    its own loss): their gradient comes from inside the model, and a replay starting from them as
    well as from the loss would count it twice. One walk of the graph, on the first step."""
    stack = [fn for t in outputs for fn, _ in t.grad_fn.next_functions if fn is not None]
    seen: set[Any] = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    return {i for i, t in enumerate(outputs) if t.grad_fn in seen}


class Replayer:
    """Root hooks that keep each micro-batch's references; :meth:`replay` runs them again."""

    def __init__(self, root: torch.nn.Module, device: torch.device) -> None:
        self.root, self.device = root, device
        self._kind = device.type  # read on every forward: torch.device.type builds a str at each read
        self.batches: list[_MicroBatch] = []
        self.replaying = False
        self.broken = False  # this step's references are incomplete: it cannot be replayed
        self.forward_bad: list[int] = []  # the last replay's micro-batches whose outputs were non-finite
        # the last replay made finite gradients whose float32 norm overflows (see replay): what
        # made the step look bad, reproduced, with nothing non-finite to localize
        self.norm_overflow = False
        # the last replay's micro-batches whose outputs were finite, as the step's own were, and the
        # gradient the loss handed them was not: the loss or its targets made the NaN/Inf, after the model
        self.loss_made: list[int] = []
        # ... the same, where the step's own outputs were gone (the loop did not hold them): the loss
        # or its targets, or a fault of the step's forward that did not recur; not known which
        self.loss_unclear: list[int] = []
        self._device_rng = getattr(torch, device.type, None) if device.type != "cpu" else None
        self._internal: dict[int, set[int]] = {}  # number of outputs -> positions fed by the others
        # kept eager under torch.compile(model): the root's hooks run outside its graph. The
        # outputs are handed over by the backward-end trigger's root hook (backward.py), which sees
        # the same outputs: one hook, and one Dynamo-disabled wrapper, on every forward, not two
        self._handles = [
            root.register_forward_pre_hook(ours(torch._dynamo.disable(self._keep)), with_kwargs=True),
        ]

    def _rng(self) -> tuple:
        device = self._device_rng.get_rng_state() if self._device_rng is not None else None
        return torch.get_rng_state(), device

    def _set_rng(self, rng: tuple) -> None:
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            self._device_rng.set_rng_state(rng[1])

    def _keep(self, module: Any, args: Any, kwargs: Any = None) -> None:
        # ``kwargs`` missing: removed while the forward that calls it had begun (torch then calls a
        # hook registered with kwargs as one without): nothing to keep
        if kwargs is None or self.replaying or self.broken or not (module.training and torch.is_grad_enabled()):
            return
        try:  # inside the user's forward: must never raise
            if len(self.batches) >= MAX_BATCHES:  # forwards with grad but no step (an eval loop in train mode)
                self.batches.clear()
                self.broken = True  # this step cannot be replayed whole
                return
            kind = self._kind
            autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            self.batches.append(_MicroBatch(args, kwargs, self._rng(), autocast))
        except Exception:
            self.broken = True

    def outputs(self, module: Any, output: Any) -> None:
        """The root's ``output`` of the forward :meth:`_keep` kept: its gradient is kept as it
        flows back (a gradient hook on each output that carries one). Never raises."""
        # not self._handles: removed (the trigger's root hook still hands outputs over: ignored)
        if (not self._handles or self.replaying or self.broken or not self.batches
                or not (module.training and torch.is_grad_enabled())):
            return
        try:
            self._hook_outputs(self.batches[-1], output)
        except Exception:
            self.broken = True

    def _hook_outputs(self, batch: _MicroBatch, output: Any) -> None:
        outputs = _grad_outputs(output)
        internal = self._internal.get(len(outputs))
        if internal is None:
            internal = self._internal[len(outputs)] = _internal(outputs) if len(outputs) > 1 else set()
        for pos, t in enumerate(outputs):
            if pos not in internal:
                add_grad_hook(t, t.grad_fn, partial(_keep_grad, batch.grads, pos))
                batch.outputs[pos] = (weakref.ref(t), t._version)

    def release(self) -> None:
        """This step's update is under way and will not be replayed: its references go now (a
        forward later in the step is kept again, until :meth:`clear`). Each batch's gradients are
        emptied too: the hook that filled them hangs on the output's graph node, which lives as
        long as the loop holds its output (``logits``, to the end of the step)."""
        for batch in self.batches:
            batch.grads.clear()
        self.batches = []

    def clear(self) -> None:
        """The step ended: its references go."""
        self.batches = []
        self.broken = False

    def replay(self, params: list[torch.Tensor], batches: Optional[list] = None,
               grads_out: Optional[list] = None, losses_finite: Optional[list[bool]] = None) -> bool:
        """Run the step's micro-batches again, forward and backward (the observer's hooks must be on).
        True when the replay reproduced the skip: some parameter gradient came out non-finite, and
        no micro-batch whose outputs' gradients were non-finite (a non-finite loss) made finite
        outputs this time (a few reads per micro-batch: syncs, on a skipped step only). Parameters'
        ``.grad``, buffers and RNG states are left as they were. Raises :class:`NotReplayable`, before
        running anything, when a kept input was changed in place since its forward.
        ``batches``: an earlier step's (:meth:`hand_over`) instead of this step's. ``grads_out``: a
        list as long as ``params``, filled with each parameter's replayed gradient, summed over the
        micro-batches (None where none came), for the detail of a step whose ``.grad`` is gone.
        A replay that does not reproduce the skip but makes a gradient whose float32 norm overflows
        on finite elements (above ~1.8e19; without a scaler, that inf norm is what checked the step
        bad) sets :attr:`norm_overflow` (one more reduction and read per micro-batch, on such a
        replay only; a micro-batch's own gradients, not their sum over the step).
        ``losses_finite``: per micro-batch, whether the step's own loss was finite (None: not known).
        A finite loss whose gradient reached finite outputs as inf is the scale's doing (a scaled
        gradient beyond the outputs' fp16 range, the scaler's warm-up): the same step."""
        self.norm_overflow = False
        self.loss_made, self.loss_unclear = [], []
        if batches is None:
            if self.broken:
                return False
            batches = self.batches
        if not batches:
            return False
        for index, batch in enumerate(batches):  # before anything runs: raises NotReplayable
            batch.check_unchanged(index)
        trainable = [p for p in params if p.requires_grad]
        where = [i for i, p in enumerate(params) if p.requires_grad]  # trainable -> position in params
        kept = [p.grad for p in trainable]  # nested backward passes (reentrant checkpointing) accumulate
        reproduced = unfaithful = False
        self.forward_bad = []
        with self._running_again():
            try:
                with torch.enable_grad():
                    for index, batch in enumerate(batches):
                        self._set_rng(batch.rng)
                        enabled, dtype = batch.autocast
                        with torch.autocast(self.device.type, dtype=dtype, enabled=enabled):
                            output = self.root(*batch.args, **batch.kwargs)
                        outputs = _grad_outputs(output)
                        if outputs and not _finite(outputs):  # its forward went bad: its inputs are saved
                            self.forward_bad.append(index)
                        pairs = [(outputs[pos], g) for pos, g in batch.grads.items() if pos < len(outputs)]
                        if pairs and not _finite([g for _, g in pairs]) and _finite([t for t, _ in pairs]):
                            # the loss went non-finite from outputs this forward made finite. The same
                            # step if the step's own outputs were finite too: then the loss or its
                            # targets (a NaN label) made it, after the model; if they were not, the
                            # step's forward did what this one did not. Gone (the loop did not hold
                            # them): not known, and the replay's values stand, said as unclear
                            if not (losses_finite is not None and index < len(losses_finite) and losses_finite[index]):
                                # (a finite loss: the scaled gradient overflowed at the outputs, the same step)
                                original = batch.outputs_were_finite(list(batch.grads))
                                if original is None:
                                    self.loss_unclear.append(index)
                                elif original:
                                    self.loss_made.append(index)
                                else:
                                    unfaithful = True
                        if pairs and trainable:
                            for p in trainable:
                                p.grad = None
                            leaves = _leaves([t for t, _ in pairs], trainable)
                            grads = torch.autograd.grad([t for t, _ in pairs], leaves, [g for _, g in pairs],
                                                        allow_unused=True)
                            if grads_out is not None:
                                _add_grads(grads_out, [g if g is not None else p.grad
                                                       for g, p in zip(grads[:len(trainable)], trainable)], where)
                            grads = [g for g in grads[:len(trainable)] if g is not None]
                            grads += [p.grad for p in trainable if p.grad is not None]  # inside checkpoints
                            if grads and not reproduced:
                                reproduced = not _finite(grads)
                                if not (reproduced or self.norm_overflow):
                                    self.norm_overflow = not bool(
                                        torch.isfinite(torch_access.tensor_norms(grads, self.device)).all())
                            del grads, leaves
                        del output, outputs, pairs
            finally:
                for p, grad in zip(trainable, kept):
                    p.grad = grad
        return reproduced and not unfaithful

    def inputs_of(self, module: torch.nn.Module, index: int) -> Optional[tuple[Any, Any, dict]]:
        """The arguments ``module`` ran on in micro-batch ``index`` of this step (its latest call
        there, as the keeper keeps them: a shared module is called more than once), got by running
        that forward again without grad (after the module's other pre-hooks, which may replace
        them), and the autocast state it ran under; None when the module is not reached or the
        micro-batch cannot run again. For the fp32 recompute of a step observed live (whose inputs
        were not kept: recompute.py). RNG states and buffers are left as they were; compiled code
        runs eagerly (the module's call must run as Python)."""
        if self.broken or not 0 <= index < len(self.batches):
            return None
        batch = self.batches[index]
        try:
            batch.check_unchanged(index)
        except NotReplayable:
            return None
        got: list = []

        def grab(_module: Any, args: Any, kwargs: Any) -> None:
            got[:] = [(args, kwargs, autocast_state())]

        handle = module.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with self._running_again():
                self._set_rng(batch.rng)
                enabled, dtype = batch.autocast
                with torch.no_grad(), run_eagerly(), torch.autocast(self.device.type, dtype=dtype, enabled=enabled):
                    self.root(*batch.args, **batch.kwargs)
        except Exception:  # the user's model, run again outside its step: no inputs, not a failure
            return None
        finally:
            handle.remove()
        return got[0] if got else None

    def forwards_again(self) -> bool:
        """Run this step's kept micro-batches' forwards again, without grad, for the hooks on (the
        observer's) to see: a step that ends unfinished (the loop raised on a NaN loss before its
        backward) between ``layer_every`` steps, whose module values nobody observed. RNG states
        and buffers are left as they were; compiled code runs eagerly. False when there is nothing
        to run or it cannot run again (a micro-batch's input changed in place, or its forward raises)."""
        if self.broken or not self.batches:
            return False
        try:
            for index, batch in enumerate(self.batches):
                batch.check_unchanged(index)
            with self._running_again():
                for batch in self.batches:
                    self._set_rng(batch.rng)
                    enabled, dtype = batch.autocast
                    with torch.no_grad(), run_eagerly(), torch.autocast(self.device.type, dtype=dtype, enabled=enabled):
                        self.root(*batch.args, **batch.kwargs)
        except Exception:  # the user's model, run again after its step failed: no values, not a failure
            return False
        return True

    @contextlib.contextmanager
    def _running_again(self) -> Iterator[None]:
        """For a run of kept micro-batches: the buffers (BatchNorm's running stats) and RNG states
        put back as they were after it, and the root's hooks keeping nothing meanwhile."""
        buffers = [(b, b.detach().clone()) for b in self.root.buffers()]
        now = self._rng()
        self.replaying = True
        try:
            yield
        finally:
            self.replaying = False
            self._set_rng(now)
            with torch.no_grad():
                for b, kept in buffers:
                    b.copy_(kept)

    def hand_over(self) -> list:
        """This step's kept micro-batches, for a replay after the step ended (a fused optimizer's
        skip, read a step late: see deferred.py); the replayer starts the next step empty."""
        batches = [] if self.broken else self.batches
        self.clear()
        return batches

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.batches = []


def _leaves(outputs: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` and then every other leaf the outputs' graph accumulates into (inputs that require
    grad): ``autograd.grad`` runs only the nodes that lead to the tensors it is asked for, and a
    training backward runs every node that leads to any leaf (a reentrant checkpoint's node leads to
    its input only; the parameters inside it are reached by its own backward pass)."""
    seen_nodes: set[Any] = set()
    ids = {id(p) for p in params}
    leaves = list(params)
    stack = [t.grad_fn for t in outputs]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if isinstance(variable, torch.Tensor) and id(variable) not in ids:
            ids.add(id(variable))
            leaves.append(variable)
        stack.extend(f for f, _ in node.next_functions)
    return leaves


def _finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite (one multi-tensor reduction, one read)."""
    norms = torch._foreach_norm([t.detach() for t in tensors], math.inf)
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


def _add_grads(out: list, grads: list, where: list[int]) -> None:
    """Sum one micro-batch's replayed gradients into ``out`` (by position in the parameter list)."""
    for g, i in zip(grads, where):
        if g is not None:
            out[i] = g.detach() if out[i] is None else out[i] + g


def _keep_grad(grads: dict, pos: int, grad: Optional[torch.Tensor]) -> None:
    if grad is not None:
        grads[pos] = grad
