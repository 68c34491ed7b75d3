"""`ampwatch demo`: deterministic CPU recordings of real training, written to ``sample_runs/``.

Each run trains a small GPT-like model (built from code, random weights, synthetic data: nothing is
downloaded) through ampwatch itself. Fixed seeds, one torch thread: the same files every time on the
same torch build.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from .models import TinyGPT, batches


def train(path: Path, steps: int, *, dtype: torch.dtype = torch.float16, use_scaler: bool = True,
          init_scale: float = 2.0 ** 16, growth_interval: int = 2000, lr: float = 3e-3,
          lr_at: Optional[Callable[[int], float]] = None, fault: Optional[Callable[[nn.Module, int], None]] = None,
          seed: int = 0, progress: Optional[Callable[[int], None]] = None, **options) -> Path:
    """Train TinyGPT for ``steps`` optimizer steps under ampwatch; returns the run file."""
    import ampwatch
    torch.manual_seed(seed)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval) if use_scaler else None
    data = batches(64, 32, 8, seed)
    config = {"model": "TinyGPT(d=64, layers=2)", "lr": lr, "init_scale": init_scale if use_scaler else None,
              "amp_dtype": str(dtype).replace("torch.", ""), "steps": steps, "max_grad_norm": 1.0}
    with ampwatch.attach(model, opt, scaler, path=str(path), name=path.stem, config=config, **options) as watch:
        for step in range(steps):
            if lr_at is not None:
                for group in opt.param_groups:
                    group["lr"] = lr_at(step)
            if fault is not None:
                fault(model, step)
            x, y = next(data)
            with torch.autocast("cpu", dtype=dtype):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                watch.log(loss=loss)
                opt.step()
            opt.zero_grad(set_to_none=True)
            if progress is not None:
                progress(1)
    return watch.path


def _activation_burst(module: str, start: int, end: int, factor: float) -> Callable[[nn.Module, int], None]:
    """Simulates a burst of outlier batches: ``module``'s fp16 output is scaled by ``factor`` for steps
    [start, end), so the forward overflows, every such step is skipped and the scale collapses; the
    weights are untouched (skipped steps don't update), so the run recovers after the burst."""
    state = {"step": -1, "handle": None}

    def amplify(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> Optional[torch.Tensor]:
        return output * factor if start <= state["step"] < end else None

    def fault(model: nn.Module, step: int) -> None:
        state["step"] = step
        if state["handle"] is None:
            # prepend: run before ampwatch's own hook, so the recording sees what the next layer sees
            state["handle"] = model.get_submodule(module).register_forward_hook(amplify, prepend=True)
    return fault


def _corrupt_once(step_at: int, module: str, factor: float) -> Callable[[nn.Module, int], None]:
    """Simulates a corrupted update: multiply one layer's weights once (the run's post-mortem shows it)."""
    def fault(model: nn.Module, step: int) -> None:
        if step == step_at:
            with torch.no_grad():
                model.get_submodule(module).weight.mul_(factor)
    return fault


SAMPLES: dict[str, dict] = {
    "healthy_fp16": dict(steps=300, init_scale=2.0 ** 20),
    "overflow_storm": dict(steps=300, init_scale=2.0 ** 24, growth_interval=10,
                           fault=_activation_burst("h.0.mlp.fc", 120, 150, 1e5)),
    "diverged": dict(steps=250, init_scale=2.0 ** 16, fault=_corrupt_once(180, "h.1.mlp.fc", 1e5)),
    "bf16_noscaler": dict(steps=300, dtype=torch.bfloat16, use_scaler=False),
    # recorded through the Lightning callback (16-mixed, CPU GradScaler at 2**24, accumulation 2, clip 1.0)
    "lightning_fp16": dict(steps=200, via="lightning"),
}


def make_samples(out: Path, names: Optional[list[str]] = None,
                 progress: Optional[Callable[[int], None]] = None) -> list[Path]:
    """(Re)write the sample runs into ``out``; existing files of the same name are replaced."""
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    written = []
    for name in names or list(SAMPLES):
        target = out / f"{name}.sqlite"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{target}{suffix}").unlink(missing_ok=True)
        spec = dict(SAMPLES[name])
        if spec.pop("via", None) == "lightning":
            from .lightning_sample import record_sample  # needs ampwatch[lightning]
            written.append(record_sample(target, steps=spec["steps"]))
            if progress is not None:
                progress(spec["steps"])
        else:
            written.append(train(target, progress=progress, **spec))
    return written


def total_steps(names: Optional[list[str]] = None) -> int:
    return sum(SAMPLES[n]["steps"] for n in names or list(SAMPLES))


__all__ = ["train", "make_samples", "SAMPLES", "total_steps"]
