"""HF safetensors in and out of a pipeline: exact round trip at pp2 x tp2 x dp2 (sharded source, sharded
output), a tied model, bf16 -> fp32, the per-rank memory bound at pp4, and one-line bad-key errors."""

from __future__ import annotations

import json
import os

import hf_utils as hu
import parity_utils as pu
import pytest
import torch
import torch.distributed as dist

import pp_tp
from pp_tp.base.tensors import full_tensor
from pp_tp.errors import ConfigError
from pp_tp.hf_checkpoint import open_checked
from pp_tp.parity import PipelineRun, ReferenceRun, lockstep, rel_err


def roundtrip_case(tmp: str, pcfg_kw: dict, tie: bool, lr: float = 0.5) -> dict:
    """transformers writes a sharded checkpoint -> the pipeline loads it -> loss and one SGD step on both ->
    save_pretrained -> from_pretrained equals the plain model's updated weights."""
    src, out = os.path.join(tmp, "src"), os.path.join(tmp, "out")
    config = hu.llama_config(tie_word_embeddings=tie)
    if dist.get_rank() == 0:
        hu.llama(config).save_pretrained(src, max_shard_size="60KB")  # several files + index
    dist.barrier()
    pcfg = pu.pcfg_of(**pcfg_kw)
    pipe = pp_tp.build_pipeline(hu.llama(config, "meta"), pp_tp.build_mesh(pcfg), pcfg, checkpoint=src)

    def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr)

    ref = ReferenceRun(hu.from_pretrained(src), sgd)
    step = next(lockstep(PipelineRun(pipe, sgd), ref, [pu.batch(pu.TINY, 8, 16)]))
    pipe.save_pretrained(out, max_shard_size="40KB")
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    return {
        "loss": step.loss,
        "ref_loss": step.ref_loss,
        "param_err": hu.max_param_err(hu.from_pretrained(out), ref.params()),
        "files": files,
        "src_files": sorted(f for f in os.listdir(src) if f.endswith(".safetensors")),
        "keys": sorted(json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]),
    }


def _check_roundtrip(results: list[dict], tie: bool) -> None:
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * r["ref_loss"], r
        assert r["param_err"] <= 1e-5, r
        assert len(r["src_files"]) > 1 and len(r["files"]) > 1, r  # sharded in, sharded out
        assert ("lm_head.weight" in r["keys"]) is not tie  # a tied weight is stored once


def test_round_trip_pp2_tp2_dp2_is_exact(world, tmp_path):
    kw = dict(pp=2, tp=2, dp_shard=2, schedule="1F1B", microbatches=2)
    _check_roundtrip(world(8).run(roundtrip_case, str(tmp_path), kw, False), tie=False)


def test_round_trip_of_a_tied_model_stores_it_once(world, tmp_path):
    _check_roundtrip(world(1).run(roundtrip_case, str(tmp_path), dict(pp=1, microbatches=2), True), tie=True)


def test_round_trip_of_a_model_tied_across_pp2_tp2_dp2(world, tmp_path):
    kw = dict(pp=2, tp=2, dp_shard=2, schedule="1F1B", microbatches=2, embedding="vocab_parallel")
    _check_roundtrip(world(8).run(roundtrip_case, str(tmp_path), kw, True), tie=True)


def per_part_case(tmp: str) -> dict:
    """Phi3 at tp2: its fused qkv_proj and gate_up_proj are split per part (each rank holds rows of q, k and v, of
    gate and up: not one box of the stored tensor). Loaded from safetensors and saved back, every full tensor
    equals the stored one."""
    from test_hf_families import make

    src, out = os.path.join(tmp, "src"), os.path.join(tmp, "out")
    if dist.get_rank() == 0:
        model = make("phi3_mha")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
        model.save_pretrained(src)
    dist.barrier()
    pcfg = pu.pcfg_of(pp=1, tp=2, microbatches=1)
    pipe = pp_tp.build_pipeline(make("phi3_mha", device="meta"), pp_tp.build_mesh(pcfg), pcfg, checkpoint=src)
    want = hu.from_pretrained(src).state_dict()
    named = dict(pipe.model_parts[0].named_parameters())
    pipe.save_pretrained(out)
    return {
        "split": sorted(k for k, p in named.items() if "StridedShard" in str(getattr(p, "placements", ""))),
        "load_err": max(rel_err(full_tensor(p).detach(), want[k]) for k, p in named.items()),
        "save_err": hu.max_param_err(hu.from_pretrained(out), want),
    }


def test_per_part_split_weights_load_and_save_exactly(world, tmp_path):
    for r in world(2).run(per_part_case, str(tmp_path)):
        assert len(r["split"]) == 8 and r["load_err"] == 0.0 and r["save_err"] == 0.0, r


def bf16_case(tmp: str) -> dict:
    config = hu.llama_config()
    if dist.get_rank() == 0:
        hu.llama(config).to(torch.bfloat16).save_pretrained(tmp)
    dist.barrier()
    pcfg = pu.pcfg_of(pp=2, microbatches=2)
    meta = hu.llama(hu.llama_config(), "meta")  # fp32 (save_pretrained above set `config`'s dtype to bf16)
    pipe = pp_tp.build_pipeline(meta, pp_tp.build_mesh(pcfg), pcfg, checkpoint=tmp)
    want = {k: v.float() for k, v in hu.from_pretrained(tmp).to(torch.bfloat16).state_dict().items()}
    named = {k: p for part in pipe.model_parts for k, p in part.named_parameters()}
    return {
        "dtypes": sorted({str(p.dtype) for p in named.values()}),
        "err": max(rel_err(p.detach(), want[k]) for k, p in named.items()),
        "casts": dict(pipe.checkpoint_casts),
    }


def test_bf16_checkpoint_fills_fp32_master_weights_explicitly(world, tmp_path):
    for r in world(2).run(bf16_case, str(tmp_path)):
        assert r["dtypes"] == ["torch.float32"] and r["err"] == 0.0, r
        assert list(r["casts"]) == ["bfloat16 -> float32"] and r["casts"]["bfloat16 -> float32"] > 0, r


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def memory_case(tmp: str) -> dict:
    """~100M parameters in fp32 at pp4: RSS growth while building, against the checkpoint's size."""
    config = hu.llama_config(
        vocab_size=16000, hidden_size=512, intermediate_size=1536, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=64,
    )  # fmt: skip
    if dist.get_rank() == 0 and not os.path.isfile(os.path.join(tmp, "model.safetensors")):
        from safetensors.torch import save_file

        model = hu.llama(config, "meta")
        shapes = {k: p.shape for k, p in model.named_parameters()}
        save_file(pu.seeded(shapes, scale=0.02, norm=0.0), os.path.join(tmp, "model.safetensors"))
    dist.barrier()
    size = os.path.getsize(os.path.join(tmp, "model.safetensors"))
    pcfg = pu.pcfg_of(pp=4, microbatches=4)
    mesh = pp_tp.build_mesh(pcfg)
    model = hu.llama(config, "meta")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
    before = _status_kib("VmRSS")
    pipe = pp_tp.build_pipeline(model, mesh, pcfg, checkpoint=tmp)
    growth = (_status_kib("VmHWM") - before) * 1024
    local = sum(p.numel() * 4 for part in pipe.model_parts for p in part.parameters())
    params = sum(p.numel() for p in model.parameters())
    return {"growth": growth, "size": size, "local": local, "params": params}


def test_each_rank_reads_only_its_stages_at_pp4(world, tmp_path):
    res = world(4).run(memory_case, str(tmp_path))
    for r in res:
        print(f"rss growth {r['growth'] / 2**20:.0f} MiB, own params {r['local'] / 2**20:.0f} MiB, "
              f"checkpoint {r['size'] / 2**20:.0f} MiB ({r['params'] / 1e6:.0f}M params)")  # fmt: skip
        assert r["params"] >= 90e6
        assert r["growth"] < 0.6 * r["size"], r


# --- single process: every bad key is one line, before any collective ---------------------------------


def _write(path, tensors: dict) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return str(path)


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"), "missing 'model.layers.1.mlp.up_proj.weight'"),
        (lambda sd: sd.update({"model.layers.9.bias": torch.zeros(2)}), "unexpected key 'model.layers.9.bias'"),
        (
            lambda sd: sd.update({"model.norm.weight": torch.zeros(65)}),
            "'model.norm.weight' has shape (65,), the model needs (64,)",
        ),
        (lambda sd: sd.update({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}), "not a float type"),
    ],
)
def test_bad_keys_are_one_line(tmp_path, change, expected):
    meta = hu.llama(hu.llama_config(), "meta")
    sd = {k: torch.zeros(p.shape) for k, p in meta.named_parameters()}
    change(sd)
    with pytest.raises(ConfigError) as e:
        open_checked(_write(tmp_path / "ck", sd), meta)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_a_tied_alias_key_is_accepted_and_a_missing_directory_is_one_line(tmp_path):
    meta = hu.llama(hu.llama_config(tie_word_embeddings=True), "meta")
    sd = {k: torch.zeros(p.shape) for k, p in meta.named_parameters(remove_duplicate=False)}
    assert "lm_head.weight" in sd
    open_checked(_write(tmp_path / "ck", sd), meta)
    for path, msg in ((tmp_path / "nope", "is not a directory"), (tmp_path, "has no model.safetensors")):
        with pytest.raises(ConfigError, match=msg):
            open_checked(str(path), meta)
