"""Model families pp_tp knows: each registers its layout when imported."""

from pp_tp.models import credit, hf, reference, torchtitan, vit
from pp_tp.models.reference import ModelArgs, Transformer

__all__ = ["ModelArgs", "Transformer", "credit", "hf", "reference", "torchtitan", "vit"]
