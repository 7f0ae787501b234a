"""The model a `[model]` section describes, built on any device (meta for pipelined runs)."""

from __future__ import annotations

import torch
from torch import nn

from pp_tp.config import ModelConfig
from pp_tp.models.reference.model import ModelArgs, Transformer


def model_args(mcfg: ModelConfig) -> ModelArgs:
    """The reference Transformer's arguments, without the job-only fields (kind, seed)."""
    return ModelArgs(**{k: getattr(mcfg, k) for k in ModelArgs.__dataclass_fields__})


def build_model(mcfg: ModelConfig, device: str | torch.device = "meta") -> nn.Module:
    """`kind = "reference"`: our Transformer; `kind = "hf_llama"`: a transformers LlamaForCausalLM of the same shape."""
    args = model_args(mcfg)
    if mcfg.kind == "hf_llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=args.vocab_size,
            hidden_size=args.dim,
            intermediate_size=args.ffn_dim,
            num_hidden_layers=args.n_layers,
            num_attention_heads=args.n_heads,
            num_key_value_heads=args.kv_heads,
            max_position_embeddings=args.max_seq_len,
            attention_bias=args.attn_bias,
            tie_word_embeddings=args.tie_embeddings,
            rms_norm_eps=args.norm_eps,
            rope_theta=args.rope_theta,
        )
        cfg._attn_implementation = "sdpa"
        with torch.device(device):
            return LlamaForCausalLM(cfg)
    with torch.device(device):
        return Transformer(args)
