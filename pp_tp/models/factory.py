"""The model a `[model]` section describes, built on any device (meta for pipelined runs)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from pp_tp.config import ModelConfig
from pp_tp.config.kinds import MODEL_KINDS, ModelKind, register_model_kind, resolve
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.models.credit.model import CreditArgs, CreditModel
from pp_tp.models.hf.build import hf_causal_lm, hf_config
from pp_tp.models.reference.model import ModelArgs, Transformer
from pp_tp.models.vit.model import ViT, ViTArgs


def model_args(mcfg: ModelConfig) -> ModelArgs:
    """The reference Transformer's arguments, without the job-only fields (kind, hf_path, seed)."""
    return ModelArgs(**{k: getattr(mcfg, k) for k in ModelArgs.__dataclass_fields__})


# [model] keys that describe the shape; with hf_path they come from config.json.
SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len", "tie_embeddings")


def resolve_model_config(mcfg: ModelConfig) -> ModelConfig:
    """With `hf_path`, a copy whose shape keys are config.json's (read through the model's own layout);
    a shape key given beside hf_path that contradicts config.json is one line. Unchanged otherwise."""
    if not mcfg.hf_path:
        return mcfg
    if mcfg.kind != "reference":
        raise ConfigError(f"model.kind = {mcfg.kind!r} and model.hf_path both choose the model; drop model.kind")
    model = build_model(mcfg, "meta")
    d = layout_for(model).dims(model)
    found = {
        "vocab_size": d.vocab_size,
        "dim": d.dim,
        "n_layers": d.n_layers,
        "n_heads": d.n_heads,
        "n_kv_heads": d.n_kv_heads,
        "ffn_dim": d.ffn_dim,
        "max_seq_len": d.max_seq_len,
        "tie_embeddings": d.tied,
    }
    defaults = ModelConfig()
    for key in SHAPE_KEYS:
        given = getattr(mcfg, key)
        if given != getattr(defaults, key) and given != found[key]:
            raise ConfigError(
                f"model.{key} = {given} contradicts {mcfg.hf_path}/config.json ({found[key]}); "
                f"drop model.{key} (hf_path sets the shape)"
            )
    return dataclasses.replace(mcfg, **found)


def build_model(mcfg: ModelConfig, device: str | torch.device = "meta") -> nn.Module:
    """`hf_path`: the Hugging Face causal LM of DIR/config.json; otherwise the registered `model.kind`
    (pp_tp/config/kinds.py; the built-ins below, plugins alike)."""
    if mcfg.hf_path:
        return hf_causal_lm(hf_config(mcfg.hf_path), device)
    if mcfg.kind not in MODEL_KINDS:
        raise ConfigError(
            f"model.kind = {mcfg.kind!r} is not registered; use one of {', '.join(MODEL_KINDS)} or register it "
            "(pp_tp.extend.register_model_kind, or a pp_tp.model_kinds entry point)"
        )
    with torch.device(device):
        return resolve(MODEL_KINDS[mcfg.kind].build)(mcfg, device)


def _reference(mcfg: ModelConfig, device: str | torch.device) -> nn.Module:
    """Our Transformer (pp_tp.models.reference) of the [model] shape."""
    return Transformer(model_args(mcfg))


def _hf_llama(mcfg: ModelConfig, device: str | torch.device) -> nn.Module:
    """A transformers LlamaForCausalLM of the reference shape (SDPA attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    args = model_args(mcfg)
    cfg = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_seq_len,
        attention_bias=args.attn_bias,
        tie_word_embeddings=args.tie_embeddings,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


@dataclass
class GridKeys:
    """The CREDIT model's own [model] keys: `channels` variables on an `image_size` x `image_size` grid cut into
    `patch_size` patches (its width, depth and heads are the common dim, n_layers, n_heads, ffn_dim)."""

    channels: int = 4
    image_size: int = 16
    patch_size: int = 4

    def check(self) -> None:
        for key in ("channels", "image_size", "patch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key} = {getattr(self, key)} must be >= 1; set model.{key} >= 1")
        if self.image_size % self.patch_size:
            raise ConfigError(
                f"model.image_size = {self.image_size} is not divisible by model.patch_size = {self.patch_size}; "
                "pick a patch size dividing the grid"
            )


@dataclass
class ImageKeys(GridKeys):
    """The ViT's own [model] keys: images of `channels` channels on the grid, into `n_classes` classes."""

    channels: int = 3
    n_classes: int = 10

    def check(self) -> None:
        super().check()
        if self.n_classes < 2:
            raise ConfigError(f"model.n_classes = {self.n_classes} must be >= 2; set model.n_classes >= 2")


def _credit(m: ModelConfig, device: str | torch.device) -> nn.Module:
    """The CREDIT-style weather model of the [model] shape on its grid."""
    g = m.options
    return CreditModel(CreditArgs(g.channels, g.image_size, g.patch_size, m.dim, m.n_layers, m.n_heads, m.ffn_dim))


def _vit(m: ModelConfig, device: str | torch.device) -> nn.Module:
    """The ViT classifier of the [model] shape on its images."""
    g = m.options
    args = ViTArgs(g.channels, g.image_size, g.patch_size, m.dim, m.n_layers, m.n_heads, m.ffn_dim, g.n_classes)
    return ViT(args)


register_model_kind("reference", ModelKind(_reference))
register_model_kind("hf_llama", ModelKind(_hf_llama))
register_model_kind("credit", ModelKind(_credit, data="fields", section=GridKeys))
register_model_kind("vit", ModelKind(_vit, data="images", section=ImageKeys))
