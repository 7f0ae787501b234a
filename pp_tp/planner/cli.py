"""The `pp-tp plan` options and output: the dry run as text or one JSON object, and the layout search."""

from __future__ import annotations

import argparse
import json
import os
import time

from pp_tp.config import JobConfig
from pp_tp.config.loading import job_dict
from pp_tp.planner.auto import GIB
from pp_tp.planner.dry_run import plan_job
from pp_tp.planner.report import format_plan
from pp_tp.planner.search import DEVICES, Device, search


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """--search, --memory-gib, --top, --json and the cost model's device numbers."""
    parser.add_argument("--search", action="store_true", help="search layouts that fit, fastest first")
    parser.add_argument("--memory-gib", type=float, default=80.0, help="per-rank memory budget for --search")
    parser.add_argument("--top", type=int, default=5, help="how many layouts --search prints")
    parser.add_argument("--json", action="store_true", help="print one JSON object (peak_gib, candidates)")
    parser.add_argument("--device", choices=sorted(DEVICES), default="H100", help="cost model defaults")
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense TFLOP/s per device")
    parser.add_argument("--nvlink-gbps", type=float, default=None, help="NVLink GB/s per device and direction")
    parser.add_argument("--ib-gbps", type=float, default=None, help="InfiniBand GB/s per device")


def _device(args: argparse.Namespace) -> Device:
    flops, nvlink, ib = DEVICES[args.device]
    return Device(
        args.peak_tflops * 1e12 if args.peak_tflops else flops,
        args.nvlink_gbps * 1e9 if args.nvlink_gbps else nvlink,
        args.ib_gbps * 1e9 if args.ib_gbps else ib,
    )


def world_note(args: argparse.Namespace, cfg: JobConfig) -> str:
    """Where the planned world size came from, when neither --world-size nor $WORLD_SIZE gave it: the degrees'
    product, fixed by the config or (dp_shard = -1 leaving it open) with dp_shard = 1; "" otherwise."""
    if args.world_size is not None or "WORLD_SIZE" in os.environ:
        return ""
    p = cfg.parallel
    degrees = " x ".join(f"{k} {getattr(p, k)}" for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    world = f"world size {p.world_size} = {degrees}"
    if job_dict(args.config, args.overrides).get("parallel", {}).get("dp_shard", -1) == -1:
        return f"planned at {world}, the fewest ranks the degrees allow (dp_shard = -1 taken as 1); pass --world-size N"
    return f"planned at {world}, the product of the config's degrees (--world-size not given)"


def run_plan(args: argparse.Namespace, cfg: JobConfig, world: int, note: str = "") -> int:
    """Prints the dry run (or its JSON) and, with --search, the best fitting layouts; `note` (world_note) says
    where the world size came from, first in the text and as "world" in the JSON."""
    job = plan_job(cfg, world)
    out: dict = {"peak_gib": round(job.peak_bytes / GIB, 3), "world_size": world}
    if note:
        out["world"] = note
    if not args.json:
        print(f"{note}\n" if note else "", end="")
        print(format_plan(job))
    if args.search:
        dev = _device(args)
        t0 = time.perf_counter()
        found = search(cfg, world, args.memory_gib, dev, args.top)
        out["candidates"] = [
            {"parallel": c.parallel, "peak_gib": round(c.peak_gib, 3), "step_time_s": c.step_time_s, "bubble": c.bubble}
            for c in found
        ]
        if not args.json:
            print(
                f"\nsearch: {len(found)} best layouts fitting {args.memory_gib:g} GiB per rank "
                f"({args.device}: {dev.peak_flops / 1e12:g} TFLOP/s, NVLink {dev.nvlink_bw / 1e9:g} GB/s, "
                f"IB {dev.ib_bw / 1e9:g} GB/s; {time.perf_counter() - t0:.1f} s)"
            )
            for c in found:
                keys = " ".join(f"{k}={v}" for k, v in c.parallel.items())
                print(f"  {c.step_time_s:8.3f} s/step  peak {c.peak_gib:6.2f} GiB  bubble {c.bubble:.3f}  {keys}")
    if args.json:
        print(json.dumps(out))
    return 0
