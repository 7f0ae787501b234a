"""torchtitan 0.3.0's models shrunk for CPU/gloo (llama3, qwen3, qwen3 MoE, deepseek_v3), built through pp_tp's
`pipelining_fn` as torchtitan's Trainer builds them, and a batch with per-document positions: shared by
tests/test_torchtitan.py, test_torchtitan_moe.py, test_torchtitan_trainer.py and test_experts_spec.py.

CPU notes: FlexAttention has no backward on CPU in torch 2.13 and torchtitan refuses `attn_backend="sdpa"`
for language models, so the layer configs get torchtitan's ScaledDotProductAttention (causal), as its
own graph-trainer tests do.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.models.common import Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.rope import ComplexRoPE

from pp_tp.base.tensors import full_tensor
from pp_tp.integrations.torchtitan import pipelining_fn

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
