"""One Accelerate training run under ampwatch, in its own process (accelerate's state is process-global).

    python tests/helpers/accelerate_worker.py MODE OUT_DIR

MODE: ``fp16`` / ``bf16`` (``Accelerator(mixed_precision=..., cpu=True)`` as is: no scaler on the CPU),
``fp16-scaler`` (the GPU code path on the CPU: a real CPU GradScaler given to the Accelerator before
``prepare``, with native autocast), or ``fp16-scaler-fused`` (the same with ``AdamW(fused=True)``).
Writes ``OUT_DIR/run.sqlite`` and ``OUT_DIR/truth.json``: per optimizer step the mean micro-batch
loss, the pre-clip norm ``clip_grad_norm_`` returned, whether the parameters changed and
``accelerator.optimizer_step_was_skipped``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

import ampwatch
from loops import data, mlp

STEPS, ACCUMULATE = 12, 2


def main(mode: str, out: Path) -> None:
    from accelerate import Accelerator
    torch.set_num_threads(1)
    accelerator = Accelerator(mixed_precision=mode.split("-")[0], cpu=True, gradient_accumulation_steps=ACCUMULATE)
    if "scaler" in mode:
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=3)
        accelerator.native_amp = True
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True if "fused" in mode else None)
    model, opt = accelerator.prepare(model, opt)
    truth = {"loss": [], "grad_norm": [], "skipped": [], "accelerate_skipped": [], "steps_called": 0}
    opt.optimizer.register_step_pre_hook(lambda *a: truth.__setitem__("steps_called", truth["steps_called"] + 1))
    watch = ampwatch.attach(model, opt, accelerator.scaler, path=str(out / "run.sqlite"))
    for step in range(STEPS):
        x, y = data(step)
        losses = []
        before = [p.detach().clone() for p in model.parameters()]
        for xb, yb in zip(x.chunk(ACCUMULATE), y.chunk(ACCUMULATE)):
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(xb * 4).float(), yb)
                accelerator.backward(loss)
                watch.log(loss=loss)  # accelerate divides the loss it scales by the accumulation steps
                losses.append(loss.item())
                if accelerator.sync_gradients:
                    truth["grad_norm"].append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
                opt.step()
                opt.zero_grad()
        truth["loss"].append(sum(losses) / len(losses))
        truth["skipped"].append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        truth["accelerate_skipped"].append(accelerator.optimizer_step_was_skipped)
    watch.close()
    truth["scaler"] = accelerator.scaler is not None
    (out / "truth.json").write_text(json.dumps(truth))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
