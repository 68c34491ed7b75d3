"""Knowing when each backward pass ends, alike under plain training, DDP, FSDP1 and FSDP2.

The recorder measures gradients when backward has finished (after DDP's all-reduce or FSDP's
reduce-scatter), so it needs a signal that fires once per backward pass, inside it. Two triggers,
deduplicated per pass, feed one callback queued on the autograd engine (:func:`torch_access.at_backward_end`):

- a gradient hook on the root module's outputs, registered by a forward hook at each forward with
  grad enabled: it fires as soon as backward reaches the model's output, whatever wraps the
  parameters. FSDP1's flat parameters never run the original parameters' AccumulateGrad;
  FSDP2 runs a sharded parameter's post-accumulate-grad hooks itself, and only when it
  reduce-scatters (not on micro-batches under ``set_requires_gradient_sync(False)``).
- a post-accumulate-grad hook on one trainable parameter: covers a loss computed from something
  other than the model's outputs (a hook on an intermediate, a parameter penalty).

With plain parameters the second trigger alone is usually enough, and it costs nothing per step
(it is registered once), while the first registers a gradient hook at every forward (~25 us of host
time with its call in backward). So after a step in which the parameter trigger fired, the output
trigger rests (:meth:`BackwardEnd.step_ended`); after a step with a backward that no trigger saw
(that step's gradients are then measured when the optimizer steps), it is back on for good. And
while the recorder needs no end (``ends_needed``: the user's clip hands it the gradient norms), a
pass costs the parameter trigger's one call: ``started()`` and nothing queued.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch

from . import torch_access
from .copies import ours


def grad_outputs_of(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors that carry gradient inside a module's output (tuples, lists, dicts, HF outputs)."""
    return (t for t in torch_access.nested_tensors(obj) if t.requires_grad and t.grad_fn is not None)


class BackwardEnd:
    """Calls ``started()`` when a backward pass reaches the model and ``ended()`` once it is over.

    Both callbacks must never raise (the recorder passes guarded ones). ``handles`` are the
    removable hooks; gradient hooks already on live output tensors become no-ops after
    :meth:`remove`. No sync, no collective.
    """

    def __init__(self, model: torch.nn.Module, params: list[torch.Tensor],
                 started: Callable[[], None], ended: Callable[[], None],
                 outputs: Optional[Callable[[Any, Any], None]] = None) -> None:
        self._started, self._ended = started, ended
        # another listener to the root's outputs (the replayer's), called first from the same hook:
        # a second root hook would cost its own Dynamo-disabled wrapper on every forward
        self._outputs = outputs
        self._queued: Optional[int] = None  # backward pass whose end is queued (-1: id unknown)
        self._active = True
        self._fired = False        # a pass was seen this step
        self._param_fired = False  # ... by the parameter trigger
        self._sure = False         # the output trigger stays on for good
        # whether ``ended()`` has work this step: the recorder says no while the user's clip hands
        # it the step's gradient norms (watch.py), and a pass heard by the parameter trigger alone
        # then costs one call (no pass id read, no callback queued on the engine)
        self.ends_needed = True
        # torch.compile(model) runs the root's own hooks outside its graph, where Dynamo would make a
        # graph of this one: kept eager (it sees real output tensors)
        self.handles: list[Any] = [model.register_forward_hook(ours(torch._dynamo.disable(self._on_output)))]
        counted = next((p for p in params if p.requires_grad), None)
        by_parameter = counted is not None and hasattr(counted, "register_post_accumulate_grad_hook")
        if by_parameter:
            self.handles.append(counted.register_post_accumulate_grad_hook(self._on_parameter))
        # FSDP's flat (FSDP1) or sharded (FSDP2) parameters: their own AccumulateGrad may not run
        self._plain = by_parameter and all(type(p) is torch.nn.Parameter for p in params)
        self.by_output = True

    def remove(self) -> None:
        self._active = False
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def pause(self, paused: bool) -> None:
        """A replay (record/replay.py) runs backward passes that are not training's: no signal."""
        if self.handles:  # not removed
            self._active = not paused

    def step_ended(self, backward_expected: bool) -> None:
        """Whether the output trigger is needed next step: not after the parameter trigger fired
        (plain parameters); for good after a step with a backward (``backward_expected``: the loss
        was scaled or the optimizer stepped) that no trigger saw."""
        if backward_expected and not self._fired:
            self._sure = True
        self.by_output = self._sure or not (self._plain and self._param_fired)
        self._fired = self._param_fired = False

    def _on_output(self, module: Any, args: Any, output: Any) -> None:
        if self._outputs is not None:
            self._outputs(module, output)  # never raises
        if not (self._active and torch.is_grad_enabled()):
            return
        self._queued = None  # a new forward: a pass that died mid-way queues nothing any more
        if not self.by_output:
            return
        for t in grad_outputs_of(output):
            # a pre-hook on the output's node fires when a tensor hook would, at half the host cost
            t.grad_fn.register_prehook(self._on_output_grad)

    def _on_parameter(self, param: Any) -> None:
        self._param_fired = True
        self._fire()

    def _on_output_grad(self, grads: Any) -> None:
        self._fire()  # returns None: the gradient flows on unchanged

    def _fire(self, *_: Any) -> None:
        if not self._active:
            return
        if not (self.by_output or self.ends_needed):
            # the parameter trigger alone is on: it fires once per pass (a leaf accumulates once),
            # so there is nothing to deduplicate, and no end to wait for
            self._fired = True
            self._started()
            return
        current = torch_access.backward_pass_id()
        if self._queued is not None and (current == -1 or current == self._queued):
            return  # this pass's end is queued already (several outputs, or both triggers)
        self._queued = current
        self._fired = True
        self._started()
        torch_access.at_backward_end(self._on_end)

    def _on_end(self) -> None:
        self._queued = None
        if self._active:
            self._ended()
