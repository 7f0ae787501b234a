"""Reference models."""

from pp_tp.models.llama import ModelArgs, Transformer

__all__ = ["ModelArgs", "Transformer"]
