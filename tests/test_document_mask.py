"""`data.document_mask`: a packed batch through the pipeline (position ids restarting at every EOS, handed to every
stage) equals the plain model run on each document separately, summed over the same token normalization: loss,
every full gradient and the parameters after two AdamW steps, at pp2 x tp2 on the reference model and on a tied
Hugging Face family with a sliding window shorter than the documents."""

from __future__ import annotations

import dataclasses

import parity_utils as pu
import pytest
import torch
import torch.nn.functional as F
import transformers as T
from one_trip import run_cases

import pp_tp
from pp_tp.errors import ConfigError
from pp_tp.layout import check_document_mask
from pp_tp.models.reference.layout import REFERENCE
from pp_tp.models.reference.model import ModelArgs, Transformer
from pp_tp.parity import dp_share, lockstep
from pp_tp.train.packing import document_positions

VOCAB, SEQ, EOS = 64, 24, 2


def _model(name: str, device: str = "cpu", layers: int = 2) -> torch.nn.Module:
    with torch.device(device):
        if name == "reference":
            return Transformer(ModelArgs(vocab_size=VOCAB, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2,
                                         ffn_dim=48, max_seq_len=32))  # fmt: skip
        config = T.MistralConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=3,
            tie_word_embeddings=True, eos_token_id=EOS,
        )  # fmt: skip
        return T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _packed_batch(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of several EOS-ended documents of uneven lengths (some longer than the window), some labels ignored."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (rows, SEQ + 1), generator=gen)
    for r in range(rows):
        for cut in torch.randint(1, SEQ, (r % 4,), generator=gen).tolist():
            ids[r, cut] = EOS
    labels = ids[:, 1:].clone()
    labels[1, -3:] = -100
    ids = ids[:, :-1].contiguous()
    return ids, labels, document_positions(ids, EOS)


def _per_document_loss(model: torch.nn.Module, ids, labels, positions) -> torch.Tensor:
    """Each document through the plain model alone; token cross-entropies summed over the batch's token count."""
    total = torch.zeros(())
    for r in range(ids.shape[0]):
        starts = (positions[r] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        for a, b in zip(starts[:-1], starts[1:]):
            out = model(ids[r : r + 1, a:b])
            logits = out.logits if hasattr(out, "logits") else out
            logits = logits[0].to(torch.promote_types(logits.dtype, torch.float32))  # the float64 truth stays float64
            total = total + F.cross_entropy(logits, labels[r, a:b], ignore_index=-100, reduction="sum")
    return total / (labels != -100).sum()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return pu.seeded({k: v.shape for k, v in model.named_parameters()})


PP2_TP2 = dict(pp=2, tp=2, schedule="1F1B", microbatches=2, embedding="vocab_parallel")


def document_case(name: str, layout: dict = PP2_TP2, layers: int = 2) -> dict:
    """Per rank: the float64 verdict (pp_tp/parity/lockstep.py) against the per-document run over two AdamW steps; the
    packed batch without positions and the forward-only evaluation against the plain per-document loss."""
    pcfg = pu.pcfg_of(**layout)
    model = _model(name, layers=layers)
    state = _state(model)
    model.load_state_dict(state, strict=False)
    pipe = pp_tp.build_pipeline(_model(name, "meta", layers), pp_tp.build_mesh(pcfg), pcfg, state_dict=state)
    run = pu.PipelineRun(pipe, pu.adamw())
    ref = pu.ReferenceRun(model, pu.adamw(), loss_of=_per_document_loss)
    ids, labels, positions = _packed_batch(4)
    want = float(_per_document_loss(model, ids, labels, positions))
    plain_loss = float(pipe.step(ids, labels))  # without positions: attention crosses documents
    shares = [dp_share(pipe.mesh, t) for t in (ids, labels, positions)]
    evaluated = float(pipe.evaluate(*shares))  # forward only (validation), documents masked alike
    model.zero_grad()
    return {
        **pu.summary(list(lockstep(run, ref, [(ids, labels, positions)] * 2))),
        "plain_gap": abs(plain_loss - want) / want,
        "eval": abs(evaluated - want) / want,
    }


CP_CASES = [
    ("reference", dict(schedule="Interleaved1F1B", microbatches=2)),
    ("mistral_tied_sliding", dict(schedule="ZBVZeroBubble", microbatches=4)),
]


@pytest.fixture(scope="module")
def four_ranks(world) -> dict[str, list]:
    """Every multi-rank case of this file in one round trip (tests/one_trip.py)."""
    cases = [(f"{name} pp2 x tp2", document_case, (name,)) for name in ("reference", "mistral_tied_sliding")]
    cases += [(f"{name} cp", document_case, (name, dict(pp=2, cp=2, **schedule), 4)) for name, schedule in CP_CASES]
    return run_cases(world(4), cases)


def test_packed_documents_equal_each_document_alone_at_pp2_tp2(four_ranks):
    for name in ("reference", "mistral_tied_sliding"):
        for r in four_ranks[f"{name} pp2 x tp2"]:
            pu.assert_passes(r, name)
            assert r["eval"] <= 1e-5, (name, r)  # forward only: one loss, no optimizer in between
            assert r["plain_gap"] > 1e-3, (name, r)  # the mask matters on this batch: 100x the evaluation's bound


@pytest.mark.parametrize("name, schedule", CP_CASES)
def test_packed_documents_under_context_parallel(four_ranks, name, schedule):
    """pp2 x cp2, two stages per rank: each cp rank's head-tail chunks keep their queries inside their documents
    (position ids gathered over cp), on an interleaved and a V schedule with split backward."""
    for r in four_ranks[f"{name} cp"]:
        pu.assert_passes(r, name, schedule)
        assert r["eval"] <= 1e-5 and r["plain_gap"] > 1e-4, (name, r)  # the mask matters: 10x the bound


def test_positions_restart_after_every_eos_and_layouts_without_document_inputs_are_refused():
    ids = torch.tensor([[5, 2, 7, 8, 2, 2, 9]])
    assert document_positions(ids, 2).tolist() == [[0, 1, 0, 1, 2, 0, 0]]
    check_document_mask(REFERENCE)
    with pytest.raises(ConfigError, match="data.document_mask = true: the 'reference' model layout cannot keep"):
        check_document_mask(dataclasses.replace(REFERENCE, document_block_inputs=None))


def test_build_pipeline_refuses_a_layout_that_cannot_mask_documents_before_the_first_step():
    """`document_mask=True` (the trainer passes `data.document_mask`) reaches preflight at the build: BLOOM's ALiBi
    biases come from the batch's shape, so its layout has no document inputs and the build refuses in one line."""
    from pp_tp.parallel.mesh import make_mesh
    from pp_tp.planner.fake_world import fake_world

    with torch.device("meta"):
        bloom = T.BloomForCausalLM(T.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB))
    pcfg = pp_tp.ParallelConfig(pp=2, dp_shard=1, stages_per_rank=1, microbatches=2)
    with fake_world(2), pytest.raises(ConfigError, match="data.document_mask = true: the 'hf' model layout cannot"):
        pp_tp.build_pipeline(bloom, make_mesh("cpu", pcfg, 2), pcfg, seq_len=SEQ, document_mask=True)
