"""Fills one stage's (TP/FSDP/EP-sharded) parameters and its persistent buffers from an HF checkpoint, reading only
this rank's slices (of a packed expert tensor: only its experts' on-disk tensors, `views.walk_box`).

torch's `HuggingFaceStorageReader` reads the same `get_slice` blocks, but only inside `dcp.load`, whose
global planning is a collective and whose copy casts dtypes implicitly; reading the blocks here keeps every
check before any collective and the bf16 -> fp32 cast explicit (`HFSource.read`).
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch

from pp_tp.base._torch import local_index_runs, local_shape_and_offset, local_tensor
from pp_tp.base.tensors import persistent_buffers
from pp_tp.hf_checkpoint.source import HFSource
from pp_tp.hf_checkpoint.views import View, leaves
from pp_tp.stages.stage_module import StageModule


@torch.no_grad()
def load_stage(stage: StageModule, source: HFSource, casts: Counter | None = None) -> None:
    """Copies this rank's block of every parameter of `stage` from `source`, by the stage's checkpoint keys, and
    every persistent buffer whole (buffers are never sharded).

    `casts` counts the (checkpoint dtype -> parameter dtype) conversions made, for the log.
    """
    for name, p in stage.named_parameters():
        key = stage.checkpoint_keys[name]
        shape, offset = local_shape_and_offset(p)
        local = local_tensor(p)
        if tuple(local.shape) != shape:
            raise RuntimeError(f"{name}: local shard {tuple(local.shape)} is not the block {shape} torch computes")
        if local.numel() == 0:
            continue
        if casts is not None:
            _count(casts, source.views[key], local.dtype)
        _read_block(source, key, p, offset, local)
    for key, b in persistent_buffers(stage).items():
        source.read_into(key, (0,) * b.dim(), b)


def _count(casts: Counter, view: View, dtype: torch.dtype) -> None:
    """One count per parameter whose stored dtype differs (quantized ones counted as dequantized)."""
    stored = {(leaf.dtype, leaf.method) for leaf in leaves(view)}
    for src, method in sorted(stored, key=str):
        if method == "mxfp4":
            casts[f"mxfp4 (dequantized) -> {dtype}".replace("torch.", "")] += 1
        elif method is not None:
            casts[f"{src} (block {method}, dequantized) -> {dtype}".replace("torch.", "")] += 1
        elif src != dtype:
            casts[f"{src} -> {dtype}".replace("torch.", "")] += 1


def _read_block(source: HFSource, key: str, p: torch.Tensor, offset: tuple[int, ...], out: torch.Tensor) -> None:
    """Reads this rank's block of `key` into `out` (its local shard): one box at `offset`, or for a parameter split
    per part (`_StridedShard`) the boxes of its index runs, each into its place in local order."""
    runs = local_index_runs(p)
    if runs is None:
        source.read_into(key, offset, out)
        return
    starts = [list(itertools.accumulate((n for _, n in dim_runs), initial=0)) for dim_runs in runs]
    for box in itertools.product(*(list(enumerate(dim_runs)) for dim_runs in runs)):
        where = tuple(slice(starts[d][i], starts[d][i] + n) for d, (i, (_, n)) in enumerate(box))
        source.read_into(key, tuple(s for _, (s, _) in box), out[where])
