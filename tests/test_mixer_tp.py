"""Head-split TP of linear-attention and Mamba2 mixers (TP styles 'gated_delta_net' and 'mamba2',
pp_tp/parallel/mixer_tp.py) against the whole module: transformers' own Qwen3-Next and Qwen3.5 gated delta nets and
Mamba2 / NemotronH Mamba2 mixers (torch paths, fp32), split by key heads (groups) at tp2, give the whole module's
output, input gradient and every parameter's full gradient (<= 1e-5 rel), with one all-reduce in forward and one in
backward; the shared and unequal-part parameters are held whole and their Partial gradients summed once per step.
A head (group) count tp does not divide is refused in one line, on every rank, before any collective.

One 2-rank gloo world runs every case (process start is the costly part).
"""

from __future__ import annotations

import copy

import pytest
import torch
from parity_utils import flat_mesh
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.parallel.mixer_tp import GATED_DELTA_NET, plan_head_split

GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8)  # key_dim 16 != value_dim 24
# (transformers family, config keys, TP style). key_dim != value_dim is the usual case (conv and Qwen3.5's q|k|v rows
# held whole, read by rows); equal, Qwen3.5's q|k|v is split per part. Mamba2 mixers with biases everywhere.
CASES = [
    ("qwen3_next", GDN, "gated_delta_net"),
    ("qwen3_5", GDN, "gated_delta_net"),
    ("qwen3_5", {**GDN, "linear_key_head_dim": 12}, "gated_delta_net"),
    ("mamba2", dict(num_heads=8, head_dim=8, n_groups=2, use_bias=True), "mamba2"),
    ("nemotron_h", dict(mamba_num_heads=8, mamba_head_dim=8, n_groups=2), "mamba2"),
]


def _mixer(family: str, keys: dict) -> nn.Module:
    """A tiny transformers mixer, seeded alike on every rank (fp32; the torch conv, delta-rule and scan paths)."""
    from transformers import Mamba2Config, NemotronHConfig, Qwen3_5TextConfig, Qwen3NextConfig
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    gdn = dict(linear_value_head_dim=6, linear_conv_kernel_dim=4, layer_types=["linear_attention"])
    mamba = dict(expand=2, conv_kernel=4, chunk_size=8)
    config, mixer, common = {
        "qwen3_next": (Qwen3NextConfig, Qwen3NextGatedDeltaNet, gdn),
        "qwen3_5": (Qwen3_5TextConfig, Qwen3_5GatedDeltaNet, gdn),
        "mamba2": (Mamba2Config, Mamba2Mixer, {**mamba, "state_size": 4}),
        "nemotron_h": (NemotronHConfig, NemotronHMamba2Mixer, {**mamba, "ssm_state_size": 4}),
    }[family]
    torch.manual_seed(0)
    module = mixer(config(hidden_size=32, num_hidden_layers=1, **common, **keys), 0)
    with torch.no_grad():  # transformers' init leaves norms at ones, biases at zero: make every gradient count
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _split_vs_whole(family: str, keys: dict, style: str) -> dict:
    """On every rank: the whole mixer and its tp2 head split on the same input and output gradient."""
    from torch.distributed.tensor.parallel import parallelize_module

    from pp_tp.diagnostics.comm_ledger import CommLedger
    from pp_tp.parallel.tensor_parallel import reduce_partial_grads
    from pp_tp.parallel.tp_styles import TP_STYLES

    whole = _mixer(family, keys)
    split = copy.deepcopy(whole)
    mesh = flat_mesh(2)
    torch.manual_seed(1)
    x, dy = torch.randn(2, 10, 32), torch.randn(2, 10, 32)
    x_whole, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_whole = whole(x_whole)
    y_whole.backward(dy)
    # Each phase in a ledger of its own: the style's setup, forward, backward, the once-per-step partial sums.
    with CommLedger() as setup:
        parallelize_module(split, mesh, TP_STYLES[style].factory(), src_data_rank=None)
    with CommLedger() as forward:
        y = split(x_split)
    with CommLedger() as backward:
        y.backward(dy)
    partial = sum(any(pl.is_partial() for pl in p.grad.placements) for p in split.parameters())
    with CommLedger() as per_step:
        reduce_partial_grads([split])
    grads = {n: p.grad.full_tensor() for n, p in split.named_parameters()}
    return {
        "placements": {n: type(p.placements[0]).__name__ for n, p in split.named_parameters()},
        "counts": [led.counts() for led in (setup, forward, backward, per_step)],
        "partial": partial,
        "rel": {
            "output": _rel(y, y_whole),
            "input grad": _rel(x_split.grad, x_whole.grad),
            **{n: _rel(grads[n], p.grad) for n, p in whole.named_parameters()},
        },
    }


def _refusal(family: str, keys: dict, style: str) -> dict:
    """On every rank: a head count tp2 does not divide, refused while applying (no collective issued)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from pp_tp.diagnostics.comm_ledger import CommLedger
    from pp_tp.parallel.tp_styles import TP_STYLES

    mixer = _mixer(family, keys)
    mesh = flat_mesh(2)
    with CommLedger() as led:
        try:
            parallelize_module(mixer, mesh, TP_STYLES[style].factory(), src_data_rank=None)
        except ConfigError as e:
            return {"error": str(e), "events": len(led.events)}
    return {"error": None, "events": len(led.events)}


REFUSALS = [
    ("qwen3_5", dict(linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=8), "gated_delta_net"),
    ("mamba2", dict(num_heads=8, head_dim=8, n_groups=1), "mamba2"),
]


def _all_cases() -> dict:
    return {"cases": [_split_vs_whole(*c) for c in CASES], "refusals": [_refusal(*c) for c in REFUSALS]}


def test_mixer_head_split_equals_the_whole_mixer(world):
    per_rank = world(2).run(_all_cases)
    for rank in per_rank:
        for (family, keys, _), case in zip(CASES, rank["cases"]):
            worst = max(case["rel"], key=case["rel"].get)
            assert case["rel"][worst] <= 1e-5, (family, keys, worst, case["rel"])
            # setup: none; forward: the output's all-reduce; backward: the input's; per step: one per Partial gradient.
            assert case["counts"] == [{}, {"all_reduce": 1}, {"all_reduce": 1}, {"all_reduce": case["partial"]}]
        next_, qwen35, equal, mamba2, nemotron = (c["placements"] for c in rank["cases"])
        assert next_["in_proj_qkvz.weight"] == next_["in_proj_ba.weight"] == next_["A_log"] == "Shard"
        assert next_["conv1d.weight"] == next_["norm.weight"] == "Replicate"
        assert qwen35["in_proj_qkv.weight"] == "Replicate" and qwen35["in_proj_z.weight"] == "Shard"
        assert equal["in_proj_qkv.weight"] == "_StridedShard" and equal["out_proj.weight"] == "Shard"
        assert mamba2["in_proj.weight"] == mamba2["out_proj.bias"] == "Replicate"
        assert mamba2["norm.weight"] == mamba2["D"] == mamba2["out_proj.weight"] == "Shard"
        assert nemotron == {n: p for n, p in mamba2.items() if n not in ("in_proj.bias", "out_proj.bias")}
        # Partial: conv, norm (GDN) / conv weight and bias, in_proj weight and bias (Mamba2); out bias is whole.
        assert [c["partial"] for c in rank["cases"]] == [2, 3, 2, 4, 3]
    for refusal in zip(*(r["refusals"] for r in per_rank)):
        assert refusal[0] == refusal[1] and refusal[0]["events"] == 0
    gdn, mamba2 = per_rank[0]["refusals"]
    assert gdn["error"] == (
        "Qwen3_5GatedDeltaNet.num_k_heads = 3 is not divisible by parallel.tp = 2 (TP style 'gated_delta_net' "
        "splits Qwen3_5GatedDeltaNet by num_k_heads); set parallel.tp to a divisor of 3"
    )
    assert mamba2["error"].startswith("Mamba2Mixer.n_groups = 1 is not divisible by parallel.tp = 2")


def test_unknown_parameter_and_layout_are_refused_in_one_line():
    mixer = _mixer("qwen3_next", GDN)
    mixer.extra = nn.Parameter(torch.zeros(4))
    with pytest.raises(ConfigError, match=r"^layers.0.linear_attn.extra: TP style 'gated_delta_net' does not know"):
        plan_head_split(mixer, GATED_DELTA_NET, 2, "layers.0.linear_attn")
    del mixer.extra
    mixer.num_v_heads = 2  # the module's weights no longer match the head counts it reads
    with pytest.raises(ConfigError, match=r"is not the head layout"):
        plan_head_split(mixer, GATED_DELTA_NET, 2, "layers.0.linear_attn")
