"""A TP style is one record (pp_tp.extend.TPStyle): a style a plugin registers with one `register_tp_style` call is
checked like a built-in (gathered output, valid only in a region) and given dropout streams like one: at tp2 with
dropout on, a plan whose colwise / rowwise / replicate_input are plugin copies draws every mask the built-in plan
draws and gives the same loss. The built-in 1x1-conv pair opens and closes a dropout region like a Linear pair.
Plugin styles are registered in every process that plans with them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import parity_utils as pu
import pytest
import torch
from test_dropout_rng import RATE, SEQ, _seed_oss, _state, _step
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import pp_tp
from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.extend import TPStyle, register_tp_style
from pp_tp.layout import layout_for
from pp_tp.models.credit import CreditArgs, CreditModel
from pp_tp.models.reference import REFERENCE
from pp_tp.models.reference.layout import BLOCK_TP_PLAN
from pp_tp.models.reference.model import ModelArgs, Transformer
from pp_tp.parallel.local_styles import PackedColwise
from pp_tp.parallel.tensor_parallel import block_plan, check_tp_plan
from pp_tp.parallel.tp_styles import TP_STYLES, ReplicateInput
from pp_tp.preflight import PreflightInputs, preflight

# What a plugin would write: each record says all pp_tp reads about the style.
PLUGIN = {
    "plugin_colwise": TPStyle(lambda: ColwiseParallel(use_local_output=True), sharded_dim=0, dropout="opens"),
    "plugin_rowwise": TPStyle(lambda: RowwiseParallel(use_local_output=True), sharded_dim=1, dropout="closes"),
    "plugin_replicate_input": TPStyle(ReplicateInput, input_only=True, dropout="neutral"),
    "plugin_gather": TPStyle(
        lambda: ColwiseParallel(output_layouts=Replicate(), use_local_output=True),
        sharded_dim=0,
        gathered=True,
        dropout="neutral",
    ),
    "plugin_in_region": TPStyle(lambda: PackedColwise(1), sharded_dim=0, in_region=True, dropout="opens"),
    # The same colwise, its record silent on dropout: dropout beside it stays refused.
    "plugin_colwise_silent": TPStyle(lambda: ColwiseParallel(use_local_output=True), sharded_dim=0),
}
# Built-in -> plugin copy, for the dropout runs.
SWAP = {"colwise": "plugin_colwise", "rowwise": "plugin_rowwise", "replicate_input": "plugin_replicate_input"}
QK = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32, qk_norm=True)


def _register() -> None:
    for name, style in PLUGIN.items():
        register_tp_style(name, style)


@pytest.fixture
def plugin_styles():
    _register()
    yield
    for name in PLUGIN:
        TP_STYLES.pop(name)


def _plan_blocks(model: nn.Module, swap: dict[str, str]) -> nn.Module:
    """Every block declares its own plan: the layout's, with the styles in `swap` renamed."""
    layout = layout_for(model)
    for _, block in model.get_submodule(layout.blocks).named_children():
        block._tp_plan = {rule: swap.get(style, style) for rule, style in block_plan(block, layout).items()}
    return model


def _reference(plan: dict[str, str]) -> nn.Module:
    with torch.device("meta"):
        model = Transformer(QK)
    for block in model.layers.values():
        block._tp_plan = plan
    return model


def test_record_fields_are_checked():
    with pytest.raises(ValueError, match="TPStyle.dropout = 'open'"):
        TPStyle(lambda: None, dropout="open")
    with pytest.raises(ValueError, match="TPStyle.parts = 2 needs"):
        TPStyle(lambda: None, parts=2)
    with pytest.raises(TypeError, match=r"register_tp_style\('x', \.\.\.\) takes a pp_tp.extend.TPStyle record"):
        register_tp_style("x", lambda: None)
    assert "x" not in TP_STYLES


def test_a_plugin_gathered_style_is_accepted_where_gathered_is_required(plugin_styles):
    """q/k/v gathered to full width: the q/k norms after them see whole heads, so they need no rule of their own.
    The same plan with a non-gathered column style leaves them inside a sharded sub-block: refused."""
    pcfg = ParallelConfig(tp=2, dp_shard=1)
    for gather in ("colwise_gather_output", "plugin_gather"):
        qkv = {f"attention.w{p}": gather for p in "qkv"}
        check_tp_plan(_reference({**BLOCK_TP_PLAN, **qkv, "attention.wo": "rowwise_split_input"}), REFERENCE, pcfg)
    sharded = {**BLOCK_TP_PLAN, **{f"attention.w{p}": "plugin_colwise" for p in "qkv"}}
    with pytest.raises(ConfigError, match=r"parameter 'attention.q_norm.weight' sits inside a tensor-parallel sub"):
        check_tp_plan(_reference(sharded), REFERENCE, pcfg)


def test_a_plugin_in_region_style_is_refused_outside_a_replicate_input_sub_block(plugin_styles):
    pcfg = ParallelConfig(tp=2, dp_shard=1)
    norms = {"attention.q_norm": "replicated_with_grad_allreduce", "attention.k_norm": "replicated_with_grad_allreduce"}
    inside = {**BLOCK_TP_PLAN, **norms, "attention.wq": "plugin_in_region"}
    check_tp_plan(_reference(inside), REFERENCE, pcfg)
    outside = {rule: style for rule, style in inside.items() if rule != "attention"}
    with pytest.raises(ConfigError, match=r"'attention.wq' has style 'plugin_in_region', which leaves its input grad"):
        check_tp_plan(_reference(outside), REFERENCE, pcfg)


def test_dropout_is_placed_with_plugin_styles_whose_record_says_how(plugin_styles):
    pcfg = ParallelConfig(pp=2, tp=2, dp_shard=1, stages_per_rank=1)
    preflight(_plan_blocks(_seed_oss(RATE, "meta"), SWAP), pcfg, PreflightInputs("cpu", SEQ))
    silent = _plan_blocks(_seed_oss(RATE, "meta"), {"colwise": "plugin_colwise_silent"})
    with pytest.raises(ConfigError, match=r"TP style 'plugin_colwise_silent' of .* leaves dropout unset"):
        preflight(silent, pcfg, PreflightInputs("cpu", SEQ))


@contextmanager
def _recording_dropout(kind: Callable[[torch.Tensor], str]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every training `F.dropout` mask drawn inside, tagged with `kind(input)`."""
    original, records = torch.nn.functional.dropout, []

    def recording(x, p=0.5, training=True, inplace=False):
        out = original(x, p, training, inplace)
        if training and p > 0 and not x.is_meta:  # not the shape inference's meta forward
            records.append((kind(x), (out == 0).clone()))
        return out

    torch.nn.functional.dropout = recording
    try:
        yield records
    finally:
        torch.nn.functional.dropout = original


def _dropout_case() -> dict:
    """One tp2 step with dropout on, the built-in plan then its plugin copy, from the same weights and streams."""
    _register()
    pcfg = ParallelConfig(tp=2, dp_shard=1, microbatches=2, mixed_precision="fp32")
    mesh = pp_tp.build_mesh(pcfg)
    out = {"tp": mesh["tp"].get_local_rank()}
    for run, swap in (("builtin", {}), ("plugin", SWAP)):
        model = _plan_blocks(_seed_oss(RATE, "meta"), swap)
        pipe = pp_tp.build_pipeline(model, mesh, pcfg, state_dict=_state(), rng_seed=3)
        with _recording_dropout(lambda x: "attn" if x.dim() == 4 else "resid") as records:
            out[run] = {"loss": _step(pipe), "masks": records}
        out[run]["plan"] = sorted(set(model.model.layers[0]._tp_plan.values()))
    return out


def test_plugin_styles_draw_the_builtin_dropout_masks_at_tp2(world):
    ranks = {r["tp"]: r for r in world(2).run(_dropout_case)}
    for r in ranks.values():
        builtin, plugin = r["builtin"], r["plugin"]
        assert plugin["plan"] == ["plugin_colwise", "plugin_replicate_input", "plugin_rowwise"], plugin["plan"]
        assert plugin["loss"] == builtin["loss"] and 3.5 < builtin["loss"] < 5.0, (plugin["loss"], builtin["loss"])
        kinds = [k for k, _ in builtin["masks"]]
        assert kinds.count("attn") == 8 and kinds.count("resid") == 16, kinds  # 4 layers x 2 microbatches
        assert [k for k, _ in plugin["masks"]] == kinds
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(builtin["masks"], plugin["masks"]))
        # at the configured rate (attention probabilities hold the causal mask's zeros too)
        assert all(abs(m.float().mean().item() - RATE) < 0.1 for k, m in plugin["masks"] if k == "resid")
    # The region was opened and closed: head shards drew different masks, replicated activations the same.
    pairs = list(zip(ranks[0]["plugin"]["masks"], ranks[1]["plugin"]["masks"]))
    assert not any(torch.equal(a, b) for (k, a), (_, b) in pairs if k == "attn")
    assert all(torch.equal(a, b) for (k, a), (_, b) in pairs if k == "resid")


def _conv_dropout_case() -> dict:
    """A CREDIT model at tp2 with dropout on its 1x1-conv MLP's hidden channels (the column conv's shard) and after
    its row conv (whole channels again): built-in conv_colwise opens the region, conv_rowwise closes it."""
    pcfg = ParallelConfig(tp=2, dp_shard=1, microbatches=2, mixed_precision="fp32")
    args = CreditArgs(channels=4, image_size=16, patch_size=4, dim=32, n_layers=2, n_heads=4, ffn_dim=128)
    with torch.device("meta"):
        model = CreditModel(args)
        for block in model.blocks:
            block.mlp[1] = nn.Sequential(nn.GELU(), nn.Dropout(RATE))
            block.mlp.append(nn.Dropout(RATE))
    gen = torch.Generator().manual_seed(0)
    state = pu.seeded({k: v.shape for k, v in model.named_parameters()}, gen, norm=0.0)
    pipe = pp_tp.build_pipeline(model, pp_tp.build_mesh(pcfg), pcfg, state_dict=state, loss_fn="mse", rng_seed=3)
    x, y = torch.randn(4, 4, 16, 16, generator=gen), torch.randn(4, 4, 16, 16, generator=gen)
    with _recording_dropout(lambda h: "hidden" if h.shape[1] == args.ffn_dim // 2 else "out") as records:
        loss = pipe.step(x, y).item()
    return {"tp": pipe.mesh["tp"].get_local_rank(), "loss": loss, "masks": records}


def test_conv_pairs_open_and_close_a_dropout_region_at_tp2(world):
    ranks = {r["tp"]: r for r in world(2).run(_conv_dropout_case)}
    assert ranks[0]["loss"] == ranks[1]["loss"] and 0.0 < ranks[0]["loss"] < 10.0, ranks[0]["loss"]
    kinds = [k for k, _ in ranks[0]["masks"]]
    assert kinds == ["hidden", "out"] * 4, kinds  # 2 blocks x 2 microbatches
    assert all(abs(m.float().mean().item() - RATE) < 0.1 for r in ranks.values() for _, m in r["masks"])
    pairs = list(zip(ranks[0]["masks"], ranks[1]["masks"]))
    assert not any(torch.equal(a, b) for (k, a), (_, b) in pairs if k == "hidden")  # channel shards: independent
    assert all(torch.equal(a, b) for (k, a), (_, b) in pairs if k == "out")  # whole channels: alike on both ranks
