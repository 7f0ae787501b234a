"""A model pp_tp does not know (an MLP language model with its own module names), a renamed schedule, the model as a
TOML `model.kind` with a key of its own, and a data source of counting sequences (next token = this one + 1 mod the
vocabulary)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe

from pp_tp.extend import DataSource, ModelKind
from pp_tp.layout import ModelDims, ModelLayout, in_order
from pp_tp.schedules.registry import ScheduleSpec


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, h):
        return h + self.down(nn.functional.gelu(self.up(h)))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 16, hidden: int = 32, n_blocks: int = 3):
        super().__init__()
        self.vocab, self.dim, self.hidden = vocab, dim, hidden
        self.emb = nn.Embedding(vocab, dim)
        self.trunk = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.trunk:
            h = block(h)
        return self.head(self.ln_f(h))


LAYOUT = ModelLayout(
    name="tiny_mlp",
    matches=lambda m: isinstance(m, TinyLM),
    dims=lambda m: ModelDims(
        n_layers=len(m.trunk),
        dim=m.dim,
        n_heads=1,
        n_kv_heads=1,
        ffn_dim=m.hidden,
        vocab_size=m.vocab,
        max_seq_len=1024,
        tied=False,
    ),
    first=in_order("emb"),
    blocks="trunk",
    last=in_order("ln_f", "head"),
    shared=(),
    block_inputs=lambda stage, h: (),
    call_block=lambda block, h, extras, index: block(h),
    init_buffers=lambda stage, model: None,
)

SCHEDULE = ScheduleSpec("PluginGPipe", ScheduleGPipe, multi_stage=False, stages_per_rank=1)


@dataclass
class TinyKeys:
    """The tiny model's own [model] key (ModelKind.section): its blocks' hidden width, in place of ffn_dim."""

    hidden: int = 32


KIND = ModelKind(
    lambda m, device: TinyLM(vocab=m.vocab_size, dim=m.dim, hidden=m.options.hidden, n_blocks=m.n_layers),
    section=TinyKeys,
)


class Counting:
    """Endless samples: sample i counts up from (7 i) mod vocab, wrapping; learnable from the last token alone."""

    num_samples = None

    def __init__(self, vocab: int, seq_len: int):
        self.vocab, self.seq_len = vocab, seq_len

    def sample(self, index: int) -> torch.Tensor:
        return (torch.arange(self.seq_len + 1) + 7 * index) % self.vocab


def _counting(cfg):
    from pp_tp.train.sources import WindowData

    return WindowData([Counting(cfg.model.vocab_size, cfg.training.seq_len)], None, None, cfg)


SOURCE = DataSource(_counting)
