"""Issue 9: eager gradient observation fills a tensor's hook dict directly (``add_grad_hook``).

It skips ``Tensor.register_hook``'s Python costs, so it must keep that method's semantics: the
user's own tensor hooks on module outputs run as before and see what they saw without ampwatch
(registered before ours inside a module's forward, or after the output was changed in place),
a hook that changes the gradient still changes training, and ampwatch observes the gradient of
the value it saw in the forward. Ground truth: the same training without ampwatch.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ampwatch
from ampwatch.record import observe


class DoublesItsGradient(nn.Module):
    """Registers a user hook on its own output inside forward, before ampwatch's forward hook runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        out.register_hook(lambda g: g * 2)
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = DoublesItsGradient()
        self.second = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, seen: list) -> torch.Tensor:
        h = self.first(x)
        h.mul_(3)  # changed in place outside any module: a new value with a new node
        h.register_hook(lambda g: seen.append(g.clone()))  # the user's hook on the new value
        return self.second(h)


def _train(attach: bool, tmp_path, steps: int = 3):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 8)
    seen: list = []
    losses, grads = [], []
    watch = ampwatch.attach(model, opt, path=str(tmp_path / "r.sqlite")) if attach else None
    try:
        for _ in range(steps):
            loss = model(x, seen).square().mean()
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            losses.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        if watch is not None:
            watch.close()
    return losses, grads, seen, (watch.path if watch else None)


@pytest.mark.parametrize("accelerator", [False, True])
def test_user_tensor_hooks_on_module_outputs_behave_as_without_ampwatch(tmp_path, monkeypatch, accelerator):
    if accelerator:
        monkeypatch.setenv("AMPWATCH_CPU_AS_ACCELERATOR", "1")
    else:
        monkeypatch.delenv("AMPWATCH_CPU_AS_ACCELERATOR", raising=False)
    base = _train(False, tmp_path / "base")
    watched = _train(True, tmp_path / "watched")
    assert watched[0] == base[0]  # losses, bitwise
    for a, b in zip(watched[1], base[1]):
        assert all(torch.equal(p, q) for p, q in zip(a, b))  # the doubling hook still doubles
    assert len(watched[2]) == len(base[2]) == 3
    assert all(torch.equal(p, q) for p, q in zip(watched[2], base[2]))  # the hook after mul_ sees the new value's gradient
    run = ampwatch.load(watched[3])
    assert len(run.steps) == 3 and run.events.empty


def test_the_observed_gradient_is_of_the_value_seen_when_registered():
    """Changed in place after registration, the tensor's gradient as ampwatch saw it in forward is
    the one w.r.t. the old value (3x the new value's), while a user hook registered after the
    change sees the new value's, as with ``Tensor.register_hook``."""
    x = torch.randn(4, requires_grad=True)
    y = x * 2
    ours, users = [], []
    observe.add_grad_hook(y, y.grad_fn, lambda g: ours.append(g.clone()))
    y.mul_(3)
    y.register_hook(lambda g: users.append(g.clone()))
    (y * torch.arange(4.0)).sum().backward()
    assert torch.equal(users[0], torch.arange(4.0))
    assert torch.equal(ours[0], 3 * torch.arange(4.0))
    assert torch.equal(x.grad, 6 * torch.arange(4.0))


def test_a_user_hook_dict_already_on_the_output_is_shared_not_replaced():
    """A tensor whose hook dict exists (the user registered first) gets ours added to it."""
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    calls = []
    y.register_hook(lambda g: calls.append("user") or g * 5)
    observe.add_grad_hook(y, y.grad_fn, lambda g: calls.append(("ours", g.clone())))
    y.sum().backward()
    assert calls[0] == "user" and calls[1][0] == "ours"
    assert torch.equal(calls[1][1], torch.full((3,), 5.0))  # after the user's hook, as register_hook would
    assert torch.equal(x.grad, torch.full((3,), 10.0))
