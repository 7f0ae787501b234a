"""torchtitan 0.3.0's decoder models (llama3, qwen3 dense and MoE, deepseek_v3): model layouts and the TP plan.

A torchtitan `Decoder` keeps `tok_embeddings`, `layers` (a ModuleDict), `norm` and `lm_head`; each block is
called as `block(h, attention_masks, positions)` and its attention owns its RoPE cache. Two layouts, as the
attention projects q/k/v through one fused `wqkv` (llama3 and qwen3 flavors' default) or three Linears.

TP at the Megatron minimum (2 all-reduces forward, 2 backward per block and microbatch): "replicate_input"
on attention and feed_forward, column-parallel q/k/v (or wqkv) and w1/w3, row-parallel wo and w2.
torchtitan's fused `wqkv` weight is laid out [n_kv_heads, heads_per_kv + 2, head_dim] along its rows
(FusedQKVLinear), i.e. grouped by KV head, so a contiguous column split hands each TP rank
n_kv_heads / tp whole groups: whole q, k and v heads, no new style needed (n_kv_heads % tp is checked).
Qwen3's per-head q/k norms are replicated with their gradients summed over TP once per step.

MoE models (a block with `moe_enabled`: qwen3 MoE flavors, deepseek_v3) get their own layout: torchtitan's
router, token reorder/combine and shared experts run as they are; its GroupedExperts
(`moe.routed_experts.inner_experts`, called with tokens sorted by expert and their counts) are the experts of the
layout's record (`experts_spec`), which expert parallel dispatches (pp_tp.parallel.experts); `moe.expert_bias_E` is
its expert bias. MoE.tokens_per_expert_E keeps counting this rank's routed tokens in each forward as in
torchtitan's own model (torchtitan's optimizer hook reads and zeroes it); pp_tp's own counts are
`Pipeline.moe_stats`. TP of these models is refused (their attention differs per family; EP splits experts).

Per-step extras (`positions`, `attention_masks`) reach the blocks through `set_step_kwargs`: one entry per
microbatch, consumed in microbatch order by the stage's forwards (every torch schedule runs a stage's
forwards in microbatch order).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.layout import ExpertsSpec, ModelDims, ModelLayout, in_order

_STEP_KWARGS = "_pp_tp_step_kwargs"


def is_torchtitan_decoder(model: nn.Module) -> bool:
    """A torchtitan Decoder (llama3, qwen3, ...); torchtitan is imported only if it is already loaded."""
    import sys

    decoder = sys.modules.get("torchtitan.models.common.decoder")
    return decoder is not None and isinstance(model, decoder.Decoder)


def _attention(block: nn.Module) -> nn.Module:
    return block.get_submodule("attention")


def _fused(model: nn.Module) -> bool:
    first = next(iter(model.layers.values()))
    return hasattr(_attention(first).qkv_linear, "wqkv")


def _moe_blocks(model: nn.Module) -> list[nn.Module]:
    return [block for block in model.layers.values() if getattr(block, "moe_enabled", False)]


def _has_moe(model: nn.Module) -> bool:
    return bool(_moe_blocks(model))


def _ffn_dim(block: nn.Module) -> int:
    """The dense MLP's hidden size, or for an MoE block one expert's."""
    if getattr(block, "moe_enabled", False):
        return block.moe.routed_experts.inner_experts.w1_EFD.shape[1]
    return block.feed_forward.w1.out_features


def _check_moe(model: nn.Module) -> None:
    """Refuses, in one line, what the MoE layout cannot run as torchtitan's own model does."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

    if getattr(model, "mtp_layers", None):
        raise ConfigError(
            "torchtitan model with mtp_layers (multi-token prediction): pp_tp's stages run the main decoder only; "
            "build the flavor with num_mtp_layers = 0"
        )
    for key, block in model.layers.items():
        dispatcher = block.moe.routed_experts.token_dispatcher if getattr(block, "moe_enabled", False) else None
        if dispatcher is not None and type(dispatcher) not in (LocalTokenDispatcher, AllToAllTokenDispatcher):
            raise ConfigError(
                f"torchtitan model layers.{key}: token dispatcher {type(dispatcher).__name__} is not supported by "
                'pp_tp (its expert parallel replaces it); build the flavor with moe_comm_backend = "standard"'
            )


def _dims(model: nn.Module) -> ModelDims:
    if _has_moe(model):
        _check_moe(model)
    first = next(iter(model.layers.values()))
    attn = _attention(first)
    c = model.config
    return ModelDims(
        n_layers=len(model.layers),
        dim=c.dim,
        n_heads=attn.n_heads,
        n_kv_heads=getattr(attn, "n_kv_heads", attn.n_heads),
        ffn_dim=_ffn_dim(first),
        vocab_size=c.vocab_size,
        max_seq_len=c.max_seq_len,
        tied=bool(c.enable_weight_tying),
    )


def set_step_kwargs(stage: nn.Module, per_microbatch: list[dict[str, Any]]) -> None:
    """Queues one step's per-microbatch block kwargs (`positions`, `attention_masks`) for `stage`."""
    setattr(stage, _STEP_KWARGS, deque(per_microbatch))


def _block_inputs(stage: nn.Module, h: torch.Tensor) -> tuple[Any, ...]:
    queue = getattr(stage, _STEP_KWARGS, None)
    kw = queue.popleft() if queue else {}
    positions = kw.get("positions")
    if positions is not None and positions.shape[:2] != h.shape[:2]:
        raise ValueError(f"positions {tuple(positions.shape)} do not match the microbatch {tuple(h.shape[:2])}")
    return kw.get("attention_masks"), positions


def _init_buffers(stage: nn.Module, model: nn.Module) -> None:
    """Every torchtitan module's own buffers (RoPE caches; MoE expert_bias_E and tokens_per_expert_E, zeros), on
    their own (materialized) device."""
    for m in stage.modules():
        if hasattr(m, "_init_self_buffers"):
            m._init_self_buffers(buffer_device=None)


_BASE_PLAN = {
    "attention": "replicate_input",
    "feed_forward": "replicate_input",
    "attention.wo": "rowwise",
    "feed_forward.w1": "colwise",
    "feed_forward.w3": "colwise",
    "feed_forward.w2": "rowwise",
}
_QKV = ("attention.qkv_linear.wq", "attention.qkv_linear.wk", "attention.qkv_linear.wv")


def _layout(name: str, fused: bool) -> ModelLayout:
    qkv = {"attention.qkv_linear.wqkv": "colwise"} if fused else dict.fromkeys(_QKV, "colwise")
    return ModelLayout(
        name=name,
        matches=lambda m: is_torchtitan_decoder(m) and not _has_moe(m) and _fused(m) == fused,
        dims=_dims,
        first=in_order("tok_embeddings"),
        blocks="layers",
        last=in_order("norm", "lm_head"),
        shared=(),
        block_inputs=_block_inputs,
        call_block=lambda block, h, extras, index: block(h, *extras),
        init_buffers=_init_buffers,
        tp_plan={**_BASE_PLAN, **qkv},
        qk_norms=("attention.q_norm", "attention.k_norm"),
        attention="attention",
    )


def experts_spec(model: nn.Module) -> ExpertsSpec:
    """torchtitan's routed experts: GroupedExperts (w1/w2/w3, not packed: no TP), called grouped by its own
    reorder/combine, sized by its config's num_experts and top_k (read off the first MoE layer), with the MoE's
    expert bias; no router is declared (the auxiliary loss is refused)."""
    moe = _moe_blocks(model)[0].moe
    return ExpertsSpec(
        modules=("moe.routed_experts.inner_experts",),
        n_experts=moe.routed_experts.inner_experts.num_experts,
        top_k=moe.router.top_k,
        grouped=True,
        weights=None,
        bias=("moe.expert_bias_E",),
    )


TORCHTITAN_DECODER = _layout("torchtitan_decoder", fused=True)
TORCHTITAN_DECODER_QKV = _layout("torchtitan_decoder_qkv", fused=False)
TORCHTITAN_MOE = dataclasses.replace(
    TORCHTITAN_DECODER,
    name="torchtitan_moe",
    matches=lambda m: is_torchtitan_decoder(m) and _has_moe(m),
    tp_plan={},
    qk_norms=(),
    tp_refusal="pp_tp runs torchtitan's MoE models without tensor parallelism; set parallel.tp = 1 "
    "(parallel.ep splits the experts)",
    specialize=lambda model: dataclasses.replace(TORCHTITAN_MOE, specialize=None, experts_spec=experts_spec(model)),
)
