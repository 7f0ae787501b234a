"""Every check that needs the model, in one place: run by `build_pipeline` before any collective and by
every CLI command on the meta model, so `pp-tp check` refuses exactly what a run would refuse.

The checks that need only the config live in `pp_tp.config.validate`; the two together are all the
refusals a job can meet before it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelDims, ModelLayout, check_document_mask, layout_for
from pp_tp.parallel.float8 import check_float8
from pp_tp.parallel.tensor_parallel import check_tp_plan
from pp_tp.split.plan import StagePlan, plan_stages


@dataclass(frozen=True)
class Preflight:
    """What the checks found out on the way: the model's layout, its dims and the stage plan."""

    layout: ModelLayout
    dims: ModelDims
    plan: StagePlan


def check_model_shape(pcfg: ParallelConfig, d: ModelDims) -> None:
    """Refuses a model shape TP cannot shard evenly (heads, KV heads, FFN, vocabulary)."""
    if not d.head_dim:  # head_dim derived from dim: it must divide, and RoPE needs it even
        _check_divisible("model.dim", d.dim, "model.n_heads", d.n_heads)
    if not d.head_dim and (d.dim // d.n_heads) % 2:
        raise ConfigError(
            f"model.dim / model.n_heads = {d.dim} / {d.n_heads} = {d.dim // d.n_heads} is an odd "
            "head_dim; RoPE rotates channel pairs, so pick model.dim and model.n_heads giving an even "
            "head_dim"
        )
    _check_divisible("model.n_heads", d.n_heads, "model.n_kv_heads", d.n_kv_heads)
    for key, value in (
        ("model.n_heads", d.n_heads),
        ("model.n_kv_heads", d.n_kv_heads),
        ("model.ffn_dim", d.ffn_dim),
        ("model.vocab_size", d.vocab_size),
    ):
        _check_divisible(key, value, "parallel.tp", pcfg.tp)


def check_seq_len(seq_len: int, d: ModelDims, key: str = "training.seq_len") -> None:
    """Refuses sequences longer than the model's positions (rotary tables, position embeddings)."""
    if seq_len > d.max_seq_len:
        raise ConfigError(
            f"{key} = {seq_len} exceeds model.max_seq_len = {d.max_seq_len}; lower {key} or raise model.max_seq_len"
        )


def check_tied(pcfg: ParallelConfig, d: ModelDims) -> None:
    """Tied embeddings under TP: the embedding and the column-parallel head must share one (vocabulary) sharding."""
    if d.tied and pcfg.tp > 1 and pcfg.embedding != "vocab_parallel":
        raise ConfigError(
            f"parallel.embedding = {pcfg.embedding!r}: the model ties its input and output embeddings, and with "
            'parallel.tp > 1 the head is sharded on the vocabulary; set parallel.embedding = "vocab_parallel" so '
            "both copies share one sharding"
        )


def preflight(
    model: nn.Module, pcfg: ParallelConfig, device_type: str, seq_len: int | None = None, document_mask: bool = False
) -> Preflight:
    """All model-dependent refusals for `model` under a resolved `pcfg`, in one order; no communication.
    `document_mask`: the job packs documents (`data.document_mask`), so the layout must mask them."""
    layout = layout_for(model)
    if document_mask:
        check_document_mask(layout)
    d = layout.dims(model)
    check_model_shape(pcfg, d)
    if seq_len is not None:
        check_seq_len(seq_len, d)
    check_tied(pcfg, d)
    check_tp_plan(model, layout, pcfg)
    check_float8(pcfg, device_type)
    return Preflight(layout, d, plan_stages(model, layout, pcfg, seq_len))


def _check_divisible(key: str, value: int, by_key: str, by: int) -> None:
    if value % by:
        raise ConfigError(
            f"{key} = {value} is not divisible by {by_key} = {by}; "
            f"set {by_key} to a divisor of {value} or {key} to a multiple of {by}"
        )
