"""Stage costs for the layout search, measured once per (tp, activation checkpointing) and reused.

A full dry run per candidate parallelizes and runs every stage kind on fake tensors (about a second for a
405B-like job); hundreds of candidates would take minutes. Blocks of one model are alike and saved
activations grow with the microbatch, so a stage of kind (embed, n blocks, head) is measured at n = 1
(and a plain stage at n = 1 and 2, for what a block adds), on dp = 1, with microbatches of one and two
sequences, and the rest follows:

- parameters: the TP-local shapes of each part; FSDP gives dp/tp coordinate 0 the first chunk of dim 0,
  ceil(d0 / dp_shard) rows (torch.chunk, as fully_shard pads), so any dp_shard is counted exactly;
- activations: linear in n and affine in the microbatch (rotary slices do not grow with it).

tests/test_planner_search.py checks the result equals the full dry run (pp_tp.planner.plan_job).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import Counter
from dataclasses import dataclass

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from pp_tp._torch import FakeTensorMode
from pp_tp.config import JobConfig
from pp_tp.config.fsdp_policy import FsdpPolicy
from pp_tp.mesh import MESH_DIMS
from pp_tp.models.factory import build_model
from pp_tp.parallel.apply import parallelize_stage
from pp_tp.planner.activations import stage_activation_bytes
from pp_tp.planner.fake_world import fake_world
from pp_tp.planner.memory import StageCost, boundary_extras, tp_local_numel
from pp_tp.preflight import resolve_embedding
from pp_tp.split.plan import StageSpec
from pp_tp.stages.stage_module import StageModule

Kind = tuple[bool, int, bool]  # (embed, blocks, head)


@dataclass(frozen=True)
class Measured:
    """One measured stage: TP-local parameter shapes as {(dim0, rest): count}, its largest FSDP unit's
    TP-local elements, and saved activation bytes of microbatches of one and two sequences."""

    shapes: Counter
    unit: int
    act: int
    act2: int  # at a microbatch of two sequences: activations are affine in the microbatch (rotary slices)
    recompute: int = 0  # what the backward's recompute of one checkpointed module saves, at one and two
    recompute2: int = 0

    def local(self, dp_shard: int) -> int:
        """Elements of the largest (first) FSDP shard."""
        return sum(n * math.ceil(d0 / dp_shard) * rest for (d0, rest), n in self.shapes.items())

    @property
    def tp_local(self) -> int:
        return sum(n * d0 * rest for (d0, rest), n in self.shapes.items())


def _shape(p) -> tuple[int, int]:
    """(dim 0, elements per row) of the parameter as one TP rank holds it (on dp = 1, its local tensor)."""
    local = p.to_local() if isinstance(p, DTensor) else p
    d0 = local.shape[0] if local.dim() else 1
    return d0, local.numel() // max(d0, 1)


class StageCostCache:
    """Stage costs of one job's model under any layout; measurements are keyed by (tp, AC, kind)."""

    def __init__(self, cfg: JobConfig, model, layout):
        self.cfg, self.model, self.layout = cfg, model, layout
        self._measured: dict[tuple[int, str, Kind], Measured] = {}
        self._costs: dict[tuple, StageCost] = {}
        self.dims = layout.dims(model)
        # Two blocks are all a measurement needs; an HF model keeps its config.json's shape.
        few = {"n_layers": min(2, cfg.model.n_layers)} if not cfg.model.hf_path else {}
        self._small = dataclasses.replace(cfg.model, **few)

    def _spec(self, kind: Kind) -> StageSpec:
        embed, n, head = kind
        keys = self.layout.block_keys(self.model)[:n]
        fqns = ([self.layout.embed] if embed else []) + [f"{self.layout.blocks}.{b}" for b in keys]
        fqns += [self.layout.norm, self.layout.head] if head else []
        return StageSpec(0, 0, embed, keys, head, fqns)

    def _measure(self, tp: int, ac: str, kinds: list[Kind]) -> None:
        """Parallelizes and runs each kind on a fake world of tp ranks (pp = dp = 1), one sequence."""
        sized = resolve_embedding(dataclasses.replace(self.cfg.parallel, tp=tp), self.dims)
        pcfg = dataclasses.replace(
            sized, pp=1, tp=tp, dp_shard=1, dp_replicate=1, activation_checkpoint=ac, compile=False,
            float8=False, fsdp_reshard_after_forward="default", fsdp_grad_reduce="step", schedule="1F1B",
            stages_per_rank=1, split="balanced", layers_per_stage=None, stage_fqns=None,
        )  # fmt: skip
        seq, dim = self.cfg.training.seq_len, self.layout.dims(self.model).dim
        with fake_world(tp), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            mesh = init_device_mesh("cpu", (1, 1, 1, tp), mesh_dim_names=MESH_DIMS)
            fake = FakeTensorMode(allow_non_fake_inputs=True)
            for kind in kinds:
                model = build_model(self._small, "meta")  # the passes change the model's modules in place
                stage = StageModule(model, self.layout, self._spec(kind))
                parallelize_stage(stage, mesh, pcfg, FsdpPolicy.for_rank(pcfg, 0))
                shapes = Counter(_shape(p) for p in stage.parameters())
                blocks = [sum(tp_local_numel(p) for p in b.parameters()) for b in stage.block_modules()]
                total = sum(tp_local_numel(p) for p in stage.parameters())
                with fake:
                    (act1, re1), (act2, re2) = (
                        stage_activation_bytes(stage, mesh, pcfg, mb, seq, dim) for mb in (1, 2)
                    )
                unit = max([*blocks, total - sum(blocks)])
                self._measured[(tp, ac, kind)] = Measured(shapes, unit, act1, act2, re1, re2)

    def _get(self, tp: int, ac: str, kinds: list[Kind]) -> list[Measured]:
        missing = [k for k in dict.fromkeys(kinds) if (tp, ac, k) not in self._measured]
        if missing:
            self._measure(tp, ac, missing)
        return [self._measured[(tp, ac, k)] for k in kinds]

    def cost(self, tp: int, ac: str, kind: Kind, dp_shard: int, microbatch: int) -> StageCost:
        """The StageCost the full dry run would measure for this stage kind and layout."""
        key = (tp, ac, kind, dp_shard, microbatch)
        if key not in self._costs:
            embed, n, head = kind
            if n >= 1 and self.layout.dims(self.model).n_layers >= 2:  # a block adds the same wherever it is
                one, b1, b2 = self._get(tp, ac, [(embed, 1, head), (False, 1, False), (False, 2, False)])
            else:
                one = b1 = b2 = self._get(tp, ac, [kind])[0]
            k = max(n - 1, 0)
            shapes = Counter({s: one.shapes[s] + k * (b2.shapes[s] - b1.shapes[s]) for s in one.shapes | b2.shapes})
            act1, act2 = (getattr(one, a) + k * (getattr(b2, a) - getattr(b1, a)) for a in ("act", "act2"))
            probe = Measured(+shapes, max(one.unit, b2.unit), act1, act2)
            act = act1 + (microbatch - 1) * (act2 - act1)
            recompute = one.recompute + (microbatch - 1) * (one.recompute2 - one.recompute)
            pcfg = dataclasses.replace(self.cfg.parallel, tp=tp)
            buffers, transient = boundary_extras(embed, head, pcfg, microbatch, self.cfg.training.seq_len, self.dims)
            self._costs[key] = StageCost(
                probe.local(dp_shard), probe.tp_local, act, probe.unit, buffers, transient + recompute
            )
        return self._costs[key]
