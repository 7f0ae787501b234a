"""Context parallel (`parallel.cp`): head-tail sequence chunks, K/V all-gathered over cp, exact against the plain model.

One 4-rank gloo world runs every multi-rank case (process start is the costly part): the reference model at
pp2 x cp2 with uneven padding and clipping, HF Llama at tp2 x cp2, a sliding-window Mistral at pp2 x cp2, Gemma 2's
softcapping and GPT-OSS's sinks at pp2 x cp2, a V schedule's split backward under full activation checkpointing,
HSDP with compiled blocks; each takes two AdamW steps and passes the float64 verdict on the loss, every full
gradient and the parameters (pp_tp/parity/lockstep.py). MoE with EP and balancing under cp:
tests/test_moe_balancing.py; packed documents: tests/test_document_mask.py. The refusals are one line each, before
any collective.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import parity_utils as pu
import pytest
import torch
from one_trip import run_cases

import pp_tp
from pp_tp.config import ParallelConfig, config_from_dict, resolve_parallel, validate
from pp_tp.errors import ConfigError
from pp_tp.parallel.fsdp import grad_factor

WORLD = 4
ARGS2 = dataclasses.replace(pu.TINY, n_layers=2)


SPLIT_BACKWARD = dict(pp=2, cp=2, microbatches=4, schedule="ZBVZeroBubble", activation_checkpoint="full")
# aot_eager: dynamo and AOTAutograd capture the blocks as inductor does (test_fsdp.py compiles the same way); inductor's
# own code generation cost 40-60 s here on 2 shared cores and proves nothing about cp. Two blocks: each compiled block
# costs its capture, and a second one proves no more.
HSDP_COMPILED = dict(pp=1, cp=2, dp_replicate=2, microbatches=2, compile=True, compile_backend="aot_eager")
KV = dict(pp=2, cp=2, microbatches=2)
SEQ = 24
CP_FAMILIES = [
    ("gemma2_softcap", dict(pp=2, cp=2, microbatches=2)),  # eager attention: logit softcapping, sliding windows
    ("gpt_oss", dict(pp=2, cp=2, microbatches=2)),  # eager attention with a sink logit per head; MoE experts
]


@pytest.fixture(scope="module")
def four_ranks(world) -> dict[str, list]:
    """Every multi-rank case of this file in the session's 4-rank world, in one round trip (tests/one_trip.py)."""
    import test_hf_families as hf

    cases = [
        ("chunks", _chunks, (0,)),
        ("blocks", _blocks_step, (SEQ,)),
        ("kv", _kv_ledger, (pu.pcfg_of(**KV),)),
        ("reference", _compare, (pu.pcfg_of(pp=2, cp=2, microbatches=2),)),
        ("hf_llama", _compare, (pu.pcfg_of(pp=1, tp=2, cp=2, microbatches=2), True)),
        ("mistral", _compare, (pu.pcfg_of(pp=2, cp=2, microbatches=2), False, _mistral)),
        ("families", hf.run_all, (CP_FAMILIES,)),
        ("split_backward", _compare, (pu.pcfg_of(**SPLIT_BACKWARD),)),
        ("hsdp_compiled", _compare, (pu.pcfg_of(**HSDP_COMPILED), False, None, 2, ARGS2)),
    ]
    return run_cases(world(WORLD), cases)


def _compare(pcfg: ParallelConfig, hf: bool = False, model=None, steps: int = 2, args=pu.TINY) -> dict:
    """Runs on every rank: the pipelined build against the plain one in lockstep, `steps` steps, clipped at 1.0."""
    if model is None:
        return pu.compare(pcfg, args, hf=hf, steps=steps, max_norm=1.0)
    state = {k: v.detach().clone() for k, v in model().state_dict().items()}
    ids, labels = pu.batch(pu.TINY, 8, 16)
    ref = pu.ReferenceRun(_loaded(model, state), pu.adamw(), 1.0)
    pipe = pu.pp_tp.build_pipeline(model(device="meta"), pp_tp.build_mesh(pcfg), pcfg, state_dict=copy.deepcopy(state))
    run = pu.PipelineRun(pipe, pu.adamw(), 1.0)
    result = pu.summary(list(pu.lockstep(run, ref, [(ids, labels)] * steps)))
    pp_rank = pipe.mesh["pp"].get_local_rank()
    return {**result, "names": sorted(run.keys), "all_names": sorted(ref.grads()), "pp_rank": pp_rank}


def _loaded(model, state: dict):
    m = model()
    m.load_state_dict(state)
    return m


def _mistral(device: str = "cpu"):
    """A tiny Mistral whose window (4) is shorter than the sequence (16): sliding-window layers under cp."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, sliding_window=4,
                        attn_implementation="sdpa")  # fmt: skip
    with torch.device(device):
        return MistralForCausalLM(cfg)


def _chunks(_: int) -> list:
    """Runs on every rank: which positions this cp rank holds and the mask it builds (pp2 x cp2, seq 8)."""
    mesh = pp_tp.build_mesh(pu.pcfg_of(pp=2, cp=2))
    from pp_tp.parallel.context_parallel import ContextParallel

    cp = ContextParallel(mesh)
    ids = torch.arange(8).expand(2, -1)
    positions = cp.local_positions(2, 8, torch.device("cpu"))[0].tolist()
    return [cp.shard(ids)[0].tolist(), positions, cp.mask(4, torch.device("cpu")).int().tolist()]


def test_head_tail_chunks_and_mask(four_ranks):
    out = four_ranks["chunks"]
    assert out[0][0] == [0, 1, 6, 7] and out[0][1] == [0, 1, 6, 7]  # cp rank 0: chunks 0 and 3
    assert out[1][0] == [2, 3, 4, 5]  # cp rank 1: chunks 1 and 2 (rank 1 of 4 is pp0, cp1)
    # rank 0's queries (0, 1, 6, 7) against keys in gathered order (0, 1, 6, 7, 2, 3, 4, 5)
    assert out[0][2] == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1, 1],
    ]


def test_reference_pp2_cp2_uneven_padding(four_ranks):
    """Rows padded unevenly (labels -100), two microbatches, clipping at 1.0: every cp rank counts its tokens."""
    pu.assert_parity(four_ranks["reference"])


def test_hf_llama_tp2_cp2(four_ranks):
    pu.assert_parity(four_ranks["hf_llama"])


def test_sliding_window_mistral_pp2_cp2(four_ranks):
    pu.assert_parity(four_ranks["mistral"])


def test_split_backward_with_recompute_and_hsdp_with_compile_under_cp(four_ranks):
    """The K/V all-gather's backward inside a split (input / weight) backward, recomputed by full activation
    checkpointing; and FSDP over (dp_replicate, dp_shard x cp) with compiled blocks."""
    pu.assert_parity(four_ranks["split_backward"])
    pu.assert_parity(four_ranks["hsdp_compiled"])


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(cp=2, ep=4, dp_shard=1), "parallel.ep = 4 with parallel.cp = 2: the EP group spans all cp ranks"),
        (dict(cp=4, ep=2, dp_shard=2), "so ep must be cp times a divisor of dp_shard; set parallel.ep to one of 4, 8"),
        (dict(cp=0), "parallel.cp"),
    ],
)
def test_parallel_rules_under_cp(kw, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        resolve_parallel(ParallelConfig(**{"dp_shard": 1, **kw}), ParallelConfig(**{"dp_shard": 1, **kw}).world_size)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "sections, message",
    [
        (dict(training={"seq_len": 30}), "training.seq_len = 30 is not divisible by 2 * parallel.cp = 4"),
        (dict(model={"kind": "vit"}, data={"source": "images"}), "is not a language model"),
    ],
)
def test_job_rules_under_cp(sections, message, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=re.escape(message)):  # config_from_dict validates
        validate(config_from_dict({"parallel": {"cp": 2, "dp_shard": 1}, **sections}), 2)


def test_cp_one_leaves_the_mesh_and_config_as_they_were():
    """cp = 1: dp_shard from the same product and the same FSDP factor as before; cp ranks leave dp_shard alone
    and join the factor."""
    p = resolve_parallel(ParallelConfig(pp=2, tp=2, dp_shard=-1, microbatches=2), 8)
    assert (p.cp, p.dp_shard, grad_factor(p)) == (1, 2, 2)
    p = resolve_parallel(ParallelConfig(pp=2, cp=2, dp_shard=-1, microbatches=2), 8)
    assert (p.dp_shard, grad_factor(p)) == (2, 4)


def _kv_ledger(pcfg: ParallelConfig) -> dict:
    """Runs on every rank: one step's collectives on the cp group (after a warm-up step) and the planner's bytes."""
    from pp_tp.diagnostics.comm_ledger import CommLedger
    from pp_tp.planner.context import kv_gather_bytes

    run = pu.pipeline(pcfg, pu.reference_state())
    pipe, (ids, labels) = run.pipe, pu.batch(pu.TINY, 8, 16)
    pipe.step(ids, labels)
    with CommLedger() as led:
        pipe.step(ids, labels)
    cp = pipe.mesh.get_group("cp").group_name
    on_cp = [(e.kind, e.nbytes) for e in led.events if e.group == cp and e.kind in ("all_gather", "all_reduce")]
    layers = sum(len(p.block_modules()) for p in pipe.model_parts)
    dims = pipe.model_parts[0].layout.dims(pu.make_model(device="meta"))
    return {"on_cp": on_cp, "layers": layers, "analytic": kv_gather_bytes(8 // pcfg.microbatches, 16, dims, pcfg)}


def test_kv_all_gather_bytes_equal_the_planners(four_ranks):
    """Per attention layer and microbatch: K and V each all-gathered once over cp, together the planner's
    kv_gather_bytes; their gradients summed back once each (an all-reduce on gloo) of the same size."""
    pcfg = pu.pcfg_of(**KV)
    for r in four_ranks["kv"]:
        per_step = 2 * r["layers"] * pcfg.microbatches  # K and V, per layer and microbatch
        gathers = [n for kind, n in r["on_cp"] if kind == "all_gather"]
        sums = [n for kind, n in r["on_cp"] if kind == "all_reduce" and n == r["analytic"] // 2]
        assert r["layers"] == 2 and len(gathers) == per_step and len(sums) == per_step, r
        assert sum(gathers) == r["layers"] * pcfg.microbatches * r["analytic"] == 2 * 2 * 8192, r


def test_softcapping_and_sink_families_under_cp(four_ranks):
    """Transformers' own eager attention functions (softcapping, sinks) on local queries against gathered keys."""
    import test_hf_families as hf

    hf.assert_exact(four_ranks["families"], CP_FAMILIES)


def _blocks_step(seq: int) -> dict:
    """Runs on every rank: one pp2 x cp2 step of the reference model under an aten op counter, with every tensor
    autograd saves recorded (shape) and every op's output shape."""
    from pp_tp.base._torch import TorchDispatchMode, storage_id, tree_flatten

    flash, fwd_masks, shapes = [0, 0], [], set()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
                flash[name.endswith("_backward")] += 1
                fwd_masks.append((kwargs or {}).get("attn_mask") is not None)
            shapes.update(tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            return out

    pcfg = pu.pcfg_of(pp=2, cp=2, microbatches=2)
    pipe = pu.pipeline(pcfg, pu.reference_state()).pipe
    ids, labels = pu.batch(pu.TINY, 4, seq)
    saved = set()
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.add(tuple(t.shape)) or t, lambda t: t)
    with Count(), hooks:
        pipe.step(ids, labels)
    cp = pipe.model_parts[0].context_parallel
    held = cp.held_bytes()  # before the documents' step, whose boolean mask is cached
    masks = []  # packed documents keep a mask: the tensors saved with its [S/cp, S] dims, kept alive to tell apart
    positions = torch.cat([torch.arange(10), torch.arange(seq - 10)]).expand(4, -1)  # two documents a row
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: masks.append(t) or t, lambda t: t)
    with hooks:
        pipe.step(ids, labels, positions)
    masks = [t for t in masks if _has_pair(tuple(t.shape), seq // 2, seq)]
    return {"flash": flash, "masked": any(fwd_masks), "saved": saved, "shapes": shapes, "cp_rank": cp.rank,
            "held": held, "layers": sum(len(p.block_modules()) for p in pipe.model_parts),
            "doc_masks": (len(masks), len({storage_id(t.untyped_storage()) for t in masks}),
                          {(t.dtype, t.shape[0]) for t in masks})}  # fmt: skip


def _has_pair(shape: tuple, a: int, b: int) -> bool:
    return any(shape[i : i + 2] == (a, b) for i in range(len(shape) - 1))


def test_causal_layers_run_fused_blocks_with_no_mask(four_ranks):
    """Plain causal attention under cp2 dispatches only the flash-for-CPU kernel, with no mask: per layer and
    microbatch, cp rank 0 one block for its head chunk and two (prefix, diagonal) for its tail, rank 1 two and two,
    as many backward calls; no [S/cp, S] tensor is saved or made by any op, none is cached. With packed documents
    the layers share one float mask per microbatch."""
    seq = SEQ
    for r in four_ranks["blocks"]:
        calls = r["layers"] * 2 * (3 if r["cp_rank"] == 0 else 4)  # 2 microbatches
        assert r["flash"] == [calls, calls] and not r["masked"] and r["held"] == 0, r["flash"]
        assert not [s for s in r["saved"] | r["shapes"] if _has_pair(s, seq // 2, seq)], r["saved"]
        assert (2, 2, seq, 8) in r["saved"]  # K and V gathered in sequence order: 2 rows, 2 KV heads, head dim 8
        # packed documents: every layer saves the mask, one float mask per microbatch shared by the rank's layers
        # (SDPA would have converted the boolean one in each layer)
        assert r["doc_masks"] == (r["layers"] * 2, 2, {(torch.float32, 2)}), r["doc_masks"]
