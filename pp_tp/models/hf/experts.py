"""A Hugging Face MoE's experts record (`ExpertsSpec`), read once off what the family declares.

The experts modules come from the config's `base_model_ep_plan` (`ep_dispatch_experts`), TP of experts from its
`base_model_tp_plan` (pp_tp.models.hf.tp_plan), the packed weights' storage from the attributes transformers'
`use_experts_implementation` gives the module (`is_transposed`, `is_concatenated`, `has_bias`, `has_gate`,
`has_post_expert_norm`), top-k from `num_experts_per_tok`, routers from a probe (pp_tp.models.hf.routers) and expert
biases from the blocks' `e_score_correction_bias` buffers (DeepSeek-V3 and the families built like it).
"""

from __future__ import annotations

from torch import nn

from pp_tp.layout import ExpertsSpec, PackedSwiGLU
from pp_tp.models.hf.routers import block_routers
from pp_tp.models.hf.tp_plan import block_experts
from pp_tp.parallel.tensor_parallel import matches_rule

_BIAS = "e_score_correction_bias"
_GATE_UP, _DOWN = "gate_up_proj", "down_proj"


def experts_spec(model: nn.Module, blocks_key: str, blocks: list[nn.Module]) -> ExpertsSpec | None:
    """The model's experts record, or None when it declares no experts modules its blocks hold."""
    modules, tp_declared = block_experts(model, blocks_key)
    found = [m for b in blocks for n, m in b.named_modules() if n and any(matches_rule(r, n) for r in modules)]
    if not found:
        return None
    module = found[0]
    weights = _packed(module)
    return ExpertsSpec(
        modules=modules,
        n_experts=next(iter(module.parameters())).shape[0],  # transformers keeps the expert on dim 0
        top_k=getattr(model.config, "num_experts_per_tok", None),
        weights=weights,
        # TP of experts splits plain packed SwiGLU only: no norm after each expert
        tp=tp_declared and weights is not None and not getattr(module, "has_post_expert_norm", False),
        count_attr="num_experts" if "num_experts" in vars(module) else None,  # transformers' kernels size bins by it
        routers=block_routers(model, blocks),
        bias=tuple(sorted({n for b in blocks for n, _ in b.named_buffers() if n.rpartition(".")[2] == _BIAS})),
    )


def _packed(module: nn.Module) -> PackedSwiGLU | None:
    """transformers' packed gate/up and down weights as this module stores them; None without a packed gate."""
    params = dict(module.named_parameters(recurse=False))
    if not getattr(module, "has_gate", True) or _GATE_UP not in params or _DOWN not in params:
        return None
    transposed, bias = getattr(module, "is_transposed", False), getattr(module, "has_bias", False)
    return PackedSwiGLU(
        gate_up=_GATE_UP,
        down=_DOWN,
        gate_up_dim=2 if transposed else 1,
        down_dim=1 if transposed else 2,
        concatenated=getattr(module, "is_concatenated", True),
        gate_up_bias=f"{_GATE_UP}_bias" if bias else None,
        down_bias=f"{_DOWN}_bias" if bias else None,
    )
