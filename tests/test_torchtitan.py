"""pp_tp inside the real torchtitan 0.3.0 on CPU/gloo: its llama3 (fused qkv) and qwen3 (q/k norms) models,
shrunk, through `pipelining_fn` with the Trainer's exact keywords, `to_empty()` + `init_weights()` as the
Trainer does, one step with the Trainer's microbatch lists, per-document `positions` and
`global_valid_tokens`: loss and every full gradient equal torchtitan's own non-PP model on the same weights.

CPU notes: FlexAttention has no backward on CPU in torch 2.13 and torchtitan refuses `attn_backend="sdpa"`
for language models, so the layer configs get torchtitan's ScaledDotProductAttention (causal), as its
own graph-trainer tests do (tests/titan_utils.py builds them).
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torchtitan")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from titan_utils import (  # noqa: E402
    CONFIGS,
    DIM,
    LAYERS,
    MBS,
    ROWS,
    SEQ,
    VOCAB,
    _batch,
    _build,
    _sections,
    _union_of_weights,
    llama3_config,
)  # fmt: skip
from torchtitan.config import CompileConfig  # noqa: E402

from pp_tp.base.tensors import full_tensor  # noqa: E402
from pp_tp.errors import ConfigError  # noqa: E402
from pp_tp.integrations.torchtitan import model_spec, parallel_config, pipelining_fn  # noqa: E402
from pp_tp.integrations.torchtitan_parts import PipelineSchedule  # noqa: E402
from pp_tp.layout import layout_for  # noqa: E402
from pp_tp.parallel.mesh import dp_rank  # noqa: E402


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
