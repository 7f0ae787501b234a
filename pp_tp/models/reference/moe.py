"""The reference Transformer's mixture-of-experts MLP, in Hugging Face's MoE structure (Mixtral, Qwen3-MoE,
DeepSeek-V3): a router `gate`, packed `experts`, optional dense `shared_experts`, so expert-parallel code treats it
like those families.

Dropless: every token reaches its top_k experts; nothing is capped or dropped, so the result does not depend on how
tokens are grouped into microbatches or ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pp_tp.base.override import Override
from pp_tp.base.tensors import at_least_fp32
from pp_tp.config.schema import ModelShape


class Router(nn.Module):
    """Scores every expert, picks top_k per token.

    `expert_bias` (persistent, fp32, zeros at init) is added to the scores for the *choice* only, never to the
    weights: DeepSeek-V3's auxiliary-loss-free balancing moves it between steps.
    """

    def __init__(self, dim: int, n_experts: int, top_k: int, scoring: str, norm_topk: bool):
        super().__init__()
        self.top_k = top_k
        self.scoring = scoring
        self.norm_topk = norm_topk
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, dim] -> (router_logits [T, E], top_k_weights [T, k], top_k_index [T, k]), in fp32."""
        logits = F.linear(at_least_fp32(hidden), at_least_fp32(self.weight))
        scores = logits.softmax(dim=-1) if self.scoring == "softmax" else logits.sigmoid()
        index = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
        weights = scores.gather(-1, index)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights, index


class Experts(nn.Module):
    """E SwiGLU experts in packed 3-D parameters: `gate_up_proj` [E, 2 * hidden, dim] (gate rows, then up rows)
    and `down_proj` [E, dim, hidden], Hugging Face's layout.

    `forward` runs the experts this module holds, `num_experts` = dim 0 of its parameters as forward sees them
    (a subset of the model's experts under expert parallel, indexed locally); a top_k_index entry outside
    [0, num_experts) (another rank's expert, a sentinel) is ignored. Every expert runs, on the tokens it got
    (possibly none), so both parameters always get a gradient (zeros where no token went): FSDP2 reduce-scatters
    only parameters holding a gradient, and ranks must agree on which.
    """

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))

    @property
    def num_experts(self) -> int:
        """The experts this module holds: its parameters' dim 0 (never stored apart, so it cannot disagree)."""
        return self.gate_up_proj.shape[0]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, dim] -> [T, dim]: for each token, sum over its k slots of weight * expert(hidden)."""
        n_experts, k = self.num_experts, top_k_index.shape[-1]
        slots = top_k_index.reshape(-1)
        # Slots grouped by expert (stable: token order kept within an expert); foreign ids sort last.
        kept = (slots >= 0) & (slots < n_experts)
        expert = torch.where(kept, slots, n_experts)
        order = torch.argsort(expert, stable=True)
        tokens, weights = order // k, top_k_weights.reshape(-1)[order, None]
        x = hidden[tokens]
        if _grouped_mm_fits(x, self.gate_up_proj, self.down_proj):  # no host read: the groups' ends stay a tensor
            kept = kept[order, None]
            ends = torch.searchsorted(expert[order], torch.arange(n_experts, device=x.device), right=True)
            # grouped_mm leaves the rows past the last group (foreign slots) unset, forward and backward: masked out
            y = self._grouped(torch.where(kept, x, 0), ends.to(torch.int32))
            y = torch.where(kept, y * weights, 0)
        else:
            counts = SLOT_COUNTS()(expert, n_experts)
            local = sum(counts)
            tokens, y = tokens[:local], self._loop(x[:local], counts) * weights[:local]
        return torch.zeros_like(hidden).index_add_(0, tokens, y.to(hidden.dtype))

    def _loop(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [N, dim] grouped by expert -> [N, dim], one expert at a time (any device, dtype, layout)."""
        parts = []
        for gate_up, down, x_e in zip(self.gate_up_proj.unbind(0), self.down_proj.unbind(0), x.split(counts)):
            gate, up = F.linear(x_e, gate_up).chunk(2, dim=-1)
            parts.append(F.linear(F.silu(gate) * up, down))
        return torch.cat(parts)

    def _grouped(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """The same as `_loop` in two grouped matmuls over all experts (group e = rows ends[e-1]:ends[e], int32)."""
        gate, up = F.grouped_mm(x, self.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends)


def _grouped_mm_fits(*tensors: torch.Tensor) -> bool:
    """Whether F.grouped_mm takes these tensors exactly as the loop would (measured bit-equal on CPU here and on an
    H200), with every stride but the unit one and the start aligned to 16 bytes (its kernel refuses others).
    The per-expert loop keeps what it cannot take, each for one reason:
    - a tensor subclass: DTensor shards (grouped_mm has no sharding rule), torchao's float8 tensors, fake tensors
      (the planner's: their meta kernel takes bf16 only);
    - float64 and other dtypes: "Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double" (torch 2.13);
    - devices other than CPU and CUDA (not measured)."""
    dtype = tensors[0].dtype
    return dtype in (torch.float32, torch.bfloat16) and all(
        type(t) in (torch.Tensor, nn.Parameter)
        and t.device.type in ("cpu", "cuda")
        and t.dtype == dtype
        and t.data_ptr() % 16 == 0
        and all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1)
        for t in tensors
    )


def _read_counts(expert: torch.Tensor, n_experts: int) -> list[int]:
    """Slots per expert as Python ints: one host read."""
    return torch.bincount(expert, minlength=n_experts + 1)[:n_experts].tolist()


# Slots per expert for the per-expert loop: read off the routing, or, in a run without values (the planner's, on fake
# tensors), what it installed.
SLOT_COUNTS = Override(_read_counts)


class MoE(nn.Module):
    """The MLP of an MoE layer: route each token, run its experts, add the shared experts (when given)."""

    def __init__(self, args: ModelShape, shared_experts: nn.Module | None):
        super().__init__()
        self.gate = Router(args.dim, args.n_experts, args.top_k, args.router, args.norm_topk)
        self.experts = Experts(args.n_experts, args.dim, args.expert_dim)
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, dim] -> [B, S, dim]; tokens are routed one by one, so B and S only shape the batch."""
        hidden = x.reshape(-1, x.shape[-1])
        _, weights, index = self.gate(hidden)
        out = self.experts(hidden, index, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out.view_as(x)


@torch.no_grad()
def init_expert_bias(module: nn.Module) -> None:
    """Zeros every router's `expert_bias` in `module`: the bias's init rule (balancing moves it later)."""
    for m in module.modules():
        if isinstance(m, Router):
            m.expert_bias.zero_()
