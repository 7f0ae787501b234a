"""Hugging Face safetensors checkpoints in and out of a pipeline, per rank: no rank ever holds the whole model."""

from __future__ import annotations

from pp_tp.hf_checkpoint.load import load_stage
from pp_tp.hf_checkpoint.save import parse_size, save_pretrained
from pp_tp.hf_checkpoint.source import HFSource, has_weights, open_checked

__all__ = ["HFSource", "has_weights", "load_stage", "open_checked", "parse_size", "save_pretrained"]
