"""torchtitan's own decoder models (llama3, qwen3 dense and MoE, deepseek_v3), registered when torchtitan imports."""

import importlib.util

from pp_tp.layout import register_layout
from pp_tp.models.torchtitan.layout import TORCHTITAN_DECODER, TORCHTITAN_DECODER_QKV, TORCHTITAN_MOE, set_step_kwargs

AVAILABLE = importlib.util.find_spec("torchtitan") is not None
if AVAILABLE:
    register_layout(TORCHTITAN_DECODER_QKV)
    register_layout(TORCHTITAN_DECODER)
    register_layout(TORCHTITAN_MOE)

__all__ = ["AVAILABLE", "TORCHTITAN_DECODER", "TORCHTITAN_DECODER_QKV", "TORCHTITAN_MOE", "set_step_kwargs"]
