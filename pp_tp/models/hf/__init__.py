"""Hugging Face transformers models (registered on import; transformers itself is imported lazily)."""

from pp_tp.models.hf.layout import HF_LLAMA
from pp_tp.stages.layouts import register_layout

register_layout(HF_LLAMA)

__all__ = ["HF_LLAMA"]
