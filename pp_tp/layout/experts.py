"""One record of what pp_tp knows about a family's mixture-of-experts experts (`ModelLayout.experts_spec`).

Expert parallel, TP of experts, the planner, routing statistics and load balancing read a family's experts only
through this record, so a family whose experts are named or stored unlike transformers' is one `ExpertsSpec` in its
layout, with no edit to pp_tp. Its values (experts per layer, top-k) are read once from the model's config by the
layout that declares it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pp_tp.base.fqn import matches_rule


@dataclass(frozen=True)
class PackedSwiGLU:
    """The experts' weights as packed SwiGLU (what TP of experts splits and a checkpoint converts): `gate_up` holds
    gate and up along `gate_up_dim` (gate then up when `concatenated`, else interleaved gate/up pairs), `down` holds
    the expert hidden dim along `down_dim`; optional biases [experts, width] (GPT-OSS) follow their weights.
    Non-gated experts (Nemotron-H: up -> activation -> down) name their up projection `gate_up`, not concatenated:
    TP splits it by contiguous shards of the hidden dim, as interleaved pairs are.
    Defaults: transformers' names and storage ([E, 2 * hidden, dim] and [E, dim, hidden])."""

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    gate_up_dim: int = 1
    down_dim: int = 2
    concatenated: bool = True
    gate_up_bias: str | None = None
    down_bias: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """Every parameter these weights name."""
        return tuple(n for n in (self.gate_up, self.down, self.gate_up_bias, self.down_bias) if n is not None)


@dataclass(frozen=True)
class ExpertsSpec:
    """A family's routed experts, in one place.

    ``modules``: block-relative names (``*`` matches one component) of the experts modules, whose parameters all hold
    the expert on ``expert_dim`` (expert parallel shards that dim).
    ``n_experts`` / ``top_k``: experts per MoE layer and per token (top_k None: unknown; the planner refuses it).
    ``grouped``: the calling convention; False: routed, ``experts(hidden [T, D], top_k_index [T, k], top_k_weights
    [T, k])`` (transformers, the reference MoE); True: ``experts(tokens sorted by expert [N, D], tokens_per_expert
    [E] or a list of E ints)`` (torchtitan's GroupedExperts, JetMoE's ParallelExperts: their caller applies the scores).
    ``dense``: a third convention, ``experts(rows [E * T, D])``: every token at every expert, expert e reading the
    e-th of E equal contiguous row blocks (Llama 4, whose caller scales the rows by the routing scores first).
    ``weights``: the packed SwiGLU weights (None: stored otherwise, so no TP of experts); ``tp``: the family declares
    TP of its experts (then ``weights`` says what to split); without it parallel.tp > 1 is refused.
    ``count_attr``: the module attribute its forward sizes its experts by (transformers' ``num_experts``), set to the
    local count under expert parallel; None: the forward reads its parameters' shape.
    ``routers``: block-relative names of routers ``router(hidden [T, D]) -> (logits [T, E], top_k_weights [T, k],
    top_k_index [T, k])`` whose probabilities are softmax(logits) (the auxiliary loss reads them); empty: refused.
    ``bias``: block-relative names of fp32 expert-bias buffers [E] that shift the expert choice only, moved by
    moe.bias_update_rate.
    """

    modules: tuple[str, ...]
    n_experts: int
    top_k: int | None
    grouped: bool = False
    dense: bool = False
    expert_dim: int = 0
    weights: PackedSwiGLU | None = PackedSwiGLU()
    tp: bool = False
    count_attr: str | None = None
    routers: tuple[str, ...] = ()
    bias: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.grouped and self.dense:
            raise ValueError("ExpertsSpec: grouped and dense are two calling conventions; set one")
        if self.tp and self.weights is None:
            raise ValueError("ExpertsSpec: tp = True needs the packed weights it splits (weights)")

    def holds(self, name: str) -> bool:
        """Whether the block-relative module `name` is one of these experts modules (each ``*`` one component, as
        `parallelize_module` matches): what a reader outside parallel/ (checkpoints) keys expert parameters by."""
        return any(matches_rule(rule, name) for rule in self.modules)

    def routing_counts(self, args: tuple) -> torch.Tensor:
        """The routing slots per expert [n_experts] (int64) of one call of an experts module, read from its
        arguments per the calling convention (before any dispatch: global expert ids). Dense: the rows a zero
        routing score left all zero count as not routed."""
        if self.dense:
            rows = args[0].detach()
            return rows.reshape(self.n_experts, -1, rows.shape[-1]).ne(0).any(-1).sum(1).to(torch.int64)
        if self.grouped:  # rows per expert: a tensor (torchtitan) or a list of ints (JetMoE)
            return torch.as_tensor(args[1], device=args[0].device).detach().to(torch.int64)
        ids = args[1].detach().reshape(-1)  # bincount would read max(ids) to the host on CUDA
        return torch.zeros(self.n_experts, dtype=torch.int64, device=ids.device).index_add_(
            0, ids, torch.ones_like(ids)
        )
