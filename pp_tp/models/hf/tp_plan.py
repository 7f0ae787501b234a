"""A Hugging Face model's declared `base_model_tp_plan`, translated into pp_tp's no-SP block plan.

HF's `colwise` / `rowwise` map to the same styles with local outputs; `replicate_input` goes on every
module holding column-parallel layers, so backward all-reduces once per sub-block (Megatron minimum:
2 all-reduces forward and 2 backward per block). Where HF gathers (`colwise_gather_output` followed by
`rowwise_split_input`: fused projections, full-width q/k norms) the same gather is kept, which is exact.
Styles pp_tp cannot honour give the layout a `tp_refusal`, raised in one line when parallel.tp > 1.
MoE experts modules come from `base_model_ep_plan` (`ep_dispatch_experts`); their declared TP (`moe_tp_experts`
with `packed_colwise` gate/up and `rowwise` down) is pp_tp's experts pass (pp_tp.parallel.experts), not a style.
"""

from __future__ import annotations

from torch import nn

# HF style -> pp_tp style (pp_tp.parallel.tensor_parallel.STYLES).
SUPPORTED = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather_output",
    "rowwise_split_input": "rowwise_split_input",
    "replicated_with_grad_allreduce": "replicated_with_grad_allreduce",
    "replicate": "replicate",
}
_COLUMN = ("colwise", "colwise_gather_output")
# HF styles that shard or dispatch MoE experts (the refusal says so; any other unsupported style is named as is).
_EXPERT_STYLES = {"grouped_gemm", "ep_dispatch_experts", "moe_tp_experts", "packed_colwise", "packed_rowwise"}
# The expert TP pp_tp's experts pass runs: gate/up packed on the output dim, split per part; down row-parallel.
_EXPERTS_TP = {"": "moe_tp_experts", ".gate_up_proj": "packed_colwise", ".down_proj": "rowwise"}


def block_experts(model: nn.Module, blocks_key: str) -> tuple[tuple[str, ...], bool]:
    """(block-relative experts modules from base_model_ep_plan, whether base_model_tp_plan declares their TP)."""
    prefix = f"{blocks_key}.*."
    ep_plan = getattr(model.config, "base_model_ep_plan", None) or {}
    experts = tuple(r[len(prefix) :] for r, s in ep_plan.items() if s == "ep_dispatch_experts" and r.startswith(prefix))
    declared = getattr(model.config, "base_model_tp_plan", None) or {}
    tp = bool(experts) and all(
        declared.get(f"{prefix}{e}{part}") == s for e in experts for part, s in _EXPERTS_TP.items()
    )
    return experts, tp


def _is_expert_rule(rule: str, experts: tuple[str, ...]) -> bool:
    return any(rule == e or rule.startswith(e + ".") for e in experts)


def block_tp_plan(model: nn.Module, blocks_key: str) -> tuple[dict[str, str], str | None]:
    """(block-relative plan, refusal text or None) from the config's base_model_tp_plan."""
    family = type(model).__name__
    declared = getattr(model.config, "base_model_tp_plan", None)
    if not declared:
        return {}, (
            f"model {family} declares no base_model_tp_plan, so pp_tp cannot shard it; set parallel.tp = 1 "
            "or register a layout with a tp_plan (pp_tp.extend.register_layout)"
        )
    prefix = f"{blocks_key}.*."
    experts, experts_tp = block_experts(model, blocks_key)
    plan: dict[str, str] = {}
    for rule, style in declared.items():
        if not rule.startswith(prefix):
            continue  # embedding and head are pp_tp's own (parallel.embedding, parallel.loss_parallel)
        if experts_tp and _is_expert_rule(rule[len(prefix) :], experts):
            continue  # the experts pass shards them
        if style not in SUPPORTED:
            why = " (MoE experts stay whole per rank)" if style in _EXPERT_STYLES else ""
            return {}, (
                f"model {family}: its tensor-parallel rule {rule!r} uses Hugging Face style {style!r}, which "
                f"pp_tp does not support{why}; set parallel.tp = 1"
            )
        plan[rule[len(prefix) :]] = SUPPORTED[style]
    parents = {rule.rpartition(".")[0] for rule, style in plan.items() if style in _COLUMN and "." in rule}
    return {**{p: "replicate_input" for p in sorted(parents)}, **plan}, None
