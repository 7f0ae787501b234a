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

import inspect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pp_tp.models.hf.record import Record, record_of, seeded_values
from pp_tp.models.hf.self_check import TOLERANCE
from pp_tp.parallel.inferred_styles import LocalHeads, head_count, is_conv1d, localizable
from pp_tp.parallel.tp_proof import call_order, proven
from pp_tp.parallel.tp_styles import TP_STYLES, TPStyle, register_tp_style


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


def inferred_tp_plan(
    model: nn.Module, blocks: list[nn.Module], computed: frozenset[str] = frozenset()
) -> dict[str, str]:
    """The block-relative plan proven on `model`'s small copy (kept in its family's record): the pairs found and
    proven, `replicate` on every region left whole. `blocks`: the model's layers; `computed`: the per-head layer
    arguments its forward computes for all heads (ALiBi biases)."""
    record = record_of(model)
    path = next(n for n, m in model.named_modules() if any(c is blocks[0] for c in m.children()))
    return dict(record.derived(("tp_plan", path, computed), lambda: _infer(record, path, computed)))


def _block_inputs(record: Record, path: str, n_blocks: int) -> list[tuple[tuple, dict]]:
    """What the record's eval forward handed each block (first call each)."""
    if record.error is not None:
        raise record.error
    first: dict[str, tuple[tuple, dict]] = {}
    for call in record.calls:
        first.setdefault(call.name, (call.args, call.kwargs))
    names = [f"{path}.{i}" for i in range(n_blocks)]
    return [first[n] for n in names if n in first]


def _infer(record: Record, path: str, computed: frozenset[str]) -> dict[str, str]:
    model = record.copy()  # never called: a block keeping state from its last call (RecurrentGemma) copies so
    seeded_values(model, 1, "stir")  # no zero biases or unit norms: a bias added twice or a dropped scale would show
    blocks = list(model.get_submodule(path).children())
    inputs = _block_inputs(record, path, len(blocks))
    hidden = model.config.hidden_size
    found: dict[tuple[str, ...], list] = {}  # region tops -> [(block, inputs, want, order, region)]
    for block, ins in zip(blocks, inputs):
        order, want = call_order(block, *ins)
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
        for order, want in [call_order(block, *ins)]
    )
    for tops, choice in chosen.items() if together else ():
        region = found[tops][0][4]
        plan.update({c.name: _style(c, choice["parts"][c.name], True) for c in region.columns})
        plan[region.row.name] = _style(region.row, 1, False)
        plan.update({n: _local_style(names) for n, names in choice["local"].items()})
    whole = {n if _top(n) == "" else _top(n) for b in blocks for n in _layers(b) if not _split(n, plan)}
    plan.update(dict.fromkeys(sorted(whole), "replicate"))
    return plan


def _proven(block: nn.Module, inputs: tuple[tuple, dict], want: torch.Tensor, regions: list[tuple[Region, dict]]):
    """`proven` for `regions`, each with its choice (column parts, local modules)."""
    choice = {name: parts for _, c in regions for name, parts in c["parts"].items()}
    local = {name: names for _, c in regions for name, names in c["local"].items()}
    return proven(block, inputs, want, choice, {r.row.name for r, _ in regions}, local, TOLERANCE)


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
