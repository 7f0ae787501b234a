"""FSDP2 around pipeline stages: the reshard policy table, and parity with the non-PP build (loss, full gradients,
params after 3 AdamW steps with gradient clipping) over reshard policies, HSDP, FSDP x TP, bf16 mixed precision,
activation checkpointing and compile, and gradient reduction every k microbatches.
"""

from __future__ import annotations

from dataclasses import replace

import parity_utils as pu
import pytest
import torch
from one_trip import run_cases

from pp_tp.config import ConfigError, ParallelConfig
from pp_tp.config.fsdp_policy import FsdpPolicy, uses_fsdp

# Below the TINY model's gradient norm (about 1.1-1.4 here), so clipping really scales every step.
MAX_NORM = 0.1
ARGS2 = replace(pu.TINY, n_layers=2)


# --- single process: the policy table --------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, expected, gathered",
    [
        (dict(pp=2, fsdp_reshard_after_forward="default"), False, True),
        (dict(pp=1, fsdp_reshard_after_forward="default"), None, False),
        (dict(pp=2, fsdp_reshard_after_forward="always"), True, False),
        (dict(pp=1, fsdp_reshard_after_forward="never"), False, True),
        (dict(pp=2, fsdp_reshard_after_forward=2), 2, False),
    ],
)
def test_reshard_policy(kw, expected, gathered):
    policy = FsdpPolicy.for_rank(ParallelConfig(dp_shard=4, **kw), 0)
    assert repr(policy.reshard_after_forward) == repr(expected)  # None, True/False and 2 kept apart
    assert policy.keeps_params_gathered is gathered
    assert policy.reshards_params is not gathered


@pytest.mark.parametrize(
    "kw, every",
    [
        (dict(fsdp_grad_reduce="step"), None),
        (dict(fsdp_grad_reduce="microbatch"), 1),
        (dict(fsdp_grad_reduce=2), 2),
        (dict(fsdp_grad_reduce=4), None),  # k >= m: once per step
        (dict(fsdp_grad_reduce=2, dp_shard=1, mixed_precision="fp32"), None),  # no FSDP
    ],
)
def test_grad_reduce_policy(kw, every):
    policy = FsdpPolicy.for_rank(ParallelConfig(**{"dp_shard": 2, "microbatches": 4, **kw}), 0)
    assert policy.grad_reduce_every == every


def test_policy_per_pp_rank_and_auto_refused():
    pcfg = ParallelConfig(pp=2, dp_shard=2, microbatches=4, fsdp_reshard_after_forward=["always", "default"])
    assert [FsdpPolicy.for_rank(pcfg, r).reshard_after_forward for r in (0, 1)] == [True, False]
    with pytest.raises(ConfigError, match="resolved by the planner"):
        FsdpPolicy.for_rank(replace(pcfg, fsdp_grad_reduce="auto"), 0)


def test_fsdp_is_used_for_dp_or_bf16_only():
    assert uses_fsdp(ParallelConfig(dp_shard=2, mixed_precision="fp32"))
    assert uses_fsdp(ParallelConfig(dp_shard=1, mixed_precision="bf16"))
    assert not uses_fsdp(ParallelConfig(dp_shard=1, tp=2, mixed_precision="fp32"))


# --- parity ----------------------------------------------------------------------------------------


def parity_case(configs: list[dict], args=pu.TINY, batch_size: int = 8, backend: str | None = None) -> list[dict]:
    """compare() for each config, clipping every step; `backend` compiles with that torch.compile backend."""
    graphs = torch._dynamo.utils.counters["stats"]
    out = []
    for kw in configs:
        before = graphs["unique_graphs"]
        kw = {**kw, "compile_backend": backend} if backend else kw
        r = pu.compare(pu.pcfg_of(**kw), args, steps=2, batch_size=batch_size, max_norm=MAX_NORM)
        r["graphs"] = graphs["unique_graphs"] - before
        out.append(r)
    return out


def _assert_all(results: list[list[dict]]) -> None:
    for per_config in zip(*results):
        pu.assert_parity(list(per_config))
        assert all(n > MAX_NORM for r in per_config for n in r["ref_norms"]), "clipping must be active"


PP2_DP2 = [
    dict(pp=2, dp_shard=2, schedule="1F1B", microbatches=2),
    dict(pp=2, dp_shard=2, schedule="Interleaved1F1B", stages_per_rank=2, microbatches=2),
    dict(pp=2, dp_shard=2, schedule="ZBVZeroBubble", stages_per_rank=2, microbatches=4),
    # Policies that re-gather parameters, and HSDP without pp: the numbers must not move.
    dict(
        pp=2,
        dp_shard=2,
        schedule="Interleaved1F1B",
        stages_per_rank=2,
        microbatches=2,
        fsdp_reshard_after_forward="always",
    ),
    dict(pp=1, dp_shard=4, schedule="GPipe", microbatches=2, fsdp_reshard_after_forward=2),
    dict(pp=1, dp_replicate=2, dp_shard=2, schedule="1F1B", microbatches=2),
]


# FSDP over dp = 2, and over a one-rank dp mesh next to TP (bf16 alone switches FSDP on for its casts).
BF16 = [
    dict(pp=2, dp_shard=2, schedule="1F1B", microbatches=2, mixed_precision="bf16"),
    dict(pp=2, tp=2, schedule="Interleaved1F1B", stages_per_rank=2, microbatches=2, mixed_precision="bf16"),
]
COMPILED = [dict(pp=2, dp_shard=2, schedule="1F1B", microbatches=2, activation_checkpoint="full", compile=True)]
SELECTIVE = [
    dict(
        pp=2, dp_shard=2, schedule="ZBVZeroBubble", stages_per_rank=2, microbatches=4, activation_checkpoint="selective"
    )
]


@pytest.fixture(scope="module")
def four_ranks(world) -> dict[str, list]:
    """Every 4-rank parity case of this file in one round trip (tests/one_trip.py)."""
    return run_cases(
        world(4),
        [
            ("pp2_dp2", parity_case, (PP2_DP2,)),
            ("bf16", parity_case, (BF16,)),
            # aot_eager: inductor builds here but takes minutes per block on 2 shared cores; the product default stays.
            ("compiled", parity_case, (COMPILED, ARGS2, 8, "aot_eager")),
            ("selective", parity_case, (SELECTIVE,)),
            ("grad_reduce", parity_case, (GRAD_REDUCE,)),
        ],
    )


def test_parity_pp2_dp2_every_schedule_class_and_policy(four_ranks):
    _assert_all(four_ranks["pp2_dp2"])


def test_parity_bf16_mixed_precision(four_ranks):
    results = four_ranks["bf16"]
    _assert_all(results)  # judged with the floor of bf16 roundoff
    # bf16 really ran: fp32 parity is ~1e-7, bf16 compute is off by far more.
    assert all(r["grad_err"] > 1e-4 for per_rank in results for r in per_rank)


def test_parity_activation_checkpoint_and_compile(four_ranks):
    results = four_ranks["compiled"]
    _assert_all(results)
    assert all(r[0]["graphs"] > 0 for r in results), "torch.compile must have captured the blocks"
    _assert_all(four_ranks["selective"])


# pp2 x tp2 x dp_shard2 on 1F1B, InterleavedZeroBubble and DualPipeV: tests/test_schedules.py's FULL layout.
WORLD8 = [
    dict(pp=2, tp=2, dp_shard=2, schedule="ZBVZeroBubble", stages_per_rank=2, microbatches=4),
    dict(pp=2, dp_replicate=2, dp_shard=2, schedule="Interleaved1F1B", stages_per_rank=2, microbatches=2),
]


def test_parity_fsdp_x_tp_and_hsdp_with_pp(world):
    _assert_all(world(8).run(parity_case, WORLD8, batch_size=16))


# --- gradient reduction every k microbatches (parallel.fsdp_grad_reduce) --------------------------


GRAD_REDUCE = [
    dict(pp=2, dp_shard=2, schedule="1F1B", microbatches=4, fsdp_grad_reduce="microbatch"),
    dict(pp=2, dp_shard=2, schedule="GPipe", microbatches=4, fsdp_grad_reduce=3, fsdp_reshard_after_forward="always"),
    dict(
        pp=2,
        dp_shard=2,
        schedule="Interleaved1F1B",
        stages_per_rank=2,
        microbatches=4,
        fsdp_grad_reduce=2,
        fsdp_reshard_after_forward="always",
    ),
    dict(pp=2, dp_shard=2, schedule="ZBVZeroBubble", stages_per_rank=2, microbatches=4, fsdp_grad_reduce="microbatch"),
    dict(pp=1, dp_shard=4, schedule="GPipe", microbatches=2, fsdp_reshard_after_forward=2, fsdp_grad_reduce=1),
    dict(pp=1, dp_replicate=2, dp_shard=2, schedule="1F1B", microbatches=2, fsdp_grad_reduce=1),
]


def test_parity_grad_reduce_every_k_microbatches(four_ranks):
    _assert_all(four_ranks["grad_reduce"])
