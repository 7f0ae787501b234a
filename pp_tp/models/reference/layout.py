"""The reference Transformer's model layout and tensor-parallel plan."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pp_tp.config.schema import ModelShape
from pp_tp.layout import ExpertsSpec, ModelDims, ModelLayout, in_order
from pp_tp.models.reference.model import Transformer, document_mask, param_init_std, rope_cache
from pp_tp.models.reference.moe import init_expert_bias
from pp_tp.parallel.tensor_parallel import rules_present


def _dims(model: Transformer) -> ModelDims:
    a = model.args
    return ModelDims(a.n_layers, a.dim, a.n_heads, a.kv_heads, a.ffn_dim, a.vocab_size, a.max_seq_len, a.tie_embeddings)


def _init_buffers(stage: nn.Module, model: Transformer) -> None:
    a = model.args
    stage.rope = rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, stage.rope.device)
    init_expert_bias(stage)  # persistent: a source, when there is one, overwrites it afterwards


def _document_mask(stage: nn.Module, position_ids: torch.Tensor) -> torch.Tensor | None:
    """The blocks' mask for per-token positions: over the keys gathered under context parallel when the step packs
    documents (its cp rank's queries inside their documents), None for plain causal under cp (the attention runs
    by blocks, no mask), else `document_mask`."""
    cp = getattr(stage, "context_parallel", None)
    if cp is None:
        return document_mask(position_ids)
    if not cp.documents:
        return None
    return cp.attention_mask(position_ids.shape[1], position_ids.device, None, position_ids)


def _specialize(model: Transformer) -> ModelLayout:
    """REFERENCE itself for the dense model; with experts, the experts named for expert parallel and TP of
    experts, shared experts as dense TP MLPs, and only the rules some block has (MoE layers hold no w1/w2/w3)."""
    if not model.args.n_experts:
        return REFERENCE
    return dataclasses.replace(
        REFERENCE,
        specialize=None,
        tp_plan=rules_present({**BLOCK_TP_PLAN, **SHARED_EXPERTS_TP_PLAN}, model.layers.children()),
        experts_spec=experts_spec(model.args),
    )


def experts_spec(args: ModelShape) -> ExpertsSpec:
    """The reference MoE's experts (moe.py): transformers' packed weights and routed call, TP of experts declared,
    its softmax router (the sigmoid one's probabilities are not softmax) and router expert bias."""
    return ExpertsSpec(
        modules=("feed_forward.experts",),
        n_experts=args.n_experts,
        top_k=args.top_k,
        tp=True,
        routers=("feed_forward.gate",) if args.router == "softmax" else (),
        bias=("feed_forward.gate.expert_bias",),
    )


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

# An MoE layer's shared experts: a dense SwiGLU MLP of its own sub-block.
SHARED_EXPERTS_TP_PLAN = {
    "feed_forward.shared_experts": "replicate_input",
    "feed_forward.shared_experts.w1": "colwise",
    "feed_forward.shared_experts.w3": "colwise",
    "feed_forward.shared_experts.w2": "rowwise",
}

REFERENCE = ModelLayout(
    name="reference",
    matches=lambda m: isinstance(m, Transformer),
    dims=_dims,
    first=in_order("tok_embeddings"),
    blocks="layers",
    last=in_order("norm", "output"),
    shared=("rope",),
    block_inputs=lambda stage, h: (stage.rope,),
    call_block=lambda block, h, extras, index: block(h, *extras),
    init_buffers=_init_buffers,
    tp_plan=BLOCK_TP_PLAN,
    qk_norms=("attention.q_norm", "attention.k_norm"),
    init_std=param_init_std,
    static_block_inputs=True,  # the rotary table only
    specialize=_specialize,
    document_block_inputs=lambda stage, h, pos: (stage.rope[pos], _document_mask(stage, pos)),
)
