"""A small ViT classifier: images in, class logits out.

Patch embedding (a strided conv) plus a learned position embedding gives `[B, N, dim]` patch tokens; pre-norm
Transformer blocks; a final norm, the mean over the patches and a linear head. Each block declares its tensor
parallelism two ways, so one model exercises both: the attention with `_tp_plan` (column-parallel q, k, v and a
row-parallel output projection; the attention reads its head count off the shard) and the MLP with
`_tp_col` / `_tp_row`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pp_tp.models.credit.model import CreditArgs


@dataclass(frozen=True)
class ViTArgs(CreditArgs):
    """CREDIT's image and width keys (its grid is the image), RGB by default, and the classes."""

    channels: int = 3
    n_classes: int = 10

    @property
    def n_patches(self) -> int:
        return self.grid**2


class Patches(nn.Module):
    def __init__(self, a: ViTArgs):
        super().__init__()
        self.proj = nn.Conv2d(a.channels, a.dim, a.patch_size, stride=a.patch_size)
        self.pos = nn.Parameter(torch.zeros(1, a.n_patches, a.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos


class SelfAttention(nn.Module):
    """Full (non-causal) self-attention over the patches; heads = q's output width / head_dim."""

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

    def __init__(self, a: ViTArgs):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(a.dim), SelfAttention(a.dim, a.n_heads)
        self.norm2, self.mlp = nn.LayerNorm(a.dim), Mlp(a.dim, a.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MeanPool(nn.Module):
    """The mean over the patch tokens: `[B, N, dim]` -> `[B, dim]`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


class ViT(nn.Module):
    def __init__(self, a: ViTArgs):
        super().__init__()
        self.args = a
        self.patch_embed = Patches(a)
        self.blocks = nn.ModuleList(ViTBlock(a) for _ in range(a.n_layers))
        self.norm, self.pool, self.head = nn.LayerNorm(a.dim), MeanPool(), nn.Linear(a.dim, a.n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch_embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.pool(self.norm(h)))
