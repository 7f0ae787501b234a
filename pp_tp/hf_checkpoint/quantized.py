"""Quantized published checkpoints: block FP8 (DeepSeek-V3's `quant_method = "fp8"`) dequantized on read.

DeepSeek-V3 / R1 store each Linear weight as `float8_e4m3fn` with a `weight_scale_inv` of one float per
`weight_block_size` block (128 x 128; ceil at the edges): the value is fp8 * scale, computed in fp32 and then cast
to the training dtype, as transformers' `Fp8Dequantize` does. A rank reads its box of the fp8 weight and the scale
blocks covering it, so dequantizing is block by block and per rank. Any other `quant_method` is refused in one line.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from pp_tp.errors import ConfigError
from pp_tp.hf_checkpoint.views import Leaf

FP8 = (torch.float8_e4m3fn,)
SCALE_SUFFIX = "_scale_inv"
_READS = "pp_tp reads unquantized weights and block FP8 (quant_method = 'fp8', DeepSeek-V3's format)"


@dataclass(frozen=True)
class Quantization:
    """What config.json's `quantization_config` says of the stored weights."""

    method: str
    block: tuple[int, int]


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
        raise ConfigError(
            f"checkpoint {path!r}: quantization_config.quant_method = 'mxfp4' (GPT-OSS) is not read per rank; "
            "dequantize it once with transformers (Mxfp4Config(dequantize=True)) and give that directory"
        )
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
    """The on-disk tensors with every FP8 weight carrying its scale (the scales are consumed). A weight without
    its scale, a scale of the wrong grid or FP8 weights without an fp8 quantization_config: one line each."""
    out = {}
    scales = {k for k in leaves if k.endswith(SCALE_SUFFIX)}
    for key, leaf in leaves.items():
        weight = leaves.get(key.removesuffix(SCALE_SUFFIX)) if key in scales else None
        if weight is not None and weight.dtype in FP8:
            continue  # read with its weight
        if leaf.dtype not in FP8:
            out[key] = leaf
            continue
        if quant is None:
            raise ConfigError(
                f"checkpoint {leaf.file}: {key!r} is stored as {leaf.dtype} but config.json has no "
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
        out[key] = Leaf(key, leaf.file, leaf.shape, leaf.dtype, scale, quant.block)
    return out


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
