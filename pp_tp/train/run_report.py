"""What rank 0 tells the user before step 1: where the weights come from and the resolved layout
(mesh, stage table, the planner's per-rank memory estimate); every figure also goes to the JSONL file."""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.config import JobConfig
from pp_tp.hf_checkpoint import has_weights
from pp_tp.parallel.experts import expert_dispatches
from pp_tp.parallel.mesh import MESH_DIMS
from pp_tp.parallel.whole_on_tp import whole_on_tp
from pp_tp.planner import plan_job
from pp_tp.planner.dry_run import JobPlan
from pp_tp.runtime.pipeline import Pipeline


def dry_run(cfg: JobConfig) -> JobPlan | None:
    """The planner's dry run, on the rank that will be rank 0, before the process group exists (the dry run
    needs a process of its own); None on other ranks, once a process group is up (tests), for a model with its
    own loss (the planner estimates language models only) or under context parallel (not modelled yet)."""
    if dist.is_initialized() or os.environ.get("RANK", "0") != "0" or cfg.training.loss or cfg.parallel.cp > 1:
        return None
    return plan_job(cfg, cfg.parallel.world_size)


def initial_weights(cfg: JobConfig, resume: str | None) -> tuple[str | None, str]:
    """(HF directory to load, the log line saying where the weights come from)."""
    hf = cfg.model.hf_path
    if resume:
        return None, f"weights: resuming from {resume} (wins over any initial load)"
    if hf and has_weights(hf):
        return hf, f"weights: loaded from {hf} (each rank reads its own slices)"
    where = f"; {hf} has no safetensors" if hf else ""
    return None, f"weights: random init (seed {cfg.model.seed}){where}"


def layout(cfg: JobConfig, mesh: DeviceMesh, pipe: Pipeline, plan) -> tuple[str, dict]:
    """The layout as text for rank 0's stdout and as one JSONL row."""
    p = cfg.parallel
    shape = {d: mesh[d].size() for d in MESH_DIMS} | ({"ep": p.ep} if p.ep > 1 else {})
    lines = [
        f"layout: {dist.get_world_size()} ranks, mesh " + " x ".join(f"{k}={v}" for k, v in shape.items())
        + f"; schedule {p.schedule}, {p.microbatches} microbatches, {p.num_stages} stages; {p.mixed_precision}",
        pipe.plan.table(),
    ]  # fmt: skip
    row: dict = {"event": "layout", "world_size": dist.get_world_size(), "mesh": shape, "schedule": p.schedule}
    row["stages"] = [
        {"stage": s.index, "pp_rank": s.rank, "blocks": list(s.blocks), "embed": s.embed, "head": s.head,
         "params": s.params}
        for s in pipe.plan.stages
    ]  # fmt: skip
    held = sorted({(d.local_experts, d.n_experts) for part in pipe.model_parts for d in expert_dispatches(part)})
    if held:
        row["experts_per_rank"] = held[0][0]
        lines.append(
            "experts per MoE layer on each rank: "
            + ", ".join(f"{local} of {total}" for local, total in held)
            + f" (ep={p.ep}"
            + (f", each TP-sharded over tp={p.tp})" if p.tp > 1 else ")")
        )
    whole = whole_on_tp(pipe.model_parts) if p.tp > 1 else {}
    if whole:  # exact (replicated input, identical gradients on every TP rank), paid in compute and memory
        row["tp_whole"] = {name: count for name, (_, count) in whole.items()}
        lines.append(
            f"run whole on every TP rank (tp={p.tp} splits none of their heads), this rank's blocks: "
            + ", ".join(f"{name} ({'/'.join(cls)}) {count:,} params" for name, (cls, count) in whole.items())
        )
    if plan is not None:
        lines.append(
            "planner's estimate of each rank's peak (model state, AdamW, activations and buffers; dp/tp coordinate 0;"
            " the step log's figure is measured):"
        )
        row["memory_gib"] = {}
        for r in plan.ranks:
            gib = r.total_bytes / 2**30
            row["memory_gib"][r.pp_rank] = gib
            lines.append(f"  pp rank {r.pp_rank}: stages {r.stages}, estimated peak {gib:.3f} GiB")
    if pipe.checkpoint_casts:
        row["casts"] = dict(pipe.checkpoint_casts)
        lines.append("checkpoint dtype conversions: " + ", ".join(f"{k} x{n}" for k, n in row["casts"].items()))
    return "\n".join(lines), row
