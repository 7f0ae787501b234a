"""The "raw" side of the pipeline benchmarks: the same split written directly on torch.distributed.pipelining.

No pp_tp code runs in a raw step: hand-made `nn.Module` stages over a full model's own submodules,
`PipelineStage` (shape inference at the first step), the torch schedule class, a mean cross-entropy and
torch's default `scale_grads=True`. Stage i holds layers [i*L/n, (i+1)*L/n), the first stage the
embedding, the last the norm and head; rank r holds stages r, r+p, ... (loop) or r and 2p-1-r (V).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage

from pp_tp.models.reference.model import ModelArgs, Transformer
from pp_tp.schedules.registry import default_stages_per_rank, get_schedule_spec


def hf_config(dim: int, layers: int, vocab: int, seq: int) -> Any:
    """Issue 16's Llama shape at dim 384 (6 heads of 64, 2 KV heads, ffn 1024), scaled with dim otherwise."""
    from transformers import LlamaConfig

    heads = max(dim // 64, 1)
    return LlamaConfig(
        hidden_size=dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 3, 1),
        intermediate_size=dim * 8 // 3,
        vocab_size=vocab,
        max_position_embeddings=seq,
    )


def full_model(kind: str, dim: int, layers: int, vocab: int, seq: int) -> nn.Module:
    """The whole model with deterministic weights (every call gives the same values)."""
    if kind == "hf":
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        return LlamaForCausalLM(hf_config(dim, layers, vocab, seq)).float()
    args = ModelArgs(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=8, ffn_dim=3 * dim, max_seq_len=seq)
    model = Transformer(args)
    model.init_weights(seed=0)
    return model


class RawStage(nn.Module):
    """A hand-split stage of the reference Transformer or an HF Llama: [embedding] + blocks + [norm + head]."""

    def __init__(self, model: nn.Module, layers: Sequence[int], first: bool, last: bool):
        super().__init__()
        self.hf = hasattr(model, "model")
        base = model.model if self.hf else model
        self.embed = (base.embed_tokens if self.hf else base.tok_embeddings) if first else None
        blocks = base.layers
        self.layers = nn.ModuleList(blocks[i] if self.hf else blocks[str(i)] for i in layers)
        self.norm = base.norm if last else None
        self.head = (model.lm_head if self.hf else model.output) if last else None
        if self.hf:
            self.rotary = base.rotary_emb
        else:
            self.register_buffer("rope", model.rope, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        if self.hf:  # as a user would write it: plain causal attention (attention_mask=None), rotary per stage
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            emb = self.rotary(h, pos)
            for layer in self.layers:
                h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=emb)
                h = h[0] if isinstance(h, tuple) else h
        else:
            for layer in self.layers:
                h = layer(h, self.rope)
        return self.head(self.norm(h)) if self.head is not None else h


def mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def stage_ids(schedule: str, pp: int, rank: int) -> tuple[list[int], int]:
    """This rank's stage indices and the number of stages, from the schedule's mapping."""
    spec = get_schedule_spec(schedule)
    if spec.mapping == "v":
        return [rank, 2 * pp - 1 - rank], 2 * pp
    v = default_stages_per_rank(schedule, pp)
    return [rank + k * pp for k in range(v)], v * pp


def raw_step(
    model: nn.Module, n_layers: int, schedule: str, m: int, ids: torch.Tensor, labels: torch.Tensor, pp: int
) -> tuple[Callable[[], Any], list[nn.Parameter]]:
    """One step function of the raw pipeline on this rank, and the parameters it trains."""
    rank = dist.get_rank()
    ids_here, n = stage_ids(schedule, pp, rank)
    per = n_layers // n
    mods = [RawStage(model, range(i * per, (i + 1) * per), i == 0, i == n - 1) for i in ids_here]
    stages = [PipelineStage(mod, i, n, torch.device("cpu")) for mod, i in zip(mods, ids_here)]
    spec = get_schedule_spec(schedule)
    sched = spec.cls(stages if spec.multi_stage else stages[0], n_microbatches=m, loss_fn=mean_ce)
    args = (ids,) if 0 in ids_here else ()
    last = n - 1 in ids_here

    def step() -> None:
        sched.step(*args, target=labels if last else None, losses=[] if last else None)

    return step, [p for mod in mods for p in mod.parameters()]
