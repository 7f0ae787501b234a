"""The model abstraction the core sees: where a model's embedding, blocks, norm and head live, and its registry."""

from pp_tp.layout.experts import ExpertsSpec, PackedSwiGLU
from pp_tp.layout.model_layout import (
    Edge,
    ModelDims,
    ModelLayout,
    blocks_layout,
    check_document_mask,
    in_order,
    layout_for,
    register_layout,
)

__all__ = [
    "Edge",
    "ExpertsSpec",
    "ModelDims",
    "ModelLayout",
    "PackedSwiGLU",
    "blocks_layout",
    "check_document_mask",
    "in_order",
    "layout_for",
    "register_layout",
]
