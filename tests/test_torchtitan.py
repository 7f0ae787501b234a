"""pp_tp inside the real torchtitan 0.3.0 on CPU/gloo: its llama3 (fused qkv) and qwen3 (q/k norms) models,
shrunk, through `pipelining_fn` with the Trainer's exact keywords, `to_empty()` + `init_weights()` as the
Trainer does, one step with the Trainer's microbatch lists, per-document `positions` and
`global_valid_tokens`: loss and every full gradient equal torchtitan's own non-PP model on the same weights.

CPU notes: FlexAttention has no backward on CPU in torch 2.13 and torchtitan refuses `attn_backend="sdpa"`
for language models, so the layer configs get torchtitan's ScaledDotProductAttention (causal), as its
own graph-trainer tests do.
"""

from __future__ import annotations

from functools import partial

import pytest

pytest.importorskip("torchtitan")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.models.common import Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.rope import ComplexRoPE  # noqa: E402

from pp_tp.integrations.torchtitan import pipelining_fn  # noqa: E402
from pp_tp.tensor_utils import full_tensor  # noqa: E402

VOCAB, DIM, LAYERS, SEQ, ROWS, MBS = 128, 64, 4, 16, 8, 2


def _sdpa(layers: list) -> list:
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def llama3_config(tied: bool = False, fused: bool = True):
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
        vocab_size=VOCAB,
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init={"weight": torch.nn.init.normal_}
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_sdpa(layers),
    )


def qwen3_config():
    """torchtitan's qwen3 dense model, shrunk and untied: head_dim 32 != dim / n_heads, per-head q/k norms."""
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _qwen3_norm

    rope = CosSinRoPE.Config(dim=32, max_seq_len=32, theta=1000000.0)
    layers = _build_qwen3_layers(
        n_layers=LAYERS, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=128, rope=rope, attn_backend="flex"
    )
    return Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init={"weight": torch.nn.init.normal_}
        ),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init={"weight": partial(torch.nn.init.normal_, std=0.02)}
        ),
        layers=_sdpa(layers),
    )


CONFIGS = {"llama3": llama3_config, "qwen3": qwen3_config, "llama3_qkv": lambda: llama3_config(fused=False)}


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


def _sections(pp: int, tp: int = 1, dp_shard: int = 1) -> tuple[ParallelismConfig, TrainingConfig]:
    par = ParallelismConfig(
        pipeline_parallel_degree=pp,
        tensor_parallel_degree=tp,
        data_parallel_shard_degree=dp_shard,
        pipeline_parallel_microbatch_size=MBS,
        enable_sequence_parallel=False,
    )
    train = TrainingConfig(local_batch_size=ROWS // dp_shard, seq_len=SEQ, mixed_precision_param="float32")
    return par, train


def _build(name: str, pp: int, tp: int = 1, dp_shard: int = 1):
    par, train = _sections(pp, tp, dp_shard)
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
        for k, p in model.named_parameters():
            p.copy_(weights[k])
    pred = model(ids, positions=positions)
    loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=-100)
    loss = loss / (labels != -100).sum()
    loss.backward()
    with torch.no_grad():  # what dropping `positions` would compute instead
        dropped = float((model(ids) - pred).abs().max())
    return {"loss": loss.item(), "grads": {k: p.grad for k, p in model.named_parameters()}, "dropped": dropped}


def titan_case(name: str, pp: int, tp: int = 1, dp_shard: int = 1) -> dict:
    schedule, parts, first, last = _build(name, pp, tp, dp_shard)
    ids, labels, positions = _batch()
    weights = _union_of_weights(parts)
    dp_rank = schedule.pipe.mesh["dp_shard"].get_local_rank()
    rows = slice(dp_rank * ROWS // dp_shard, (dp_rank + 1) * ROWS // dp_shard)
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
