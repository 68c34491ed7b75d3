"""nanoGPT's training loop, call for call, on a tiny GPT built from code, recorded with ONE line.

The loop follows karpathy/nanoGPT ``train.py``: autocast + ``GradScaler(enabled=dtype == 'float16')``,
``gradient_accumulation_steps`` micro-steps with ``loss = loss / gradient_accumulation_steps``,
``scaler.unscale_`` + ``clip_grad_norm_(model.parameters(), grad_clip)``, AdamW with nanoGPT's
decay / no-decay groups (fused where this torch has it), the warm-up + cosine ``get_lr``, and the
log line nanoGPT prints. The model ties ``lm_head.weight`` to ``transformer.wte.weight`` as
nanoGPT's ``model.py`` does. The only ampwatch line is ``ampwatch.attach(...)``.

    python examples/nanogpt_loop.py --out runs/nanogpt.sqlite --iters 30
    ampwatch summary runs/nanogpt.sqlite

Runs on the CPU in seconds (random tokens, nothing downloaded). ``tests/test_nanogpt.py`` checks
every recorded column against the numbers this loop computes itself.
"""
from __future__ import annotations

import argparse
import inspect
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias), nn.LayerNorm(c.n_embd, bias=c.bias)
        self.attn = nn.ModuleDict(dict(c_attn=nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias),
                                       c_proj=nn.Linear(c.n_embd, c.n_embd, bias=c.bias)))
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias), gelu=nn.GELU(),
                                      c_proj=nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)))
        self.n_head = c.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp.c_proj(self.mlp.gelu(self.mlp.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """nanoGPT's GPT, shrunk: token + position embeddings, pre-LN blocks, a TIED lm_head."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd), wpe=nn.Embedding(c.block_size, c.n_embd),
            drop=nn.Dropout(c.dropout), h=nn.ModuleList([Block(c) for _ in range(c.n_layer)]),
            ln_f=nn.LayerNorm(c.n_embd, bias=c.bias)))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in nanoGPT
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple, device_type: str):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        # nanoGPT asks for CUDA; CPU fused AdamW exists too on recent torch, so use it where offered
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type in ("cuda", "cpu")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": True} if fused else {}))


def get_lr(it: int, learning_rate: float, warmup_iters: int, lr_decay_iters: int, min_lr: float) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def train(out: Optional[str] = None, *, max_iters: int = 20, dtype: str = "float16", seed: int = 1337,
          gradient_accumulation_steps: int = 4, batch_size: int = 4, grad_clip: float = 1.0,
          init_scale: float = 2.0 ** 16, fault: Optional[tuple[int, float]] = None,
          verbose: bool = True, **attach_options: Any) -> dict[str, Any]:
    """Train and return the loop's own numbers (per iteration) and the model. ``out``: record there
    with ampwatch (None: not recorded). ``fault=(iter, shift)`` adds ``shift`` to ``ln_f``'s bias at
    that iteration (a weight gone wrong: ``lm_head``'s input grows and its fp16 weight gradient
    overflows)."""
    torch.manual_seed(seed)
    device_type = "cpu"
    config = GPTConfig()
    model = GPT(config)
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    ctx = nullcontext() if dtype == "float32" else torch.autocast(device_type=device_type, dtype=ptdtype)
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"), init_scale=init_scale)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), device_type)
    data = torch.randint(config.vocab_size, (4096,), generator=torch.Generator().manual_seed(seed))

    def get_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - config.block_size, (batch_size,), generator=torch.Generator().manual_seed(i))
        x = torch.stack([data[j:j + config.block_size] for j in ix])
        return x, torch.stack([data[j + 1:j + 1 + config.block_size] for j in ix])

    watch = None
    if out is not None:
        import ampwatch
        watch = ampwatch.attach(model, optimizer, scaler, path=out, config={"grad_clip": grad_clip}, **attach_options)
    truth: dict[str, list] = {k: [] for k in ("loss", "printed", "scale", "lr", "grad_norm", "skipped")}
    batches = 0
    X, Y = get_batch(batches)
    for iter_num in range(max_iters):
        if fault is not None and iter_num == fault[0]:
            with torch.no_grad():
                model.transformer.ln_f.bias.add_(fault[1])
        lr = get_lr(iter_num, 1e-3, 5, max_iters, 1e-4)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        micro = []
        for micro_step in range(gradient_accumulation_steps):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            micro.append(loss.item())  # ground truth only (nanoGPT reads it once, below)
            batches += 1
            X, Y = get_batch(batches)
            scaler.scale(loss).backward()
        truth["scale"].append(scaler.get_scale() if scaler.is_enabled() else None)
        before = [p.detach().clone() for p in model.parameters()]
        norm = None
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # nanoGPT drops this
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        lossf = loss.item() * gradient_accumulation_steps  # what nanoGPT prints
        truth["loss"].append(sum(micro))
        truth["printed"].append(lossf)
        truth["lr"].append(lr)
        truth["grad_norm"].append(None if norm is None else float(norm))
        truth["skipped"].append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        if verbose:
            print(f"iter {iter_num}: loss {lossf:.4f}")
    if watch is not None:
        watch.close()
    return {"truth": truth, "model": model, "path": None if watch is None else watch.path,
            "micro_batches": gradient_accumulation_steps, "grad_clip": grad_clip}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/nanogpt.sqlite")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run file")
    args = parser.parse_args()
    result = train(args.out, max_iters=args.iters, dtype=args.dtype, overwrite=args.overwrite)
    print(f"recorded to {result['path']}")
