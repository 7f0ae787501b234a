"""Published-format MoE checkpoints for tests/test_hf_moe_checkpoint.py and bench/moe_checkpoint_load.py: tiny
families saved by transformers' own save_pretrained (per expert on disk), the block-FP8 form DeepSeek-V3 is
published in (float8_e4m3fn weights, a float32 `weight_scale_inv` per block, `quantization_config`) and the MXFP4
form of GPT-OSS's experts (`*_blocks` / `*_scales`)."""

from __future__ import annotations

import json
import math
import os

import torch

# Linear weights DeepSeek-V3's published checkpoint keeps unquantized (embeddings, head, norms, the router)
UNQUANTIZED = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def save_family(model: torch.nn.Module, path: str, state: dict, max_shard_size: str = "100KB") -> str:
    """`model` with `state` (parameters and persistent buffers) written by transformers' save_pretrained."""
    model.load_state_dict(state, strict=False)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return path


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    s = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return s[: shape[0], : shape[1]]


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale per block): scale = block amax / 448, DeepSeek-V3's recipe."""
    grid = tuple(math.ceil(n / b) for n, b in zip(w.shape, block))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[: w.shape[0], : w.shape[1]] = w
    amax = padded.reshape(grid[0], block[0], grid[1], block[1]).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (w / _expand(scale, w.shape, block)).to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The reference block dequantization: fp8 * its block's scale, in fp32."""
    return q.to(torch.float32) * _expand(scale, q.shape, block)


def _files(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def to_fp8(src: str, out: str, block: tuple[int, int]) -> int:
    """`src` (fp32, per expert) rewritten the way DeepSeek-V3 is published; returns the number of fp8 weights.
    Shards and index keep their layout (the scales join their weight's file)."""

    def convert(key: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if t.dim() == 2 and key.endswith(".weight") and not any(u in key for u in UNQUANTIZED):
            return dict(zip((key, key + "_scale_inv"), quantize(t, block)))
        return None

    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return _rewrite(src, out, convert, quant)


def _rewrite(src: str, out: str, convert, quantization_config: dict) -> int:
    """`src` with each tensor `convert(key, tensor)` gives replaced by what it gives (None: kept), in the same files
    and index, and config.json's `quantization_config`; returns the number of tensors converted."""
    from safetensors.torch import load_file, save_file

    os.makedirs(out, exist_ok=True)
    n, weight_map = 0, {}
    for name in _files(src):
        tensors = {}
        for key, t in load_file(os.path.join(src, name)).items():
            converted = convert(key, t)
            tensors.update(converted or {key: t})
            n += converted is not None
        save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if len(_files(src)) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return n


def dequantized_dir(fp8: str, out: str, block: tuple[int, int]) -> str:
    """The fp8 directory dequantized whole by the reference formula, plain fp32 (what from_pretrained reads)."""
    from safetensors.torch import load_file, save_file

    os.makedirs(out, exist_ok=True)
    for name in _files(fp8):
        loaded = load_file(os.path.join(fp8, name))
        plain = {
            k: dequantize(t, loaded[k + "_scale_inv"], block) if t.dtype == torch.float8_e4m3fn else t
            for k, t in loaded.items()
            if not k.endswith("_scale_inv")
        }
        save_file(plain, os.path.join(out, name), metadata={"format": "pt"})
    with open(os.path.join(fp8, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    index = os.path.join(fp8, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            wm = {k: v for k, v in json.load(f)["weight_map"].items() if not k.endswith("_scale_inv")}
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": wm}, f)
    return out


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's MXFP4 of a packed expert tensor [E, in, out]: (blocks [E, out, in / 32, 16] uint8, two e2m1 values a
    byte, low nibble first; scales [E, out, in / 32] uint8, a power of two biased by 127 per 32 inputs), each value
    the e2m1 nearest to it over its group's scale = 2 ** ceil(log2(amax / 6))."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    lut = torch.tensor(FP4_VALUES)
    e, n_in, n_out = w.shape
    groups = w.transpose(1, 2).reshape(e, n_out, n_in // 32, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    idx = (groups / torch.exp2(exp).unsqueeze(-1)).unsqueeze(-1).sub(lut).abs().argmin(-1).to(torch.uint8)
    return idx[..., 0::2] | (idx[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def to_mxfp4(src: str, out: str) -> int:
    """`src` (fp32) rewritten the way GPT-OSS is published: every packed expert weight as `*_blocks` / `*_scales`,
    config.json with quant_method = "mxfp4"; returns the number of quantized tensors. Shards keep their layout."""

    def convert(key: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if t.dim() == 3 and key.endswith("_proj"):
            return dict(zip((key + "_blocks", key + "_scales"), quantize_mxfp4(t)))
        return None

    return _rewrite(src, out, convert, {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]})
