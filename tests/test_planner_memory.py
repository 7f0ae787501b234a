"""The planner's memory model against a real run: predicted per-rank peak vs measured peak, within 15 %.

What is measured, on every rank of a 4-rank gloo world, over two training steps (zero_grad, Pipeline.step,
AdamW step) after the pipeline is built: the sum of the current sizes of every live tensor storage the
rank's thread touches, sampled after every aten/c10d op (a TorchDispatchMode). A storage is known once it
is an input or output of an op, or the storage of a parameter or buffer at the start; it is live until its
StorageImpl is freed (a weak reference to the storage, not to a tensor: autograd's saved tensors share
storages with tensors that are gone), and its size is read again at every sample, because FSDP2 resizes its
all-gather storages in place (resize_ outside the dispatcher). This is
tensor memory only: no allocator caching or fragmentation, no Python objects, no gloo's own buffers. Two
steps, so the second one sees what the first leaves behind: pipeline receive buffers, AdamW states,
gradients. The prediction is `pp_tp.planner.plan_job(cfg, 4)`'s RankMemory.total_bytes for the rank's pp
rank, compared on ranks at dp/tp coordinate 0 (the planner's rank). Under TP the measured peak of the last
pp rank varies between runs (when an async collective's buffer is freed depends on timing): 13.8 to 15.4 MB
for pp2-tp2-GPipe-AC, predicted 13.9 MB.
"""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pp_tp.config import config_from_dict

BASE = {
    "model": {"vocab_size": 512, "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
              "max_seq_len": 64},
    "training": {"batch_size": 32, "seq_len": 64},
}  # fmt: skip

CASES = {  # name: [parallel] keys; 4 ranks each
    "pp2-dp2-1F1B": dict(pp=2, dp_shard=2, schedule="1F1B", microbatches=4),
    "pp2-tp2-GPipe-AC": dict(pp=2, tp=2, schedule="GPipe", microbatches=4, activation_checkpoint="full"),
    "pp2-dp2-interleaved-always-microbatch": dict(
        pp=2, dp_shard=2, schedule="Interleaved1F1B", stages_per_rank=2, microbatches=4,
        fsdp_reshard_after_forward="always", fsdp_grad_reduce="microbatch",
    ),
    "pp2-dp2-1F1B-k2-selective": dict(
        pp=2, dp_shard=2, schedule="1F1B", microbatches=8, fsdp_grad_reduce=2, activation_checkpoint="selective"
    ),
    "pp4-GPipe": dict(pp=4, schedule="GPipe", microbatches=4),
    "moe-pp2-ep2-1F1B": dict(pp=2, dp_shard=2, ep=2, schedule="1F1B", microbatches=4),
}  # fmt: skip
# The reference MoE (every layer: 8 experts top 2, one shared): experts sharded over ep, routed slots and the
# dispatch's all-to-all buffers in the activations. The planner assumes balanced routing; this run routes for real.
MOE = {"n_experts": 8, "top_k": 2, "n_shared_experts": 1, "moe_ffn_dim": 64}


def job(name: str) -> dict:
    model = {**BASE["model"], **(MOE if name.startswith("moe") else {})}
    return {**BASE, "model": model, "parallel": {"tp": 1, "dp_shard": 1, "mixed_precision": "fp32", **CASES[name]}}


class LiveStorageBytes(TorchDispatchMode):
    """Peak of the summed current sizes of the live storages seen (see the module docstring). A storage is held by a
    weak reference to its Python object, which torch keeps alive exactly as long as the storage (PyObject
    preservation: autograd's saved tensors keep it too); that object reads the storage's current size directly, so a
    sample is one dereference and one size read per storage (measured against an expiry check, a tensor reference
    and a storage lookup per storage: the same peaks on every rank of every case, a case's CPU time down 30 %)."""

    def __init__(self):
        super().__init__()
        self._seen: dict[int, weakref.ref] = {}  # storage key -> weak reference to the storage's Python object
        self.peak = 0

    def track(self, t: torch.Tensor) -> None:
        from pp_tp.base._torch import local_tensor

        t = local_tensor(t)
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ref = self._seen.get(storage._cdata)
        if ref is None or ref() is None:
            self._seen[storage._cdata] = weakref.ref(storage)

    def sample(self) -> None:
        """Runs after every op."""
        total, dead = 0, []
        for key, ref in self._seen.items():
            storage = ref()
            if storage is None:
                dead.append(key)
            else:
                total += storage.nbytes()
        for key in dead:
            del self._seen[key]
        if total > self.peak:
            self.peak = total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                self.track(t)
        self.sample()
        return out


def measure_case(d: dict) -> dict:
    """Builds the job, runs two AdamW steps under LiveStorageBytes; this rank's coordinates and peak."""
    import pp_tp
    from pp_tp.models.factory import build_model
    from pp_tp.train.trainer import build_optimizers

    cfg = config_from_dict(d, world_size=4)
    p = cfg.parallel
    torch.manual_seed(0)
    mesh = pp_tp.build_mesh(p)
    pipe = pp_tp.build_pipeline(build_model(cfg.model, "meta"), mesh, p, seq_len=cfg.training.seq_len)
    optimizers, _ = build_optimizers(pipe.model_parts, cfg.training)
    local = cfg.training.batch_size // p.dp
    ids = torch.randint(0, cfg.model.vocab_size, (local, cfg.training.seq_len))
    coord0 = mesh["tp"].get_local_rank() == 0 and mesh["dp_shard"].get_local_rank() == 0
    mode = LiveStorageBytes()
    for part in pipe.model_parts:
        for t in (*part.parameters(), *part.buffers()):
            mode.track(t)
    # Only the planner's rank (dp/tp coordinate 0) is compared, so only it pays for the sampling.
    with mode if coord0 else contextlib.nullcontext():
        for _ in range(2):
            for opt in optimizers:
                opt.zero_grad()
            pipe.step(ids, ids)
            for opt in optimizers:
                opt.step()
    return {"pp_rank": mesh["pp"].get_local_rank(), "coord0": coord0, "peak": mode.peak}


@pytest.mark.parametrize("name", sorted(CASES))
def test_predicted_peak_within_15_percent_of_measured(name, world):
    from pp_tp.planner import plan_job

    d = job(name)
    predicted = [r.total_bytes for r in plan_job(config_from_dict(d, world_size=4), 4).ranks]
    for r in world(4).run(measure_case, d):
        if r["coord0"]:
            ratio = predicted[r["pp_rank"]] / r["peak"]
            pp_rank, peak = r["pp_rank"], r["peak"]
            print(f"\n{name} pp rank {pp_rank}: predicted {predicted[pp_rank]} measured {peak} ratio {ratio:.3f}")
            assert abs(ratio - 1) <= 0.15, (name, r, predicted)
