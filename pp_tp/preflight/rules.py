"""Every check that needs the model, in one place: run by `build_pipeline` before any collective and by
every CLI command on the meta model, so `pp-tp check` refuses exactly what a run would refuse.

The checks that need only the config live in `pp_tp.config.validate`; the two together are all the
refusals a job can meet before it starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from pp_tp.config import JobConfig, MoEConfig, ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelDims, ModelLayout, check_document_mask, layout_for
from pp_tp.parallel.context_parallel import check_cp_model
from pp_tp.parallel.experts import check_experts
from pp_tp.parallel.float8 import check_float8
from pp_tp.parallel.rng import DEVICES, active_dropout
from pp_tp.parallel.tensor_parallel import block_plan, check_tp_plan
from pp_tp.parallel.tp_styles import TP_STYLES
from pp_tp.parallel.whole_on_tp import splits_attention
from pp_tp.runtime.balancing import check_balancing
from pp_tp.split.plan import StagePlan, plan_stages
from pp_tp.stages.stage_module import reserved_name


@dataclass(frozen=True)
class PreflightInputs:
    """What `preflight` needs beyond the model and the parallel config, one record for every caller: build.py fills it
    from `BuildOptions`, the planner and `pp-tp check` from the job's config (`of_job`), so each checks the same.

    `device_type`: the mesh's. `seq_len`: the job's sequence length (None: not checked). `document_mask`: the job
    packs documents (`data.document_mask`), so the layout must mask them. `custom_loss`: the job brings its own loss
    (build_pipeline's loss_fn, [training] loss). `moe`: the job's MoE load balancing (`[moe]`, build_pipeline's moe).
    """

    device_type: str
    seq_len: int | None = None
    document_mask: bool = False
    custom_loss: bool = False
    moe: MoEConfig | None = None

    @classmethod
    def of_job(cls, cfg: JobConfig, device_type: str) -> PreflightInputs:
        """A TOML job's inputs: [training] seq_len and loss, [data] document_mask, [moe]."""
        t = cfg.training
        return cls(device_type, t.seq_len, cfg.data.document_mask, bool(t.loss), cfg.moe)


@dataclass(frozen=True)
class Preflight:
    """What the checks found out on the way: the model's layout, its dims, the stage plan and the parallel config
    with its model-dependent defaults resolved (`parallel.embedding`)."""

    layout: ModelLayout
    dims: ModelDims
    plan: StagePlan
    parallel: ParallelConfig


def check_model_shape(pcfg: ParallelConfig, d: ModelDims, split_heads: bool = True) -> None:
    """Refuses a model shape TP cannot shard evenly (heads and KV heads where `split_heads`: the TP plan splits
    attention; FFN, vocabulary)."""
    if not d.head_dim:  # head_dim derived from dim: it must divide, and RoPE needs it even
        _check_divisible("model.dim", d.dim, "model.n_heads", d.n_heads)
    if not d.head_dim and (d.dim // d.n_heads) % 2:
        raise ConfigError(
            f"model.dim / model.n_heads = {d.dim} / {d.n_heads} = {d.dim // d.n_heads} is an odd "
            "head_dim; RoPE rotates channel pairs, so pick model.dim and model.n_heads giving an even "
            "head_dim"
        )
    _check_divisible("model.n_heads", d.n_heads, "model.n_kv_heads", d.n_kv_heads)
    heads = (("model.n_heads", d.n_heads), ("model.n_kv_heads", d.n_kv_heads)) if split_heads else ()
    for key, value in (
        *heads,
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


def resolve_embedding(pcfg: ParallelConfig, d: ModelDims) -> ParallelConfig:
    """`parallel.embedding = "auto"` made concrete: vocab-parallel when the model ties its embeddings and tp > 1
    (the one sharding a tied weight can share with the column-parallel head), replicated otherwise."""
    if pcfg.embedding != "auto":
        return pcfg
    return dataclasses.replace(pcfg, embedding="vocab_parallel" if d.tied and pcfg.tp > 1 else "replicate")


def check_tied(pcfg: ParallelConfig, d: ModelDims) -> None:
    """Tied embeddings under TP: the embedding and the column-parallel head must share one (vocabulary) sharding."""
    if d.tied and pcfg.tp > 1 and pcfg.embedding != "vocab_parallel":
        raise ConfigError(
            f"parallel.embedding = {pcfg.embedding!r}: the model ties its input and output embeddings, and with "
            'parallel.tp > 1 the head is sharded on the vocabulary; set parallel.embedding = "vocab_parallel" (or '
            'leave it "auto") so both copies share one sharding'
        )


def check_loss(layout: ModelLayout, pcfg: ParallelConfig, custom_loss: bool) -> None:
    """A model that is not a language model has no token loss; the caller's loss gets the whole output."""
    if not layout.is_lm and not custom_loss:
        raise ConfigError(
            f"model layout {layout.name!r} is not a language model, so it has no token loss; set [training] loss "
            '(e.g. "mse") or pass build_pipeline(loss_fn=...)'
        )
    if custom_loss and pcfg.loss_parallel:
        raise ConfigError("parallel.loss_parallel shards logits for the token loss; set it to false with your own loss")


def check_layout_names(layout: ModelLayout) -> None:
    """Each stage holds the model's modules under their own names, so none may be a stage attribute's name."""
    tops = {f.split(".")[0] for f in (*layout.first.modules, layout.blocks, *layout.last.modules, *layout.shared)}
    taken = sorted(n for n in tops if reserved_name(n))
    if taken:
        raise ConfigError(
            f"model layout {layout.name!r}: module {taken[0]!r} has the name of a pipeline stage attribute; "
            "rename that module in the model"
        )


def check_layout_holds_all(model: nn.Module, layout: ModelLayout) -> None:
    """A parameter under no module the layout places on a stage would silently leave training and checkpoints (a
    multimodal model's vision tower beside its language model): refused in one line."""
    placed = [p for p in (*layout.first.modules, layout.blocks, *layout.last.modules, *layout.shared) if p]
    names: dict[int, list[str]] = {}  # a tied parameter (BERT-generation's lm_head.bias) is placed under any name
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for name, *aliases in names.values():
        if not any(n == p or n.startswith(p + ".") for n in (name, *aliases) for p in placed):
            raise ConfigError(
                f"model {type(model).__name__}: parameter {name!r} lies outside every module the {layout.name!r} "
                "layout places on a stage, so it would not be trained or saved; pp_tp trains a decoder-only LM "
                "(load the text model alone) or register a layout that places it (pp_tp.extend.register_layout)"
            )


def check_dropout(model: nn.Module, layout: ModelLayout, pcfg: ParallelConfig, device_type: str) -> None:
    """Dropout whose masks the RNG discipline (pp_tp/parallel/rng.py) cannot place is refused: on a device whose
    generator pp_tp does not swap, inside compiled blocks under TP, or next to a TP style whose record does not say
    what it does to a TP-sharded dropout region (`TPStyle.dropout` unset)."""
    rates = active_dropout(model)
    if not rates:
        return
    off = f"or set the dropout ({rates[0]}) to 0"
    if device_type not in DEVICES:
        raise ConfigError(
            f"dropout ({rates[0]}) on a {device_type!r} device: pp_tp keeps per-stage dropout streams on "
            f"{' and '.join(DEVICES)} generators only; run on one of them {off}"
        )
    if pcfg.tp == 1:
        return
    if pcfg.compile:
        raise ConfigError(
            f"parallel.compile = true with dropout ({rates[0]}) and parallel.tp = {pcfg.tp}: the TP-rank dropout "
            f"streams switch generator states inside the blocks, which compiled blocks do not see; set "
            f"parallel.compile = false {off}"
        )
    for key, block in model.get_submodule(layout.blocks).named_children():
        for rule, style in block_plan(block, layout).items():
            if TP_STYLES[style].dropout is None:
                raise ConfigError(
                    f"dropout ({rates[0]}) with parallel.tp = {pcfg.tp}: TP style {style!r} of "
                    f"{layout.blocks}.{key}.{rule} is not known to hand on a sharded or a replicated activation, so "
                    f"pp_tp cannot tell which dropout masks must differ per TP rank (its TPStyle record leaves "
                    f"dropout unset); set parallel.tp = 1 {off}"
                )


def preflight(model: nn.Module, pcfg: ParallelConfig, inputs: PreflightInputs) -> Preflight:
    """All model-dependent refusals for `model` under a resolved `pcfg`, in one order; no communication. Callers
    build with the returned `parallel`, whose model-dependent defaults are resolved."""
    layout = layout_for(model)
    if inputs.document_mask:
        check_document_mask(layout)
    d = layout.dims(model)
    pcfg = resolve_embedding(pcfg, d)
    check_layout_names(layout)
    check_layout_holds_all(model, layout)
    check_loss(layout, pcfg, inputs.custom_loss)
    check_model_shape(pcfg, d, pcfg.tp == 1 or splits_attention(model, layout))
    if inputs.seq_len is not None and layout.is_lm:  # other models take no token sequence
        check_seq_len(inputs.seq_len, d)
    check_tied(pcfg, d)
    check_tp_plan(model, layout, pcfg)
    check_experts(model, layout, pcfg)
    check_cp_model(model, layout, pcfg, inputs.custom_loss)
    check_balancing(model, layout, pcfg, inputs.moe or MoEConfig())
    check_dropout(model, layout, pcfg, inputs.device_type)
    check_float8(pcfg, inputs.device_type)
    return Preflight(layout, d, plan_stages(model, layout, pcfg, inputs.seq_len), pcfg)


def _check_divisible(key: str, value: int, by_key: str, by: int) -> None:
    if value % by:
        raise ConfigError(
            f"{key} = {value} is not divisible by {by_key} = {by}; "
            f"set {by_key} to a divisor of {value} or {key} to a multiple of {by}"
        )
