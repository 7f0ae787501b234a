"""Tiny Hugging Face Llama models for the checkpoint, export and tokenizer tests (built here, nothing downloaded)."""

from __future__ import annotations

import torch
from torch import nn

from pp_tp.parity import rel_err

TINY_HF = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


def llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_HF, "tie_word_embeddings": False, **kw})


def llama(config, device: str = "cpu", seed: int = 0) -> nn.Module:
    """The model of `config` with seeded random weights (norms near 1, so every path is exercised)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if device != "meta":
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def from_pretrained(path: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)


def max_param_err(got: nn.Module, want: dict[str, torch.Tensor]) -> float:
    """Largest relative error of `got`'s parameters against `want` (keys: the model's own names)."""
    named = dict(got.named_parameters(remove_duplicate=False))
    return max(rel_err(named[k].detach(), v) for k, v in want.items())
