"""A small ViT-like classifier for the non-LM tests: patch embedding -> blocks on [B, N, D] tokens -> norm, mean
pool, linear head. Its attention is planned with `_tp_plan` (the existing mechanism) and its MLP declared with
`_tp_col` / `_tp_row`, so one block exercises both."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pp_tp.extend import register_layout
from pp_tp.layout import ModelDims, blocks_layout


class Patches(nn.Module):
    def __init__(self, channels: int, dim: int, patch: int, n_patches: int):
        super().__init__()
        self.proj = nn.Conv2d(channels, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, n_patches, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos


class SelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.q, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(3))
        # A key bias's gradient is exactly zero (softmax ignores a per-query shift): AdamW would amplify roundoff.
        self.k = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ViTBlock(nn.Module):
    _tp_plan = {"attn": "replicate_input", "attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise",
                "attn.proj": "rowwise"}  # fmt: skip
    _tp_col = "mlp.fc1"
    _tp_row = "mlp.fc2"

    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), SelfAttention(dim, n_heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), Mlp(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


class ViT(nn.Module):
    def __init__(self, channels=3, image=16, patch=4, dim=32, depth=4, n_heads=4, hidden=64, classes=10):
        super().__init__()
        self.n_heads, self.hidden = n_heads, hidden
        self.patch_embed = Patches(channels, dim, patch, (image // patch) ** 2)
        self.blocks = nn.Sequential(*(ViTBlock(dim, n_heads, hidden) for _ in range(depth)))
        self.norm, self.pool, self.head = nn.LayerNorm(dim), MeanPool(), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.norm(self.blocks(self.patch_embed(x)))))


def _dims(m: ViT) -> ModelDims:
    dim = m.head.in_features
    n = m.patch_embed.pos.shape[1]
    return ModelDims(len(m.blocks), dim, m.n_heads, m.n_heads, m.hidden, 0, n, False, head_dim=dim // m.n_heads)


VIT = blocks_layout(
    "vit_test", lambda m: isinstance(m, ViT), _dims, ("patch_embed",), "blocks", ("norm", "pool", "head")
)
register_layout(VIT)
