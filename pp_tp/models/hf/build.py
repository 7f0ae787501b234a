"""Hugging Face models from a directory's config.json, built on any device (meta for pipelined runs)."""

from __future__ import annotations

import os

import torch
from torch import nn

from pp_tp.errors import ConfigError


def hf_config(path: str):  # -> transformers.PretrainedConfig (transformers is imported lazily)
    """DIR/config.json as a transformers config; one line when it is missing or not a causal LM's."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model.hf_path = {path!r} has no config.json; give a Hugging Face model directory")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(
            f"model.hf_path = {path!r}: transformers cannot read its config.json ({e}); "
            "give a Hugging Face model directory"
        ) from None


def hf_causal_lm(config, device: str | torch.device = "meta") -> nn.Module:
    """The `*ForCausalLM` of `config`, with the attention implementation config.json asks for (sdpa if none)."""
    from transformers import AutoModelForCausalLM

    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    try:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    except ValueError as e:
        raise ConfigError(
            f"model.hf_path: {type(config).__name__} is not a causal LM transformers can build "
            f"({str(e).splitlines()[0]}); give a decoder LM's directory"
        ) from None
