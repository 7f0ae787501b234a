"""Dropout's RNG discipline (pp_tp/parallel/rng.py) on a Seed-OSS-like model (attention and residual dropout) at
pp2 x dp2 x tp2: every `F.dropout` mask is recorded per rank. Replicated activations (the residual dropouts after
the row-parallel layers, the blocks' outputs) are identical on the two TP ranks; the attention-probability masks of
the two head shards differ; dp replicas and the two stages draw different masks; consecutive layers and steps too,
and the streams a checkpoint saves replay a step's masks. With activation checkpointing the recompute redraws the
same masks (gradients equal to the run without it), and the model trains (loss falls). Refusals where the
discipline cannot hold, and `switch_off_dropout`, single-process.

Random draws beyond dropout (PhiMoE's sparsemixer routing with `router_jitter_noise` on, pp_tp/models/hf/randomness.py)
follow the same discipline: built with the noise on at dp2 x tp2 (4 ranks: they draw from the same stage streams as
dropout, whose difference across stages the 8-rank case proves) and fed the same tokens on both dp replicas, every
router's choices are identical on the two TP ranks, differ across dp replicas and differ from the noiseless top-1; a
TP plan that would put such a draw inside a sharded region is refused for parallel.tp > 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import parity_utils as pu
import pytest
import torch
import transformers as T

import pp_tp
from pp_tp.base.tensors import full_tensor
from pp_tp.config import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.models.hf import randomness
from pp_tp.models.hf.layout import compose
from pp_tp.models.reference.model import ModelArgs
from pp_tp.parallel.rng import active_dropout, switch_off_dropout
from pp_tp.parity import dp_share
from pp_tp.preflight import PreflightInputs, preflight
from pp_tp.train.checkpoint import _restore_rng, _rng_blob

VOCAB, SEQ, BATCH = 64, 16, 8
RATE = 0.3
PCFG = dict(pp=2, dp_shard=2, tp=2, schedule="1F1B", microbatches=2)


def _seed_oss(dropout: float, device: str = "cpu", attn: str = "eager") -> torch.nn.Module:
    config = T.SeedOssConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, attention_dropout=dropout,
        residual_dropout=dropout,
    )  # fmt: skip
    with torch.device(device):
        return T.AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def _state() -> dict[str, torch.Tensor]:
    return pu.seeded({k: v.shape for k, v in _seed_oss(0.0, "meta").named_parameters()}, norm=0.0)


def _pipe(dropout: float, **kw) -> pp_tp.Pipeline:
    pcfg = pu.pcfg_of(**{**PCFG, **kw})
    return pp_tp.build_pipeline(
        _seed_oss(dropout, "meta"), pp_tp.build_mesh(pcfg), pcfg, state_dict=_state(), rng_seed=3
    )


def _step(pipe: pp_tp.Pipeline) -> float:
    ids, labels = pu.batch(ModelArgs(vocab_size=VOCAB), BATCH, SEQ)
    return pipe.step(dp_share(pipe.mesh, ids), dp_share(pipe.mesh, labels)).item()


def _grads(pipe: pp_tp.Pipeline) -> dict[str, torch.Tensor]:
    return {k: full_tensor(p.grad) for part in pipe.model_parts for k, p in part.named_parameters()}


def _case() -> dict:
    """This rank's dropout masks of one step, in call order and tagged with their layer, and its blocks' outputs;
    the same step with activation checkpointing (same streams: same loss and gradients), then a few more steps."""
    pipe = _pipe(RATE)
    layer, records, outputs = [None], [], []
    original = torch.nn.functional.dropout

    def recording(x, p=0.5, training=True, inplace=False):
        out = original(x, p, training, inplace)
        if training and p > 0:
            records.append((layer[0], "attn" if x.dim() == 4 else "resid", (out == 0).clone()))
        return out

    hooks = []
    for part in pipe.model_parts:
        for block in part.block_modules():
            idx = block.self_attn.layer_idx
            hooks.append(block.register_forward_pre_hook(lambda m, a, idx=idx: layer.__setitem__(0, idx)))
            hooks.append(block.register_forward_hook(lambda m, a, out: outputs.append(out.detach().clone())))
    torch.nn.functional.dropout = recording
    try:
        loss = _step(pipe)
    finally:
        torch.nn.functional.dropout = original
        for hook in hooks:
            hook.remove()
    grads = _grads(pipe)
    saved = _rng_blob(pipe.rng_streams)  # what a checkpoint keeps of the streams
    second = _step(pipe)  # no optimizer step: only the masks can change the loss
    _restore_rng(saved, pipe.rng_streams)
    replayed = _step(pipe)
    checkpointed = _pipe(RATE, activation_checkpoint="full")
    losses = [_step(checkpointed)]
    recomputed = _grads(checkpointed)
    opt = torch.optim.AdamW([p for part in checkpointed.model_parts for p in part.parameters()], lr=1e-2)
    for _ in range(3):
        opt.step()
        opt.zero_grad()
        losses.append(_step(checkpointed))
    return {
        "coords": tuple(pipe.mesh[d].get_local_rank() for d in ("pp", "dp_shard", "tp")),
        "records": records,
        "outputs": outputs,
        "loss_diff": abs(loss - losses[0]),
        "grad_diff": max(pu.rel_err(recomputed[k], grads[k]) for k in grads),
        "losses": losses,
        "step_losses": (loss, second, replayed),
    }


def _phimoe(device: str = "cpu", noise: float = 0.5) -> torch.nn.Module:
    config = T.PhimoeConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, num_local_experts=4, router_jitter_noise=noise,
    )  # fmt: skip
    with torch.device(device):
        return T.AutoModelForCausalLM.from_config(config)


def _noise_case() -> dict:
    """This rank's router choices (routing weights, experts, router logits) in one step of PhiMoE with its sparsemixer
    noise on, every dp replica fed the same tokens."""
    state = pu.seeded({k: v.shape for k, v in _phimoe("meta").named_parameters()}, scale=0.2, norm=0.0)
    pcfg = pu.pcfg_of(**{**PCFG, "pp": 1})
    pipe = pp_tp.build_pipeline(_phimoe("meta", 0.0), pp_tp.build_mesh(pcfg), pcfg, state_dict=state, rng_seed=3)
    for part in pipe.model_parts:  # the noise on after the build: this test is about the streams it draws from
        for module in part.modules():
            if hasattr(module, "router_jitter_noise"):
                module.router_jitter_noise = 0.5
    records = []
    hooks = [
        m.register_forward_hook(lambda m, a, out: records.append([full_tensor(t).detach().clone() for t in out]))
        for part in pipe.model_parts
        for name, m in part.named_modules()
        if name.endswith("mlp.router")
    ]
    ids, labels = pu.batch(ModelArgs(vocab_size=VOCAB), BATCH // 2, SEQ)
    try:
        pipe.step(ids, labels)  # the same tokens on both dp replicas
    finally:
        for hook in hooks:
            hook.remove()
    return {"coords": tuple(pipe.mesh[d].get_local_rank() for d in ("dp_shard", "tp")), "records": records}


def test_router_noise_follows_the_dropout_discipline(world):
    ranks = {r["coords"]: r["records"] for r in world(4).run(_noise_case)}
    for dp in range(2):
        a, b = ranks[(dp, 0)], ranks[(dp, 1)]
        assert len(a) == 8  # 4 layers x 2 microbatches
        assert all(torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))  # TP ranks choose alike
        logits, weights, experts = a[0]
        assert (experts[:, 0] != logits.argmax(-1)).any()  # the noise acts: not always the top-1 expert
    for tp in range(2):  # the first router sees the same values on both dp replicas, and draws differently
        a, b = ranks[(0, tp)][0], ranks[(1, tp)][0]
        assert torch.equal(a[0], b[0]) and not torch.equal(a[2], b[2]), (a, b)


def test_a_draw_inside_a_sharded_region_refuses_tp_and_the_noise_can_be_switched_off():
    model = _phimoe("meta")
    layout = randomness.check_randomness(model, compose(model))
    assert layout.tp_refusal is None  # the router draws on the replicated hidden state, outside every region
    assert randomness.noise_keys(model) == {"router_jitter_noise": 0.5}
    opened = dataclasses.replace(layout, tp_plan={"self_attn.q_proj": "colwise"})  # a region left open to the end
    refusal = randomness.check_randomness(model, opened).tp_refusal
    assert re.fullmatch(
        r"model PhimoeForCausalLM: its training forward draws random numbers \(router_jitter_noise = 0.5\) in "
        r"model.layers.0.mlp.router, inside a tensor-parallel sharded region, .*; set parallel.tp = 1 or "
        r"router_jitter_noise to 0 in the model config",
        refusal,
    )
    closed = dataclasses.replace(layout, tp_plan={"self_attn.q_proj": "colwise", "self_attn.o_proj": "rowwise"})
    assert randomness.check_randomness(model, closed).tp_refusal is None
    assert randomness.switch_off_noise(model, {"router_jitter_noise": 0.5}) == ["router_jitter_noise"]
    assert model.config.router_jitter_noise == 0.0 and model.model.layers[3].mlp.router.router_jitter_noise == 0.0


def test_dropout_streams_follow_the_discipline(world):
    results = world(8).run(_case)
    ranks = {r["coords"]: r for r in results}

    def masks(coords, kind):
        return [m for _, k, m in ranks[coords]["records"] if k == kind]

    for pp, dp in itertools.product(range(2), range(2)):
        a, b = ranks[(pp, dp, 0)], ranks[(pp, dp, 1)]
        # replicated activations: identical on the two TP ranks (residual masks and the blocks' outputs)
        assert len(a["outputs"]) == 4 and all(torch.equal(x, y) for x, y in zip(a["outputs"], b["outputs"]))
        assert all(torch.equal(x, y) for x, y in zip(masks((pp, dp, 0), "resid"), masks((pp, dp, 1), "resid")))
        # the two head shards draw independent attention masks
        attn0, attn1 = masks((pp, dp, 0), "attn"), masks((pp, dp, 1), "attn")
        assert len(attn0) == 4 and not any(torch.equal(x, y) for x, y in zip(attn0, attn1))
        # consecutive layers draw different masks, at the configured rate
        resid = masks((pp, dp, 0), "resid")
        assert not torch.equal(resid[0], resid[2]) and all(abs(m.float().mean() - RATE) < 0.1 for m in resid)
    for pp, tp, kind in itertools.product(range(2), range(2), ("attn", "resid")):  # dp replicas differ
        assert not any(torch.equal(x, y) for x, y in zip(masks((pp, 0, tp), kind), masks((pp, 1, tp), kind)))
    for dp, tp, kind in itertools.product(range(2), range(2), ("attn", "resid")):  # stage 2 does not repeat stage 1
        assert not any(torch.equal(x, y) for x, y in zip(masks((0, dp, tp), kind), masks((1, dp, tp), kind)))
    for r in results:
        first, second, replayed = r["step_losses"]  # new masks each step; a restored checkpoint replays them
        assert second != first and replayed == second, r["step_losses"]
        assert r["loss_diff"] <= 1e-6 and r["grad_diff"] <= 1e-5, r  # the recompute redraws the same masks
        assert all(torch.isfinite(torch.tensor(r["losses"]))) and r["losses"][-1] < r["losses"][0], r["losses"]


def _preflight(model: torch.nn.Module, **kw) -> None:
    preflight(
        model,
        ParallelConfig(**{"pp": 2, "tp": 2, "dp_shard": 1, "stages_per_rank": 1, **kw}),
        PreflightInputs("cpu", SEQ),
    )


def test_where_the_discipline_cannot_hold_dropout_is_refused_in_one_line():
    model = _seed_oss(0.1, "meta")
    with pytest.raises(ConfigError, match=r"parallel.compile = true with dropout .* set parallel.compile = false"):
        _preflight(model, compile=True)
    with pytest.raises(ConfigError, match=r"dropout .* on a 'mps' device"):
        preflight(model, ParallelConfig(pp=2, dp_shard=1, stages_per_rank=1), PreflightInputs("mps", SEQ))
    with pytest.raises(ConfigError, match=r"attention_dropout = 0.1 inside the 'flex_attention' attention kernel"):
        _preflight(_seed_oss(0.1, "meta", attn="flex_attention"))
    _preflight(_seed_oss(0.0, "meta"), compile=True)  # no dropout: nothing to place


def test_switch_off_dropout_turns_off_modules_attributes_and_config():
    model = _seed_oss(0.1, "meta")
    assert "model.layers.0.self_attn.attention_dropout" in active_dropout(model)
    found = switch_off_dropout(model)
    assert "config.attention_dropout" in found and "model.layers.3.mlp.residual_dropout" in found
    assert active_dropout(model) == [] and model.config.residual_dropout == 0.0
    neox = T.GPTNeoXForCausalLM(T.GPTNeoXConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                intermediate_size=64, vocab_size=64, hidden_dropout=0.2))  # fmt: skip
    assert switch_off_dropout(neox)[:1] == ["gpt_neox.emb_dropout"] and neox.gpt_neox.emb_dropout.p == 0.0
