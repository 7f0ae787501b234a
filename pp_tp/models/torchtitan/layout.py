"""torchtitan 0.3.0's decoder models (llama3, qwen3 dense): the model layout and tensor-parallel plan.

A torchtitan `Decoder` keeps `tok_embeddings`, `layers` (a ModuleDict), `norm` and `lm_head`; each block is
called as `block(h, attention_masks, positions)` and its attention owns its RoPE cache. Two layouts, as the
attention projects q/k/v through one fused `wqkv` (llama3 and qwen3 flavors' default) or three Linears.

TP at the Megatron minimum (2 all-reduces forward, 2 backward per block and microbatch): "replicate_input"
on attention and feed_forward, column-parallel q/k/v (or wqkv) and w1/w3, row-parallel wo and w2.
torchtitan's fused `wqkv` weight is laid out [n_kv_heads, heads_per_kv + 2, head_dim] along its rows
(FusedQKVLinear), i.e. grouped by KV head, so a contiguous column split hands each TP rank
n_kv_heads / tp whole groups: whole q, k and v heads, no new style needed (n_kv_heads % tp is checked).
Qwen3's per-head q/k norms are replicated with their gradients summed over TP once per step.

Per-step extras (`positions`, `attention_masks`) reach the blocks through `set_step_kwargs`: one entry per
microbatch, consumed in microbatch order by the stage's forwards (every torch schedule runs a stage's
forwards in microbatch order).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.layout import ModelDims, ModelLayout

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


def _dims(model: nn.Module) -> ModelDims:
    for key, block in model.layers.items():
        if getattr(block, "moe_enabled", False) or not hasattr(block, "feed_forward"):
            raise ConfigError(
                f"torchtitan model layers.{key} is a mixture-of-experts block: pp_tp's torchtitan layouts take "
                "dense decoders only; use a dense flavor or torchtitan's own pipelining_fn"
            )
    attn = _attention(next(iter(model.layers.values())))
    c = model.config
    return ModelDims(
        n_layers=len(model.layers),
        dim=c.dim,
        n_heads=attn.n_heads,
        n_kv_heads=attn.n_kv_heads,
        ffn_dim=next(iter(model.layers.values())).feed_forward.w1.out_features,
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
    for m in stage.modules():
        if type(m).__name__.endswith("RoPE") and hasattr(m, "_init_self_buffers"):
            m._init_self_buffers(buffer_device=None)  # recomputed on the cache's own (materialized) device


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
        matches=lambda m: is_torchtitan_decoder(m) and _fused(m) == fused,
        dims=_dims,
        embed="tok_embeddings",
        blocks="layers",
        norm="norm",
        head="lm_head",
        shared=(),
        block_inputs=_block_inputs,
        call_block=lambda block, h, extras: block(h, *extras),
        init_buffers=_init_buffers,
        tp_plan={**_BASE_PLAN, **qkv},
        qk_norms=("attention.q_norm", "attention.k_norm"),
        attention="attention",
    )


TORCHTITAN_DECODER = _layout("torchtitan_decoder", fused=True)
TORCHTITAN_DECODER_QKV = _layout("torchtitan_decoder_qkv", fused=False)
