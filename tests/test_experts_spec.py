"""A family's experts are one record (`ExpertsSpec`, `ModelLayout.experts_spec`): every MoE layout declares the
values its config says, and a family whose experts are named and stored unlike transformers' (the expert on dim 1,
its own weight names, its own count attribute) runs expert parallel exactly with nothing but its record: at
pp2 x ep2 and at pp2 x tp2 (TP of experts), judged in lockstep against the plain model (pp_tp/parity/lockstep.py).
"""

from __future__ import annotations

import copy
import dataclasses

import parity_utils as pu
import pytest
import torch
import torch.nn.functional as F
import transformers
from test_hf_families import make
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import pp_tp
from pp_tp.extend import ExpertsSpec, PackedSwiGLU, register_layout
from pp_tp.layout import layout_for
from pp_tp.models.reference import REFERENCE, Transformer
from pp_tp.models.reference.moe import MoE
from pp_tp.parity import PipelineRun, ReferenceRun, lockstep

MOE = dataclasses.replace(pu.TINY, n_experts=4, top_k=2, n_shared_experts=1, moe_ffn_dim=16, moe_every=2)


# --- (a) every MoE layout's record holds what its config says -------------------------------------------------


def test_reference_record():
    spec = layout_for(pu.make_model(MOE, device="meta")).experts_spec
    assert spec == ExpertsSpec(
        modules=("feed_forward.experts",), n_experts=4, top_k=2, tp=True,
        routers=("feed_forward.gate",), bias=("feed_forward.gate.expert_bias",),
    )  # fmt: skip
    sigmoid = dataclasses.replace(MOE, router="sigmoid", top_k=3, n_experts=6)
    spec = layout_for(pu.make_model(sigmoid, device="meta")).experts_spec
    assert (spec.n_experts, spec.top_k, spec.routers) == (6, 3, ())
    assert layout_for(pu.make_model(device="meta")).experts_spec is None


@pytest.mark.parametrize(
    "name, modules, routers, bias",
    [
        ("mixtral_moe", ("mlp.experts",), ("mlp.gate",), ()),
        ("qwen3_moe", ("mlp.experts",), ("mlp.gate",), ()),
        ("deepseek_v3", ("mlp.experts",), (), ("mlp.gate.e_score_correction_bias",)),  # sigmoid router: no aux loss
    ],
)
def test_hf_records(name, modules, routers, bias):
    model = make(name, "meta")
    spec, c = layout_for(model).experts_spec, model.config
    count = getattr(c, "num_local_experts", None) or getattr(c, "n_routed_experts", None) or c.num_experts
    assert (spec.modules, spec.n_experts, spec.top_k) == (modules, count, c.num_experts_per_tok)
    assert (spec.routers, spec.bias, spec.grouped, spec.expert_dim) == (routers, bias, False, 0)
    assert spec.weights == PackedSwiGLU() and spec.count_attr == "num_experts"


def test_gpt_oss_record_says_how_its_experts_are_stored():
    spec = layout_for(make("gpt_oss", "meta")).experts_spec
    assert spec.weights == PackedSwiGLU(
        gate_up_dim=2, down_dim=1, concatenated=False, gate_up_bias="gate_up_proj_bias", down_bias="down_proj_bias"
    )


def test_llama4_record_is_proven_by_probes():
    """Llama 4 declares its experts only in its TP plan (`moe_tp_experts`), stores gate/up as [E, D, 2F] without
    transformers' storage attributes and calls them densely (every token, rows in equal blocks per expert): the
    probes on a small CPU copy prove the dense convention and the transposed, concatenated packing, so TP of its
    experts follows its declared (`packed_rowwise` / `colwise`) rules."""
    spec = layout_for(make("llama4_text", "meta")).experts_spec
    assert (spec.modules, spec.n_experts, spec.top_k) == (("feed_forward.experts",), 4, 1)
    assert spec.dense and not spec.grouped
    assert spec.weights == PackedSwiGLU(gate_up_dim=2, down_dim=1) and spec.tp
    assert spec.routers == ()  # a sigmoid of the top-k logits: no softmax router for the auxiliary loss
    rows = torch.zeros(4 * 3, 5)
    rows[[0, 1, 4, 11]] = 1.0  # expert 0: two routed rows, expert 1: one, expert 2: none, expert 3: one
    assert spec.routing_counts((rows,)).tolist() == [2, 1, 0, 1]


def test_non_gated_experts_record_and_a_storage_no_split_keeps():
    """Nemotron-H's experts are not gated (up_proj [E, F, D] -> relu2 -> down_proj [E, D, F]) and declare
    `colwise` / `rowwise` on them: TP of experts splits up_proj by contiguous shards of F, down_proj on F. Inkling
    declares plain `colwise` on a concatenated [gate; up]: a contiguous split would hand one rank every gate row,
    not what its forward computes, so tp > 1 stays refused in one line naming the parts."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from pp_tp.models.hf.experts import experts_spec
    from pp_tp.models.hf.small import small_config
    from pp_tp.models.hf.tp_plan import block_tp_plan

    def record_and_refusal(model_type: str) -> tuple[ExpertsSpec, str | None]:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(small_config(CONFIG_MAPPING[model_type]()))
        blocks = list(model.model.layers)
        return experts_spec(model, "layers", blocks), block_tp_plan(model, "layers", blocks)[1]

    spec, refusal = record_and_refusal("nemotron_h")
    assert spec.weights == PackedSwiGLU(gate_up="up_proj", concatenated=False) and spec.tp and refusal is None
    spec, refusal = record_and_refusal("inkling_text")
    assert not spec.tp
    assert "'moe_tp_experts' with parts {'gate_up_proj': 'colwise', 'down_proj': 'rowwise'}" in refusal
    assert "\n" not in refusal


def test_torchtitan_record():
    pytest.importorskip("torchtitan")
    from titan_utils import EXPERTS, deepseek_v3_config

    with torch.device("meta"):
        model = deepseek_v3_config().build()
    spec = layout_for(model).experts_spec
    assert spec == ExpertsSpec(
        modules=("moe.routed_experts.inner_experts",), n_experts=EXPERTS, top_k=2, grouped=True, weights=None,
        bias=("moe.expert_bias_E",),
    )  # fmt: skip


# --- (b) a family whose experts are stored otherwise, declared by its record alone -------------------------------


class ToyExperts(nn.Module):
    """SwiGLU experts stored unlike transformers': `w_in` [dim, E, 2 * hidden] (gate then up) and `w_out`
    [hidden, E, dim], the expert on dim 1; the forward loops over `self.count` experts, ids outside ignored."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.count = n_experts
        self.w_in = nn.Parameter(torch.empty(dim, n_experts, 2 * hidden))
        self.w_out = nn.Parameter(torch.empty(hidden, n_experts, dim))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(self.count):
            token, slot = torch.nonzero(top_k_index == e, as_tuple=True)
            gate, up = (hidden[token] @ self.w_in[:, e]).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.w_out[:, e]
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class ToyMoE(Transformer):
    """The reference Transformer with ToyExperts in its MoE layers."""

    def __init__(self, args):
        super().__init__(args)
        for block in self.layers.values():
            if isinstance(block.feed_forward, MoE):
                block.feed_forward.experts = ToyExperts(args.n_experts, args.dim, args.expert_dim)


def _toy_layout(model: ToyMoE):
    layout = REFERENCE.specialize(model)
    weights = PackedSwiGLU(gate_up="w_in", down="w_out", gate_up_dim=2, down_dim=0)
    spec = dataclasses.replace(layout.experts_spec, expert_dim=1, weights=weights, count_attr="count")
    return dataclasses.replace(layout, name="toy_moe", experts_spec=spec)


register_layout(dataclasses.replace(REFERENCE, name="toy_moe", matches=lambda m: isinstance(m, ToyMoE),
                                    specialize=_toy_layout))  # fmt: skip


def _toy(device: str) -> ToyMoE:
    with torch.device(device):
        return ToyMoE(MOE)


def _toy_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    model = _toy("cpu")
    state = pu.seeded({k: p.shape for k, p in model.named_parameters()}, gen, 0.05)
    state.update({k: torch.randn(b.shape, generator=gen) * 0.05 for k, b in pu.persistent_buffers(model).items()})
    return state


def _placement(p: torch.Tensor, dim: str):
    """How `p` is split over the mesh dim `dim` (None: not a DTensor over it)."""
    names = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
    return p.placements[names.index(dim)] if dim in names else None


def toy_case(kw: dict) -> dict:
    pcfg = pu.pcfg_of(pp=2, schedule="1F1B", microbatches=2, **kw)
    state = _toy_state()
    ref_model = _toy("cpu")
    ref_model.load_state_dict(state, strict=False)
    pipe = pp_tp.build_pipeline(_toy("meta"), pp_tp.build_mesh(pcfg), pcfg, state_dict=copy.deepcopy(state))
    run, ref = PipelineRun(pipe, pu.adamw()), ReferenceRun(ref_model, pu.adamw())
    ids, labels = pu.batch(MOE, 8, 16)
    result = pu.summary(list(lockstep(run, ref, [(ids, labels)] * 2)))
    experts = [m for part in pipe.model_parts for m in part.modules() if isinstance(m, ToyExperts)]
    dim, want = ("ep", Shard(1)) if pcfg.ep > 1 else ("tp", Shard(0))  # w_out: experts on dim 1, hidden on dim 0
    split = [_placement(m.w_out, dim) == want and m.count == 4 // pcfg.ep for m in experts]
    result["split"] = bool(split) and all(split)
    result["counted"] = sum(int(c.sum()) for c in pipe.moe_stats["tokens_per_expert"].values())
    return result


def toy_cases() -> list[dict]:
    return [toy_case(kw) for kw in (dict(dp_shard=2, ep=2), dict(tp=2))]


def test_toy_family_runs_expert_parallel_and_tp_of_experts_from_its_record(world):
    for rank in world(4).run(toy_cases):
        for kw, r in zip(("ep2", "tp2"), rank):
            pu.assert_passes(r, kw)
            assert r["split"], (kw, r)
            assert r["counted"] == 8 * 16 * 2, (kw, r)  # every token's top-2 slots, one MoE layer per pp rank


# --- (c) experts found by structure, and stored so that no split keeps an expert together -------------------------


def test_grouped_probe_proves_jetmoe_experts_and_rejects_a_mixing_forward():
    """JetMoE's ParallelExperts (declared nowhere) take (rows sorted by expert, rows per expert as a list): the
    probe proves row group e runs through expert e's weights alone; a forward that reads one expert's weights for
    every group fails it. Routing counts read the list form."""
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeParallelExperts

    from pp_tp.models.hf.experts import _groups_per_expert

    torch.manual_seed(0)
    experts = JetMoeParallelExperts(4, 8, 6)
    nn.init.normal_(experts.weight)
    rows, counts = torch.randn(10, 8), [1, 2, 3, 4]
    with torch.no_grad():
        assert _groups_per_expert(experts, rows, counts)

    class Mixing(JetMoeParallelExperts):
        def forward(self, inputs, expert_size):
            return F.linear(inputs, self.weight[0])

    mixing = Mixing(4, 8, 6)
    mixing.weight.data.copy_(experts.weight.data)
    with torch.no_grad():
        assert not _groups_per_expert(mixing, rows, counts)
    spec = ExpertsSpec(modules=("mlp.input_linear",), n_experts=4, top_k=2, grouped=True, weights=None)
    assert spec.routing_counts((rows, counts)).tolist() == counts


def test_longcat_identity_experts_refused_naming_the_unequal_counts():
    """LongCat-Flash's gate/up holds rows for its identity experts too and its down only the routed ones: refused
    in one line saying which parameter holds how many."""
    from transformers import AutoConfig
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

    from pp_tp.errors import ConfigError
    from pp_tp.parallel.experts import _check_module

    config = AutoConfig.for_model("longcat_flash", n_routed_experts=4, zero_expert_num=2, hidden_size=8)
    config.expert_ffn_hidden_size = 4
    with torch.device("meta"):
        experts = LongcatFlashExperts(config)
    spec = ExpertsSpec(modules=("mlp.experts",), n_experts=6, top_k=2)
    with pytest.raises(ConfigError, match=r"gate_up_proj holds 6 experts on dim 0 and down_proj 4 \(the 2 more") as e:
        _check_module("model.layers.0.mlp.experts", experts, spec)
    assert "\n" not in str(e.value)
