"""Tensor parallelism inside a pipeline stage, without sequence parallel, on torch's DTensor parallel styles.

Stage boundaries carry plain tensors, so every style hands back local tensors: column-parallel outputs
stay sharded on features (heads) inside a block, row-parallel outputs are all-reduced back to
replicated activations. The attention and MLP inputs enter as Replicate DTensors ("replicate_input"), so
backward all-reduces once per sub-block rather than once per column-parallel layer: per block and microbatch,
2 all-reduces in forward and 2 in backward (Megatron's g and f). A plan maps module FQNs (``*`` matches
one name component, as in ``parallelize_module``) to style names in STYLES. A block's plan is its class's
``_tp_plan`` when it declares one, else the model layout's ``tp_plan`` plus its q/k norms.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelLayout
from pp_tp.parallel.declared_tp import ConvChannelParallel, declared_plan
from pp_tp.parallel.local_styles import PackedColwise, ReplicatedPartialGrad, localize_heads, shard_head_params
from pp_tp.parallel.rng import active_dropout, install_sharded_regions

if TYPE_CHECKING:  # annotations only: parallel/ is applied to stage modules, it does not build them
    from pp_tp.stages.stage_module import StageModule


class ReplicateInput(ParallelStyle):
    """Makes a sub-block's hidden-state input a Replicate DTensor (Megatron's f); other arguments pass untouched.

    The column-parallel layers reading it return Partial input gradients that autograd adds up locally;
    leaving the DTensor in backward all-reduces the sum once. Everything in the module that reads the
    hidden state must therefore be a TP-styled layer. The hidden state is the first positional argument,
    or, when the caller passes everything by keyword, the keyword named like the forward's first parameter.
    Not PrepareModuleInput: that needs the module's exact positional arity, which differs between models.
    `local_heads`: the module slices a per-part-split q/k/v projection by its head counts (local_styles.py).
    `head_params`: the module's own parameters hold one entry per head (GPT-OSS's sinks): split by heads and read
    as this rank's shard inside its forward (local_styles.py).
    """

    def __init__(self, local_heads: bool = False, head_params: bool = False):
        super().__init__()
        self.local_heads = local_heads
        self.head_params = head_params

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters), None)
        if self.local_heads:
            localize_heads(module, device_mesh.size())
        if self.head_params:
            shard_head_params(module, device_mesh, self.src_data_rank)

        def replicate(x: torch.Tensor) -> DTensor:
            return DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
            if args:
                return (replicate(args[0]), *args[1:]), kwargs
            if first not in kwargs:
                raise TypeError(
                    f"{type(mod).__name__} (TP style 'replicate_input') got no positional argument "
                    f"and no {first!r} keyword to replicate"
                )
            return args, {**kwargs, first: replicate(kwargs[first])}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


# Style name -> factory (a fresh style per module; None leaves the module whole on every TP rank).
STYLES: dict[str, Callable[[], ParallelStyle | None]] = {
    # Weight and bias sharded on out_features; the output stays this rank's feature (head) shard.
    "colwise": lambda: ColwiseParallel(use_local_output=True),
    # Same, with the output all-gathered: the default head, full-vocabulary logits on every TP rank.
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate(), use_local_output=True),
    # Weight sharded on in_features; the partial sums are all-reduced, the bias is added once.
    "rowwise": lambda: RowwiseParallel(use_local_output=True),
    # Weight sharded on in_features, the replicated input sliced locally, the partial sums all-reduced
    # (after a gathered column-parallel layer, e.g. HF's fused projections).
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate(), use_local_output=True),
    # nn.Embedding sharded on the vocabulary; each rank looks up its rows, the sum is all-reduced.
    "vocab_parallel": lambda: RowwiseParallel(input_layouts=Replicate(), use_local_output=True),
    # Per part: a Linear packing 2 (gate, up) or 3 equal parts (q, k, v) on its output, each split over TP, so the
    # local output is every part's shard in order (local_styles.py); no gather.
    "colwise_packed2": lambda: PackedColwise(2),
    "colwise_packed3": lambda: PackedColwise(3),
    # Column-parallel on a replicated module's output inside the sub-block (MLA's kv_b_proj): input gradient partial.
    "colwise_in_region": lambda: PackedColwise(1),
    # Whole on every TP rank inside a replicate_input sub-block (MLA's latent projections and norms): gradients
    # Partial, the parameters' summed once per step (reduce_partial_grads), the input's by the sub-block's all-reduce.
    "replicated_partial_grad": ReplicatedPartialGrad,
    # Replicated weights on a head-sharded input (q/k norms): the weights become Replicate DTensors, so
    # their gradients come out Partial and are summed over TP once per step (reduce_partial_grads).
    # The norm acts on the last dim only, so naming dim 2 (heads of [b, s, h, d]) as sharded is bookkeeping.
    "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=2, use_local_output=True),
    # Left whole on every TP rank; listed so verify() does not report its Linear layers as forgotten.
    "replicate": lambda: None,
    # On an attention / MLP module: one all-reduce of its input gradient per microbatch (ReplicateInput).
    "replicate_input": ReplicateInput,
    # The same on an attention module reading head counts to slice a per-part-split q/k/v projection.
    "replicate_input_local_heads": lambda: ReplicateInput(local_heads=True),
    # The same on an attention module whose own parameters hold one entry per head (sinks): split by heads.
    "replicate_input_head_params": lambda: ReplicateInput(head_params=True),
    # A plain 1x1 nn.Conv2d split on output / input channels (declared with _tp_col / _tp_row; declared_tp.py).
    "conv_colwise": lambda: ConvChannelParallel(column=True),
    "conv_rowwise": lambda: ConvChannelParallel(column=False),
}

# Column-parallel styles whose output is gathered back to full width (replicated).
_GATHERED = {"colwise_gather_output"}
# Styles that only prepare a module's inputs: its Linear layers still need rules of their own.
_INPUT_STYLES = {"replicate_input", "replicate_input_local_heads", "replicate_input_head_params"}
# Input styles that also split the module's own parameters by heads (dim 0).
_HEAD_PARAMS = {"replicate_input_head_params"}
# Styles valid only inside a replicate_input sub-block: they leave their input gradient partial for its all-reduce.
_IN_REGION = {"colwise_in_region", "replicated_partial_grad"}
# Equal parts a per-part style splits its weight dim into (each part must divide by parallel.tp).
_PARTS = {"colwise_packed2": 2, "colwise_packed3": 3}

# The nn.Linear / nn.Conv2d weight dim each style splits, for the divisibility check (blocks hold Linear layers;
# the embedding's vocabulary is checked with the model shape).
_LINEAR_SHARDED_DIM = {
    "colwise": 0,
    "colwise_gather_output": 0,
    "colwise_packed2": 0,
    "colwise_packed3": 0,
    "colwise_in_region": 0,
    "rowwise": 1,
    "rowwise_split_input": 1,
    "conv_colwise": 0,
    "conv_rowwise": 1,
}


def register_tp_style(
    name: str,
    factory: Callable[[], ParallelStyle | None],
    *,
    linear_sharded_dim: int | None = None,
    input_only: bool = False,
) -> None:
    """Adds a style name plans may use: `factory()` returns a fresh torch ParallelStyle (None: leave whole).

    `linear_sharded_dim`: the nn.Linear weight dim it splits (checked against parallel.tp before any
    collective); `input_only`: it only prepares inputs, so the module's Linear layers need rules of their own.
    """
    STYLES[name] = factory
    if linear_sharded_dim is not None:
        _LINEAR_SHARDED_DIM[name] = linear_sharded_dim
    if input_only:
        _INPUT_STYLES.add(name)


@dataclass
class PlanReport:
    """What a plan does to a module: the FQN -> style it resolves to and what it got wrong."""

    resolved: dict[str, str]
    unmatched_rules: list[str]
    unsharded_linears: list[str]
    # Parameters inside a "replicate_input" sub-block with feature-sharded columns that no rule covers: between its
    # column- and row-parallel layers they would see a shard and get a partial gradient per TP rank (refused).
    unplanned_params: list[str]

    @property
    def ok(self) -> bool:
        return not (self.unmatched_rules or self.unsharded_linears)


def matches_rule(rule: str, fqn: str) -> bool:
    """`parallelize_module`'s matching: same number of components, fnmatch on each."""
    parts, names = rule.split("."), fqn.split(".")
    return len(parts) == len(names) and all(fnmatch(n, p) for n, p in zip(names, parts))


def _check_styles(plan: Mapping[str, str]) -> None:
    for rule, style in plan.items():
        if style not in STYLES:
            raise ConfigError(
                f"tensor-parallel plan rule {rule!r}: style {style!r} is unknown; use one of {', '.join(STYLES)}"
            )


def verify(module: nn.Module, plan: Mapping[str, str]) -> PlanReport:
    """Resolves `plan` on `module`; reports rules that matched no submodule and Linear layers no rule covers."""
    _check_styles(plan)
    names = [n for n, _ in module.named_modules() if n]
    resolved: dict[str, str] = {}
    unmatched = []
    for rule, style in plan.items():
        hits = [n for n in names if matches_rule(rule, n)]
        unmatched += [] if hits else [rule]
        resolved.update(dict.fromkeys(hits, style))
    covered = [c for c, style in resolved.items() if style not in _INPUT_STYLES]
    # Sub-blocks whose column-parallel layers hand on a feature shard (not gathered): their middle is sharded.
    sharded = [c for c, style in resolved.items() if _LINEAR_SHARDED_DIM.get(style) == 0 and style not in _GATHERED]
    regions = [
        c for c, style in resolved.items() if style in _INPUT_STYLES and any(s.startswith(c + ".") for s in sharded)
    ]
    under = lambda n, prefixes: any(n == c or n.startswith(c + ".") for c in prefixes)  # noqa: E731
    unsharded = [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and not under(n, covered)]
    by_head = [c for c, style in resolved.items() if style in _HEAD_PARAMS]
    unplanned = [
        n
        for n, _ in module.named_parameters()
        if under(n.rpartition(".")[0], regions)
        and not under(n.rpartition(".")[0], covered)
        and n.rpartition(".")[0] not in by_head
    ]
    return PlanReport(resolved, unmatched, unsharded, unplanned)


def rules_present(plan: Mapping[str, str], blocks: Iterable[nn.Module]) -> dict[str, str]:
    """The rules of `plan` that match a submodule of some block: a family's plan covers every config of it
    (dense and MoE layers, shared experts, ...), a model's layout keeps what this model has."""
    names = {n for block in blocks for n, _ in block.named_modules() if n}
    return {rule: style for rule, style in plan.items() if any(matches_rule(rule, n) for n in names)}


def block_plan(block: nn.Module, layout: ModelLayout, where: str = "") -> dict[str, str]:
    """A block's own `_tp_plan` if it declares one, else the layout's rules this block has (a model may mix dense
    and MoE blocks) plus its q/k norms; then the column/row pairs it declares with `_tp_col` / `_tp_row`
    (declared_tp.py; `where` names the block in errors). `check_tp_plan` refuses a layout rule no block has."""
    pairs = declared_plan(block, where or f"block {type(block).__name__}")
    declared = getattr(block, "_tp_plan", None)
    if declared is not None:
        return {**declared, **pairs}
    present = [n for n, _ in block.named_modules() if n]
    plan = {rule: style for rule, style in layout.tp_plan.items() if any(matches_rule(rule, n) for n in present)}
    # A sub-block's input replication only where its sharded layers are (not on an MoE block's dense-MLP rule).
    plan = {
        rule: style
        for rule, style in plan.items()
        if style not in _INPUT_STYLES
        or any(r.rpartition(".")[0] == rule and s not in _INPUT_STYLES for r, s in plan.items())
    }
    qk = {n: "replicated_with_grad_allreduce" for n in layout.qk_norms if n in present}
    return {**plan, **qk, **pairs}


def stage_plan(stage: StageModule, pcfg: ParallelConfig) -> dict[str, str]:
    """The plan for one StageModule: embedding per `parallel.embedding`, its blocks, and the head
    (vocab-sharded logits with `parallel.loss_parallel`, gathered logits otherwise)."""
    lay = stage.layout
    if stage.is_first and pcfg.embedding == "auto":
        raise ConfigError(
            'parallel.embedding = "auto" reached the TP pass unresolved; resolve it with the model first '
            "(pp_tp.preflight.resolve_embedding, which build_pipeline runs)"
        )
    plan = {lay.embed: pcfg.embedding} if stage.is_first and lay.is_lm else {}
    for key, block in zip(stage.spec.blocks, stage.block_modules()):
        plan.update({f"{lay.blocks}.{key}.{rule}": style for rule, style in block_plan(block, lay).items()})
    if stage.is_last and lay.is_lm:  # a non-LM model's pre and post modules run whole on every TP rank
        plan[lay.head] = "colwise" if pcfg.loss_parallel else "colwise_gather_output"
    return plan


def _refuse_unmatched(report: PlanReport, where: str) -> None:
    if report.unmatched_rules:
        raise ConfigError(
            f"tensor-parallel plan rule {report.unmatched_rules[0]!r} matches no module of {where}; "
            "fix the rule in the block's _tp_plan or the model layout's tp_plan"
        )


def check_tp_plan(model: nn.Module, layout: ModelLayout, pcfg: ParallelConfig) -> None:
    """Checks every block's plan on the full (meta) model on every rank, so a bad plan fails before any
    collective: unknown styles, rules matching nothing, sharded weight dims not divisible by `parallel.tp`.
    Linear layers no rule covers only warn: they run whole on every TP rank, which is correct but wasteful."""
    if pcfg.tp == 1:
        return
    if layout.tp_refusal:
        raise ConfigError(layout.tp_refusal)
    unsharded: set[str] = set()
    blocks = list(model.get_submodule(layout.blocks).named_children())
    where = {key: f"block {layout.blocks}.{key} ({type(block).__name__})" for key, block in blocks}
    plans = {key: block_plan(block, layout, where[key]) for key, block in blocks}
    used = {rule for plan in plans.values() for rule in plan}
    unused = [rule for rule in layout.tp_plan if rule not in used and layout.tp_plan[rule] not in _INPUT_STYLES]
    if unused:
        raise ConfigError(
            f"tensor-parallel plan rule {unused[0]!r} matches no module of any block of {layout.blocks}; "
            "fix the rule in the model layout's tp_plan"
        )
    for key, block in blocks:
        report = verify(block, plans[key])
        _refuse_unmatched(report, where[key])
        if report.unplanned_params:
            raise ConfigError(
                f"tensor-parallel plan of block {layout.blocks}.{key} ({type(block).__name__}): parameter "
                f"{report.unplanned_params[0]!r} sits inside a tensor-parallel sub-block but no rule covers it "
                "(its gradient would be partial on each TP rank); set parallel.tp = 1 or add a rule for it"
            )
        unsharded.update(report.unsharded_linears)
        for fqn, style in report.resolved.items():
            module, dim = block.get_submodule(fqn), _LINEAR_SHARDED_DIM.get(style)
            size = module.weight.shape[dim] if isinstance(module, (nn.Linear, nn.Conv2d)) and dim is not None else 0
            if style in _HEAD_PARAMS:
                _check_head_params(module, f"{layout.blocks}.{key}.{fqn}", pcfg.tp)
            parts = _PARTS.get(style, 1)
            if size % (pcfg.tp * parts):
                each = f" in each of its {parts} parts" if parts > 1 else ""
                raise ConfigError(
                    f"{layout.blocks}.{key}.{fqn}.weight dim {dim} = {size} is not divisible by "
                    f"parallel.tp = {pcfg.tp}{each} ({style!r}); set parallel.tp to a divisor of {size // parts}"
                )
            regions = [c for c, s in report.resolved.items() if s in _INPUT_STYLES and fqn.startswith(c + ".")]
            if style in _IN_REGION and not regions:
                raise ConfigError(
                    f"tensor-parallel plan of block {layout.blocks}.{key}: {fqn!r} has style {style!r}, which leaves "
                    "its input gradient for a sub-block's input all-reduce, but no replicate_input module holds it; "
                    "add a replicate_input rule for its sub-block"
                )
    if unsharded:
        warnings.warn(
            f"tensor parallel: Linear layers {sorted(unsharded)} match no TP plan rule and run "
            'unsharded on every TP rank; add them to the plan ("replicate" if intended)',
            stacklevel=2,
        )


def _check_head_params(module: nn.Module, fqn: str, tp: int) -> None:
    for name, p in module.named_parameters(recurse=False):
        if p.dim() == 0 or p.shape[0] % tp:
            raise ConfigError(
                f"{fqn}.{name}: {tuple(p.shape)} cannot be split by heads over parallel.tp = {tp} (dim 0 must be "
                "divisible by it); set parallel.tp to a divisor of the head count"
            )


def apply_tp(stage: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig) -> bool:
    """Shards the stage over mesh["tp"] (on meta, without communication); no-op when tp == 1."""
    if pcfg.tp == 1:
        return False
    report = verify(stage, stage_plan(stage, pcfg))
    _refuse_unmatched(report, f"stage {stage.spec.index}")
    styles = {fqn: style for fqn, name in report.resolved.items() if (style := STYLES[name]()) is not None}
    # src_data_rank=None: shard locally; values are filled after materialization (tensor_utils.copy_full_).
    parallelize_module(stage, mesh["tp"], styles, src_data_rank=None)
    _retie(stage)
    if active_dropout(stage):  # TP-sharded activations draw their dropout masks per TP rank (parallel/rng.py)
        install_sharded_regions(stage, report.resolved, mesh.device_type, mesh["tp"].get_local_rank())
    return True


def _retie(stage: StageModule) -> None:
    """Points every copy of a tied weight inside the stage back at one parameter: each style distributed
    its own copy, and a tied weight must stay one tensor with one gradient (the shardings match, as
    preflight requires)."""
    first: dict[str, nn.Parameter] = {}
    for name, p in list(stage.named_parameters(remove_duplicate=False)):
        key = stage.checkpoint_keys[name]
        if key in first and p is not first[key]:
            owner, _, attr = name.rpartition(".")
            setattr(stage.get_submodule(owner), attr, first[key])
        first.setdefault(key, p)


def reduce_partial_grads(modules: Iterable[nn.Module]) -> None:
    """Sums the Partial gradients of replicated parameters (q/k norms) over TP, one all-reduce each.

    Home-made because torch reduces a Partial gradient lazily at each use, i.e. several times per
    optimizer step; called once after the step's last backward, so microbatches add up locally first.
    """
    for module in modules:
        for p in module.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                p.grad = g.redistribute(g.device_mesh, p.placements)
