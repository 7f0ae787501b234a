"""Model families pp_tp knows: each registers its layout when imported; factory registers the `model.kind`s."""

from pp_tp.models import credit, factory, hf, reference, torchtitan, vit
from pp_tp.models.reference import ModelArgs, Transformer

__all__ = ["ModelArgs", "Transformer", "credit", "factory", "hf", "reference", "torchtitan", "vit"]
