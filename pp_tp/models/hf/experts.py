"""A Hugging Face MoE's experts record (`ExpertsSpec`), read once off what the family declares.

The experts modules come from the config's `base_model_ep_plan` (`ep_dispatch_experts`) or its TP plan's
`moe_tp_experts` rules (pp_tp.models.hf.tp_plan.block_experts), TP of experts from its `base_model_tp_plan`, top-k from
`num_experts_per_tok`, routers from a probe (pp_tp.models.hf.routers) and expert biases from the blocks'
`e_score_correction_bias` buffers (DeepSeek-V3 and the families built like it).
The packed weights' storage comes from the attributes transformers' `use_experts_implementation` gives the module
(`is_transposed`, `is_concatenated`, `has_bias`, `has_gate`, `has_post_expert_norm`); a module without them (Llama 4's
[E, D, 2F] gate/up) gets the storage a probe proves: on a CPU copy built from the small config, random weights, the
sum of its forward over the two TP shards that storage implies equals its whole forward. Its calling convention is
transformers' routed one, or dense (`ExpertsSpec.dense`) for a one-argument forward a probe proves reads E equal
contiguous row blocks, block e through expert e's weights alone.
A family declaring no experts modules at all (JetMoE: `ParallelExperts` in its MoE MLP and in its mixture of attention
heads) gets those found by structure: modules whose own parameters all hold one count (> 1) on dim 0 and whose
forward takes (rows sorted by expert, rows per expert), kept where a probe proves that convention (grouped,
`ExpertsSpec.grouped`): on the small copy's own forward, the arguments it gives each such module, run whole, equal
each expert's row group run through that expert's weights alone.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import torch
from torch import nn

from pp_tp.base._torch import swap_parameters
from pp_tp.layout import ExpertsSpec, PackedSwiGLU
from pp_tp.models.hf.record import Record, record_of
from pp_tp.models.hf.routers import block_routers
from pp_tp.models.hf.tp_plan import block_experts
from pp_tp.parallel.tensor_parallel import matches_rule

_BIAS = "e_score_correction_bias"
_GATE_UP, _UP, _DOWN = "gate_up_proj", "up_proj", "down_proj"
_ROWS = 4  # probe rows per expert


def experts_spec(model: nn.Module, blocks_key: str, blocks: list[nn.Module]) -> ExpertsSpec | None:
    """The model's experts record, or None when it declares no experts modules its blocks hold."""
    modules, tp_form = block_experts(model, blocks_key)
    grouped = not modules
    if grouped:
        modules = _grouped_experts(model, blocks_key, blocks)
    found = [m for b in blocks for n, m in b.named_modules() if n and any(matches_rule(r, n) for r in modules)]
    if not found:
        return None
    module = found[0]
    dense, weights = (False, None) if grouped else _probed(module, model)
    return ExpertsSpec(
        modules=modules,
        n_experts=next(iter(module.parameters())).shape[0],  # transformers keeps the expert on dim 0
        top_k=getattr(model.config, "num_experts_per_tok", None),
        grouped=grouped,
        dense=dense,
        weights=weights,
        # TP of experts splits plain packed SwiGLU or non-gated up/down only, stored as the declared rules name it,
        # no norm after each expert
        tp=tp_form is not None
        and weights is not None
        and (weights.gate_up_dim == 2, weights.gate_up == _GATE_UP) == tp_form
        and not getattr(module, "has_post_expert_norm", False),
        count_attr=_count_attr(module),
        routers=block_routers(model, blocks),
        bias=tuple(sorted({n for b in blocks for n, _ in b.named_buffers() if n.rpartition(".")[2] == _BIAS})),
    )


def _count_attr(module: nn.Module) -> str | None:
    """The attribute the module's forward sizes its experts by (transformers' kernels' bins, JetMoE's loop)."""
    return "num_experts" if "num_experts" in vars(module) else None


def _grouped_experts(model: nn.Module, blocks_key: str, blocks: list[nn.Module]) -> tuple[str, ...]:
    """Block-relative names of the undeclared experts modules the grouped probe proves (kept in the family's
    record)."""
    names = tuple(sorted({n for b in blocks for n, m in b.named_modules() if n and _grouped_shaped(m)}))
    if not names:
        return ()
    record = record_of(model)
    path = next(n for n, m in model.named_modules() if m is blocks[0]).rpartition(".")[0]  # blocks_key's full path
    return record.derived(("grouped", names), lambda: _prove_grouped(record, path, names))


def _grouped_shaped(module: nn.Module) -> bool:
    """Own parameters only, all holding one count (> 1) on dim 0, and a two-argument forward."""
    params = list(module.parameters(recurse=False))
    counts = {p.shape[0] if p.dim() >= 2 else 0 for p in params}
    return (
        bool(params)
        and len(params) == len(list(module.parameters()))
        and len(counts) == 1
        and min(counts) > 1
        and len(inspect.signature(module.forward).parameters) == 2
    )


@torch.no_grad()
def _prove_grouped(record: Record, blocks: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """The `names` whose module, in the family's recorded forward, is called as grouped experts: its first call
    (in the first block holding it), rerun on a copy of the module with random values N(0, 0.5)."""
    if record.error is not None:  # a copy the probe cannot run proves nothing
        return ()
    watched = set(names) | {n.rpartition(".")[0] for n in names}  # the experts and the modules around them
    modules: dict[str, nn.Module] = {}
    for block in record.model.get_submodule(blocks).children():
        for n, m in block.named_modules():
            if n in watched:
                modules.setdefault(n, m)
    by_module = {id(m): n for n, m in modules.items()}
    calls: dict[str, tuple] = {}
    for call in record.calls:  # in the order calls returned: a module's calls in the order it was called
        if id(call.module) in by_module:
            calls.setdefault(by_module[id(call.module)], call.args)  # the first (called twice: mixture of heads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            spread = {n: copy.deepcopy(modules[n]) for n in names if _called(calls, n)}
            for module in spread.values():
                for p in module.parameters():
                    p.normal_(0.0, 0.5)
        return tuple(n for n in names if n in spread and _groups_per_expert(spread[n], *calls[n]))
    except Exception:  # noqa: BLE001 - a module the probe cannot run proves nothing
        return ()


def _called(calls: dict[str, tuple], name: str) -> bool:
    """Called with two arguments, and so is the module around it (its FSDP unit under expert parallel runs on
    that module's forward: JetMoE's attention experts sit in a module called only through other methods)."""
    return len(calls.get(name, ())) == 2 and ("." not in name or name.rpartition(".")[0] in calls)


def _groups_per_expert(module: nn.Module, rows: torch.Tensor, counts) -> bool:
    """Whether the forward on (rows sorted by expert, rows per expert) runs group e through expert e's weights
    alone, the count attribute (if any) sized to the one expert."""
    params = dict(module.named_parameters(recurse=False))
    sizes = [int(c) for c in counts]
    if len(sizes) != next(iter(params.values())).shape[0] or sum(sizes) != rows.shape[0]:
        return False
    whole, parts, attr = module(rows, counts), [], _count_attr(module)
    for e, group in enumerate(rows.split(sizes)):
        saved = swap_parameters(module, {k: p[e : e + 1] for k, p in params.items()})
        saved_count = getattr(module, attr) if attr else None
        if attr:
            setattr(module, attr, 1)
        try:
            parts.append(module(group, counts[e : e + 1]))
        finally:
            swap_parameters(module, saved)
            if attr:
                setattr(module, attr, saved_count)
    return whole.shape[0] == rows.shape[0] and torch.allclose(whole, torch.cat(parts), rtol=1e-5, atol=1e-6)


def _declared(module: nn.Module) -> bool:
    return hasattr(module, "is_transposed")  # set by transformers' use_experts_implementation


def _candidates(module: nn.Module) -> list[PackedSwiGLU]:
    """The packings `module` may store: the one transformers declares on it, else every plain one to probe. Experts
    transformers declares non-gated (`has_gate` False: Nemotron-H's up_proj -> activation -> down_proj) are recorded
    with up_proj as `gate_up`, not concatenated: split by contiguous shards of its hidden dim, as down's input."""
    params = dict(module.named_parameters(recurse=False))
    gated = getattr(module, "has_gate", True)
    up = _GATE_UP if gated else _UP
    if up not in params or _DOWN not in params or not (gated or _declared(module)):
        return []
    bias = getattr(module, "has_bias", False)
    forms = (
        [(module.is_transposed, gated and getattr(module, "is_concatenated", True))]
        if _declared(module)
        else [(t, c) for t in (False, True) for c in (True, False)]
    )
    return [
        PackedSwiGLU(
            gate_up=up,
            down=_DOWN,
            gate_up_dim=2 if transposed else 1,
            down_dim=1 if transposed else 2,
            concatenated=concatenated,
            gate_up_bias=f"{up}_bias" if bias else None,
            down_bias=f"{_DOWN}_bias" if bias else None,
        )
        for transposed, concatenated in forms
    ]


def _probed(module: nn.Module, model: nn.Module) -> tuple[bool, PackedSwiGLU | None]:
    """(dense calling convention, packed weights or None), proven on a small CPU copy where not declared (kept in
    the family's record)."""
    dense = len(inspect.signature(module.forward).parameters) == 1
    candidates = _candidates(module)
    if not dense and (_declared(module) or not candidates):
        return False, candidates[0] if candidates else None
    record = record_of(model)
    return record.derived(("experts", type(module)), lambda: _probe(type(module), record.small, dense, candidates))


@torch.no_grad()
def _probe(cls: type, config, dense: bool, candidates: list[PackedSwiGLU]) -> tuple[bool, PackedSwiGLU | None]:
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            module = cls(config).to(torch.float32)
            for p in module.parameters():
                p.normal_(0.0, 0.5)
            params = dict(module.named_parameters(recurse=False))
            n = next(iter(params.values())).shape[0]
            width = config.hidden_size
            if dense:
                x = torch.randn(n * _ROWS, width)
                call: Callable[[], torch.Tensor] = lambda: module(x)  # noqa: E731
                dense = _blocks_per_expert(module, params, n, x)
            else:
                index, ones = torch.randint(0, n, (n * _ROWS, 1)), torch.ones(n * _ROWS, 1)
                x = torch.randn(n * _ROWS, width)
                call = lambda: module(x, index, ones)  # noqa: E731
            whole = call()
            weights = next((w for w in candidates if _splits_exactly(module, params, w, call, whole)), None)
            return dense, weights
    except Exception:  # noqa: BLE001 - a module the probe cannot run is not proven
        return False, None


def _blocks_per_expert(module: nn.Module, params: dict[str, nn.Parameter], n: int, x: torch.Tensor) -> bool:
    """Whether the one-argument forward runs row block e through expert e's weights alone (the dense convention)."""
    whole = module(x)
    parts = []
    for e, rows in enumerate(x.chunk(n)):
        saved = swap_parameters(module, {k: p[e : e + 1] for k, p in params.items()})
        try:
            parts.append(module(rows))
        finally:
            swap_parameters(module, saved)
    return whole.shape == x.shape and torch.allclose(whole, torch.cat(parts), rtol=1e-5, atol=1e-5)


def _splits_exactly(
    module: nn.Module, params: dict[str, nn.Parameter], w: PackedSwiGLU, call: Callable[[], torch.Tensor], whole
) -> bool:
    """Whether the forward on TP shard 0 plus the forward on shard 1 of packing `w` (what pp_tp.parallel.experts
    places: gate/up per part or by contiguous pairs, down on its input dim, down's bias on shard 0) is the whole."""
    if set(params) != set(w.names):
        return False
    total = torch.zeros_like(whole)
    for rank in range(2):
        local = {}
        for name, p in params.items():
            dim = w.gate_up_dim if name == w.gate_up else w.down_dim if name == w.down else p.dim() - 1
            if name == w.down_bias:
                local[name] = p if rank == 0 else torch.zeros_like(p)
            elif name in (w.gate_up, w.gate_up_bias) and w.concatenated:
                local[name] = torch.cat([half.chunk(2, dim)[rank] for half in p.chunk(2, dim)], dim)
            else:
                local[name] = p.chunk(2, dim)[rank]
        saved = swap_parameters(module, local)
        try:
            part = call()
        except RuntimeError:  # shapes this packing implies that the forward cannot take: not its packing
            return False
        finally:
            swap_parameters(module, saved)
        if part.shape != total.shape:
            return False
        total += part
    return bool(torch.allclose(total, whole, rtol=1e-4, atol=1e-5))
