"""Mixture-of-experts experts inside a stage: expert parallel over mesh["ep"], TP of experts over mesh["tp"].

The experts modules a layout names (`ModelLayout.experts`) keep their parameter names; their 3-D parameters
become DTensors: Shard(0), the expert dim, over "ep" (each EP rank a contiguous block of experts), and under TP
the packed gate/up split per part (every rank keeps matching gate and up rows; interleaved gate/up pairs by plain
contiguous shards) and down split on its input dim; biases (GPT-OSS) follow: gate/up's like its weight, down's whole
on every TP rank and added by one of them (pp_tp.parallel.expert_dispatch).
`.full_tensor()` gives every expert, so checkpoints stay layout-free. The module's class gains a forward that
dispatches tokens (pp_tp.parallel.expert_dispatch) around the family's own forward, run on local experts.
Two calling conventions: routed, `experts(hidden [T, D], top_k_index [T, k], top_k_weights [T, k])`
(transformers, the reference MoE), and grouped, `experts(tokens sorted by expert [N, D], tokens_per_expert [E])`
(torchtitan's GroupedExperts, after its own reorder; its caller applies the routing scores). A grouped call is
dispatched as a routed one with k = 1 and unit weights (exact: x * 1 and 0 + x), its local forward gets its
tokens sorted by local expert again.
"""

from __future__ import annotations

import inspect
from functools import cache, partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

from pp_tp.base._torch import StridedShard
from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelLayout
from pp_tp.parallel.expert_dispatch import ExpertDispatch
from pp_tp.parallel.tensor_parallel import matches_rule

# TP of experts: the packed gate/up weight and the down weight, by name (transformers' and the reference MoE's), and
# their biases (transformers' names).
_GATE_UP, _DOWN = "gate_up_proj", "down_proj"
_GATE_UP_BIAS, _DOWN_BIAS = "gate_up_proj_bias", "down_proj_bias"


def experts_modules(block: nn.Module, layout: ModelLayout) -> list[tuple[str, nn.Module]]:
    """The block's experts modules (block-relative name, module) the layout declares."""
    return [(n, m) for n, m in block.named_modules() if n and any(matches_rule(r, n) for r in layout.experts)]


def moe_layers(block: nn.Module, layout: ModelLayout) -> dict[str, nn.Module]:
    """The block's MoE layers: the block-relative name of the module around each experts module ("" when the
    experts module is the block's child) -> that experts module. Routing counts and expert biases key by it."""
    return {name.rpartition(".")[0]: m for name, m in experts_modules(block, layout)}


def grouped(module: nn.Module) -> bool:
    """Called as experts(tokens sorted by expert, tokens_per_expert) (torchtitan), not the routed convention."""
    return len(inspect.signature(module.forward).parameters) == 2


def routing_counts(module: nn.Module, args: tuple, n: int) -> torch.Tensor:
    """The routing slots per expert [n] (int64) of one call of an experts module, in either convention."""
    if grouped(module):
        return args[1].detach().to(torch.int64)
    return torch.bincount(args[1].detach().reshape(-1), minlength=n)


def n_experts(module: nn.Module) -> int:
    """The experts an experts module holds: dim 0 of its parameters."""
    return next(iter(module.parameters())).shape[0]


def check_experts(model: nn.Module, layout: ModelLayout, pcfg: ParallelConfig) -> None:
    """Refuses, in one line and before any collective, experts that parallel.ep or parallel.tp cannot split."""
    if pcfg.ep == 1 and pcfg.tp == 1:
        return
    family = type(model).__name__
    found = [
        (f"{layout.blocks}.{key}.{name}", m)
        for key, block in model.get_submodule(layout.blocks).named_children()
        for name, m in experts_modules(block, layout)
    ]
    if pcfg.ep > 1 and not found:
        raise ConfigError(
            f"parallel.ep = {pcfg.ep} but model {family} has no experts modules pp_tp can split (a Hugging Face "
            "MoE declares them in base_model_ep_plan, a layout in ModelLayout.experts); set parallel.ep = 1"
        )
    for fqn, module in found:
        params = dict(module.named_parameters(recurse=False))
        nested = len(params) != len(list(module.parameters()))
        if not params or len({p.shape[0] for p in params.values()}) != 1 or nested:
            raise ConfigError(
                f"{fqn} ({type(module).__name__}) is not an experts module of packed parameters sharing the expert "
                "dim 0; set parallel.ep = 1 and parallel.tp = 1"
            )
        if len(inspect.signature(module.forward).parameters) not in (2, 3):
            raise ConfigError(
                f"{fqn} ({type(module).__name__}) is not called as experts(hidden, top_k_index, top_k_weights) nor "
                "experts(tokens sorted by expert, tokens_per_expert); set parallel.ep = 1 and parallel.tp = 1"
            )
        count = n_experts(module)
        if count % pcfg.ep:
            raise ConfigError(
                f"{fqn} holds {count} experts, not divisible by parallel.ep = {pcfg.ep}; "
                f"set parallel.ep to a divisor of {count}"
            )
        if pcfg.tp > 1:
            _check_experts_tp(family, fqn, module, layout, pcfg.tp)


def _check_experts_tp(family: str, fqn: str, module: nn.Module, layout: ModelLayout, tp: int) -> None:
    """TP of experts only where the model declares it and the experts are plain packed SwiGLU weights."""
    if not layout.experts_tp:
        raise ConfigError(
            f"model {family}: its experts ({fqn}) declare no tensor parallelism; set parallel.tp = 1 "
            "(parallel.ep splits experts across ranks instead)"
        )
    biases = {_GATE_UP_BIAS, _DOWN_BIAS} if getattr(module, "has_bias", False) else set()
    extra = sorted(set(dict(module.named_parameters(recurse=False))) - {_GATE_UP, _DOWN, *biases})
    unusual = [
        attr
        for attr, plain in (("has_gate", True), ("has_post_expert_norm", False))
        if getattr(module, attr, plain) != plain
    ]
    if extra or unusual or not hasattr(module, _GATE_UP) or not hasattr(module, _DOWN):
        what = (
            f"parameter {extra[0]!r}" if extra else f"{unusual[0]} = {getattr(module, unusual[0])}" if unusual else ""
        )
        raise ConfigError(
            f"{fqn} ({type(module).__name__}): TP of experts splits packed gate_up_proj and down_proj only, and this "
            f"module differs ({what or 'missing gate_up_proj/down_proj'}); set parallel.tp = 1"
        )
    width = module.down_proj.shape[_feature_dim(module, _DOWN)]
    if width % tp:
        raise ConfigError(
            f"{fqn}.down_proj: expert hidden size {width} is not divisible by parallel.tp = {tp}; "
            f"set parallel.tp to a divisor of {width}"
        )


def _feature_dim(module: nn.Module, name: str) -> int:
    """The expert hidden (intermediate) dim of gate_up_proj / down_proj, per the module's storage order."""
    transposed = getattr(module, "is_transposed", False)
    return {(_GATE_UP, False): 1, (_GATE_UP, True): 2, (_DOWN, False): 2, (_DOWN, True): 1}[(name, transposed)]


def _tp_placement(module: nn.Module, name: str) -> Placement:
    """How TP splits one experts parameter: gate/up (and its bias) per part when [gate; up] are concatenated, by
    contiguous shards when interleaved (each shard keeps whole gate/up pairs); down on its input dim; down's bias
    whole (one TP rank adds it)."""
    if name == _DOWN_BIAS:
        return Replicate()
    dim = 1 if name == _GATE_UP_BIAS else _feature_dim(module, name)
    if name in (_GATE_UP, _GATE_UP_BIAS) and getattr(module, "is_concatenated", True):
        return StridedShard(dim, split_factor=2)
    return Shard(dim)


def _placements(module: nn.Module, name: str, pcfg: ParallelConfig) -> list[Placement]:
    placements: list[Placement] = [Shard(0)] if pcfg.ep > 1 else []
    if pcfg.tp > 1:
        placements.append(_tp_placement(module, name))
    return placements


def shard_experts(module: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig) -> None:
    """Turns the experts' parameters into DTensors (on meta, no communication) and gives the module its dispatch."""
    dims = tuple(d for d, n in (("ep", pcfg.ep), ("tp", pcfg.tp)) if n > 1)
    sub = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
    count = n_experts(module)
    for name, p in list(module.named_parameters(recurse=False)):
        shard = distribute_tensor(p.data, sub, _placements(module, name, pcfg), src_data_rank=None)
        module.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))
    tp = mesh["tp"] if pcfg.tp > 1 else None
    zeroed = (_DOWN_BIAS,) if tp is not None and tp.get_local_rank() and hasattr(module, _DOWN_BIAS) else ()
    dispatch = ExpertDispatch(count, mesh["ep"] if pcfg.ep > 1 else None, tp, zeroed)
    if "num_experts" in vars(module) and not grouped(module):  # transformers' kernels size their bins by it
        module.num_experts = dispatch.local_experts
    module.expert_dispatch = dispatch
    module.__class__ = _dispatching(type(module), grouped(module))


@cache
def _dispatching(cls: type[nn.Module], is_grouped: bool) -> type[nn.Module]:
    """`cls` with a forward that dispatches tokens around `cls.forward` (one subclass per experts class)."""

    def forward(self: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        return self.expert_dispatch(self, cls.forward, hidden, top_k_index, top_k_weights)

    def forward_grouped(self: Any, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> Any:
        experts = torch.arange(tokens_per_expert.numel(), device=tokens.device)
        ids = torch.repeat_interleave(experts, tokens_per_expert, output_size=tokens.shape[0]).unsqueeze(1)
        ones = torch.ones(tokens.shape[0], 1, dtype=tokens.dtype, device=tokens.device)
        return self.expert_dispatch(self, partial(_grouped_local, cls.forward), tokens, ids, ones)

    body = forward_grouped if is_grouped else forward
    return type(cls.__name__, (cls,), {"forward": body, "__module__": cls.__module__})


def _grouped_local(forward: Any, module: nn.Module, slots: torch.Tensor, ids: torch.Tensor, weights: Any) -> Any:
    """A grouped experts forward on the dispatched slots: sorted by local expert for it, then put back.
    `weights` are the unit ones of `forward_grouped`; the caller (torchtitan's combine) applies the scores."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=module.expert_dispatch.local_experts)
    return forward(module, slots[order], counts)[torch.argsort(order)]


def expert_dispatches(module: nn.Module) -> list[ExpertDispatch]:
    """The dispatch of every experts module this pass sharded inside `module` (load statistics, reports)."""
    return [
        m.expert_dispatch for m in module.modules() if isinstance(getattr(m, "expert_dispatch", None), ExpertDispatch)
    ]


def apply_experts(stage: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig) -> bool:
    """Expert parallel and TP of experts on the stage's experts modules; no-op when ep == tp == 1."""
    if pcfg.ep == 1 and pcfg.tp == 1:
        return False
    found = [m for block in stage.block_modules() for _, m in experts_modules(block, stage.layout)]
    for module in found:
        shard_experts(module, mesh, pcfg)
    return bool(found)
