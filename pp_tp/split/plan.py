"""The stage plan: which module FQNs each pipeline stage owns and which pp rank runs it.

Split modes:
  even             layers evenly; the first (n_layers % stages) stages take one extra layer
  weighted         embedding and head count as `split_embed_weight` / `split_head_weight` layers
  balanced         cut points minimise the most expensive stage by analytic FLOPs (stages/cost.py)
  layers_per_stage an explicit layer count per stage
  explicit         an explicit list of module FQNs per stage
Weighted and balanced place the cuts with an exact min-max contiguous partition (dynamic programming),
so uneven layer counts never drop or duplicate a layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import nn

from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelDims, ModelLayout
from pp_tp.schedules.registry import default_stages_per_rank, stage_owner
from pp_tp.split import cost


@dataclass
class StageSpec:
    index: int
    rank: int
    embed: bool
    blocks: list[str]
    head: bool
    fqns: list[str] = field(default_factory=list)
    params: int = 0
    cost: float = 0.0


@dataclass
class StagePlan:
    stages: list[StageSpec]
    pp: int
    split: str

    def for_rank(self, rank: int) -> list[StageSpec]:
        """This pp rank's stages, in stage order (the order torch's multi-stage schedules expect)."""
        return [s for s in self.stages if s.rank == rank]

    def table(self) -> str:
        """The plan as a text table, for `pp-tp plan`."""
        rows = [("stage", "rank", "layers", "n", "params", "cost (GFLOP/token)", "holds")]
        for s in self.stages:
            layers = f"{s.blocks[0]}-{s.blocks[-1]}" if len(s.blocks) > 1 else (s.blocks[0] if s.blocks else "-")
            holds = "+".join(x for x, on in (("embed", s.embed), ("head", s.head)) if on) or "-"
            rows.append(
                (str(s.index), str(s.rank), layers, str(len(s.blocks)), f"{s.params:,}", f"{s.cost / 1e9:.4f}", holds)
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def _even(n_layers: int, k: int) -> list[int]:
    base, extra = divmod(n_layers, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def _minmax_partition(weights: list[float], k: int) -> list[int]:
    """Sizes of k contiguous non-empty parts of `weights` minimising the largest part's sum."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[j][i]: minimal max-part cost of splitting the first i items into j parts
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for c in range(j - 1, i):
                v = max(best[j - 1][c], prefix[i] - prefix[c])
                if v < best[j][i] - 1e-9 * abs(v):
                    best[j][i], cut[j][i] = v, c
    sizes, i = [], n
    for j in range(k, 0, -1):
        sizes.append(i - cut[j][i])
        i = cut[j][i]
    return sizes[::-1]


def _layer_counts_from_items(item_weights: list[float], k: int) -> list[int]:
    """Partition [embed, layer..., head] and return the layer count of each part."""
    sizes = _minmax_partition(item_weights, k)
    counts, start, n = [], 0, len(item_weights)
    for size in sizes:
        end = start + size
        counts.append(sum(1 for i in range(start, end) if 0 < i < n - 1))
        start = end
    return counts


def _layer_counts(pcfg: ParallelConfig, d: ModelDims, seq_len: int) -> list[int]:
    """Layers per stage; the list lengths and entries were checked with the config (config.validate)."""
    k = pcfg.num_stages
    if pcfg.split == "layers_per_stage":
        counts = list(pcfg.layers_per_stage)
        if sum(counts) != d.n_layers:
            raise ConfigError(
                f"parallel.layers_per_stage = {counts} sums to {sum(counts)} but "
                f"model.n_layers = {d.n_layers}; make the counts sum to {d.n_layers}"
            )
        return counts
    if d.n_layers < k:
        raise ConfigError(
            f"model.n_layers = {d.n_layers} is fewer than the {k} pipeline stages "
            "(parallel.pp * parallel.stages_per_rank); lower parallel.pp or parallel.stages_per_rank, "
            "or add layers"
        )
    if pcfg.split == "even":
        return _even(d.n_layers, k)
    if pcfg.split == "weighted":
        items = [pcfg.split_embed_weight] + [1.0] * d.n_layers + [pcfg.split_head_weight]
    else:  # balanced
        items = [cost.embed_flops(d)] + [cost.block_flops(d, seq_len)] * d.n_layers + [cost.head_flops(d)]
    counts = _layer_counts_from_items(items, k)
    if 0 in counts[1:-1]:  # a middle stage with no layer has nothing to run
        raise ConfigError(
            f"parallel.split = {pcfg.split!r} leaves a middle stage empty ({counts}); "
            "lower parallel.pp/stages_per_rank or the embed/head weights"
        )
    return counts


def _explicit(pcfg: ParallelConfig, layout: ModelLayout, keys: list[str]) -> list[tuple[bool, list[str], bool]]:
    """Checks an explicit FQN list per stage: known names, in model order, each exactly once."""
    first, last = list(layout.first.modules), list(layout.last.modules)
    order = first + [f"{layout.blocks}.{k}" for k in keys] + last
    lists = pcfg.stage_fqns  # one non-empty list per stage (config.validate)
    flat = [f for stage in lists for f in stage]
    unknown = [f for f in flat if f not in order]
    if unknown:
        raise ConfigError(
            f"parallel.stage_fqns: unknown module {unknown[0]!r}; use names like {order[0]!r}, "
            f"{order[1]!r}, {order[-1]!r}"
        )
    if flat != order:
        missing = [f for f in order if f not in flat]
        what = f"misses {missing[0]!r}" if missing else "repeats a module or breaks model order"
        raise ConfigError(f"parallel.stage_fqns {what}; list every module once, in model order")
    if lists[0][: len(first)] != first or lists[-1][-len(last) :] != last:
        raise ConfigError(f"parallel.stage_fqns: {first} must open the first stage and {last} close the last one")
    prefix = f"{layout.blocks}."
    return [(first[0] in s, [f[len(prefix) :] for f in s if f.startswith(prefix)], last[-1] in s) for s in lists]


def plan_stages(model: nn.Module, layout: ModelLayout, pcfg: ParallelConfig, seq_len: int | None = None) -> StagePlan:
    """Plans stages for `model` (meta or real) under `pcfg`; pure and local, so every rank gets the same plan."""
    if pcfg.stages_per_rank is None:
        pcfg = dataclasses.replace(pcfg, stages_per_rank=default_stages_per_rank(pcfg.schedule, pcfg.pp))
    d = layout.dims(model)
    seq_len = seq_len or d.max_seq_len
    keys = layout.block_keys(model)
    k = pcfg.num_stages
    if pcfg.split == "explicit":
        parts = _explicit(pcfg, layout, keys)
    else:
        counts = _layer_counts(pcfg, d, seq_len)
        bounds = [sum(counts[:i]) for i in range(k + 1)]
        parts = [(i == 0, keys[bounds[i] : bounds[i + 1]], i == k - 1) for i in range(k)]
    owners = stage_owner(pcfg.pp, pcfg.stages_per_rank, pcfg.schedule)
    stages = []
    for i, (embed, blocks, head) in enumerate(parts):
        fqns = (list(layout.first.modules) if embed else []) + [f"{layout.blocks}.{b}" for b in blocks]
        fqns += list(layout.last.modules) if head else []
        flops = (cost.embed_flops(d) if embed else 0.0) + len(blocks) * cost.block_flops(d, seq_len)
        flops += cost.head_flops(d) if head else 0.0
        seen: set[int] = set()
        params = 0
        for f in fqns:
            for p in model.get_submodule(f).parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params += p.numel()
        stages.append(StageSpec(i, owners[i], embed, blocks, head, fqns, params, flops))
    return StagePlan(stages, pcfg.pp, pcfg.split)
