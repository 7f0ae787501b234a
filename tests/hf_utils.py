"""Tiny Hugging Face models built here (nothing downloaded): one tiny config per kind of family, seeded weights, and
the one family parity case every family test file runs.

Kinds of tiny config: `BASE` for the softmax decoders built from their config class (`family(T.LlamaConfig, ...)`),
a family's own default config shrunk by the self-check's rule (`family("glm4_moe")`), and `TINY_HF` for the
checkpoint, export and tokenizer tests' Llama (`llama_config`). Each test module keeps its own table of `Family`
records; a `Family` pickles whole (a config callable of this module or the test's own, and its kernel), so cases
travel to the ranks with the families they name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import parity_utils as pu
import torch
from parity_utils import seeded
from torch import nn

import pp_tp
from pp_tp.base.tensors import persistent_buffers
from pp_tp.models.reference.model import ModelArgs, Transformer
from pp_tp.parity import rel_err

VOCAB, SEQ = 64, 16  # SEQ: longer than every sliding window of the tables
BASE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
TINY_HF = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


# --- seeded weights (parity_utils.seeded) ------------------------------------------------------------------------


def seeded_state(model: nn.Module, seed: int = 0, scale: float = 0.1) -> dict[str, torch.Tensor]:
    """`seeded` parameters (a tied weight once, under its canonical name), then persistent float buffers (router
    biases, activation constants) moved off their init, so one left unfilled or unused shows."""
    gen = torch.Generator().manual_seed(seed)
    state = seeded({k: v.shape for k, v in model.named_parameters()}, gen, scale)
    for k, b in persistent_buffers(model).items():
        state[k] = b + 0.05 * torch.randn(b.shape, generator=gen, dtype=b.dtype) if b.is_floating_point() else b
    return state


# --- one tiny config per kind of family -----------------------------------------------------------------------


def _from_class(cls: type, extra: dict, layers: int) -> Any:
    return cls(**{**BASE, **extra, "num_hidden_layers": layers})


def _shrunk(model_type: str, per_layer: str, extra: dict, layers: int) -> Any:
    """The family's default config shrunk by the self-check's rule, `layers` deep: its distinct layer types cycled
    (`per_layer="kinds"`) or every per-layer list cycled as it stands (`"lists"`: layer types, MLP types, ...)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from pp_tp.models.hf.small import small_config

    config = small_config(CONFIG_MAPPING[model_type]())
    n = config.num_hidden_layers
    if per_layer == "lists":
        lists = {k: v for k, v in config.to_dict().items() if isinstance(v, list) and len(v) == n}
    else:
        types = list(dict.fromkeys(getattr(config, "layer_types", None) or []))
        lists = {"layer_types": types} if types else {}
    kw = {**extra, "num_hidden_layers": layers, "vocab_size": VOCAB, "max_position_embeddings": 64}
    kw.update({k: (v * layers)[:layers] for k, v in lists.items()})
    for key, value in kw.items():
        setattr(config, key, value)
    return config


def _reference(extra: dict, layers: int) -> ModelArgs:
    return ModelArgs(**{**dict(vocab_size=VOCAB, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64), **extra,
                        "n_layers": layers})  # fmt: skip


@dataclass(frozen=True)
class Family:
    """A tiny model: `config(layers)` builds its config (a HF config, or ModelArgs for pp_tp's own Transformer)."""

    config: Callable[[int], Any]
    attn: str | None = "sdpa"  # None: the family's own default kernel

    def make(self, device: str = "cpu", layers: int = 4) -> nn.Module:
        config = self.config(layers)
        with torch.device(device):
            if isinstance(config, ModelArgs):
                return Transformer(config)
            from transformers import AutoModelForCausalLM

            kernel = {"attn_implementation": self.attn} if self.attn else {}
            return AutoModelForCausalLM.from_config(config, **kernel)


def family(kind: type | str, attn: str = "sdpa", per_layer: str = "kinds", **extra: Any) -> Family:
    """A config class over `BASE`, a model type's own default shrunk (`_shrunk`), or "reference" (pp_tp's own)."""
    if kind == "reference":
        return Family(functools.partial(_reference, extra), attn)
    if isinstance(kind, str):
        return Family(functools.partial(_shrunk, kind, per_layer, extra), attn)
    return Family(functools.partial(_from_class, kind, extra), attn)


# --- the one family parity case ---------------------------------------------------------------------------------


class _FirstStepOnce(pu.ReferenceRun):
    """A reference whose first step (from the family's seeded weights, on the case's batch) is taken once per family
    and replayed in its other one-step cases: that step reads the weights and the batch, never the layout, so a
    family run at tp and at ep needs its fp32 and float64 references stepped once (the float64 one is the dearest
    part of a case, pp_tp/parity/widen.py). Later steps load the pipeline's own parameters: never replayed."""

    def __init__(self, model: nn.Module, memo: dict, key: Any):
        super().__init__(model, pu.adamw())
        self.memo, self.key = memo, key

    def in_float64(self) -> pu.ReferenceRun:
        return _FirstStepOnce(super().in_float64().model, self.memo, (self.key, "float64"))

    def step(self, *batch: torch.Tensor) -> float:
        if self.losses:
            raise RuntimeError("only the first step from the model's weights is shared between cases")
        if self.key not in self.memo:
            super().step(*batch)
            named = self.model.named_parameters()
            self.memo[self.key] = (
                self.losses[-1],
                {k: (p.detach().clone(), None if p.grad is None else p.grad.clone()) for k, p in named},
                {k: b.clone() for k, b in self.buffers().items()},
            )
            return self.losses[-1]
        loss, params, buffers = self.memo[self.key]
        with torch.no_grad():
            for k, p in self.model.named_parameters():
                p.copy_(params[k][0])
                p.grad = None if params[k][1] is None else params[k][1].clone()
            for k, b in self.buffers().items():
                b.copy_(buffers[k])
        self.losses.append(loss)
        return loss


def family_case(fam: Family, kw: dict, batch: int = 8, memo: dict | None = None) -> dict:
    """Per rank: the pipelined build (parallel keys `kw`; `steps`, 2 unless it says 1) against the model's own run on
    the same seeded weights and batch (rows padded unevenly), in lockstep (pp_tp/parity/lockstep.py): the float64
    verdict on the loss, every full gradient (a tied copy against the tied weight's), the parameters after each AdamW
    step and the persistent buffers; and the stages this rank holds. A second step proves the optimizer state
    carried: the family tests take two in at least one case of each layout kind (mesh shape, one or two stages per
    rank) and one in the others. `memo`: one-step cases of one family share their references' step
    (`_FirstStepOnce`)."""
    steps = kw.get("steps", 2)
    pcfg = pu.pcfg_of(**{k: v for k, v in kw.items() if k != "steps"})
    ids, labels = pu.batch(ModelArgs(vocab_size=VOCAB), batch, SEQ, pad=True)
    torch.manual_seed(0)
    model = fam.make()
    state = seeded_state(model)
    model.load_state_dict(state, strict=False)
    assert all(torch.equal(b, state[k]) for k, b in persistent_buffers(model).items())
    pipe = pp_tp.build_pipeline(fam.make("meta"), pp_tp.build_mesh(pcfg), pcfg, state_dict=state)
    shared = memo is not None and steps == 1
    ref = _FirstStepOnce(model, memo, (fam, batch)) if shared else pu.ReferenceRun(model, pu.adamw())
    run = pu.PipelineRun(pipe, pu.adamw())
    return {
        **pu.summary(list(pu.lockstep(run, ref, [(ids, labels)] * steps))),
        "buffers": len(run.buffers()),
        "stages": pipe.stage_indices,
    }


def run_families(cases: list[tuple[Family, dict]]) -> list[dict]:
    """A harness case: every (family, parallel keys) case on this rank, the one-step cases of a family sharing its
    references' step."""
    memo: dict = {}
    return [family_case(fam, kw, memo=memo) for fam, kw in cases]


def assert_exact(results: list[list[dict]], cases: list[tuple[Any, dict]]) -> None:
    """Every rank's result of every case passes the float64 verdict."""
    for per_rank in results:
        for (name, kw), r in zip(cases, per_rank):
            pu.assert_passes(r, name, kw)


# --- the checkpoint tests' Llama ----------------------------------------------------------------------------------


def llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_HF, "tie_word_embeddings": False, **kw})


def llama(config, device: str = "cpu", seed: int = 0) -> nn.Module:
    """The model of `config` with seeded random weights (norms near 1, so every path is exercised)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if device != "meta":
        model.load_state_dict(seeded({k: p.shape for k, p in model.named_parameters()}, seed, 0.05), strict=False)
    return model


def from_pretrained(path: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)


def max_param_err(got: nn.Module, want: dict[str, torch.Tensor]) -> float:
    """Largest relative error of `got`'s parameters against `want` (keys: the model's own names)."""
    named = dict(got.named_parameters(remove_duplicate=False))
    return max(rel_err(named[k].detach(), v) for k, v in want.items())
