"""Tokens per expert of every MoE layer a rank holds, counted over one step: `Pipeline.moe_stats`.

A forward pre-hook on each experts module (the layout's `experts_spec`, which also says how its call's arguments
carry the routing) adds up its routing slots per expert, whatever the layout (experts whole, expert parallel, TP of
experts: the hook sees the routing before any dispatch). At the end of a step the counts of all local layers are
summed over the data-parallel and cp ranks in one all-reduce per dimension (TP ranks route the same tokens, pp
ranks hold other layers), so every rank of a pp rank sees the same global counts. A forward recomputed by activation
checkpointing is not counted twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.base._torch import in_backward
from pp_tp.layout import ExpertsSpec, ModelLayout
from pp_tp.parallel.experts import moe_layers
from pp_tp.parallel.mesh import rank_device, token_groups


class RoutingStats:
    """Counts routing slots per expert for the experts modules of `stages` (layer FQN -> int64 [E])."""

    def __init__(self, stages: list[nn.Module], layout: ModelLayout, mesh: DeviceMesh):
        self.counts: dict[str, torch.Tensor] = {}
        device = rank_device(mesh)
        self._groups = token_groups(mesh)
        for stage in stages:
            for key, block in zip(stage.spec.blocks, stage.block_modules()):
                for name, experts in moe_layers(block, layout).items():
                    layer = f"{layout.blocks}.{key}.{name}".rstrip(".")
                    self.counts[layer] = torch.zeros(layout.experts_spec.n_experts, dtype=torch.int64, device=device)
                    experts.register_forward_pre_hook(self._counter(layer, layout.experts_spec))

    def _counter(self, layer: str, spec: ExpertsSpec):
        def count(module: nn.Module, args: tuple) -> None:
            if in_backward():  # activation checkpointing's recomputation: already counted in the forward
                return
            self.counts[layer] += spec.routing_counts(args)

        return count

    def reset(self) -> None:
        for counts in self.counts.values():
            counts.zero_()

    def collect(self) -> dict[str, torch.Tensor]:
        """The step's counts summed over the data-parallel ranks (a collective when the rank holds MoE layers)."""
        if not self.counts:
            return {}
        flat = torch.cat(list(self.counts.values()))
        for group in self._groups:
            dist.all_reduce(flat, group=group)
        return dict(zip(self.counts, flat.split([c.numel() for c in self.counts.values()])))


def imbalance(tokens_per_expert: dict[str, torch.Tensor]) -> dict[str, float]:
    """max / mean tokens per expert, per layer (1.0 = perfectly balanced)."""
    return {k: float(c.max() / c.float().mean().clamp(min=1e-9)) for k, c in tokens_per_expert.items()}
