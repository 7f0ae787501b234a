"""A small ViT classifier (TP declared with `_tp_plan` and `_tp_col` / `_tp_row`) and its layout (registered on
import)."""

from pp_tp.layout import register_layout
from pp_tp.models.vit.layout import VIT
from pp_tp.models.vit.model import ViT, ViTArgs

register_layout(VIT)

__all__ = ["VIT", "ViT", "ViTArgs"]
