"""The demo's model and data: a tiny GPT and its seeded token batches, built from code (no download).

Shared by ``ampwatch demo`` (:mod:`.demo`) and the Lightning sample (:mod:`.lightning_sample`).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d)})
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc", nn.Linear(d, 4 * d))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("proj", nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn["qkv"](self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn["proj"](y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A nanoGPT-shaped decoder: token + position embeddings, pre-LN blocks, tied LM head."""

    def __init__(self, vocab: int = 64, d: int = 64, layers: int = 2, heads: int = 4, seq: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: counted once in param_count
        for module in self.modules():  # nanoGPT's init: small weights, a loss that starts near ln(vocab)
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def batches(vocab: int, seq: int, batch: int, seed: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences that count up by a random stride mod vocab: learnable, so healthy runs converge."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        tokens = (start + stride * torch.arange(seq + 1)) % vocab
        yield tokens[:, :-1], tokens[:, 1:]
