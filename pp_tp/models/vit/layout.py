"""The ViT's layout: patch embedding before the blocks, norm, mean pool and head after them."""

from __future__ import annotations

from pp_tp.layout import ModelDims, ModelLayout, blocks_layout
from pp_tp.models.credit.model import init_std
from pp_tp.models.vit.model import ViT


def _dims(model: ViT) -> ModelDims:
    a = model.args
    return ModelDims(
        a.n_layers, a.dim, a.n_heads, a.n_heads, a.ffn_dim, 0, a.n_patches, False, head_dim=a.dim // a.n_heads
    )


VIT: ModelLayout = blocks_layout(
    "vit",
    lambda m: isinstance(m, ViT),
    _dims,
    pre=("patch_embed",),
    blocks="blocks",
    post=("norm", "pool", "head"),
    init_std=init_std,  # the same rule as CREDIT's: norms ones, biases and positions zeros, weights N(0, 0.02)
    attention="attn",
)
