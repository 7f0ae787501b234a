"""Step time of a Hugging Face MoE model at pp1 x ep2 through pp_tp, against transformers' own expert parallel and
against whole experts, on 2 gloo ranks; and the rows each EP dispatch sends against the analytic minimum.

    python bench/moe_step.py [--rounds 5] [--steps 3]

transformers' distributed loading (`distributed_config`) needs `accelerate` (without it: "ValueError: Using a
`device_map`, `tp_plan`, ... requires `accelerate`"); the [hf] extra installs it.

A small Qwen3-MoE (fp32, CPU; 8 experts, top 2) saved once, loaded by three builds on the same 2 ranks, each a
data-parallel rank of its own batch share (the same tokens for all three):
- "pp_tp ep2": `build_pipeline` at pp1 x dp_shard2 x ep2 (experts split, tokens dispatched by all-to-all);
- "hf ep2": transformers' `from_pretrained(distributed_config=DistributedConfig(fsdp_size=2, ep_size=2))`, its
  `ep_dispatch_experts` plan with the `AllToAllEP` dispatch (FSDP2 over the dense part); its loss is its own,
  the same tokens with the labels shifted inside (SEQ - 1 targets per row), so its first loss differs a little;
- "pp_tp ep1": `build_pipeline` at pp1 x dp_shard2 with whole experts (FSDP2 shards them like everything else).
A step is forward + backward + AdamW. Rounds alternate the three (every round runs each for `--steps` steps after
a barrier) so load drifts hit all alike; the table gives each build's median step time (slowest rank) and the
ratios of medians. Then one more step of each EP build counts the forward all-to-all rows (bench/moe_alltoall.py's
`routed_rows`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from common import World, table
from moe_alltoall import routed_rows

import pp_tp

CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
              max_position_embeddings=256, norm_topk_prob=True)  # fmt: skip
ROWS, SEQ = 4, 128  # per rank
NAMES = ("pp_tp ep2", "hf ep2", "pp_tp ep1")


def _model(path: str) -> dict[str, torch.Tensor]:
    """The same seeded model on every rank: its state dict for pp_tp, written by rank 0 for transformers (pp_tp's
    checkpoint reader takes the experts' fused layout; save_pretrained writes them per expert)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))
    if dist.get_rank() == 0:
        model.save_pretrained(path)
    dist.barrier()
    return model.state_dict()


def _pp_tp(path: str, ep: int, state: dict[str, torch.Tensor]):
    """A pp_tp step on this rank's share and the modules holding its experts."""
    import parity_utils as pu

    from pp_tp.models.hf.build import hf_causal_lm, hf_config

    pcfg = pu.pcfg_of(pp=1, dp_shard=2, ep=ep)
    meta = hf_causal_lm(hf_config(path), "meta")
    pipe = pp_tp.build_pipeline(meta, pp_tp.build_mesh(pcfg), pcfg, state_dict={k: v.clone() for k, v in state.items()})
    opt = torch.optim.AdamW([p for part in pipe.model_parts for p in part.parameters()], lr=1e-4)

    def step(ids: torch.Tensor, labels: torch.Tensor) -> float:
        opt.zero_grad()
        loss = float(pipe.step(ids, labels))
        opt.step()
        return loss

    return step, pipe.model_parts


def _hf(path: str):
    """transformers' own expert parallel: a step on this rank's share (it shifts the labels itself)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(fsdp_size=2, ep_size=2)
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, dtype=torch.float32,
                                                 attn_implementation="sdpa")  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids: torch.Tensor, labels: torch.Tensor) -> float:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step, [model]


def case(path: str, rounds: int, steps: int) -> dict:
    from transformers.distributed import expert_parallel

    from pp_tp.parallel import expert_dispatch

    state = _model(path)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (2 * ROWS, SEQ + 1), generator=gen)[rank * ROWS : (rank + 1) * ROWS]
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    builds = {"pp_tp ep2": _pp_tp(path, 2, state), "hf ep2": _hf(path), "pp_tp ep1": _pp_tp(path, 1, state)}
    first = {name: step(x, y) for name, (step, _) in builds.items()}  # warm-up, and each build's first loss
    times: dict[str, list[float]] = {name: [] for name in builds}
    for _ in range(rounds):
        for name, (step, _) in builds.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step(x, y)
            t = torch.tensor([(time.perf_counter() - start) / steps])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            times[name].append(float(t))
    rows = {}
    for name, dispatch in (("pp_tp ep2", expert_dispatch), ("hf ep2", expert_parallel)):
        step, models = builds[name]
        with routed_rows(dispatch, models, 2, rank, CONFIG["num_experts"], CONFIG["hidden_size"]) as counts:
            step(x, y)
        rows[name] = counts
    return {"times": times, "first": first, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per build per round")
    args = parser.parse_args()
    world = World(2)
    try:
        with tempfile.TemporaryDirectory() as path:
            out = world.run(case, path, args.rounds, args.steps)
    finally:
        world.close()
    times, first = out[0]["times"], out[0]["first"]
    med = {name: statistics.median(times[name]) for name in NAMES}
    rows = [(n, f"{med[n]:.3f}", f"{min(times[n]):.3f}", " ".join(f"{t:.3f}" for t in times[n]), f"{first[n]:.4f}")
            for n in NAMES]  # fmt: skip
    print(table([("build", "median step (s)", "min", "rounds (s)", "first loss (rank 0)"), *rows]))
    print(f"pp_tp ep2 / hf ep2 = {med['pp_tp ep2'] / med['hf ep2']:.3f}; "
          f"pp_tp ep2 / pp_tp ep1 = {med['pp_tp ep2'] / med['pp_tp ep1']:.3f}")  # fmt: skip
    for name in ("pp_tp ep2", "hf ep2"):
        sent, minimum = (sum(r["rows"][name][k] for r in out) for k in ("sent", "minimum"))
        print(f"{name}: rows sent off-rank by the forward all-to-alls (both ranks, out and back, one step) = {sent}; "
              f"analytic minimum 2 x {minimum} = {2 * minimum} (ratio {sent / max(2 * minimum, 1):.3f}); "
              f"bytes = rows * {CONFIG['hidden_size']} * 4 = {sent * CONFIG['hidden_size'] * 4:,}")  # fmt: skip


if __name__ == "__main__":
    main()
