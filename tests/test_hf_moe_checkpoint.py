"""Published MoE checkpoints in and out (issue 34): per-expert on-disk layouts read through transformers' own
conversion mapping, each rank reading only its experts; block FP8 and MXFP4 dequantized on read; one training step
from the loaded weights equal to the model's own run; export back to the layout from_pretrained reads, gathered one
expert at a time; bad input refused in one line.

All multi-rank cases run in one 4-rank world (process start is the costly part): pp2 x ep2 and pp2 x tp2 (TP
experts), pp2 x dp2 (FSDP shards the expert dim); pp2 x ep2 x tp2 would take 8 ranks."""

from __future__ import annotations

import json
import os
import re

import moe_checkpoint_utils as mu
import parity_utils as pu
import pytest
import torch
import torch.distributed as dist
from hf_utils import SEQ, VOCAB, seeded_state
from test_hf_families import make

import pp_tp
from pp_tp.base.tensors import full_tensor, persistent_buffers
from pp_tp.errors import ConfigError
from pp_tp.hf_checkpoint import open_checked, save
from pp_tp.hf_checkpoint.per_expert import expert_dims
from pp_tp.hf_checkpoint.source import HFSource
from pp_tp.models.reference.model import ModelArgs
from pp_tp.parity.lockstep import dp_share, mean_token_loss

FAMILIES = ("mixtral_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")
LAYOUTS = {
    "pp2_ep2": dict(pp=2, dp_shard=2, ep=2, schedule="1F1B", microbatches=2),
    "pp2_tp2": dict(pp=2, tp=2, schedule="1F1B", microbatches=2),
    "pp2_dp2": dict(pp=2, dp_shard=2, schedule="1F1B", microbatches=2),
}
BLOCK = (16, 16)
# (family, layout) exported after two steps: load_case exports these from its own build; pp2 x dp2 builds its own.
ROUNDTRIPS = [("mixtral_moe", "pp2_ep2"), ("deepseek_v3", "pp2_ep2"), ("qwen3_moe", "pp2_tp2")]


def _saved(tmp: str, name: str) -> str:
    path = os.path.join(tmp, name)
    if dist.get_rank() == 0 and not os.path.isdir(path):
        mu.save_family(make(name), path, seeded_state(make(name)))
    dist.barrier()
    return path


def _from_pretrained(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return pu.batch(ModelArgs(vocab_size=VOCAB), 4, SEQ)


def _compare(pipe, want: dict[str, torch.Tensor]) -> dict:
    """Every full parameter and persistent buffer against `want`: keys that differ (exact), and how many."""
    differ, n = [], 0
    for part in pipe.model_parts:
        for key, p in part.named_parameters():
            n += 1
            if not torch.equal(full_tensor(p.detach()), want[key]):
                differ.append(key)
        for key, b in persistent_buffers(part).items():
            n += 1
            if not torch.equal(b, want[key]):
                differ.append(key)
    return {"differ": differ, "checked": n}


def _reading(*args, **kwargs):
    """`build_pipeline(*args, **kwargs)`, recording each on-disk box the rank reads: (key, offset, shape)."""
    read, orig = [], HFSource._leaf

    def spy(self, files, leaf, offset, out):
        read.append((leaf.key, offset, tuple(out.shape)))
        return orig(self, files, leaf, offset, out)

    HFSource._leaf = spy
    try:
        return pp_tp.build_pipeline(*args, **kwargs), read
    finally:
        HFSource._leaf = orig


def _experts_read(read: list) -> list[int]:
    return sorted({int(m.group(1)) for k, _, _ in read if (m := re.search(r"\.experts\.(\d+)\.", k))})


def load_case(tmp: str) -> list[dict]:
    """Each family at pp2 x ep2 and pp2 x tp2: the loaded model equals from_pretrained of the same directory
    exactly, and one AdamW step from it passes the float64 verdict against the model's own run (loss, every full
    gradient, the updated parameters); the pairs of ROUNDTRIPS then take a second step and are exported."""
    out = []
    ids, labels = _batch()
    for name in FAMILIES:
        src = _saved(tmp, name)
        want = _from_pretrained(src)
        for layout in ("pp2_ep2", "pp2_tp2"):
            kw = LAYOUTS[layout]
            pcfg = pu.pcfg_of(**kw)
            mesh = pp_tp.build_mesh(pcfg)
            pipe, read = _reading(make(name, "meta"), mesh, pcfg, checkpoint=src)
            loaded = _compare(pipe, want)
            torch.manual_seed(0)
            model = make(name)
            model.load_state_dict(want, strict=False)
            run, ref = pu.PipelineRun(pipe, pu.adamw()), pu.ReferenceRun(model, pu.adamw())
            step = pu.summary(list(pu.lockstep(run, ref, [(ids, labels)])))
            ep_rank = mesh["ep"].get_local_rank() if kw.get("ep", 1) > 1 else None
            out.append({"family": name, "layout": layout, "experts_read": _experts_read(read), "ep_rank": ep_rank,
                        **loaded, "score": step["score"], "scores": step["scores"]})  # fmt: skip
            if (name, layout) in ROUNDTRIPS:  # the round trip of this build: a second step, then the export
                run.step(ids, labels)
                out[-1]["exported"] = _exported(pipe, mesh, src, os.path.join(tmp, f"out_{name}_{layout}"), ids, labels)
    return out


def fp8_case(tmp: str) -> dict:
    """DeepSeek-V3 as published (block FP8) at pp2 x ep2: parameters equal the block-wise dequantization exactly,
    within FP8 rounding of the originals; the casts line counts the dequantized parameters."""
    src, fp8, deq = (os.path.join(tmp, d) for d in ("deepseek_v3", "fp8", "deq"))
    _saved(tmp, "deepseek_v3")
    if dist.get_rank() == 0:
        mu.to_fp8(src, fp8, BLOCK)
        mu.dequantized_dir(fp8, deq, BLOCK)
    dist.barrier()
    pcfg = pu.pcfg_of(**LAYOUTS["pp2_ep2"])
    pipe = pp_tp.build_pipeline(make("deepseek_v3", "meta"), pp_tp.build_mesh(pcfg), pcfg, checkpoint=fp8)
    return {**_compare(pipe, _from_pretrained(deq)), "worst_vs_original": _worst(pipe, _from_pretrained(src)),
            "casts": dict(pipe.checkpoint_casts)}  # fmt: skip


def _worst(pipe, orig: dict[str, torch.Tensor]) -> float:
    return max(
        ((full_tensor(p.detach()) - orig[k]).norm() / orig[k].norm()).item()
        for part in pipe.model_parts
        for k, p in part.named_parameters()
    )


def mxfp4_case(tmp: str) -> list[dict]:
    """GPT-OSS with MXFP4 experts as published, at pp2 x ep2 and pp2 x tp2: parameters equal transformers'
    dequantization (from_pretrained of the same directory) exactly, within FP4 rounding of the originals; each rank
    reads only its experts' (EP) or its output rows' (TP) blocks and scales."""
    src, q = _saved(tmp, "gpt_oss"), os.path.join(tmp, "mxfp4")
    if dist.get_rank() == 0:
        mu.to_mxfp4(src, q)
    dist.barrier()
    want, orig, out = _from_pretrained(q), _from_pretrained(src), []
    for layout in ("pp2_ep2", "pp2_tp2"):
        pcfg = pu.pcfg_of(**LAYOUTS[layout])
        mesh = pp_tp.build_mesh(pcfg)
        pipe, read = _reading(make("gpt_oss", "meta"), mesh, pcfg, checkpoint=q)
        boxes = [(k, off, shape) for k, off, shape in read if k.endswith("_blocks")]
        ep_rank = mesh["ep"].get_local_rank() if layout == "pp2_ep2" else None
        out.append({"layout": layout, **_compare(pipe, want), "worst_vs_original": _worst(pipe, orig),
                    "casts": dict(pipe.checkpoint_casts), "experts": {(off[0], shape[0]) for _, off, shape in boxes},
                    "share": _share(q, boxes), "ep_rank": ep_rank})  # fmt: skip
    return out


def _share(path: str, boxes: list) -> float:
    """The largest fraction of one MXFP4 tensor (counted dequantized: two values a byte) the boxes read."""
    from safetensors import safe_open

    size = {}
    for name in (f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, name), framework="pt") as f:
            size.update({k: 2 * torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys()})
    read: dict[str, int] = {}
    for k, _, shape in boxes:
        read[k] = read.get(k, 0) + torch.Size(shape).numel()
    return max(n / size[k] for k, n in read.items())


def _exported(pipe, mesh, src: str, out: str, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """save_pretrained of a trained pipeline: from_pretrained of the output (one process) equals the trained weights
    exactly and gives the pipeline's loss; the output has the source's (per expert) keys; no packed expert tensor was
    gathered whole."""
    whole, gather = [], save._gather_unit

    def spy(unit, *args):
        whole.extend([unit.key] if unit.dim is None else [])
        return gather(unit, *args)

    save._gather_unit = spy
    try:
        pipe.save_pretrained(out, max_shard_size="100KB")
    finally:
        save._gather_unit = gather
    loss = float(pipe.evaluate(dp_share(mesh, ids), dp_share(mesh, labels)))
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        plain = float(mean_token_loss(exported, ids, labels))
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        keys = sorted(json.load(f)["weight_map"])
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        src_keys = sorted(json.load(f)["weight_map"])
    experts = expert_dims(pipe.model_parts)
    return {**_compare(pipe, exported.state_dict()), "same_keys": keys == src_keys, "loss": loss, "plain": plain,
            "experts": len(experts), "whole_experts": sorted(set(whole) & set(experts))}  # fmt: skip


def roundtrip_case(tmp: str, name: str, layout: str) -> dict:
    """Load, two AdamW steps, then the export checks of `_exported` (load_case does the same after its verdict step
    for the pairs of ROUNDTRIPS)."""
    src = _saved(tmp, name)
    pcfg = pu.pcfg_of(**LAYOUTS[layout])
    mesh = pp_tp.build_mesh(pcfg)
    pipe = pp_tp.build_pipeline(make(name, "meta"), mesh, pcfg, checkpoint=src)
    run, (ids, labels) = pu.PipelineRun(pipe, pu.adamw()), _batch()
    for _ in range(2):
        run.step(ids, labels)
    return _exported(pipe, mesh, src, os.path.join(tmp, f"out_{name}_{layout}"), ids, labels)


def _check_roundtrip(r: dict, name: str, layout: str) -> None:
    assert r["checked"] > 0 and not r["differ"] and r["same_keys"], (name, layout, r)
    assert r["experts"] > 0 and not r["whole_experts"], (name, layout, r)
    assert abs(r["loss"] - r["plain"]) <= 1e-5 * abs(r["plain"]), (name, layout, r)


def test_published_moe_checkpoints_load_train_save_and_dequantize_per_rank(world, tmp_path):
    w = world(4)
    for rank, results in enumerate(w.run(load_case, str(tmp_path))):
        assert sorted((r["family"], r["layout"]) for r in results if "exported" in r) == sorted(ROUNDTRIPS)
        for r in results:
            assert r["checked"] > 0 and not r["differ"], r
            pu.assert_passes(r, r["family"], r["layout"])
            if (r["family"], r["layout"]) in ROUNDTRIPS:
                _check_roundtrip(r["exported"], r["family"], r["layout"])
            if r["ep_rank"] is not None and r["family"] != "gpt_oss":  # GPT-OSS stores its experts packed
                assert r["experts_read"] == [2 * r["ep_rank"], 2 * r["ep_rank"] + 1], (rank, r)
    for r in w.run(fp8_case, str(tmp_path)):
        assert r["checked"] > 0 and not r["differ"], r
        assert 0 < r["worst_vs_original"] < 0.07, r
        assert sum(n for k, n in r["casts"].items() if "dequantized" in k) > 0, r
    for results in w.run(mxfp4_case, str(tmp_path)):
        for r in results:
            assert r["checked"] > 0 and not r["differ"], r
            assert 0 < r["worst_vs_original"] < 0.2, r  # e2m1: 3 significant bits
            assert r["casts"].get("mxfp4 (dequantized) -> float32", 0) > 0, r
            if r["ep_rank"] is not None:  # 4 experts: this rank's 2, never another's
                assert r["experts"] == {(2 * r["ep_rank"], 2)} and r["share"] == 0.5, r
            else:  # TP: every expert, its half of gate and of up (output rows) or of down's inputs
                assert r["experts"] == {(0, 4)} and r["share"] == 0.5, r
    for r in w.run(roundtrip_case, str(tmp_path), "mixtral_moe", "pp2_dp2"):
        _check_roundtrip(r, "mixtral_moe", "pp2_dp2")


# --- single process: bad input is one line, before any collective ------------------------------------------------


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("mixtral"))
    return mu.save_family(make("mixtral_moe"), path, seeded_state(make("mixtral_moe")), max_shard_size="10GB")


def _edited(src: str, dst, change) -> str:
    """A copy of `src` (one safetensors file) with `change(tensors)` applied, and its config.json."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    config = json.load(open(os.path.join(src, "config.json")))
    change(tensors, config)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))
    return str(dst)


def _drop(pattern: str):
    return lambda t, c: [t.pop(k) for k in [k for k in t if re.search(pattern, k)]]


E = "model.layers.1.block_sparse_moe.experts"


@pytest.mark.parametrize(
    "change, expected",
    [
        (_drop(r"layers\.1\..*experts\.2\.w1"), "missing expert 2 of 'model.layers.1.mlp.experts.gate_up_proj'"),
        (_drop(r"layers\.1\..*experts\.3\."), "missing expert 3 of 'model.layers.1.mlp.experts.gate_up_proj'"),
        (lambda t, c: t.update({f"{E}.1.w2.weight": torch.zeros(32, 65)}), f"'{E}.1.w2.weight' has shape (32, 65)"),
        (lambda t, c: c.update(quantization_config={"quant_method": "awq"}), "quant_method = 'awq' is unknown"),
        (
            lambda t, c: t.update({f"{E}.0.w1.weight": t[f"{E}.0.w1.weight"].to(torch.float8_e4m3fn)}),
            "config.json has no fp8 quantization_config",
        ),
    ],
)
def test_bad_moe_checkpoints_are_one_line(mixtral_dir, tmp_path, change, expected):
    with pytest.raises(ConfigError) as e:
        open_checked(_edited(mixtral_dir, tmp_path / "ck", change), make("mixtral_moe", "meta"))
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_fp8_weight_without_its_scale_is_one_line(mixtral_dir, tmp_path):
    fp8 = str(tmp_path / "fp8")
    mu.to_fp8(mixtral_dir, fp8, BLOCK)

    def change(t, c):
        del t[f"{E}.1.w3.weight_scale_inv"]

    with pytest.raises(ConfigError) as e:
        open_checked(_edited(fp8, tmp_path / "ck", change), make("mixtral_moe", "meta"))
    assert f"fp8 weight '{E}.1.w3.weight' has no scale" in str(e.value) and "\n" not in str(e.value)


def test_a_conversion_pp_tp_cannot_read_per_rank_is_refused_by_name(mixtral_dir, monkeypatch):
    from transformers.core_model_loading import Concatenate, Interleave, MergeModulelist, WeightConverter

    from pp_tp.hf_checkpoint import conversion

    interleaved = WeightConverter(
        ["mlp.experts.*.w1.weight", "mlp.experts.*.w3.weight"],  # patterns of their own (they key the converter)
        "mlp.experts.gate_up_proj",
        [MergeModulelist(0), Concatenate(1), Interleave(1)],
    )
    own = conversion.conversions
    monkeypatch.setattr(conversion, "conversions", lambda model: [interleaved, *own(model)])
    with pytest.raises(ConfigError) as e:
        open_checked(mixtral_dir, make("mixtral_moe", "meta"))
    assert "needs transformers' Interleave conversion" in str(e.value) and "\n" not in str(e.value)


def test_mxfp4_blocks_without_their_scales_are_one_line(tmp_path):
    plain = mu.save_family(
        make("gpt_oss"), str(tmp_path / "plain"), seeded_state(make("gpt_oss")), max_shard_size="10GB"
    )
    mu.to_mxfp4(plain, str(tmp_path / "mxfp4"))
    key = "model.layers.2.mlp.experts.down_proj"

    def change(t, c):
        del t[key + "_scales"]

    with pytest.raises(ConfigError) as e:
        open_checked(_edited(str(tmp_path / "mxfp4"), tmp_path / "ck", change), make("gpt_oss", "meta"))
    assert f"mxfp4 blocks '{key}_blocks' have no scales" in str(e.value) and "\n" not in str(e.value), str(e.value)
