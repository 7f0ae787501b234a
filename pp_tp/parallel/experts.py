"""Mixture-of-experts experts inside a stage: expert parallel over mesh["ep"], TP of experts over mesh["tp"].

Everything read about a family's experts comes from its record (`ModelLayout.experts_spec`, pp_tp.layout.experts).
The experts modules it names keep their parameter names; their parameters become DTensors: Shard on the expert
dim over "ep" (each EP rank a contiguous block of experts), and under TP the packed gate/up split per part (every
rank keeps matching gate and up rows; interleaved gate/up pairs, or a non-gated up projection (Nemotron-H), by plain
contiguous shards) and down split on its input dim; biases (GPT-OSS) follow: gate/up's like its weight, down's whole
on every TP rank and added by one of them (pp_tp.parallel.expert_dispatch).
`.full_tensor()` gives every expert, so checkpoints stay layout-free. The module's class gains a forward that
dispatches tokens (pp_tp.parallel.expert_dispatch) around the family's own forward, run on local experts.
Three calling conventions: routed, `experts(hidden [T, D], top_k_index [T, k], top_k_weights [T, k])`
(transformers, the reference MoE), grouped, `experts(tokens sorted by expert [N, D], tokens_per_expert [E])`
(torchtitan's GroupedExperts, after its own reorder, or JetMoE's ParallelExperts, rows per expert a list; its caller
applies the routing scores), and dense,
`experts(rows [E * T, D])`, expert e on the e-th of E equal row blocks (Llama 4; its caller scales the rows). A
grouped or dense call is dispatched as a routed one with k = 1 and unit weights (exact: x * 1 and 0 + x), its local
forward gets its rows sorted by local expert again.
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
from pp_tp.layout import ExpertsSpec, ModelLayout
from pp_tp.parallel.expert_dispatch import ExpertDispatch
from pp_tp.parallel.tensor_parallel import matches_rule

# The calling conventions (ExpertsSpec.grouped / dense): how the experts are called, and with how many arguments.
_CALLS = {
    "routed": ("experts(hidden, top_k_index, top_k_weights)", 3),
    "grouped": ("experts(tokens sorted by expert, tokens_per_expert)", 2),
    "dense": ("experts(rows in equal blocks per expert)", 1),
}


def _convention(spec: ExpertsSpec) -> str:
    return "grouped" if spec.grouped else "dense" if spec.dense else "routed"


def experts_modules(block: nn.Module, layout: ModelLayout) -> list[tuple[str, nn.Module]]:
    """The block's experts modules (block-relative name, module) the layout declares."""
    return [(n, m) for n, m in block.named_modules() if n and any(matches_rule(r, n) for r in layout.experts)]


def moe_layers(block: nn.Module, layout: ModelLayout) -> dict[str, nn.Module]:
    """The block's MoE layers: the block-relative name of the module around each experts module ("" when the
    experts module is the block's child) -> that experts module. Routing counts and expert biases key by it."""
    return {name.rpartition(".")[0]: m for name, m in experts_modules(block, layout)}


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
            "MoE declares them in base_model_ep_plan, a layout in ModelLayout.experts_spec); set parallel.ep = 1"
        )
    spec = layout.experts_spec
    for fqn, module in found:
        _check_module(fqn, module, spec)
        if spec.n_experts % pcfg.ep:
            raise ConfigError(
                f"{fqn} holds {spec.n_experts} experts, not divisible by parallel.ep = {pcfg.ep}; "
                f"set parallel.ep to a divisor of {spec.n_experts}"
            )
        if pcfg.tp > 1:
            _check_experts_tp(family, fqn, module, spec, pcfg.tp)


def _check_module(fqn: str, module: nn.Module, spec: ExpertsSpec) -> None:
    """The module is what its record says: its own parameters hold the experts on the expert dim, and its forward
    takes the declared calling convention's arguments."""
    params = dict(module.named_parameters(recurse=False))
    nested = len(params) != len(list(module.parameters()))
    d, n = spec.expert_dim, spec.n_experts
    counts = {name: p.shape[d] if p.dim() > d else 0 for name, p in params.items()}
    if len(set(counts.values())) > 1:  # LongCat-Flash: gate/up holds rows for its identity experts too, down not
        (most, big), (fewest, small) = max(counts.items(), key=lambda c: c[1]), min(counts.items(), key=lambda c: c[1])
        raise ConfigError(
            f"{fqn} ({type(module).__name__}): {most} holds {big} experts on dim {d} and {fewest} {small} (the "
            f"{big - small} more have no {fewest} rows, as identity experts), so a split of each parameter by "
            "expert would not keep one expert's rows on one rank; set parallel.ep = 1 and parallel.tp = 1"
        )
    if not params or nested:
        raise ConfigError(
            f"{fqn} ({type(module).__name__}) is not an experts module of parameters holding its {n} experts on "
            f"dim {d} (ExpertsSpec.expert_dim); set parallel.ep = 1 and parallel.tp = 1"
        )
    call, arity = _CALLS[_convention(spec)]
    if len(inspect.signature(module.forward).parameters) != arity:
        raise ConfigError(
            f"{fqn} ({type(module).__name__}) is not called as {call} (ExpertsSpec.grouped / dense); "
            "set parallel.ep = 1 and parallel.tp = 1"
        )


def _check_experts_tp(family: str, fqn: str, module: nn.Module, spec: ExpertsSpec, tp: int) -> None:
    """TP of experts only where the model declares it, on exactly the packed SwiGLU (or non-gated up/down) weights
    its record names."""
    if not spec.tp:
        raise ConfigError(
            f"model {family}: its experts ({fqn}) declare no tensor parallelism; set parallel.tp = 1 "
            "(parallel.ep splits experts across ranks instead)"
        )
    w = spec.weights
    params = set(dict(module.named_parameters(recurse=False)))
    extra, missing = sorted(params - set(w.names)), [n for n in w.names if n not in params]
    if extra or missing:
        what = f"parameter {extra[0]!r}" if extra else f"no {missing[0]}"
        raise ConfigError(
            f"{fqn} ({type(module).__name__}): TP of experts splits packed {w.gate_up} and {w.down} only, and this "
            f"module differs ({what}); set parallel.tp = 1"
        )
    width = getattr(module, w.down).shape[w.down_dim]
    if width % tp:
        raise ConfigError(
            f"{fqn}.{w.down}: expert hidden size {width} is not divisible by parallel.tp = {tp}; "
            f"set parallel.tp to a divisor of {width}"
        )


def _tp_placement(spec: ExpertsSpec, name: str) -> Placement:
    """How TP splits one experts parameter: gate/up (and its bias) per part when [gate; up] are concatenated, by
    contiguous shards when interleaved (each shard keeps whole gate/up pairs) or non-gated (up alone); down on its
    input dim; down's bias whole (one TP rank adds it)."""
    w = spec.weights
    if name == w.down_bias:
        return Replicate()
    bias_dim = 1 if spec.expert_dim == 0 else 0  # a bias is [experts, width] or [width, experts]
    dim = {w.gate_up: w.gate_up_dim, w.down: w.down_dim}.get(name, bias_dim)
    if name in (w.gate_up, w.gate_up_bias) and w.concatenated:
        return StridedShard(dim, split_factor=2)
    return Shard(dim)


def _placements(spec: ExpertsSpec, name: str, pcfg: ParallelConfig) -> list[Placement]:
    placements: list[Placement] = [Shard(spec.expert_dim)] if pcfg.ep > 1 else []
    if pcfg.tp > 1:
        placements.append(_tp_placement(spec, name))
    return placements


def shard_experts(module: nn.Module, spec: ExpertsSpec, mesh: DeviceMesh, pcfg: ParallelConfig) -> None:
    """Turns the experts' parameters into DTensors (on meta, no communication) and gives the module its dispatch."""
    dims = tuple(d for d, n in (("ep", pcfg.ep), ("tp", pcfg.tp)) if n > 1)
    sub = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
    for name, p in list(module.named_parameters(recurse=False)):
        shard = distribute_tensor(p.data, sub, _placements(spec, name, pcfg), src_data_rank=None)
        module.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))
    tp = mesh["tp"] if pcfg.tp > 1 else None
    down_bias = spec.weights.down_bias if spec.weights is not None else None
    zeroed = (down_bias,) if tp is not None and tp.get_local_rank() and down_bias is not None else ()
    dispatch = ExpertDispatch(spec.n_experts, mesh["ep"] if pcfg.ep > 1 else None, tp, zeroed)
    if spec.count_attr is not None:  # the family's forward sizes its experts by it (transformers' kernels' bins)
        setattr(module, spec.count_attr, dispatch.local_experts)
    module.expert_dispatch = dispatch
    module.__class__ = _dispatching(type(module), _convention(spec))


@cache
def _dispatching(cls: type[nn.Module], convention: str) -> type[nn.Module]:
    """`cls` with a forward that dispatches tokens around `cls.forward` (one subclass per experts class)."""

    def forward(self: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        return self.expert_dispatch(self, cls.forward, hidden, top_k_index, top_k_weights)

    def forward_grouped(self: Any, tokens: torch.Tensor, tokens_per_expert: torch.Tensor | list[int]) -> Any:
        counts = torch.as_tensor(tokens_per_expert, device=tokens.device)
        experts = torch.arange(counts.numel(), device=tokens.device)
        ids = torch.repeat_interleave(experts, counts, output_size=tokens.shape[0]).unsqueeze(1)
        ones = torch.ones(tokens.shape[0], 1, dtype=tokens.dtype, device=tokens.device)
        local = partial(_grouped_local, cls.forward, isinstance(tokens_per_expert, list))
        return self.expert_dispatch(self, local, tokens, ids, ones)

    def forward_dense(self: Any, rows: torch.Tensor) -> Any:
        n = self.expert_dispatch.n_experts
        experts = torch.arange(n, device=rows.device)
        ids = torch.repeat_interleave(experts, rows.shape[0] // n, output_size=rows.shape[0]).unsqueeze(1)
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        return self.expert_dispatch(self, partial(_dense_local, cls.forward), rows, ids, ones)

    body = {"routed": forward, "grouped": forward_grouped, "dense": forward_dense}[convention]
    return type(cls.__name__, (cls,), {"forward": body, "__module__": cls.__module__})


def _grouped_local(
    forward: Any, as_list: bool, module: nn.Module, slots: torch.Tensor, ids: torch.Tensor, weights: Any
) -> Any:
    """A grouped experts forward on the dispatched slots: sorted by local expert for it, then put back; the rows
    per local expert in the form the caller gave (a list of ints: JetMoE). `weights` are the unit ones of
    `forward_grouped`; the caller (torchtitan's combine, JetMoE's gates) applies the scores."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(module.expert_dispatch.local_experts, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # bincount would read max(flat) to the host on CUDA
    return forward(module, slots[order], counts.tolist() if as_list else counts)[torch.argsort(order)]  # list: a read


def _dense_local(forward: Any, module: nn.Module, slots: torch.Tensor, ids: torch.Tensor, weights: Any) -> Any:
    """A dense experts forward on the dispatched rows: sorted by local expert into its equal blocks, then put back.
    Every local expert gets the same row count (each rank sends T rows per expert, equal microbatches)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return forward(module, slots[order])[torch.argsort(order)]


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
        shard_experts(module, stage.layout.experts_spec, mesh, pcfg)
    return bool(found)
