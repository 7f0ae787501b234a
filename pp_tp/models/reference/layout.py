"""The reference Transformer's model layout and tensor-parallel plan."""

from __future__ import annotations

from torch import nn

from pp_tp.layout import ModelDims, ModelLayout
from pp_tp.models.reference.model import Transformer, document_mask, param_init_std, rope_cache


def _dims(model: Transformer) -> ModelDims:
    a = model.args
    return ModelDims(a.n_layers, a.dim, a.n_heads, a.kv_heads, a.ffn_dim, a.vocab_size, a.max_seq_len, a.tie_embeddings)


def _init_buffers(stage: nn.Module, model: Transformer) -> None:
    a = model.args
    stage.rope = rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, stage.rope.device)


# Column-parallel q/k/v and w1/w3, row-parallel wo and w2; "replicate_input" on the attention and MLP
# makes backward all-reduce once per sub-block (docs/design.md, tensor parallelism).
BLOCK_TP_PLAN = {
    "attention": "replicate_input",
    "feed_forward": "replicate_input",
    "attention.wq": "colwise",
    "attention.wk": "colwise",
    "attention.wv": "colwise",
    "attention.wo": "rowwise",
    "feed_forward.w1": "colwise",
    "feed_forward.w3": "colwise",
    "feed_forward.w2": "rowwise",
}

REFERENCE = ModelLayout(
    name="reference",
    matches=lambda m: isinstance(m, Transformer),
    dims=_dims,
    embed="tok_embeddings",
    blocks="layers",
    norm="norm",
    head="output",
    shared=("rope",),
    block_inputs=lambda stage, h: (stage.rope,),
    call_block=lambda block, h, extras: block(h, *extras),
    init_buffers=_init_buffers,
    tp_plan=BLOCK_TP_PLAN,
    qk_norms=("attention.q_norm", "attention.k_norm"),
    init_std=param_init_std,
    static_block_inputs=True,  # the rotary table only
    document_block_inputs=lambda stage, h, pos: (stage.rope[pos], document_mask(pos)),
)
