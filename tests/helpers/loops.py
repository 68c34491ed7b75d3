"""Tiny models and training loops used across tests: real torch, real GradScaler, on the CPU."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F


def mlp(seed: int = 0, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))


def gloo_ddp_mlp(rank: int, world: int, port: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One rank of a test job: a gloo process group on localhost, one torch thread, DDP over
    :func:`mlp`, SGD."""
    import os

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(mlp())
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def data(seed: int = 0, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


def amp_step(model, opt, scaler, x, y, *, accum: int = 1, clip: Optional[float] = None,
             dtype=torch.float16, set_to_none: bool = True, watch=None) -> None:
    """One optimizer step of the canonical loop, with k micro-batches."""
    for xb, yb in zip(x.chunk(accum), y.chunk(accum)):
        with torch.autocast("cpu", dtype=dtype):
            out = model(xb)
        loss = F.mse_loss(out.float(), yb) / accum
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
            if watch is not None:
                watch.log(loss=loss)
    if scaler is not None:
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
    else:
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    opt.zero_grad(set_to_none=set_to_none)


class Amplify(torch.autograd.Function):
    """Identity forward; multiplies the gradient flowing back by 1e6 (a backward-only overflow)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e6


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def changed(before: list[torch.Tensor], model: nn.Module) -> bool:
    return any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))


def train(steps: int, *, scaler_factory: Optional[Callable] = None, attach: Optional[Callable] = None,
          seed: int = 0, lr: float = 1e-2, **step_kwargs):
    """Train the MLP; returns (model, watch, list of ground-truth 'was the update applied')."""
    model = mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = scaler_factory() if scaler_factory else None
    watch = attach(model, opt, scaler) if attach else None
    applied = []
    for i in range(steps):
        x, y = data(seed + i)
        before = snapshot(model)
        amp_step(model, opt, scaler, x, y, watch=watch, **step_kwargs)
        applied.append(changed(before, model))
    if watch is not None:
        watch.close()
    return model, watch, applied


def bf16_fault_run(model: nn.Module, path, fault_step: int, watched: bool, *, steps: int, batch: int,
                   device: str = "cpu", fused: bool = False, pre_hook: Optional[Callable] = None,
                   post_hook: Optional[Callable] = None, compiled: Optional[str] = None,
                   **options: Any) -> tuple[list, list]:
    """bf16 autocast, no scaler, SGD (``fused``: AdamW(fused=True)), the loss through ``watch.log``:
    module "2"'s weights are 1e38 at ``fault_step``, so its output overflows to ±inf (a fault in the
    weights and inputs a replay runs on, also a step later; the weights and optimizer state that
    step wrote are repaired after it, so training goes on). Returns each step's loss, and the final parameters
    followed by the optimizer's state tensors. ``pre_hook``, ``post_hook``: optimizer step hooks of
    the loop's own, the first registered after ampwatch attaches, the second before. ``compiled``:
    a torch.compile backend the model runs under (attached before compiling). ``options``:
    ampwatch.attach's (layer_every=5 unless given)."""
    import ampwatch
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=1e-2))
    if post_hook is not None:
        opt.register_step_post_hook(post_hook)
    options.setdefault("layer_every", 5)
    watch = ampwatch.attach(model, opt, None, path=str(path), **options) if watched else None
    if pre_hook is not None:
        opt.register_step_pre_hook(pre_hook)
    net = torch.compile(model, backend=compiled) if compiled else model
    g = torch.Generator(device=device).manual_seed(1)
    n_in, n_out = model[0].in_features, model[-1].out_features
    losses = []
    for i in range(steps):
        if i == fault_step:
            saved = model[2].weight.detach().clone()
            with torch.no_grad():
                model[2].weight.fill_(1e38)  # finite in bf16; the sum of a row of products is not
        with torch.autocast(device, dtype=torch.bfloat16):
            out = net(torch.randn(batch, n_in, device=device, generator=g))
            loss = F.mse_loss(out.float(), torch.zeros(batch, n_out, device=device))
        loss.backward()
        if watch is not None:
            watch.log(loss=loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
        if i == fault_step:
            with torch.no_grad():
                model[2].weight.copy_(saved)
                for prm in model.parameters():
                    prm.nan_to_num_(0.0)
                for moments in opt.state.values():
                    for value in moments.values():
                        if isinstance(value, torch.Tensor) and value.is_floating_point():
                            value.nan_to_num_(0.0)
    if watch is not None:
        watch.close()
    state = [v.detach().clone() for moments in opt.state.values() for v in moments.values()
             if isinstance(v, torch.Tensor)]
    return losses, [prm.detach().clone() for prm in model.parameters()] + state
