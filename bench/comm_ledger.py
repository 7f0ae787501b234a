"""Communication per step for every schedule and FSDP reshard policy, against the analytic minimum.

    python bench/comm_ledger.py
    python bench/comm_ledger.py --schedules 1F1B Interleaved1F1B --policies default always

8 gloo ranks = pp2 x dp_shard2 x tp2, fp32, a tiny model; one step after a warm-up step is recorded
with pp_tp.diagnostics.comm_ledger.CommLedger on every rank, split by process group. Shown for the two
ranks at dp/tp coordinate 0 (pp rank 0 and 1) as measured/minimum op counts, and total bytes likewise.
Minimum per rank and step, from the rank's own stages:
  FSDP (dp_shard):  1 all-gather and 1 reduce-scatter per unit (each block, each stage root)
  TP (tp):          2 all-reduces of [mb, seq, dim] per block per microbatch forward, 2 backward; the head
                    adds 1 all-gather of the logits forward and 1 all-reduce backward per microbatch
  p2p (pp):         1 activation and 1 gradient per microbatch per cross-rank stage boundary
  step scalars:     global token count and loss: 2 all-reduces on dp_shard, 1 on pp
Counts are exact (no timing), so one step is enough.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from common import World, batch, default_stages_per_rank, table

import pp_tp
from pp_tp.diagnostics.comm_ledger import CommLedger
from pp_tp.errors import ConfigError
from pp_tp.models.reference.model import ModelArgs, Transformer
from pp_tp.planner import tp_local_numel
from pp_tp.schedules.registry import check_schedule

GROUPS = ("dp_shard", "tp", "pp")
COLUMNS = (
    ("dp_shard", "all_gather"),
    ("dp_shard", "reduce_scatter"),
    ("tp", "all_reduce"),
    ("tp", "all_gather"),
    ("pp", "send"),
    ("pp", "recv"),
)
SCALAR_ALL_REDUCES = {"dp_shard": 2, "pp": 1}
_MESH: dict = {}


def minimum(pipe, args: ModelArgs, mb: int, seq: int) -> dict[tuple[str, str], tuple[int, int]]:
    """(group, kind) -> (ops, bytes) this rank needs at least for one step; fp32 everywhere."""
    m = pipe.pcfg.microbatches
    act = mb * seq * args.dim * 4
    owner = {s.index: s.rank for s in pipe.plan.stages}
    ops: Counter = Counter()
    nbytes: Counter = Counter()

    def add(key: tuple[str, str], count: int, size: int) -> None:
        ops[key] += count
        nbytes[key] += count * size

    for stage in pipe.model_parts:
        s = stage.spec.index
        blocks = stage.block_modules()
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        units = [list(b.parameters()) for b in blocks] + [[p for p in stage.parameters() if id(p) not in in_blocks]]
        for unit in filter(None, units):
            size = 4 * sum(tp_local_numel(p) for p in unit)
            add(("dp_shard", "all_gather"), 1, size)
            add(("dp_shard", "reduce_scatter"), 1, size)
        add(("tp", "all_reduce"), 4 * len(blocks) * m, act)
        if stage.is_last:
            add(("tp", "all_gather"), m, mb * seq * args.vocab_size * 4)
            add(("tp", "all_reduce"), m, act)
        for peer, kinds in ((s + 1, ("send", "recv")), (s - 1, ("recv", "send"))):  # activation out, grad in
            if peer in owner and owner[peer] != owner[s]:
                for kind in kinds:
                    add(("pp", kind), m, act)
    for group, count in SCALAR_ALL_REDUCES.items():
        add((group, "all_reduce_scalar"), count, 8)
    return {k: (ops[k], nbytes[k]) for k in ops}


def measure(schedule: str, policy: str, args: ModelArgs, rows: int, seq: int, m: int) -> dict | None:
    """On every rank: one step's ledger by group and the minimum; None except at dp/tp coordinate 0."""
    pcfg = pp_tp.ParallelConfig(
        pp=2,
        tp=2,
        dp_shard=2,
        schedule=schedule,
        microbatches=m,
        stages_per_rank=default_stages_per_rank(schedule, 2),
        fsdp_reshard_after_forward=policy,
        mixed_precision="fp32",
    )
    if "mesh" not in _MESH:
        _MESH["mesh"] = pp_tp.build_mesh(pcfg)
    mesh = _MESH["mesh"]
    with torch.device("meta"):
        model = Transformer(args)
    pipe = pp_tp.build_pipeline(model, mesh, pcfg, seq_len=seq)
    dp = mesh.get_local_rank("dp_shard")
    ids, labels = (t[dp * rows // 2 : (dp + 1) * rows // 2] for t in batch(args, rows, seq))
    pipe.step(ids, labels)
    with CommLedger() as led:
        pipe.step(ids, labels)
    if dp or mesh.get_local_rank("tp"):
        return None
    measured = {}
    for name in GROUPS:
        events = [e for e in led.events if e.group == mesh.get_group(name).group_name]
        for e in events:
            kind = "all_reduce_scalar" if e.kind == "all_reduce" and e.nbytes <= 8 else e.kind
            ops, size = measured.get((name, kind), (0, 0))
            measured[(name, kind)] = (ops + 1, size + e.nbytes)
    return {
        "pp_rank": mesh.get_local_rank("pp"),
        "measured": measured,
        "minimum": minimum(pipe, args, rows // 2 // m, seq),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=[
            "GPipe",
            "1F1B",
            "Interleaved1F1B",
            "LoopedBFS",
            "InterleavedZeroBubble",
            "ZBVZeroBubble",
            "DualPipeV",
        ],
    )
    parser.add_argument("--policies", nargs="+", default=["default", "always", "never"])
    parser.add_argument("--m", type=int, default=4)
    a = parser.parse_args()
    args = ModelArgs(vocab_size=128, dim=64, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=16)
    rows, seq = 2 * a.m, 16
    out = [("schedule", "reshard", "pp rank", *(f"{g}:{k}" for g, k in COLUMNS), "other", "bytes meas/min")]
    world = World(8)
    refused = []
    try:
        for schedule in a.schedules:
            for policy in a.policies:
                try:  # combinations the config refuses (zero-bubble with "always") have no row
                    check_schedule(2, default_stages_per_rank(schedule, 2), a.m, schedule, policy)
                except ConfigError as e:
                    refused.append(f"{schedule}/{policy}: {e}")
                    continue
                for r in filter(None, world.run(measure, schedule, policy, args, rows, seq, a.m)):
                    meas, low = r["measured"], r["minimum"]
                    cells = [f"{meas.get(key, (0, 0))[0]}/{low.get(key, (0, 0))[0]}" for key in COLUMNS]
                    other = {k: v for k, v in meas.items() if k not in COLUMNS and v[0] != low.get(k, (0,))[0]}
                    total = sum(v[1] for v in meas.values()) / sum(v[1] for v in low.values())
                    out.append(
                        (
                            schedule,
                            policy,
                            r["pp_rank"],
                            *cells,
                            " ".join(f"{g}:{k}={v[0]}" for (g, k), v in other.items()) or "-",
                            f"{total:.3f}",
                        )
                    )
    finally:
        world.close()
    print(
        f"pp2 x dp_shard2 x tp2, fp32; model dim={args.dim} layers={args.n_layers} vocab={args.vocab_size}; "
        f"global batch {rows}x{seq}, m={a.m}; cells: measured/minimum ops per step"
    )
    print(table(out))
    print("\n".join(f"refused {line}" for line in refused))


if __name__ == "__main__":
    main()
