"""Hugging Face transformers decoder LMs (the layout registers on import; transformers is imported lazily)."""

from pp_tp.layout import register_layout
from pp_tp.models.hf import cp_attention  # noqa: F401  (registers HF attention with context parallel)
from pp_tp.models.hf.layout import HF

register_layout(HF)

__all__ = ["HF"]
