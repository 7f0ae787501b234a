"""Tensor parallelism inside a pipeline stage, without sequence parallel, on torch's DTensor parallel styles.

Stage boundaries carry plain tensors, so every style hands back local tensors: column-parallel outputs
stay sharded on features (heads) inside a block, row-parallel outputs are all-reduced back to
replicated activations. The attention and MLP inputs enter as Replicate DTensors ("replicate_input"), so
backward all-reduces once per sub-block rather than once per column-parallel layer: per block and microbatch,
2 all-reduces in forward and 2 in backward (Megatron's g and f). A plan maps module FQNs (``*`` matches
one name component, as in ``parallelize_module``) to style names, each a record in tp_styles.TP_STYLES (what it
applies, what the checks below verify, what it does to dropout). A block's plan is its class's
``_tp_plan`` when it declares one, else the model layout's ``tp_plan`` plus its q/k norms.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from pp_tp.base.fqn import matches_rule
from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelLayout
from pp_tp.parallel.declared_tp import declared_plan
from pp_tp.parallel.rng import active_dropout, install_sharded_regions
from pp_tp.parallel.tp_styles import TP_STYLES

if TYPE_CHECKING:  # annotations only: parallel/ is applied to stage modules, it does not build them
    from pp_tp.stages.stage_module import StageModule


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


def _check_styles(plan: Mapping[str, str]) -> None:
    for rule, style in plan.items():
        if style not in TP_STYLES:
            raise ConfigError(
                f"tensor-parallel plan rule {rule!r}: style {style!r} is unknown; use one of {', '.join(TP_STYLES)}"
            )


def _input_only(style: str) -> bool:
    """Whether `style` only prepares inputs; False for a name no record has (refused later, in one line)."""
    return style in TP_STYLES and TP_STYLES[style].input_only


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
    covered = [c for c, style in resolved.items() if not _input_only(style)]
    # Sub-blocks whose column-parallel layers hand on a feature shard (not gathered): their middle is sharded.
    sharded = [c for c, s in resolved.items() if TP_STYLES[s].sharded_dim == 0 and not TP_STYLES[s].gathered]
    regions = [c for c, style in resolved.items() if _input_only(style) and any(s.startswith(c + ".") for s in sharded)]
    under = lambda n, prefixes: any(n == c or n.startswith(c + ".") for c in prefixes)  # noqa: E731
    unsharded = [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and not under(n, covered)]
    by_head = [c for c, style in resolved.items() if TP_STYLES[style].head_params]
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
        if not _input_only(style) or any(r.rpartition(".")[0] == rule and not _input_only(s) for r, s in plan.items())
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
    unused = [rule for rule in layout.tp_plan if rule not in used and not _input_only(layout.tp_plan[rule])]
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
            module, record = block.get_submodule(fqn), TP_STYLES[style]
            dim, parts = record.sharded_dim, record.parts
            size = module.weight.shape[dim] if isinstance(module, (nn.Linear, nn.Conv2d)) and dim is not None else 0
            if record.head_params:
                _check_head_params(module, f"{layout.blocks}.{key}.{fqn}", pcfg.tp)
            if size % (pcfg.tp * parts):
                each = f" in each of its {parts} parts" if parts > 1 else ""
                raise ConfigError(
                    f"{layout.blocks}.{key}.{fqn}.weight dim {dim} = {size} is not divisible by "
                    f"parallel.tp = {pcfg.tp}{each} ({style!r}); set parallel.tp to a divisor of {size // parts}"
                )
            regions = [c for c, s in report.resolved.items() if _input_only(s) and fqn.startswith(c + ".")]
            if record.in_region and not regions:
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
    styles = {fqn: style for fqn, name in report.resolved.items() if (style := TP_STYLES[name].factory()) is not None}
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
