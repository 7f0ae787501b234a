"""pp_tp inside the real torchtitan 0.3.0 on CPU/gloo: its llama3 (fused qkv) and qwen3 (q/k norms) models,
shrunk, through `pipelining_fn` with the Trainer's exact keywords, `to_empty()` + `init_weights()` as the
Trainer does, one step with the Trainer's microbatch lists, per-document `positions` and
`global_valid_tokens`: loss and every full gradient equal torchtitan's own non-PP model on the same weights.

CPU notes: FlexAttention has no backward on CPU in torch 2.13 and torchtitan refuses `attn_backend="sdpa"`
for language models, so the layer configs get torchtitan's ScaledDotProductAttention (causal), as its
own graph-trainer tests do.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest

pytest.importorskip("torchtitan")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.models.common import Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402
from torchtitan.models.common.rope import ComplexRoPE  # noqa: E402

from pp_tp.base.tensors import full_tensor  # noqa: E402
from pp_tp.errors import ConfigError  # noqa: E402
from pp_tp.integrations.torchtitan import model_spec, parallel_config, pipelining_fn  # noqa: E402
from pp_tp.integrations.torchtitan_parts import PipelineSchedule  # noqa: E402
from pp_tp.layout import layout_for  # noqa: E402
from pp_tp.parallel.mesh import dp_rank  # noqa: E402

VOCAB, DIM, LAYERS, SEQ, ROWS, MBS, EXPERTS = 128, 64, 4, 16, 8, 2, 8


def _sdpa(layers: list) -> list:
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def llama3_config(tied: bool = False, fused: bool = True, vocab: int = VOCAB):
    """torchtitan's llama3 debugmodel, shrunk: 4 layers, dim 64, 4 heads over 2 KV heads, fused qkv."""
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers, _output_linear_init

    rope = ComplexRoPE.Config(dim=DIM // 4, max_seq_len=32, theta=500000, scaling="llama")
    layers = _build_llama3_layers(
        n_layers=LAYERS,
        dim=DIM,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=128,
        rope=rope,
        fuse_qkv=fused,
        attn_backend="flex",
    )
    return Llama3Model.Config(
        dim=DIM,
        vocab_size=vocab,
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=DIM, param_init={"weight": torch.nn.init.normal_}
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=vocab, param_init=_output_linear_init(DIM)),
        layers=_sdpa(layers),
    )


def qwen3_config():
    """torchtitan's qwen3 dense model, shrunk and untied: head_dim 32 != dim / n_heads, per-head q/k norms."""
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3 import _build_qwen3_layers

    rope = CosSinRoPE.Config(dim=32, max_seq_len=32, theta=1000000.0)
    layers = _build_qwen3_layers(
        n_layers=LAYERS, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=128, rope=rope, attn_backend="flex"
    )
    return _qwen3_model(_sdpa(layers))


def _ends(vocab: int = VOCAB) -> dict:
    """Embedding and untied head of the shrunk qwen3 and deepseek_v3 models."""
    return dict(
        vocab_size=vocab,
        dim=DIM,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=DIM, param_init={"weight": torch.nn.init.normal_}
        ),
        lm_head=Linear.Config(
            in_features=DIM, out_features=vocab, param_init={"weight": partial(torch.nn.init.normal_, std=0.02)}
        ),
    )


def _qwen3_model(layers: list, vocab: int = VOCAB):
    from torchtitan.models.qwen3 import Qwen3Model, _qwen3_norm

    return Qwen3Model.Config(norm=_qwen3_norm(DIM), layers=layers, **_ends(vocab))


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] sorted by expert times w [experts, in, out] per expert; float64 (parity's truth) expert by expert,
    as torch._grouped_mm takes no float64. Rows past the last offset (none here) come out zero in float64."""
    if x.dtype != torch.float64:
        return torch._grouped_mm(x, w, offs=offsets)
    out, start = x.new_zeros(x.shape[0], w.shape[-1]), 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


class Fp32GroupedExperts(GroupedExperts):
    """torchtitan's GroupedExperts with its grouped matmuls in fp32: its own forward always computes in bf16, whose
    rounding (once per whole-batch pass, once per microbatch in a pipeline) hides any 1e-5 comparison."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        w1, w2, w3 = (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        h = F.silu(_grouped_mm(x, w1.transpose(-2, -1), offsets))
        h = h * _grouped_mm(x, w3.transpose(-2, -1), offsets)
        return _grouped_mm(h, w2.transpose(-2, -1), offsets)


def _fp32_experts(layers: list) -> list:
    for layer in layers:
        if layer.moe is not None:
            inner = layer.moe.routed_experts.inner_experts
            layer.moe.routed_experts.inner_experts = Fp32GroupedExperts.Config(
                dim=inner.dim, hidden_dim=inner.hidden_dim, num_experts=inner.num_experts, param_init=inner.param_init
            )
    return _sdpa(layers)


def qwen3_moe_config(vocab: int = VOCAB):
    """torchtitan's qwen3 MoE, shrunk: 8 experts, top-2, softmax router with route_norm, fused qkv."""
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers

    layers = _build_qwen3_moe_layers(
        n_layers=LAYERS, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=16, moe_hidden_dim=32, num_experts=EXPERTS,
        top_k=2, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=16, max_seq_len=32, theta=1000000.0),
    )  # fmt: skip
    return _qwen3_model(_fp32_experts(layers), vocab)


def deepseek_v3_config():
    """torchtitan's deepseek_v3, shrunk: MLA, one dense layer then MoE layers with a shared expert, a sigmoid
    router with node-limited groups, route_norm and route_scale (the 671B flavor's routing)."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers

    layers = _build_dsv3_layers(
        n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=0.7, dense_hidden_dim=128,
        moe_hidden_dim=32, num_experts=EXPERTS, num_shared_experts=1, router_top_k=2, router_score_func="sigmoid",
        router_num_expert_groups=4, router_num_limited_groups=2, router_route_norm=True, router_route_scale=2.5,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=32, theta=10000.0),
    )  # fmt: skip
    norm = RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_})
    return DeepSeekV3Model.Config(norm=norm, layers=_fp32_experts(layers), mtp_layers=[], **_ends())


CONFIGS = {
    "qwen3_moe": qwen3_moe_config,
    "deepseek_v3": deepseek_v3_config,
    "llama3": llama3_config,
    "qwen3": qwen3_config,
    "llama3_qkv": lambda: llama3_config(fused=False),
    "llama3_tied": lambda: llama3_config(tied=True),
}


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids, labels with uneven -100 padding, and per-document positions (documents of 5, 7, ... tokens)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    positions = torch.zeros(ROWS, SEQ, dtype=torch.long)
    for r in range(ROWS):
        labels[r, SEQ - (r * 3) % 7 :] = -100
        doc = 5 + r % 3
        positions[r] = torch.arange(SEQ) % doc
    return ids, labels, positions


def _sections(pp: int, tp: int = 1, dp_shard: int = 1, **par_kw) -> tuple[ParallelismConfig, TrainingConfig]:
    par = ParallelismConfig(
        pipeline_parallel_degree=pp,
        tensor_parallel_degree=tp,
        data_parallel_shard_degree=dp_shard,
        pipeline_parallel_microbatch_size=MBS,
        enable_sequence_parallel=False,
        **par_kw,
    )
    train = TrainingConfig(local_batch_size=ROWS // dp_shard, seq_len=SEQ, mixed_precision_param="float32")
    return par, train


def _build(name: str, pp: int, tp: int = 1, dp_shard: int = 1, precision: str = "float32", **par_kw):
    par, train = _sections(pp, tp, dp_shard, **par_kw)
    train = dataclasses.replace(train, mixed_precision_param=precision)
    with torch.device("meta"):
        model = CONFIGS[name]().build()
    schedule, parts, first, last = pipelining_fn(
        model,
        parallel_dims=None,
        training=train,
        parallelism=par,
        compile_config=CompileConfig(components=["model"]),
        ac_config=None,
        dump_folder="",
        device=torch.device("cpu"),
        model_config=None,
        parallelize_fn=None,
        loss_fn=None,
    )
    for m in parts:  # what torchtitan's Trainer does next
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.init_weights(buffer_device=None)
        m.train()
    return schedule, parts, first, last


def _union_of_weights(parts) -> dict[str, torch.Tensor]:
    mine = {k: full_tensor(p).detach().clone() for m in parts for k, p in m.named_parameters()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for d in every for k, v in d.items()}


def _titan_reference(name: str, weights: dict, ids, labels, positions) -> dict:
    """torchtitan's own non-PP model and loss on the same weights: CE sum / global_valid_tokens."""
    model = CONFIGS[name]().build()
    with torch.no_grad():
        for k, p in model.named_parameters():  # a tied weight under its canonical (first) name
            p.copy_(weights[k])
    pred = model(ids, positions=positions)
    loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=-100)
    loss = loss / (labels != -100).sum()
    loss.backward()
    with torch.no_grad():  # what dropping `positions` would compute instead
        dropped = float((model(ids) - pred).abs().max())
    grads = {k: p.grad for k, p in model.named_parameters(remove_duplicate=False)}
    return {"loss": loss.item(), "grads": grads, "dropped": dropped}


def titan_case(name: str, pp: int, tp: int = 1, dp_shard: int = 1) -> dict:
    schedule, parts, first, last = _build(name, pp, tp, dp_shard)
    ids, labels, positions = _batch()
    weights = _union_of_weights(parts)
    dp = dp_rank(schedule.pipe.mesh)
    rows = slice(dp * ROWS // dp_shard, (dp + 1) * ROWS // dp_shard)
    mine = [t[rows].split(MBS) for t in (ids, labels, positions)]
    gvt = (labels != -100).sum()  # the Trainer's global_valid_tokens: over all DP ranks
    losses = [] if last else None
    schedule.step(
        arg_mbs=[(i,) for i in mine[0]] if first else None,
        kwarg_mbs=[{"positions": p} for p in mine[2]],
        target_mbs=list(mine[1]) if last else None,
        losses=losses,
        loss_kwargs={"global_valid_tokens": gvt},
        return_outputs=False,
    )
    ref = _titan_reference(name, weights, ids, labels, positions)
    grads = {k: full_tensor(p.grad) for m in parts for k, p in m.named_parameters()}
    reported = torch.sum(torch.stack(losses)).item() * dp_shard if last else None
    return {
        "reported": reported,
        "ref_loss": ref["loss"],
        "grad_err": max(float((g - ref["grads"][k]).norm() / ref["grads"][k].norm()) for k, g in grads.items()),
        "names": sorted(grads),
        "all_names": sorted(ref["grads"]),
        "positions_matter": ref["dropped"],
    }


TITAN_CASES = [("llama3", 2, 2, 1), ("llama3", 2, 1, 2), ("qwen3", 2, 2, 1), ("llama3_qkv", 2, 2, 1)]


def titan_cases() -> list[dict]:
    return [titan_case(*case) for case in TITAN_CASES]


def test_torchtitan_models_through_pipelining_fn_equal_torchtitan_non_pp(world):
    per_rank = world(4).run(titan_cases)
    for i, case in enumerate(TITAN_CASES):
        results = [r[i] for r in per_rank]
        names = set()
        for r in results:
            assert r["grad_err"] <= 1e-5 and r["positions_matter"] > 1e-4, (case, r)
            if r["reported"] is not None:
                assert 3.5 < r["reported"] < 8.0, (case, r)  # about ln(128) = 4.85 for a fresh model
                assert r["reported"] == pytest.approx(r["ref_loss"], rel=1e-5), (case, r)
            names.update(r["names"])
        assert sorted(names) == results[0]["all_names"], case


# --- refusals, before any collective ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "par, train, fragment",
    [
        ({}, {"global_batch_size": 64}, r"^training\.global_batch_size = 64: gradient accumulation"),
        ({"pipeline_parallel_microbatch_size": 3}, {}, r"not divisible by parallelism\.pipeline_parallel_microbatch"),
        ({"module_fqns_per_model_part": [["tok_embeddings"]]}, {}, r"^parallelism\.module_fqns_per_model_part"),
    ],
)
def test_torchtitan_config_we_cannot_honour_is_refused(monkeypatch, par, train, fragment):
    monkeypatch.setenv("WORLD_SIZE", "4")
    p, t = _sections(pp=2, dp_shard=2)
    p, t = dataclasses.replace(p, **par), dataclasses.replace(t, **train)
    with pytest.raises(ConfigError, match=fragment):
        parallel_config(p, t)


def test_torchtitan_sections_map_to_our_parallel_config(monkeypatch):
    from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC

    monkeypatch.setenv("WORLD_SIZE", "8")
    p, t = _sections(pp=2, tp=2)
    p = dataclasses.replace(p, pipeline_parallel_schedule="Interleaved1F1B", data_parallel_shard_degree=-1)
    pcfg = parallel_config(p, t, FullAC.Config(), CompileConfig(enable=True, components=["model"], backend="eager"))
    got = (pcfg.pp, pcfg.tp, pcfg.dp_shard, pcfg.stages_per_rank, pcfg.microbatches, pcfg.activation_checkpoint)
    assert got == (2, 2, 2, 2, ROWS // MBS, "full") and pcfg.compile and pcfg.compile_backend == "eager"
    with pytest.raises(ConfigError, match=r"^activation_checkpoint = MemoryBudgetAC\.Config: .* pick one$"):
        parallel_config(p, t, MemoryBudgetAC.Config())


def tied_case() -> dict | str:
    """A tied llama3 at pp2: pp_tp either trains it exactly (the embedding group) or refuses it in one line."""
    try:
        return titan_case("llama3_tied", 2)
    except ConfigError as e:
        return str(e)


def test_tied_weights_across_stages_train_exactly_or_are_refused_in_one_line(world):
    with torch.device("meta"):
        assert layout_for(llama3_config(tied=True).build()).dims(llama3_config(tied=True).build()).tied
    for r in world(2).run(tied_case):
        if isinstance(r, str):
            assert "\n" not in r and "tie" in r, r
        else:
            assert r["grad_err"] <= 1e-5, r
            assert r["reported"] is None or r["reported"] == pytest.approx(r["ref_loss"], rel=1e-5), r


def test_unknown_model_kwargs_are_refused_not_dropped():
    from types import SimpleNamespace

    schedule = PipelineSchedule(SimpleNamespace(pcfg=SimpleNamespace(microbatches=2), model_parts=[]), ROWS, SEQ)
    with pytest.raises(ConfigError, match=r"^model forward kwargs \['segment_ids'\]: .* only \['positions', "):
        schedule._stage_kwargs([{"positions": None, "segment_ids": 1}] * 2)


def test_model_spec_is_torchtitans_own_with_our_pipelining_fn():
    from torchtitan.models.llama3 import parallelize_llama

    spec = model_spec("llama3", "debugmodel", seed=3)
    assert (spec.name, spec.flavor, spec.parallelize_fn) == ("llama3", "debugmodel", parallelize_llama)
    assert spec.pipelining_fn.func is pipelining_fn and spec.pipelining_fn.keywords == {"seed": 3}
    with torch.device("meta"):
        assert layout_for(spec.model.build()).name == "torchtitan_decoder"


# --- TP communication: the Megatron minimum --------------------------------------------------------------


def titan_tp_collectives() -> dict:
    from test_tensor_parallel import _CollectiveLog

    schedule, parts, first, last = _build("llama3", pp=1, tp=2)
    ids, labels, positions = _batch()
    with _CollectiveLog() as log:
        schedule.step(ids, target=labels)
    return dict(log.calls)


def test_torchtitan_tp_all_reduces_two_forward_two_backward_per_block_and_microbatch(world):
    m, rows = ROWS // MBS, MBS
    hidden = (rows, SEQ, DIM)
    for calls in world(2).run(titan_tp_collectives):
        assert calls == {
            ("fwd", "all_reduce", hidden): 2 * LAYERS * m,  # attention out (wo) and MLP down (w2)
            ("bwd", "all_reduce", hidden): (2 * LAYERS + 1) * m,  # attention and MLP input grads; the head's
            ("fwd", "all_gather_into_tensor", (rows, SEQ, VOCAB // 2)): m,  # gathered logits
        }, calls


def test_context_parallel_degree_maps_to_parallel_cp(monkeypatch):
    """torchtitan's context_parallel_degree is pp_tp's parallel.cp; data parallel takes what pp x cp x tp leave."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    p, t = _sections(pp=2, context_parallel_degree=2)
    pcfg = parallel_config(dataclasses.replace(p, data_parallel_shard_degree=-1), t)
    assert (pcfg.pp, pcfg.cp, pcfg.tp, pcfg.dp_shard, pcfg.world_size) == (2, 2, 1, 2, 8)
    plain = parallel_config(dataclasses.replace(_sections(pp=2)[0], data_parallel_shard_degree=-1), t)
    assert (plain.cp, plain.dp_shard) == (1, 4)
