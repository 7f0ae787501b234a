"""The record of a family's forward (pp_tp/models/hf/record.py): a pipeline build runs the family's forward a fixed,
small number of times on every rank, every detector reads the one record, and the adapter keeps one way of hooking
and stopping a forward."""

from __future__ import annotations

import pathlib
import re

import parity_utils as pu
import torch
import transformers as T
from hf_utils import BASE

import pp_tp
from pp_tp.models.hf.record import Record, record_of, run_until
from pp_tp.models.hf.small import small_config

HF = pathlib.Path(pp_tp.__file__).parent / "models" / "hf"


def count_case(eps: float) -> int:
    """LlamaModel.forward calls while this rank builds a pp2 x tp2 pipeline of a 4-layer Llama (`eps` makes its
    small config, so its record, one no other case built)."""
    calls = []
    original = T.LlamaModel.forward

    def counted(self, *args, **kwargs):
        calls.append(type(self))
        return original(self, *args, **kwargs)

    T.LlamaModel.forward = counted
    try:
        with torch.device("meta"):
            model = T.LlamaForCausalLM(T.LlamaConfig(**BASE, rms_norm_eps=eps))
        pcfg = pu.pcfg_of(pp=2, tp=2, microbatches=2)
        pp_tp.build_pipeline(model, pp_tp.build_mesh(pcfg), pcfg, seed=0, seq_len=16)
    finally:
        T.LlamaModel.forward = original
    return len(calls)


def test_a_llama_build_runs_its_forward_at_most_three_times_per_rank(world):
    """The record's eval and training forwards and the self-check's: 7 before the record (issue 46)."""
    counts = world(4).run(count_case, 1.25e-6)
    assert all(1 <= n <= 3 for n in counts), counts


def test_the_record_is_built_once_and_leaves_the_rng_alone():
    with torch.device("meta"):
        model = T.LlamaForCausalLM(T.LlamaConfig(**BASE, rms_norm_eps=1.5e-6))
    torch.manual_seed(7)
    before = torch.get_rng_state()
    record = record_of(model)
    events, advanced = record.train()
    assert torch.equal(torch.get_rng_state(), before)
    assert record_of(model) is record and record.error is None and not advanced
    layers = [c.name for c in record.calls if re.fullmatch(r"model\.layers\.\d+", c.name)]
    assert layers == [f"model.layers.{i}" for i in range(record.small.num_hidden_layers)]
    assert [c.name for c in record.calls][-1] == ""  # the model itself returns last
    assert ("pre", "model.layers.0.mlp") in events and not any(kind == "draw" for kind, _ in events)


def test_run_until_stops_at_the_modules_it_waits_for():
    record = Record(T.LlamaForCausalLM, small_config(T.LlamaConfig(**BASE)))
    layers = record.model.model.layers
    seen = []
    handle = layers[1].register_forward_pre_hook(lambda *_: seen.append(1))
    try:
        with torch.no_grad():
            reached = run_until(record.model, {layers[0]: "first"}, input_ids=record.ids, use_cache=False)
    finally:
        handle.remove()
    assert list(reached) == ["first"] and not seen  # stopped before layer 1
    first = next(c for c in record.calls if c.module is layers[0])
    assert torch.equal(reached["first"].args[0], first.args[0])  # what the recorded forward handed it


def test_the_adapter_hooks_and_stops_forwards_in_one_module_and_caches_in_one():
    sources = {p.name: p.read_text() for p in HF.glob("*.py")}
    hooking = sorted(n for n, s in sources.items() if "register_forward" in s)
    stopping = [m for s in sources.values() for m in re.findall(r"^class (\w+)\((?:\w+)?Exception\)", s, re.M)]
    caches = [m for s in sources.values() for m in re.findall(r"^(_[A-Z_]+): dict\[.*\] = \{\}", s, re.M)]
    caches += [n for n, s in sources.items() if "functools.cache" in s or "lru_cache" in s]
    assert hooking == ["record.py"] and stopping == ["Stop"] and caches == ["_RECORDS"], (hooking, stopping, caches)


def test_one_weightless_prologue_replay_computes_what_the_forward_hands_its_layers():
    """BLOOM's `alibi` for the model's own 8 heads in bfloat16, by the family's own forward on a meta stand-in of the
    model's config (prologue.py: no weight materialized, BLOOM's `word_embeddings_layernorm` passed over), kept in the
    family's record: the one replay discover, position_args and the first stage's hidden path share."""
    from transformers.models.bloom.modeling_bloom import BloomModel

    from pp_tp.models.hf.prologue import prologue_of

    with torch.device("meta"):
        model = T.BloomForCausalLM(T.BloomConfig(hidden_size=32, n_layer=2, n_head=8, vocab_size=64))
    replay = prologue_of(model, "transformer.h")
    got = replay.layer_args(3, torch.arange(5).unsqueeze(0), torch.bfloat16, ("alibi",), positions=False)
    want = BloomModel.build_alibi_tensor(None, torch.ones(3, 5), 8, torch.bfloat16)
    (alibi,) = (a["alibi"] for a in got.values())  # one layer type
    assert alibi.dtype == torch.bfloat16 and torch.equal(alibi, want)
    assert all(p.is_meta for p in replay.model.parameters())
    assert prologue_of(model, "transformer.h") is replay
