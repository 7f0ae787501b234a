"""Load balancing of mixture-of-experts layers under pipelining: the auxiliary loss of softmax routers, per layer and
microbatch, and the auxiliary-loss-free expert-bias update (DeepSeek-V3), both `[moe]` (`MoEConfig`).

transformers' auxiliary loss concatenates every layer's router logits over the whole batch, so microbatch 1's
gradient would depend on later microbatches' forwards: under 1F1B it cannot be computed. As in Megatron and
torchtitan, MoE layer l on one microbatch of T tokens here gets aux_l = E * sum_e (c_e / T) * P_e (c_e its routing
slots to expert e, P_e the mean over the T tokens of softmax(router logits)_e), and the step's auxiliary loss is
aux_loss_coef * the mean over microbatches and DP ranks of sum_l aux_l. A forward hook on each router (the layout's
`experts_spec.routers`) passes its top-k weights through an identity autograd function whose backward also gives
aux_l its gradient, scaled as the LM loss is (grad_factor undoes FSDP's mean over DP, runtime/loss.py): the gradient
enters inside the stage holding the layer, with no pipeline communication. A gradient only adds to the router
logits', so it is exact wherever the LM loss's is (TP ranks route alike and hold the router whole, expert parallel
moves tokens only); a forward recomputed by activation checkpointing rebuilds the same graph, which autograd
discards, and is not counted in the reported value.

The expert bias (the layout's `experts_spec.bias` buffers) moves after each optimizer step by
bias_update_rate * sign(mean_e(c) - c_e), c = the layer's slots over the step's microbatches and DP ranks: the
counts `routing_stats` already sums in its one all-reduce per step, identical on every rank holding the layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pp_tp.base._torch import in_backward
from pp_tp.config import ParallelConfig
from pp_tp.config.schema import MoEConfig
from pp_tp.config.sections import check_balancing_keys
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelLayout
from pp_tp.parallel.experts import moe_layers
from pp_tp.parallel.tensor_parallel import matches_rule
from pp_tp.runtime.built import BuiltStages
from pp_tp.runtime.routing_stats import RoutingStats


def _named(items, rules: tuple[str, ...]) -> list[tuple[str, object]]:
    return [(n, x) for n, x in items if n and any(matches_rule(r, n) for r in rules)]


def _layer_of(owner: str, layers: list[str]) -> str | None:
    """The MoE layer (block-relative name of the module around an experts module) that the module `owner` serves:
    the one layer it sits in (HF `mlp.gate` in `mlp`) or around (torchtitan's `moe` around `moe.routed_experts`)."""
    related = [layer for layer in layers if (owner + ".").startswith(layer + ".") or layer.startswith(owner + ".")]
    return related[0] if len(related) == 1 else None


def check_balancing(model: nn.Module, layout: ModelLayout, pcfg: ParallelConfig, moe: MoEConfig) -> MoEConfig:
    """Refuses, in one line and before any collective, balancing the model cannot honour: the auxiliary loss
    without a router whose probabilities pp_tp reads exactly, the bias update without a declared expert bias."""
    moe = check_balancing_keys(moe)
    if not (moe.aux_loss_coef or moe.bias_update_rate):
        return moe
    family = type(model).__name__
    key = "moe.aux_loss_coef" if moe.aux_loss_coef else "moe.bias_update_rate"
    blocks = list(model.get_submodule(layout.blocks).children())
    spec = layout.experts_spec
    layers = [dict.fromkeys(moe_layers(b, layout), spec.n_experts if spec else 0) for b in blocks]
    if not any(layers):
        raise ConfigError(
            f"{key} = {getattr(moe, key[4:])} but model {family} has no mixture-of-experts layers pp_tp knows "
            f"(ModelLayout.experts_spec); set {key} = 0"
        )
    for block, counts in zip(blocks, layers):
        if moe.aux_loss_coef:
            found = [_layer_of(n, list(counts)) for n, _ in _named(block.named_modules(), spec.routers)]
            if sorted(found, key=str) != sorted(counts):
                raise ConfigError(
                    f"moe.aux_loss_coef = {moe.aux_loss_coef} needs each MoE layer's softmax router probabilities, "
                    f"and model {family} has no router pp_tp reads them from exactly (sigmoid routers, as "
                    'DeepSeek-V3\'s or model.router = "sigmoid", balance with moe.bias_update_rate); '
                    "set moe.aux_loss_coef = 0"
                )
        if moe.bias_update_rate:
            biases = [(_layer_of(n.rpartition(".")[0], list(counts)), b)
                      for n, b in _named(block.named_buffers(), spec.bias)]  # fmt: skip
            usable = all(b.dtype == torch.float32 and b.shape == (counts.get(layer),) for layer, b in biases)
            if sorted((layer for layer, _ in biases), key=str) != sorted(counts) or not usable:
                raise ConfigError(
                    f"moe.bias_update_rate = {moe.bias_update_rate} moves each MoE layer's fp32 expert bias [experts], "
                    f"and model {family} declares none (ExpertsSpec.bias); set moe.bias_update_rate = 0"
                )
    return moe


class _WithAuxGrad(torch.autograd.Function):
    """Identity on `x`; its backward also gives `aux` the gradient `scale` (a loss term added inside a layer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux = scale, (aux.dtype, aux.device)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        dtype, device = ctx.aux
        return grad, torch.full((), ctx.scale, dtype=dtype, device=device), None


def layer_aux(logits: torch.Tensor, top_k_index: torch.Tensor, cp: dist.ProcessGroup | None = None) -> torch.Tensor:
    """aux_l of one MoE layer on one microbatch: E * sum_e (slots_e / T) * mean_t softmax(logits)_e (fp32).

    Under context parallel (`cp`, its ranks hold the microbatch's T tokens between them) the slots are summed over
    cp first and each rank's term takes its own tokens' probabilities: the cp ranks' terms add up to aux_l, and
    each one's gradient is aux_l's for its tokens."""
    probs = logits.float().softmax(dim=-1)
    tokens, experts = probs.shape
    slots = torch.bincount(top_k_index.reshape(-1), minlength=experts).to(probs.dtype)
    if cp is not None:
        dist.all_reduce(slots, group=cp)
        tokens *= dist.get_world_size(cp)
    return experts * (slots / tokens * probs.sum(dim=0) / tokens).sum()


class AuxLoss:
    """The auxiliary loss of every router in `stages`: its gradient added in backward, its value summed per step."""

    def __init__(
        self,
        stages: list[nn.Module],
        layout: ModelLayout,
        scale: float,
        device: torch.device,
        cp: dist.ProcessGroup | None = None,
    ):
        self.scale = scale  # d(step loss)/d(aux_l) per microbatch, times the factor FSDP's mean over DP takes away
        self.cp = cp  # context parallel's group: its ranks' terms add up to each aux_l (layer_aux)
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        for stage in stages:
            for block in stage.block_modules():
                for _, router in _named(block.named_modules(), layout.experts_spec.routers):
                    router.register_forward_hook(self._add)

    def _add(self, module: nn.Module, args: tuple, output: tuple) -> tuple:
        logits, weights, index = output
        aux = layer_aux(logits, index, self.cp)
        if not in_backward():  # activation checkpointing's recomputation: already counted in the forward
            self.total += aux.detach()
        return logits, _WithAuxGrad.apply(weights, aux, self.scale), index


class ExpertBiases:
    """The expert-bias buffers of `stages` by the MoE layer FQN whose routing they shift (RoutingStats' keys)."""

    def __init__(self, stages: list[nn.Module], layout: ModelLayout):
        self.biases: list[tuple[str, torch.Tensor]] = []
        for stage in stages:
            for key, block in zip(stage.spec.blocks, stage.block_modules()):
                layers = list(moe_layers(block, layout))
                for name, bias in _named(block.named_buffers(), layout.experts_spec.bias):
                    self.biases.append((f"{layout.blocks}.{key}.{_layer_of(name.rpartition('.')[0], layers)}", bias))

    @torch.no_grad()
    def update(self, tokens_per_expert: dict[str, torch.Tensor], rate: float) -> None:
        """bias += rate * sign(mean_e(c) - c_e): underloaded experts become likelier, overloaded ones less."""
        for layer, bias in self.biases:
            c = tokens_per_expert[layer].to(bias.dtype)
            bias += rate * torch.sign(c.mean() - c)


class Balancing:
    """A pipeline's MoE state in one object: the routing counts of the MoE layers its stages hold, the auxiliary loss
    and the expert biases (each None where the model or `[moe]` has none), and the step's `stats`."""

    def __init__(self, built: BuiltStages):
        layout = built.stages[0].layout if built.stages else None
        self.routing = RoutingStats(built.stages, layout, built.mesh) if layout is not None else None
        self.has_moe = layout is not None and bool(layout.experts)
        moe = built.options.balancing
        self.rate = moe.bias_update_rate
        # d(step aux loss)/d(aux_l) per microbatch: coef / (microbatches * dp), times what FSDP's DP mean takes away.
        self.aux_mean = moe.aux_loss_coef / (built.pcfg.microbatches * built.pcfg.dp)
        cp = built.mesh.get_group("cp") if built.pcfg.cp > 1 else None
        aux = self.has_moe and moe.aux_loss_coef > 0
        scale = self.aux_mean * built.grad_factor
        self.aux = AuxLoss(built.stages, layout, scale, built.device, cp) if aux else None
        self.biases = ExpertBiases(built.stages, layout) if self.has_moe and moe.bias_update_rate else None
        # After each step of an MoE model: {"aux_loss": the step's auxiliary loss (global, 0.0 without one),
        # "tokens_per_expert": {MoE layer FQN: int64 [E]}} over the step and all DP ranks, for the MoE layers this
        # rank holds; empty for a dense model.
        self.stats: dict[str, Any] = {}

    def start_step(self) -> None:
        """Zeroes the counts and the auxiliary loss before a step's microbatches run."""
        if self.routing is not None:
            self.routing.reset()
        if self.aux is not None:
            self.aux.total.zero_()

    def end_step(self) -> None:
        """The step's routing counts, summed over the step and DP ranks (one all-reduce), into `stats`."""
        if self.has_moe:
            self.stats = {"aux_loss": 0.0, "tokens_per_expert": self.routing.collect()}

    def record_aux(self, aux: torch.Tensor) -> None:
        """The step's global sum of aux_l terms (reduced with the loss) as the reported auxiliary loss."""
        self.stats["aux_loss"] = float(aux) * self.aux_mean

    def update_expert_bias(self) -> None:
        """Every local expert bias moved by the last step's counts (`ExpertBiases.update`); a no-op at rate 0."""
        if self.biases is not None:
            self.biases.update(self.stats["tokens_per_expert"], self.rate)
