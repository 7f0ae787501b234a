"""What mixture-of-experts changes in a plan: blocks of one model that differ (DeepSeek-V3's dense first layers
beside MoE ones), the experts each rank holds, and the expert-parallel all-to-all bytes of a step.

The all-to-all model assumes balanced routing, and so does the dry run's fake forward (`balanced_routing`: fake tensors
hold no routing to read):
per MoE layer and microbatch each rank sends top_k copies of its T tokens' hidden states, (ep - 1) / ep of them to
other ranks, and gets as many expert outputs back; the backward moves the same twice more (4 all-to-alls).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pp_tp.base._torch import all_to_all_single_autograd, wait_tensor
from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelLayout
from pp_tp.models.reference.moe import SLOT_COUNTS
from pp_tp.parallel.expert_dispatch import ROUTE, ExpertDispatch
from pp_tp.parallel.experts import experts_modules
from pp_tp.split.plan import StageSpec


def _balanced_route(dispatch: ExpertDispatch, slots: torch.Tensor, flat: torch.Tensor, order: torch.Tensor) -> tuple:
    """ExpertDispatch's route when every rank's slots spread evenly over the experts (shapes only)."""
    ep = dispatch.ep.size() if dispatch.ep is not None else 1
    n = slots.shape[0]
    splits = [n // ep + (r < n % ep) for r in range(ep)]
    if dispatch.ep is not None:
        slots = wait_tensor(all_to_all_single_autograd(slots, splits, splits, dispatch.ep.get_group()))
    ids = torch.arange(n, device=slots.device) * dispatch.local_experts // max(n, 1)
    return slots, ids, splits, splits


def _balanced_counts(expert: torch.Tensor, n_experts: int) -> list[int]:
    """The reference experts' slots per expert, spread evenly (every slot counted: the planner sees no foreign id)."""
    n = expert.numel()
    return [n // n_experts + (e < n % n_experts) for e in range(n_experts)]


@contextlib.contextmanager
def balanced_routing() -> Iterator[None]:
    """The dry run's forward on fake tensors, which hold no routing: expert dispatch and the reference experts' loop
    size everything as if every expert got an equal share of the slots (the balance training aims at)."""
    with ROUTE.installed(_balanced_route), SLOT_COUNTS.installed(_balanced_counts):
        yield


Signature = tuple  # (name, shape) of every parameter of a block: blocks with equal signatures cost the same


def block_signatures(model: nn.Module, layout: ModelLayout) -> dict[str, Signature]:
    """Each block's parameter names and shapes, by block key (on meta: nothing is read)."""
    blocks = model.get_submodule(layout.blocks)
    return {
        key: tuple((n, tuple(p.shape)) for n, p in blocks.get_submodule(key).named_parameters())
        for key in layout.block_keys(model)
    }


def stage_kind(spec: StageSpec, signatures: dict[str, Signature]) -> tuple[bool, tuple, bool]:
    """(embed, its blocks' signatures in order, head): stages of one kind cost the same."""
    return spec.embed, tuple(signatures[b] for b in spec.blocks), spec.head


@dataclass(frozen=True)
class Experts:
    """The model's routed experts: `n_experts` per MoE layer, `top_k` per token, the MoE layers' block keys."""

    n_experts: int
    top_k: int
    moe_blocks: frozenset[str]

    def per_rank(self, ep: int) -> int:
        """Experts of one MoE layer on each rank under expert parallel `ep`."""
        return self.n_experts // ep


def model_experts(model: nn.Module, layout: ModelLayout) -> Experts | None:
    """The model's experts (None for a dense model), as its layout's record declares them (ExpertsSpec)."""
    spec = layout.experts_spec
    blocks = model.get_submodule(layout.blocks)
    keys = layout.block_keys(model)
    moe_blocks = frozenset(key for key in keys if experts_modules(blocks.get_submodule(key), layout))
    if spec is None or not moe_blocks:
        return None
    if not spec.top_k:
        raise ConfigError(
            f"pp-tp plan: model {type(model).__name__} has experts but its layout declares no top_k "
            "(ExpertsSpec.top_k); the planner cannot size the routed tokens (run without the planner)"
        )
    return Experts(spec.n_experts, spec.top_k, moe_blocks)


def all_to_all_bytes(tokens: int, experts: Experts, dim: int, ep: int, act_bytes: int) -> float:
    """Bytes one rank sends to other ranks per MoE layer and microbatch of `tokens` tokens, forward and backward
    (dispatch and combine each way), under balanced routing."""
    return 4 * tokens * experts.top_k * dim * act_bytes * (ep - 1) / ep


def rank_all_to_all_bytes(
    experts: Experts, blocks: Iterable[str], pcfg: ParallelConfig, tokens: int, dim: int
) -> float:
    """Bytes one rank sends to other ranks per step: all_to_all_bytes for each MoE layer among `blocks` (the rank's
    block keys) and each of its microbatches of `tokens` tokens, in the activation dtype."""
    layers = sum(b in experts.moe_blocks for b in blocks)
    act = 2 if pcfg.mixed_precision == "bf16" else 4
    return all_to_all_bytes(tokens, experts, dim, pcfg.ep, act) * layers * pcfg.microbatches
