"""Quantized published checkpoints, dequantized on read, per rank: block FP8 (DeepSeek-V3's `quant_method = "fp8"`)
and MXFP4 (GPT-OSS's experts, `quant_method = "mxfp4"`).

DeepSeek-V3 / R1 store each Linear weight as `float8_e4m3fn` with a `weight_scale_inv` of one float per
`weight_block_size` block (128 x 128; ceil at the edges): the value is fp8 * scale, computed in fp32 and then cast
to the training dtype, as transformers' `Fp8Dequantize` does. A rank reads its box of the fp8 weight and the scale
blocks covering it, so dequantizing is block by block and per rank.
GPT-OSS stores each packed expert tensor `[E, in, out]` as `*_blocks [E, out, in / 32, 16]` (two e2m1 values a
byte) and `*_scales [E, out, in / 32]` (a power-of-two exponent, biased by 127, per 32 inputs); a rank reads the
blocks and scales of its box (its experts, its TP rows, the 32-groups its columns touch) and dequantizes them with
transformers' own `convert_moe_packed_tensors`, into the parameter's dtype as from_pretrained does (elementwise, so
equal to dequantizing the whole). Any other `quant_method` is refused in one line.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pp_tp.errors import ConfigError
from pp_tp.hf_checkpoint.views import Leaf

FP8 = (torch.float8_e4m3fn,)
SCALE_SUFFIX = "_scale_inv"
MX_BLOCKS, MX_SCALES, MX_GROUP = "_blocks", "_scales", 32
_READS = (
    "pp_tp reads unquantized weights, block FP8 (quant_method = 'fp8', DeepSeek-V3's format) and MXFP4 experts "
    "(quant_method = 'mxfp4', GPT-OSS's)"
)


@dataclass(frozen=True)
class Quantization:
    """What config.json's `quantization_config` says of the stored weights."""

    method: str
    block: tuple[int, int] | None = None


def quantization(path: str) -> Quantization | None:
    """The checkpoint's quantization (None for plain weights); an unknown method is one line."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        q = json.load(f).get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "mxfp4":
        return Quantization("mxfp4")
    if method != "fp8":
        raise ConfigError(f"checkpoint {path!r}: quantization_config.quant_method = {method!r} is unknown; {_READS}")
    block = q.get("weight_block_size") or (128, 128)
    if q.get("fmt", "e4m3") != "e4m3" or len(block) != 2:
        raise ConfigError(
            f"checkpoint {path!r}: fp8 with fmt = {q.get('fmt')!r}, weight_block_size = {block!r}; "
            "pp_tp reads e4m3 weights with 2-D blocks"
        )
    return Quantization("fp8", (int(block[0]), int(block[1])))


def pair_scales(path: str, leaves: dict[str, Leaf], quant: Quantization | None) -> dict[str, Leaf]:
    """The on-disk tensors with every quantized weight carrying its scales (the scales are consumed): an FP8 weight
    under its own key, MXFP4 blocks under the key without `_blocks` (what from_pretrained loads them into). A weight
    without its scale, a scale of the wrong grid or quantized weights the quantization_config does not declare:
    one line each."""
    if quant is not None and quant.method == "mxfp4":
        leaves = _pair_mxfp4(leaves)
    out = {}
    scales = {k for k in leaves if k.endswith(SCALE_SUFFIX)}
    for key, leaf in leaves.items():
        weight = leaves.get(key.removesuffix(SCALE_SUFFIX)) if key in scales else None
        if weight is not None and weight.dtype in FP8:
            continue  # read with its weight
        if leaf.dtype not in FP8:
            out[key] = leaf
            continue
        if quant is None or quant.method != "fp8":
            raise ConfigError(
                f"checkpoint {leaf.file}: {key!r} is stored as {leaf.dtype} but config.json has no fp8 "
                "quantization_config; give the checkpoint's own config.json (quant_method = 'fp8')"
            )
        scale = leaves.get(key + SCALE_SUFFIX)
        if scale is None:
            raise ConfigError(
                f"checkpoint {leaf.file}: fp8 weight {key!r} has no scale {key + SCALE_SUFFIX!r}; "
                "every fp8 weight needs its per-block weight_scale_inv"
            )
        grid = tuple(math.ceil(n / b) for n, b in zip(leaf.shape, quant.block))
        if len(leaf.shape) != 2 or scale.shape != grid:
            raise ConfigError(
                f"checkpoint {scale.file}: {scale.key!r} has shape {scale.shape}, the {quant.block} blocks of "
                f"{key!r} {leaf.shape} need {grid}"
            )
        out[key] = Leaf(key, leaf.file, leaf.shape, leaf.dtype, scale, quant.block, "fp8")
    return out


def _pair_mxfp4(leaves: dict[str, Leaf]) -> dict[str, Leaf]:
    """MXFP4 `X_blocks [E, out, G, 16]` and `X_scales [E, out, G]` as one leaf `X` of the dequantized shape
    `[E, 32 G, out]` (transformers' layout of the packed expert tensor); unpaired or misshapen: one line."""
    out = dict(leaves)
    for key, blocks in leaves.items():
        if not key.endswith(MX_BLOCKS):
            continue
        base = key.removesuffix(MX_BLOCKS)
        scales = leaves.get(base + MX_SCALES)
        if scales is None:
            raise ConfigError(
                f"checkpoint {blocks.file}: mxfp4 blocks {key!r} have no scales {base + MX_SCALES!r}; every "
                "*_blocks tensor needs its *_scales"
            )
        if len(blocks.shape) != 4 or blocks.shape[3] != MX_GROUP // 2 or scales.shape != blocks.shape[:3]:
            raise ConfigError(
                f"checkpoint {blocks.file}: mxfp4 {key!r} {blocks.shape} and {scales.key!r} {scales.shape} are not "
                f"[experts, out, groups, {MX_GROUP // 2}] and [experts, out, groups]; give GPT-OSS's layout"
            )
        e, rows, groups, _ = blocks.shape
        del out[key], out[scales.key]
        out[base] = Leaf(key, blocks.file, (e, groups * MX_GROUP, rows), blocks.dtype, scales, None, "mxfp4")
    return out


# (file, key, offset, shape) -> that box of the on-disk tensor
ReadBox = Callable[[str, str, tuple[int, ...], tuple[int, ...]], torch.Tensor]


def read_dequantized(leaf: Leaf, offset: tuple[int, ...], shape: tuple[int, ...], dtype, read: ReadBox) -> torch.Tensor:
    """The box of a quantized leaf at `offset` of size `shape`, dequantized into `dtype`, reading only the stored
    bytes and scales the box needs."""
    if leaf.method == "mxfp4":
        return _mxfp4_box(leaf, offset, shape, dtype, read)
    scale_offset, scale_shape = scale_box(offset, shape, leaf.block)
    scale = read(leaf.scale.file, leaf.scale.key, scale_offset, scale_shape)
    return dequantize(read(leaf.file, leaf.key, offset, shape), scale, offset, leaf.block, dtype)


def _mxfp4_box(leaf: Leaf, offset: tuple[int, ...], shape: tuple[int, ...], dtype, read: ReadBox) -> torch.Tensor:
    """Box [e, i, o] of `[E, in, out]`: the blocks and scales of experts e, outputs o and the 32-groups covering i,
    through transformers' `convert_moe_packed_tensors` (-> [e, 32 groups, o]), cut to i."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    (e0, i0, o0), (ne, ni, no) = offset, shape
    g0, g1 = i0 // MX_GROUP, -(-(i0 + ni) // MX_GROUP)
    blocks = read(leaf.file, leaf.key, (e0, o0, g0, 0), (ne, no, g1 - g0, MX_GROUP // 2))
    scales = read(leaf.scale.file, leaf.scale.key, (e0, o0, g0), (ne, no, g1 - g0))
    return convert_moe_packed_tensors(blocks, scales, dtype=dtype).narrow(1, i0 - g0 * MX_GROUP, ni)


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, offset: tuple[int, ...], block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The fp8 box `weight` (at `offset` of the whole weight) times its blocks' scales, in fp32, cast to `dtype`.

    `scale` holds the scale rows and columns of the blocks the box touches, from block (offset // block) on."""
    (r0, c0), (br, bc) = offset, block
    rows, cols = weight.shape
    s = scale.to(torch.float32) if scale.dtype != torch.uint8 else (scale.to(torch.float32) - 127.0).exp2()
    s = s.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)
    s = s[r0 - (r0 // br) * br :, c0 - (c0 // bc) * bc :][:rows, :cols]
    return (weight.to(torch.float32) * s).to(dtype)


def scale_box(offset: tuple[int, ...], shape: tuple[int, ...], block: tuple[int, int]) -> tuple[tuple, tuple]:
    """(offset, shape) of the scale blocks covering the weight box."""
    lo = tuple(o // b for o, b in zip(offset, block))
    hi = tuple((o + n - 1) // b + 1 for o, n, b in zip(offset, shape, block))
    return lo, tuple(h - low for h, low in zip(hi, lo))
