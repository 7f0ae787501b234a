"""A small CREDIT-style weather model: gridded fields in, gridded fields out (regression).

Patch embedding (a strided conv) plus a learned position field, Transformer blocks on the `[B, dim, h, w]` patch
grid, a channel norm and a transposed-conv head back to the input grid. Each block opts into tensor parallelism
the way CREDIT does, by naming its layers: `_tp_col` / `_tp_row` pair the attention's fused qkv projection with
its output projection, and the MLP's two 1x1 convs. The fused qkv is laid out per head ([heads, 3, head_dim]), so
a column shard holds whole heads with their q, k and v, and the attention reads its head count off the shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class CreditArgs:
    channels: int = 4  # physical variables per grid point, in and out
    image_size: int = 16  # the grid is image_size x image_size
    patch_size: int = 4
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 64

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size


class ChannelNorm(nn.LayerNorm):
    """LayerNorm over the channel dim of a `[B, C, h, w]` field."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class PatchEmbed(nn.Module):
    def __init__(self, a: CreditArgs):
        super().__init__()
        self.proj = nn.Conv2d(a.channels, a.dim, a.patch_size, stride=a.patch_size)
        self.pos = nn.Parameter(torch.zeros(1, a.dim, a.grid, a.grid))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.pos


class Attention(nn.Module):
    """Full (non-causal) self-attention over the patches; heads = qkv's output width / (3 * head_dim)."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        # No bias: a key bias has an exactly zero gradient (softmax ignores a per-query shift), dead weight here.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(b, n, -1))


class CreditBlock(nn.Module):
    _tp_col = ["attn.qkv", "mlp.0"]
    _tp_row = ["attn.proj", "mlp.2"]

    def __init__(self, a: CreditArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(a.dim)
        self.attn = Attention(a.dim, a.n_heads)
        self.norm2 = ChannelNorm(a.dim)
        self.mlp = nn.Sequential(nn.Conv2d(a.dim, a.ffn_dim, 1), nn.GELU(), nn.Conv2d(a.ffn_dim, a.dim, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, d, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        t = t + self.attn(self.norm1(t))
        x = t.transpose(1, 2).reshape(b, d, h, w)
        return x + self.mlp(self.norm2(x))


class CreditModel(nn.Module):
    def __init__(self, a: CreditArgs):
        super().__init__()
        self.args = a
        self.patch_embed = PatchEmbed(a)
        self.blocks = nn.ModuleList(CreditBlock(a) for _ in range(a.n_layers))
        self.norm = ChannelNorm(a.dim)
        self.head = nn.ConvTranspose2d(a.dim, a.channels, a.patch_size, stride=a.patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch_embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def init_std(fqn: str, n_layers: int) -> float | None:
    """Norm weights ones, biases and the position field zeros, every other weight N(0, 0.02)."""
    if fqn.endswith(".bias") or fqn.endswith(".pos"):
        return 0.0
    module = fqn.rsplit(".", 2)[-2]
    return None if module.startswith("norm") else 0.02
