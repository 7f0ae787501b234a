"""The reference Llama-style Transformer and its layout (registered on import)."""

from pp_tp.layout import register_layout
from pp_tp.models.reference.layout import REFERENCE
from pp_tp.models.reference.model import ModelArgs, Transformer

register_layout(REFERENCE)

__all__ = ["REFERENCE", "ModelArgs", "Transformer"]
