"""Loading a published-format (per-expert) DeepSeek-like checkpoint per rank, and saving it back: peak memory and
time (issue 34).

    python bench/moe_checkpoint_load.py                 # MLA + 16 experts, 350 MiB fp32, pp1 x ep4 on 4 ranks
    python bench/moe_checkpoint_load.py --experts 32 --fp8

The checkpoint (DeepSeek-V3 architecture: MLA attention, first layer dense, routed and shared experts) is written
once by transformers' own save_pretrained (per expert on disk, 50 MB shards; `--fp8`: then rewritten as
DeepSeek-V3 is published, block FP8 with 128 x 128 scales). Each of 4 gloo ranks then runs
`build_pipeline(..., checkpoint=DIR)` at pp1 x dp_shard4 x ep4 and reports: the peak RSS growth over the build
(VmHWM after resetting it) against the checkpoint's size; its own parameters' bytes; the peak above the RSS before
`load_stage` while the stage's values are read (the stage's own pages are first touched there); the build's and
the reading's wall time (the build includes preflight and the HF self-check); and the same build from seeded values
(no checkpoint). Then each rank runs `save_pretrained` of what it loaded (20 MB files) and reports its peak RSS
growth over the save against one whole packed expert tensor (no rank gathers one: experts go one at a time) and
the save's time, side by side with the same save gathering each packed expert tensor whole (as before). Then, in
this process, transformers' from_pretrained of the whole model (wall time, peak RSS growth). Run from the
repository root with PYTHONPATH=. (or after pip install -e .).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from common import World, table

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import moe_checkpoint_utils as mu  # noqa: E402  (tests/: the FP8 form the tests read)

import pp_tp  # noqa: E402
from pp_tp.config import ParallelConfig  # noqa: E402


def config(experts: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=8000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=768, num_hidden_layers=5,
        first_k_dense_replace=1, n_routed_experts=experts, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=64,
        qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip


def write(path: str, experts: int, fp8: bool) -> str:
    from transformers import AutoModelForCausalLM

    plain = os.path.join(path, f"e{experts}")
    if not os.path.isdir(plain):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config(experts)).save_pretrained(plain, max_shard_size="50MB")
    if not fp8:
        return plain
    out = plain + "_fp8"
    if not os.path.isdir(out):
        mu.to_fp8(plain, out, (128, 128))
    return out


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS (VmHWM) back to the current RSS
    return _kib("VmRSS")


def size_of(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def rank_case(path: str | None, experts: int, out: str | None = None, whole: bool = False) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    pcfg = ParallelConfig(pp=1, dp_shard=4, ep=4, microbatches=1, mixed_precision="fp32")
    mesh = pp_tp.build_mesh(pcfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config(experts))
    reading = _ReadingPeak()
    before = _reset_peak()
    start = time.perf_counter()
    with reading:
        pipe = pp_tp.build_pipeline(model, mesh, pcfg, checkpoint=path)  # None: seeded values, the baseline
    seconds = time.perf_counter() - start
    peak = _kib("VmHWM")
    own = sum(p.to_local().numel() * 4 if hasattr(p, "to_local") else p.numel() * 4
              for part in pipe.model_parts for p in part.parameters())  # fmt: skip
    return {"growth": (max(peak, reading.hwm) - before) * 1024, "own": own, "s": seconds, "read": reading.growth,
            "read_s": reading.seconds, "casts": dict(pipe.checkpoint_casts),
            **(saving(pipe, out, whole) if out else {})}  # fmt: skip


def saving(pipe, out: str, whole: bool) -> dict:
    """The peak RSS growth and time of this rank's part of `save_pretrained`, and the bytes of the largest packed
    expert tensor (whole). `whole`: the save as it was before per-expert gathers (no parameter known as experts, so
    each is gathered whole and split by transformers' reverse conversion), side by side."""
    from pp_tp.hf_checkpoint import save
    from pp_tp.hf_checkpoint.per_expert import expert_dims

    params = {k: p for part in pipe.model_parts for k, p in part.named_parameters()}
    packed = max(params[k].numel() * params[k].element_size() for k in expert_dims(pipe.model_parts))
    before = _reset_peak()
    start = time.perf_counter()
    orig, save.expert_dims = save.expert_dims, (lambda parts: {}) if whole else save.expert_dims
    try:
        pipe.save_pretrained(out, max_shard_size="20MB")
    finally:
        save.expert_dims = orig
    return {"save": (_kib("VmHWM") - before) * 1024, "save_s": time.perf_counter() - start, "packed": packed}


class _ReadingPeak:
    """Around every `load_stage` (the stage's own tensors already allocated): the peak RSS above the RSS before
    it (the reading's temporaries and mapped pages), the largest over stages, and the time spent reading."""

    def __enter__(self):
        from pp_tp.materialize import local_stages

        self.module, self.orig = local_stages, local_stages.load_stage
        self.growth, self.hwm, self.seconds = 0, 0, 0.0

        def measured(*args, **kwargs):
            self.hwm = max(self.hwm, _kib("VmHWM"))  # the build's peak so far, kept across the reset
            before, start = _reset_peak(), time.perf_counter()
            self.orig(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            self.growth = max(self.growth, (_kib("VmHWM") - before) * 1024)

        local_stages.load_stage = measured
        return self

    def __exit__(self, *exc) -> None:
        self.module.load_stage = self.orig


def whole(path: str) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    before = _reset_peak()
    start = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return time.perf_counter() - start, (_kib("VmHWM") - before) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--dir", default="/tmp/pp_tp_bench_moe_ckpt")
    args = parser.parse_args()
    path = write(args.dir, args.experts, args.fp8)
    size = size_of(path)
    world = World(4)
    try:
        ranks = world.run(rank_case, path, args.experts, path + "_saved")
        wholes = world.run(rank_case, path, args.experts, path + "_saved", True)
        seeded = world.run(rank_case, None, args.experts)
    finally:
        world.close()
    torch.set_num_threads(1)
    hf_s, hf_growth = whole(path)
    mib = 2**20
    rows = [("", "build peak RSS growth MiB", "x checkpoint", "seeded build MiB", "own params MiB",
             "reading peak MiB", "build s", "reading s", "seeded build s")]  # fmt: skip
    for i, (r, z) in enumerate(zip(ranks, seeded)):
        rows.append((f"rank {i}", f"{r['growth'] / mib:.0f}", f"{r['growth'] / size:.3f}", f"{z['growth'] / mib:.0f}",
                     f"{r['own'] / mib:.0f}", f"{r['read'] / mib:.1f}", f"{r['s']:.1f}", f"{r['read_s']:.2f}",
                     f"{z['s']:.1f}"))  # fmt: skip
    rows.append(("from_pretrained", f"{hf_growth / mib:.0f}", f"{hf_growth / size:.3f}", "", "", "", f"{hf_s:.1f}",
                 "", ""))  # fmt: skip
    print(f"checkpoint {path}: {size / mib:.0f} MiB, {args.experts} experts, fp8={args.fp8}; casts {ranks[0]['casts']}")
    print(table(rows))
    rows = [("", "save peak RSS growth MiB", "gathering whole MiB", "packed expert tensor MiB", "save s",
             "gathering whole s")]  # fmt: skip
    rows += [(f"rank {i}", f"{r['save'] / mib:.1f}", f"{w['save'] / mib:.1f}", f"{r['packed'] / mib:.1f}",
              f"{r['save_s']:.1f}", f"{w['save_s']:.1f}") for i, (r, w) in enumerate(zip(ranks, wholes))]  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
