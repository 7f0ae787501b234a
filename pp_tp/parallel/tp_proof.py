"""Proof of a Megatron split of one block, in one process: TP copies of the block, each holding one rank's shards, run
on the same inputs, the row-parallel outputs summed over the copies as the all-reduce sums them (repeated until the
sums settle); every copy's output must equal the whole block's. Model-agnostic (any `nn.Module` block of `nn.Linear`
or transformers' `Conv1D` layers); the Hugging Face adapter's inference of the pairs (models/hf/tp_infer.py) asks it.
Home-made: torch's parallel styles apply a split, they do not say whether it computes what the block computes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from pp_tp.parallel.inferred_styles import head_count, is_conv1d, localize, slice_inputs

TP = 2  # the degree the proof runs at
_PASSES = 6  # rounds of summing row-parallel outputs; a block's pairs settle in one more round than it has pairs


def call_order(block: nn.Module, args: tuple, kwargs: dict) -> tuple[list[str], torch.Tensor]:
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


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _summed(name: str, partials: dict[str, list[torch.Tensor]], sums: dict[str, torch.Tensor]):  # noqa: ANN202
    """A forward hook recording a row-parallel layer's partial output and handing on the sum over the ranks from the
    previous round (the partial itself in the first)."""

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        partials.setdefault(name, []).append(out.clone())  # copies: families add into the output in place (Falcon)
        return sums[name].clone() if name in sums else out

    return hook


@torch.no_grad()
def proven(
    block: nn.Module,
    inputs: tuple[tuple, dict],
    want: torch.Tensor,
    choice: dict[str, int],
    row: set[str],
    local: dict[str, tuple],
    tolerance: float,
) -> bool:
    """Whether `block` split over TP ranks (`choice`: column layer -> parts; `row`: row-parallel layers; `local`:
    attention modules -> the per-head inputs they take), its row-parallel outputs summed over the ranks, gives every
    rank the whole block's output `want` on `inputs`, within `tolerance` (relative)."""
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
    return all(o.shape == want.shape and _error(o, want) <= tolerance for o in outs)
