"""Zamba2: a transformer block shared by several hybrid layers, which its forward tells apart by the layer's index
(`layer_idx` picks each layer's adapters inside the shared block), and the embedding's output handed to every layer
(`original_hidden_states`). pp_tp hands each layer its global index, carries the first layer's input beside the hidden
state across stage boundaries (pp_tp/models/hf/carried.py), and keeps the shared block as a tied weight: each stage
using it holds a copy, their gradients summed over the stages that use it (pp_tp/stages/tied.py). Exact against the
model's own run (loss, every full gradient, parameters after each AdamW step; the float64 verdict), with the two
hybrid layers on different pp ranks (two steps) and on one rank's two stages (one step, sharing the references').
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers as T
from hf_utils import BASE, VOCAB, Family, assert_exact, run_families

from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.models.hf.carried import Carried


def _zamba2(mem_blocks: int, layers: int) -> T.Zamba2Config:
    """Mamba2 and hybrid layers alternating, the shared block's adapters on (each hybrid layer its own, chosen by
    `layer_idx`), rotary tables on; `mem_blocks` shared blocks cycled over the hybrid layers."""
    return T.Zamba2Config(
        **{**BASE, "num_hidden_layers": layers, "num_key_value_heads": 4},  # its adapters widen k and v to every head
        layers_block_type=["linear_attention", "hybrid"] * (layers // 2),
        n_mamba_heads=4,
        mamba_d_state=8,
        mamba_ngroups=2,
        chunk_size=8,
        num_mem_blocks=mem_blocks,
        use_shared_attention_adapter=True,
        adapter_rank=4,
        use_mem_rope=True,
    )


ZAMBA2 = Family(functools.partial(_zamba2, 1))  # both hybrid layers share one block: tied across stages
CASES = [
    ("zamba2", dict(pp=2, dp_shard=2, schedule="1F1B", microbatches=2)),  # layers 1 and 3 on different pp ranks
    ("zamba2", dict(pp=2, dp_replicate=2, schedule="Interleaved1F1B", microbatches=2, steps=1)),  # both on pp rank 1
]


def _run(cases: list[tuple[str, dict]]) -> list[dict]:
    return run_families([(ZAMBA2, kw) for _, kw in cases])


def test_zamba2_shared_blocks_are_exact(world):
    assert_exact(world(4).run(_run, CASES), CASES)


def test_each_layer_gets_its_index_and_the_first_layers_input():
    model = ZAMBA2.make("meta")
    layout = layout_for(model)
    assert layout.dims(model).streams == 2  # [B, S, 2, D]: the hidden state and the embedding's output
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    assert "model.layers.3.shared_transformer.self_attn.linear_q_adapter_list.1.0.weight" in tied
    seen = []
    carry = Carried(("layer_idx",), ("original_hidden_states",))
    call = carry.call(lambda block, h, extras, index, **kw: seen.append(kw) or h * 2)
    h = torch.randn(2, 3, 2, 4)
    out = call(model.model.layers[3], h, (), 3)
    assert seen[0]["layer_idx"] == 3 and torch.equal(seen[0]["original_hidden_states"], h[:, :, 1])
    assert torch.equal(out, torch.stack([h[:, :, 0] * 2, h[:, :, 1]], dim=2))


def test_zamba_whose_small_copy_transformers_cannot_build_is_refused_in_one_line():
    """Zamba (v1) ties every hybrid layer's block to the first one's by a pattern that transformers rejects when the
    model has one hybrid layer, which the 2-layer copy pp_tp traces has: one line, not transformers' traceback."""
    config = T.ZambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        n_mamba_heads=2, mamba_d_state=8, layers_block_type=["mamba", "hybrid"] * 2,
    )  # fmt: skip
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with pytest.raises(ConfigError, match=r"transformers cannot build its 2-layer copy \(ValueError") as e:
        layout_for(model)
    assert "\n" not in str(e.value)
