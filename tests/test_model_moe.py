"""The reference Transformer's mixture of experts: routing and expert compute against naive loops, the pipelined
build at pp2 x dp_shard2 (experts whole on every rank) exact against the plain model on two schedules, the seeded
build's router biases, and the experts keys' refusals."""

from __future__ import annotations

import os
from dataclasses import asdict, replace

import parity_utils as pu
import pytest
import torch
import torch.nn.functional as F
from train_utils import REPO

import pp_tp
from pp_tp.base.tensors import persistent_buffers
from pp_tp.config import JobConfig, ModelConfig, TrainingConfig, load_config, validate
from pp_tp.errors import ConfigError
from pp_tp.models.factory import build_model
from pp_tp.models.reference import Transformer, moe
from pp_tp.models.reference.moe import Experts, MoE, Router
from pp_tp.planner import plan_job

# Layers 1 and 3 hold 8 experts (top 2) and a shared expert; 0 and 2 are dense.
MOE = replace(pu.TINY, n_experts=8, top_k=2, n_shared_experts=1, moe_ffn_dim=16, moe_every=2)
# Every layer MoE, sigmoid scores, weights not renormalized, no shared expert.
MOE_SIGMOID = replace(pu.TINY, n_experts=4, top_k=3, moe_ffn_dim=24, router="sigmoid", norm_topk=False)


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.T


def _naive_experts(experts: Experts, hidden, index, weights) -> torch.Tensor:
    """Token by token, slot by slot: sum of weight * expert(token) over the slots naming one of the experts."""
    n = experts.gate_up_proj.shape[0]
    rows = []
    for t in range(hidden.shape[0]):
        row = torch.zeros_like(hidden[t])
        for e, w in zip(index[t].tolist(), weights[t]):
            if 0 <= e < n:
                row = row + w * _expert(hidden[t], experts.gate_up_proj[e], experts.down_proj[e])
        rows.append(row)
    return torch.stack(rows)


def _experts(n=4, dim=8, hidden=6) -> Experts:
    gen = torch.Generator().manual_seed(0)
    experts = Experts(n, dim, hidden)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) * 0.3)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) * 0.3)
    return experts


def test_experts_equal_a_naive_loop_and_ignore_foreign_ids():
    """Output and every gradient equal the naive loop's; ids outside [0, E) (EP's sentinels) add nothing; an
    expert no token reached still gets a (zero) gradient, so FSDP ranks agree on what they reduce."""
    experts = _experts()
    assert experts.num_experts == 4
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 8, generator=gen, requires_grad=True)
    index = torch.tensor([[0, 1], [1, 0], [3, 1], [1, -1], [4, 0], [3, 3], [0, 7], [1, 0], [-5, 4], [3, 1]])
    weights = torch.rand(10, 2, generator=gen, requires_grad=True)
    got = experts(hidden, index, weights)
    grads = torch.autograd.grad(got.pow(2).sum(), (hidden, weights, experts.gate_up_proj, experts.down_proj))
    want = _naive_experts(experts, hidden, index, weights)
    want_grads = torch.autograd.grad(want.pow(2).sum(), (hidden, weights, experts.gate_up_proj, experts.down_proj))
    assert pu.rel_err(got.detach(), want.detach()) < 1e-6
    for g, w in zip(grads, want_grads):
        assert pu.rel_err(g, w) < 1e-6
    assert not got[8].any()  # slots -5 and 4: both foreign
    assert not grads[2][2].any() and grads[2][[0, 1, 3]].abs().sum(dim=(1, 2)).min() > 0  # expert 2: no token
    none = experts(hidden, torch.full((10, 2), 4), weights)  # nothing local: zeros, and still a gradient
    assert not none.any()
    assert torch.autograd.grad(none.sum(), experts.gate_up_proj)[0].shape == experts.gate_up_proj.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_per_expert_loop(monkeypatch, dtype):
    """Where grouped_mm fits (16-byte strides), it gives the loop's output and gradients bit for bit on uneven
    routing with an empty expert and foreign ids, under a stride-0 output gradient (sum); unaligned dims
    (hidden 6: 24-byte fp32 or 12-byte bf16 rows) take the loop."""
    experts = _experts(dim=16, hidden=8).to(dtype)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 16, generator=gen).to(dtype).requires_grad_()
    index = torch.tensor([[0, 1], [1, 0], [3, 1], [1, -1], [4, 0], [3, 3], [0, 7], [1, 0], [-5, 3]])  # 2: none
    weights = torch.rand(9, 2, generator=gen).to(dtype)
    wrt = (hidden, experts.gate_up_proj, experts.down_proj)
    calls, grouped = [], Experts._grouped
    monkeypatch.setattr(Experts, "_grouped", lambda self, *a: calls.append(1) or grouped(self, *a))
    got = experts(hidden, index, weights)
    got_grads = torch.autograd.grad(got.sum(), wrt)
    none = experts(hidden, torch.full((9, 2), 4), weights)  # nothing local: zeros, still a gradient
    assert not none.any() and torch.autograd.grad(none.sum(), experts.down_proj)[0].shape == (4, 16, 8)
    assert calls == [1, 1]
    monkeypatch.setattr(moe, "_grouped_mm_fits", lambda *t: False)
    want = experts(hidden, index, weights)
    want_grads = torch.autograd.grad(want.sum(), wrt)
    assert calls == [1, 1] and torch.equal(got, want) and got.abs().sum() > 0
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)
    assert not got_grads[1][2].any() and got_grads[1][[0, 1, 3]].abs().sum(dim=(1, 2)).min() > 0
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(Experts, "_grouped", lambda self, *a: calls.append(1) or grouped(self, *a))
    small = _experts().to(dtype)  # hidden 6: down_proj rows of 24 (fp32) or 12 (bf16) bytes, not 16-aligned
    small(hidden[:, :8], index, weights).sum().backward()
    assert calls == []


@pytest.mark.parametrize("scoring, norm_topk", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_router_chooses_by_biased_scores_and_weighs_by_unbiased_ones(scoring, norm_topk):
    router = Router(8, 6, 2, scoring, norm_topk)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(6, 8, generator=gen))
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 2.0]))  # expert 5 always chosen
    hidden = torch.randn(12, 8, generator=gen)
    logits, weights, index = router(hidden)
    assert torch.allclose(logits, hidden @ router.weight.T)
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    for t in range(12):
        others = sorted(range(5), key=lambda e: -scores[t, e].item())
        assert index[t].tolist() == [5, others[0]]
        want = scores[t, index[t]]
        assert torch.allclose(weights[t], want / want.sum() if norm_topk else want)


def test_moe_block_equals_a_dense_loop_over_every_expert():
    """The module: route, run each token through its chosen experts weighted, add the shared expert."""
    torch.manual_seed(3)
    moe = MoE(MOE, pu.make_model(MOE).layers["1"].feed_forward.shared_experts)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 5, MOE.dim)
    probs = (x @ moe.gate.weight.T).softmax(-1)
    want = moe.shared_experts(x)
    for b in range(2):
        for s in range(5):
            top = probs[b, s].topk(2)
            for w, e in zip(top.values / top.values.sum(), top.indices):
                want[b, s] += w * _expert(x[b, s], moe.experts.gate_up_proj[e], moe.experts.down_proj[e])
    assert pu.rel_err(moe(x).detach(), want.detach()) < 1e-6


def test_moe_layers_names_and_shapes():
    model = pu.make_model(MOE, device="meta")
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    assert shapes["layers.1.feed_forward.gate.weight"] == (8, 32)
    assert shapes["layers.1.feed_forward.experts.gate_up_proj"] == (8, 32, 32)
    assert shapes["layers.3.feed_forward.experts.down_proj"] == (8, 32, 16)
    assert shapes["layers.1.feed_forward.shared_experts.w1.weight"] == (16, 32)
    assert shapes["layers.0.feed_forward.w1.weight"] == (48, 32)  # dense: moe_every = 2
    assert set(persistent_buffers(model)) == {f"layers.{i}.feed_forward.gate.expert_bias" for i in (1, 3)}
    every = pu.make_model(MOE_SIGMOID, device="meta")
    assert all(f"layers.{i}.feed_forward.gate.weight" in dict(every.named_parameters()) for i in range(4))


def _job(**model) -> JobConfig:
    return JobConfig(model=ModelConfig(**{**asdict(MOE), **model}), training=TrainingConfig(seq_len=16))


@pytest.mark.parametrize(
    "model, message",
    [
        ({"top_k": 9}, "model.top_k = 9 exceeds model.n_experts = 8; set model.top_k <= 8"),
        ({"moe_every": 5}, "model.moe_every = 5 exceeds model.n_layers = 4, so no layer holds experts"),
        ({"n_experts": 0, "top_k": 1}, "model.n_shared_experts = 1 shapes MoE layers, but model.n_experts = 0"),
        ({"router": "sigmoidal"}, "model.router = 'sigmoidal' is not one of softmax, sigmoid (did you mean"),
        ({"n_experts": -1}, "model.n_experts = -1 must be >= 0"),
        ({"moe_every": 0}, "model.moe_every = 0 must be >= 1"),
        ({"kind": "hf_llama"}, "model.n_experts = 8 shapes pp_tp's reference Transformer, but model.kind = 'hf_llama'"),
        ({"hf_path": "DIR"}, "but model.hf_path chooses another model; drop model.n_experts"),
    ],
)
def test_experts_keys_are_refused_in_one_line(model, message):
    with pytest.raises(ConfigError, match="^[^\n]*$") as e:
        validate(_job(**model), world_size=1)
    assert message in str(e.value)


def test_the_model_itself_applies_the_same_rules():
    with pytest.raises(ConfigError, match="model.top_k = 9 exceeds model.n_experts = 8"):
        Transformer(replace(MOE, top_k=9))


def test_the_planner_counts_every_expert_parameter(monkeypatch):
    """`pp-tp plan` on the shipped MoE config: stage and per-rank parameters from the experts' real shapes (FSDP
    halves each stage's), and its fake-tensor forward through the experts (no routing values there) runs."""
    monkeypatch.chdir(REPO)  # data.path is relative to the repository root
    cfg = load_config(os.path.join("toml_configs", "moe_cpu.toml"), world_size=4)
    job = plan_job(cfg, 4)
    model = build_model(cfg.model)
    per_stage = [sum(p.numel() for f in s.fqns for p in model.get_submodule(f).parameters()) for s in job.plan.stages]
    assert [s.params for s in job.plan.stages] == per_stage
    assert sum(per_stage) == sum(p.numel() for p in model.parameters())
    assert [r.local_params for r in job.ranks] == [-(-n // 2) for n in per_stage]
    assert all(b > 0 for r in job.ranks for b in r.act_bytes_per_microbatch.values())


# --- multi-rank: experts whole on every rank (pp2 x dp_shard2), split over ep, TP of experts -----------------


def _parity(pcfg, args) -> dict:
    return pu.compare(pcfg, args, steps=2)


def _seeded(pcfg, args) -> float:
    """The seeded build's parameters and router biases against the plain model's init_weights."""
    pipe = pp_tp.build_pipeline(pu.make_model(args, device="meta"), pp_tp.build_mesh(pcfg), pcfg, seed=5)
    plain = pu.make_model(args)
    plain.init_weights(5)
    want = {**dict(plain.named_parameters()), **persistent_buffers(plain)}
    got = {k: pu.full_tensor(p) for part in pipe.model_parts for k, p in part.named_parameters()}
    got.update({k: b for part in pipe.model_parts for k, b in persistent_buffers(part).items()})
    assert any("expert_bias" in k for k in got)
    return max(pu.rel_err(v, want[k]) if want[k].any() else v.abs().max().item() for k, v in got.items())


PP2_DP2 = pu.pcfg_of(pp=2, dp_shard=2, schedule="1F1B", microbatches=4)
INTERLEAVED = pu.with_(PP2_DP2, schedule="Interleaved1F1B", stages_per_rank=2)
PP2_EP2 = pu.with_(INTERLEAVED, ep=2)
PP2_TP2 = pu.pcfg_of(pp=2, tp=2, schedule="ZBVZeroBubble", microbatches=4)
V_EP2 = pu.with_(PP2_DP2, ep=2, schedule="DualPipeV", stages_per_rank=2)  # EP under a split backward


PARITY = ((PP2_EP2, MOE), (PP2_TP2, MOE), (V_EP2, MOE_SIGMOID))


def _all_cases() -> tuple[list[dict], float]:
    """Every parity case and the seeded build, in one round trip to the world."""
    return [_parity(pcfg, args) for pcfg, args in PARITY], _seeded(pu.with_(PP2_DP2, ep=2), MOE)


def test_moe_pipelined_equals_the_plain_model(world):
    """Loss, every full gradient, parameters and router biases after two AdamW steps, fp32, <= 1e-5."""
    out = world(4).run(_all_cases)
    for i in range(len(PARITY)):
        results = [parity[i] for parity, _ in out]
        pu.assert_parity(results)
        assert any("experts.gate_up_proj" in n for n in results[0]["all_names"])
    assert max(seeded for _, seeded in out) == 0.0  # experts seeded by FQN, whatever ep
