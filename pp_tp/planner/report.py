"""The dry run as text: mesh, stage table, per-rank memory and schedule tables."""

from __future__ import annotations

from pp_tp.parallel.fsdp import uses_fsdp
from pp_tp.planner.context import kv_gather_bytes, rank_kv_bytes
from pp_tp.planner.dry_run import JobPlan
from pp_tp.planner.moe import rank_all_to_all_bytes


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (GiB at most)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _table(rows: list[tuple]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


_MEMORY_COLUMNS = (
    "pp rank",
    "stages",
    "local params",
    "params",
    "gathered",
    "grads",
    "grad accum",
    "optimizer",
    "act/microbatch",
    "act peak",
    "recv buffers",
    "bwd transient",
    "optim step tmp",
    "total",
)


def _header(job: JobPlan) -> list[str]:
    """World, mesh, model and batch shape, and the FSDP policy in force."""
    p, t, m = job.cfg.parallel, job.cfg.training, job.cfg.model
    mesh = " x ".join(f"{k}={v}" for k, v in job.mesh.items())
    chosen = job.policies or p
    fsdp = (
        f"FSDP reshard_after_forward={chosen.fsdp_reshard_after_forward} grad_reduce={chosen.fsdp_grad_reduce}"
        + (" (auto, per pp rank where a list)" if "auto" in (p.fsdp_reshard_after_forward, p.fsdp_grad_reduce) else "")
        if uses_fsdp(p)
        else "no FSDP"
    )
    return [
        f"world: {job.world_size} ranks (fake process group); mesh {mesh}",
        (
            f"model: dim={m.dim} layers={m.n_layers} heads={m.n_heads}/{m.n_kv_heads or m.n_heads} ffn={m.ffn_dim} "
            f"vocab={m.vocab_size}; batch {t.batch_size} x seq {t.seq_len}, "
            f"microbatch {job.microbatch} x "
            f"{p.microbatches} per DP rank; {p.mixed_precision}; {fsdp}; "
            f"activation checkpoint {p.activation_checkpoint}"
        ),
        *([_experts(job)] if job.experts else []),
        *([_context(job)] if p.cp > 1 else []),
    ]


def _context(job: JobPlan) -> str:
    """Context parallel: each rank's tokens, and the K/V all-gather bytes per attention layer and per step."""
    p, t = job.cfg.parallel, job.cfg.training
    one = kv_gather_bytes(job.microbatch, t.seq_len, job.dims, p)
    sent = max(
        rank_kv_bytes(sum(len(s.blocks) for s in job.plan.for_rank(r)), p, job.microbatch, t.seq_len, job.dims)
        for r in range(p.pp)
    )
    return (
        f"context parallel: cp={p.cp}, {t.seq_len // p.cp} of {t.seq_len} tokens per sequence on each rank "
        f"(head-tail chunks); K and V all-gathered {_size(one)} per attention layer and microbatch, sent per rank "
        f"and step {_size(sent)} (forward all-gather, backward reduce-scatter; the cp group is cp x tp = "
        f"{p.cp * p.tp} neighbouring ranks); FSDP over dp_shard x cp = {p.dp_shard * p.cp}"
    )


def _experts(job: JobPlan) -> str:
    """The routed experts, how many each rank holds, and the expert-parallel all-to-all bytes of a step."""
    e, p, t = job.experts, job.cfg.parallel, job.cfg.training
    if e is None:
        return ""
    layers = sum(len(s.blocks) for s in job.plan.stages)
    line = f"experts: {e.n_experts} per MoE layer in {len(e.moe_blocks)} of {layers} layers, top {e.top_k}; "
    if p.ep == 1:
        return line + "whole on every rank (parallel.ep = 1)"
    line += f"{e.per_rank(p.ep)} per rank over ep={p.ep}" + (f", each TP-sharded over tp={p.tp}" if p.tp > 1 else "")
    dim = job.dims.dim
    sent = max(
        rank_all_to_all_bytes(
            e, (b for s in job.plan.for_rank(r) for b in s.blocks), p, job.microbatch * t.seq_len, dim
        )
        for r in range(p.pp)
    )
    return line + (
        f"; all-to-all sent per rank and step {_size(sent)} (balanced routing; the ep group is ep x tp = "
        f"{p.ep * p.tp} neighbouring ranks)"
    )


def _memory_table(job: JobPlan) -> str:
    """Per pp rank: what its bytes are made of."""
    rows: list[tuple] = [_MEMORY_COLUMNS]
    for r in job.ranks:
        sizes = (
            r.param_bytes,
            r.gathered_bytes,
            r.grad_bytes,
            r.grad_accum_bytes,
            r.optim_bytes,
            sum(r.act_bytes_per_microbatch.values()),
            r.act_peak_bytes,
            r.buffer_bytes,
            r.transient_bytes,
            r.optim_step_bytes,
            r.total_bytes,
        )
        rows.append((r.pp_rank, ",".join(map(str, r.stages)), f"{r.local_params:,}", *map(_size, sizes)))
    return _table(rows)


def _schedule_table(job: JobPlan) -> str:
    """The configured schedule (*) and the comparable ones: bubble and activation peak."""
    rows: list[tuple] = [
        ("schedule", "bubble theory", "bubble simulated", "act peak", "microbatches held (rank 0 .. last)")
    ]
    for s in job.schedules:
        theory = f"{s.bubble_theory:.4f}" if s.bubble_theory is not None else "-"
        held = " ".join(f"{x:.1f}" for x in s.peak_microbatches)
        name = s.name + (" *" if s is job.schedules[0] else "")
        rows.append((name, theory, f"{s.bubble_simulated:.4f}", _size(max(s.act_peak_bytes)), held))
    return _table(rows)


def format_plan(job: JobPlan) -> str:
    """The dry run as text: mesh, stage table, per-rank memory, schedules."""
    lines = _header(job) + ["", "stages:", job.plan.table(), ""]
    lines += [f"memory per rank (dp/tp coordinate 0; schedule {job.cfg.parallel.schedule}; AdamW):", _memory_table(job)]
    lines += ["", "schedules (bubble = idle / compute time per rank; act peak = max over pp ranks):"]
    lines += [_schedule_table(job), ""]
    lines.append(f"largest per-rank peak: {_size(job.peak_bytes)} (* configured; dry run took {job.seconds:.1f} s)")
    return "\n".join(lines)
