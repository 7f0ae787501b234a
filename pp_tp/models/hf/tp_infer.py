"""Tensor parallelism for a Hugging Face family that declares no `base_model_tp_plan`: its Megatron pairs inferred from
its modules, each proven on a shrunk copy at tp = 2 before it is used.

Inference, on the self-check's small copy (`small_config`, seeded values), one block at a time, from the order in which
its block calls its Linear layers (`nn.Linear`, and transformers' `Conv1D`, whose weight is stored [in, out]):
- a region is a child of the block (attention, MLP) or the block itself (OPT's `fc1` / `fc2`); a region whose layers
  write nothing of the block's width (BERT's `intermediate`) joins the next one (its `output`);
- the region's last layer writing the block's width is the row-parallel layer; every other layer of it must read the
  block's width and is column-parallel, split whole (q/k/v, up, gate; BLOOM's, NeoX's and Persimmon's per-head
  interleaved fused q/k/v alike) or per part (GPT-2's and MPT's fused [q|k|v]: 3 parts; ModernBERT's [input | gate]:
  2), whichever the proof accepts;
- the attention modules under it divide their head counts and widths by the TP degree, and the per-head tensors the
  family computes for all heads (ALiBi biases) are sliced with their heads (parallel/inferred_styles.py).
Proof: two copies of the block, each with one TP rank's shards, run on the inputs the model's own forward handed the
block, the row-parallel outputs summed over the copies as the all-reduce sums them (repeated until the sums settle);
both copies' outputs must equal the whole block's. A region also holding parameters that its column-parallel layers'
shards could reach (norms between the pair, per-head scales, experts) is not split. A region no candidate proves runs
whole on every TP rank (exact: the replicated activation in, the same output and full gradients on every rank), as the
startup report says; if no region of any block splits, the family still trains at tp > 1, its blocks whole.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pp_tp.base.forward import without_cache
from pp_tp.models.hf.self_check import SEQ, TOLERANCE, small_config
from pp_tp.parallel.inferred_styles import LocalHeads, head_count, is_conv1d, localizable, localize, slice_inputs
from pp_tp.parallel.tp_styles import TP_STYLES, TPStyle, register_tp_style

TP = 2  # the degree the proof runs at
_PASSES = 6  # rounds of summing row-parallel outputs; a block's pairs settle in one more round than it has pairs


@dataclass(frozen=True)
class Layer:
    name: str
    conv1d: bool
    in_features: int
    out_features: int


@dataclass
class Region:
    """Block children (or the block itself: "") holding one column/row pair; `columns` in call order."""

    tops: tuple[str, ...]
    columns: tuple[Layer, ...]
    row: Layer | None


def _layers(block: nn.Module) -> dict[str, Layer]:
    out = {}
    for name, m in block.named_modules():
        if isinstance(m, nn.Linear):
            out[name] = Layer(name, False, m.weight.shape[1], m.weight.shape[0])
        elif is_conv1d(m):
            out[name] = Layer(name, True, m.weight.shape[0], m.weight.shape[1])
    return out


def _top(name: str) -> str:
    return name.split(".")[0] if "." in name else ""


def _under(name: str, tops: Iterable[str]) -> bool:
    return any(t == "" or name == t or name.startswith(t + ".") for t in tops)


def _calls(block: nn.Module, args: tuple, kwargs: dict) -> tuple[list[str], torch.Tensor]:
    """The names of `block`'s modules in the order their forwards start (first call each), and its output (run on a
    copy: the block itself stays uncalled, so copies of it can still be made)."""
    block = copy.deepcopy(block)
    order: list[str] = []
    handles = [
        m.register_forward_pre_hook(lambda mod, a, n=n: order.append(n) if n not in order else None)
        for n, m in block.named_modules()
    ]
    try:
        out = _first_tensor(block(*args, **kwargs))
    finally:
        for h in handles:
            h.remove()
    return order, out


def _first_tensor(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else next(o for o in out if isinstance(o, torch.Tensor))


def _regions(order: list[str], layers: dict[str, Layer], hidden: int) -> list[Region]:
    """The block's regions in call order; a region whose column/row pair does not fit gets `row` None."""
    groups: dict[str, list[Layer]] = {}
    for name in order:
        if name in layers:
            groups.setdefault(_top(name), []).append(layers[name])
    out, pending = [], []
    for top, found in groups.items():
        pending.append((top, found))
        if any(layer.out_features == hidden for layer in found):
            tops, found = tuple(t for t, _ in pending), [x for _, f in pending for x in f]
            pending = []
            rows = [i for i, layer in enumerate(found) if layer.out_features == hidden]
            row, columns = found[rows[-1]], found[: rows[-1]]
            fits = rows[-1] == len(found) - 1 and columns and all(c.in_features == hidden for c in columns)
            out.append(Region(("",) if "" in tops else tops, tuple(columns), row if fits else None))
    out += [Region((t,), tuple(f), None) for t, f in pending]
    return out


def _unreached(block: nn.Module, region: Region, order: list[str], split: set[str]) -> bool:
    """Whether a module holding parameters of its own, not one of the pair's layers, runs where the column-parallel
    layers' shards may reach it: inside the region before its row-parallel layer ends (for the block itself: between
    its first column-parallel layer and the row-parallel one)."""
    start = 0 if region.tops != ("",) else order.index(region.columns[0].name)
    end = order.index(region.row.name)
    for name, m in block.named_modules():
        if name in split or not any(True for _ in m.parameters(recurse=False)):
            continue
        inside = region.tops != ("",) and _under(name, region.tops) and name != ""
        if inside and (name not in order or order.index(name) <= end):
            return True
        if region.tops == ("",) and name in order and start < order.index(name) < end:
            return True
    return False


def _parts(column: Layer, row: Layer) -> tuple[int, ...]:
    fused = column.out_features // row.in_features
    if column.out_features % row.in_features == 0 and 1 < fused <= 3:
        return (1, fused)
    return (1,)


def _rank_shard(t: torch.Tensor, dim: int, parts: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s block of every one of `parts` equal parts of `t` along `dim` (a plain split for parts = 1)."""
    return torch.cat([p.chunk(TP, dim)[rank] for p in t.chunk(parts, dim)], dim)


@torch.no_grad()
def _shard_copy(block: nn.Module, choice: dict[str, int], row: set[str], local: dict[str, tuple], rank: int):
    """A copy of `block` holding rank `rank`'s shards: `choice` column layer -> parts, `row` layers (bias on rank 0
    only: added once), `local` modules -> the per-head inputs they take, localized and sliced."""
    c = copy.deepcopy(block)
    for name, parts in choice.items():
        m = c.get_submodule(name)
        m.weight = nn.Parameter(_rank_shard(m.weight, 1 if is_conv1d(m) else 0, parts, rank))
        if m.bias is not None:
            m.bias = nn.Parameter(_rank_shard(m.bias, 0, parts, rank))
        if is_conv1d(m):
            m.nf = m.weight.shape[1]
    for name in row:
        m = c.get_submodule(name)
        m.weight = nn.Parameter(_rank_shard(m.weight, 0 if is_conv1d(m) else 1, 1, rank))
        if m.bias is not None and rank:
            m.bias.zero_()
    for name, computed in local.items():
        m = c.get_submodule(name)
        heads = head_count(m)
        localize(m, TP)
        if computed and heads:
            m.register_forward_pre_hook(slice_inputs(m, computed, rank, TP, heads), with_kwargs=True)
    return c


@torch.no_grad()
def _proven(block: nn.Module, inputs: tuple[tuple, dict], want: torch.Tensor, regions: list[tuple[Region, dict]]):
    """Whether `block` with `regions` (each with its choice: column parts, local modules) split over TP ranks, its
    row-parallel outputs summed over the ranks, gives every rank the whole block's output."""
    choice = {name: parts for _, c in regions for name, parts in c["parts"].items()}
    row = {r.row.name for r, _ in regions}
    local = {name: names for _, c in regions for name, names in c["local"].items()}
    try:
        copies = [_shard_copy(block, choice, row, local, r) for r in range(TP)]
    except Exception:  # noqa: BLE001 - a region whose attributes do not divide is not proven
        return False
    sums: dict[str, torch.Tensor] = {}
    outs: list[torch.Tensor] = []
    for _ in range(_PASSES):
        partials: dict[str, list[torch.Tensor]] = {}
        outs = []
        for c in copies:
            hooks = [c.get_submodule(n).register_forward_hook(_summed(n, partials, sums)) for n in row]
            try:
                outs.append(_first_tensor(c(*inputs[0], **inputs[1])))
            except Exception:  # noqa: BLE001 - a shard the forward cannot run on is not proven
                return False
            finally:
                for h in hooks:
                    h.remove()
        new = {n: sum(p) for n, p in partials.items()}
        if new.keys() == sums.keys() and all(torch.equal(new[n], sums[n]) for n in new):
            break
        sums = new
    return all(o.shape == want.shape and _error(o, want) <= TOLERANCE for o in outs)


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _summed(name: str, partials: dict[str, list[torch.Tensor]], sums: dict[str, torch.Tensor]):  # noqa: ANN202
    """A forward hook recording a row-parallel layer's partial output and handing on the sum over the ranks from the
    previous round (the partial itself in the first)."""

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        partials.setdefault(name, []).append(out.clone())  # copies: families add into the output in place (Falcon)
        return sums[name].clone() if name in sums else out

    return hook


def _candidates(block: nn.Module, region: Region, computed: frozenset[str]) -> list[dict]:
    """The ways to split `region`, most likely first: per column layer its parts; attention modules localized or not."""
    holders = {
        n: tuple(sorted(computed & set(inspect.signature(m.forward).parameters)))
        for n, m in block.named_modules()
        if n and region.tops != ("",) and _under(n, region.tops) and localizable(m) and _attention(m)
    }
    options = [[(c.name, p) for p in _parts(c, region.row)] for c in region.columns]
    combos = [dict(combo) for combo in itertools.product(*options)]
    return [{"parts": p, "local": loc} for loc in ([holders, {}] if holders else [{}]) for p in combos]


def _attention(module: nn.Module) -> bool:
    """An attention module: it holds a head count of its own, or is named so."""
    return head_count(module) is not None or "Attention" in type(module).__name__


def _style(layer: Layer, parts: int, column: bool) -> str:
    kind = "conv1d_" if layer.conv1d else ""
    if not column:
        return f"{kind}rowwise"
    return f"{kind}colwise" + (f"_packed{parts}" if parts > 1 else "")


def _local_style(names: tuple[str, ...]) -> str:
    """The LocalHeads style slicing `names` (registered on first use: its inputs are the family's)."""
    key = "local_heads" + (f":{','.join(names)}" if names else "")
    if key not in TP_STYLES:
        register_tp_style(key, TPStyle(lambda: LocalHeads(names), dropout="neutral"))
    return key


_PLANS: dict[tuple[type, str], dict[str, str]] = {}


def inferred_tp_plan(
    model: nn.Module, blocks: list[nn.Module], computed: frozenset[str] = frozenset()
) -> dict[str, str]:
    """The block-relative plan proven on `model`'s small copy (cached per class and small config): the pairs found
    and proven, `replicate` on every region left whole. `blocks`: the model's layers; `computed`: the per-head
    layer arguments its forward computes for all heads (ALiBi biases)."""
    small = small_config(model.config)
    path = next(n for n, m in model.named_modules() if any(c is blocks[0] for c in m.children()))
    key = (type(model), small.to_json_string(use_diff=False))
    if key not in _PLANS:
        _PLANS[key] = _infer(type(model), small, path, computed)
    return dict(_PLANS[key])


def _seeded(cls: type, small: Any) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(small).to(torch.float32).eval()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # no zero biases or unit norms: a bias added twice or a dropped scale would show
            for p in model.parameters():
                p.copy_(p + 0.1 * torch.randn(p.shape, generator=gen))
    return model


def _block_inputs(model: nn.Module, blocks: list[nn.Module]) -> list[tuple[tuple, dict]]:
    """What the model's own forward hands each of `blocks` (first call each) on a fixed batch."""
    seen: dict[int, tuple[tuple, dict]] = {}
    hooks = [
        b.register_forward_pre_hook(lambda m, a, k: seen.setdefault(id(m), (a, k)) and None, with_kwargs=True)
        for b in blocks
    ]
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            model(input_ids=ids, **without_cache(model))
    finally:
        for h in hooks:
            h.remove()
    return [seen[id(b)] for b in blocks if id(b) in seen]


def _infer(cls: type, small: Any, path: str, computed: frozenset[str]) -> dict[str, str]:
    model = _seeded(cls, small)
    blocks = list(model.get_submodule(path).children())
    inputs = _block_inputs(model, blocks)
    # copies made before any call: a block keeping state from its last call (RecurrentGemma's recurrence) copies so
    blocks = [copy.deepcopy(b) for b in _seeded(cls, small).get_submodule(path).children()]
    hidden = model.config.hidden_size
    found: dict[tuple[str, ...], list] = {}  # region tops -> [(block, inputs, want, order, region)]
    for block, ins in zip(blocks, inputs):
        order, want = _calls(block, *ins)
        for region in _regions(order, _layers(block), hidden):
            found.setdefault(region.tops, []).append((block, ins, want, order, region))
    plan: dict[str, str] = {}
    chosen = {tops: c for tops, cases in found.items() if (c := _prove_region(cases, computed)) is not None}
    # every proven region split at once, in each block: the pairs together as the build applies them
    together = all(
        _proven(
            block, ins, want, [(r, chosen[r.tops]) for r in _regions(order, _layers(block), hidden) if r.tops in chosen]
        )
        for block, ins in zip(blocks, inputs)
        for order, want in [_calls(block, *ins)]
    )
    for tops, choice in chosen.items() if together else ():
        region = found[tops][0][4]
        plan.update({c.name: _style(c, choice["parts"][c.name], True) for c in region.columns})
        plan[region.row.name] = _style(region.row, 1, False)
        plan.update({n: _local_style(names) for n, names in choice["local"].items()})
    whole = {n if _top(n) == "" else _top(n) for b in blocks for n in _layers(b) if not _split(n, plan)}
    plan.update(dict.fromkeys(sorted(whole), "replicate"))
    return plan


def _split_blocks(blocks: list[nn.Module], inputs: list, hidden: int) -> Iterable[tuple]:
    for block, ins in zip(blocks, inputs):
        order, want = _calls(block, *ins)
        yield block, ins, want, _regions(order, _layers(block), hidden)


def _split(name: str, plan: dict[str, str]) -> bool:
    return name in plan and plan[name] != "replicate"


def _prove_region(cases: list, computed: frozenset[str]) -> dict | None:
    """The first candidate split of a region proven on every small block holding it (same layers), else None."""
    if any(r.row is None or (r.columns, r.row) != (cases[0][4].columns, cases[0][4].row) for *_, r in cases):
        return None
    block, _, _, order, region = cases[0]
    split = {c.name for c in region.columns} | {region.row.name}
    if any(_unreached(b, r, o, split) for b, _, _, o, r in cases):
        return None
    for cand in _candidates(block, region, computed):
        if all(_proven(b, ins, want, [(r, cand)]) for b, ins, want, _, r in cases):
            return cand
    return None


def inferred_block_plan(
    model: nn.Module, blocks: list[nn.Module], computed: frozenset[str]
) -> tuple[dict[str, str], str | None]:
    """(`inferred_tp_plan`, None), or ({}, a one-line refusal) where the small copy cannot run for the proof."""
    try:
        return inferred_tp_plan(model, blocks, computed), None
    except Exception as e:  # noqa: BLE001 - a family whose small copy cannot run has nothing proven
        return {}, (
            f"model {type(model).__name__} declares no base_model_tp_plan and pp_tp could not infer one on its small "
            f"copy ({type(e).__name__}: {str(e)[:120]}); set parallel.tp = 1"
        )
