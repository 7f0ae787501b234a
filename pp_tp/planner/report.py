"""The dry run as text: mesh, stage table, per-rank memory and schedule tables."""

from __future__ import annotations

from pp_tp.config import ModelConfig, ParallelConfig
from pp_tp.parallel.fsdp import uses_fsdp
from pp_tp.planner.dry_run import JobPlan


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
            f"vocab={m.vocab_size}{_experts(m, p)}; batch {t.batch_size} x seq {t.seq_len}, "
            f"microbatch {job.microbatch} x "
            f"{p.microbatches} per DP rank; {p.mixed_precision}; {fsdp}; "
            f"activation checkpoint {p.activation_checkpoint}"
        ),
    ]


def _experts(m: ModelConfig, p: ParallelConfig) -> str:
    """The reference model's experts, when it has any, and how many each rank holds."""
    if not m.n_experts:
        return ""
    split = f" ({m.n_experts // p.ep} per rank over ep={p.ep})" if p.ep > 1 else " (whole on every rank)"
    split += f", each TP-sharded over tp={p.tp}" if p.tp > 1 else ""
    return (
        f" experts={m.n_experts}{split} top{m.top_k} x {m.expert_dim} wide, shared={m.n_shared_experts}, "
        f"MoE every {m.moe_every} layer(s), {m.router} router"
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
