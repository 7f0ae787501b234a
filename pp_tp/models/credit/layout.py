"""The CREDIT-style model's layout: patch embedding before the blocks, channel norm and head after them."""

from __future__ import annotations

from pp_tp.layout import ModelDims, ModelLayout, blocks_layout
from pp_tp.models.credit.model import CreditModel, init_std


def _dims(model: CreditModel) -> ModelDims:
    a = model.args
    return ModelDims(
        a.n_layers, a.dim, a.n_heads, a.n_heads, a.ffn_dim, 0, a.grid * a.grid, False, head_dim=a.dim // a.n_heads
    )


CREDIT: ModelLayout = blocks_layout(
    "credit",
    lambda m: isinstance(m, CreditModel),
    _dims,
    pre=("patch_embed",),
    blocks="blocks",
    post=("norm", "head"),
    init_std=init_std,
    attention="attn",
)
