"""Hugging Face transformers decoder LMs (the layout registers on import; transformers is imported lazily)."""

from pp_tp.models.hf.layout import HF
from pp_tp.stages.layouts import register_layout

register_layout(HF)

__all__ = ["HF"]
