"""Stage costs for the layout search, measured once per (tp, activation checkpointing, ep, cp) and reused.

A full dry run per candidate parallelizes and runs every stage kind on fake tensors (about a second for a
405B-like job); hundreds of candidates would take minutes. Blocks with the same parameter shapes are alike
(pp_tp.planner.moe.block_signatures: dense and MoE layers differ) and saved activations grow with the
microbatch, so a stage of kind (embed, blocks, head) is measured in parts: its edges alone (a stage of the
embedding and/or the head and loss, no block), its first block alone, plus, per further block, a plain stage of
(x, that block) minus one of (x) for what the block adds; on a fake world of ep x cp x tp ranks, with
microbatches of one and two sequences, and the rest follows:

- parameters: the TP/EP-local shapes of each part; FSDP gives dp/tp coordinate 0 the first chunk of dim 0,
  ceil(d0 / n) rows over its n = dp_shard x cp ranks (torch.chunk, as fully_shard pads), experts
  ceil(d0 / (dp_shard / ep)), so any dp_shard is counted exactly;
- activations: additive over blocks and affine in the microbatch (rotary slices do not grow with it; nor do the
  masks of context parallel's head-tail positions);
- the edges add to the blocks (assumed, stated in BENCHMARKS.md "Planner search time at 1024 ranks"): what the
  embedding and the head and loss save, and the parameters they hold, are the same with or without blocks beside
  them; a block saves its input whether the embedding or the previous stage made it. Measuring the edges apart
  runs each block forward once per (tp, AC, ep, cp) instead of once per edge kind (4 for a pp > 1 plan);
- an edge stage saves a constant (the loss's scalars) plus what grows with the tokens of a cp rank (assumed,
  BENCHMARKS.md as above): every other tensor its embedding, head and loss save holds the rank's mb x seq / cp
  tokens (a cp rank's position ids too), so at cp > 2 it follows from the cp = 2 measurement at microbatches of
  one and two sequences, and the edges are measured at cp 1 and 2 only, not at every cp degree;
- under full AC a further block of the first block's kind adds its parameters and what its checkpoint keeps that
  the stage did not hand it (assumed, as above): its hidden state and its own copies of the tables (FSDP casts its
  inputs per block); nothing inside a checkpointed block is kept. The first block's measurement gives both
  (activations.Saved.block_input), so the (x, block) pair is not built under full AC for such blocks.

tests/test_planner_search.py checks the result equals the full dry run (pp_tp.planner.plan_job).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import Counter
from dataclasses import dataclass

from pp_tp.base._torch import FakeTensorMode
from pp_tp.config import JobConfig
from pp_tp.config.fsdp_policy import FsdpPolicy
from pp_tp.errors import ConfigError
from pp_tp.models.factory import build_model
from pp_tp.parallel.mesh import make_mesh
from pp_tp.planner.activations import Saved, stage_activation_bytes
from pp_tp.planner.context import held_mask_bytes
from pp_tp.planner.fake_world import fake_world
from pp_tp.planner.memory import StageCost, boundary_extras, is_expert, tp_local_numel, tp_local_shape
from pp_tp.planner.moe import Signature, balanced_routing, block_signatures
from pp_tp.planner.stage_build import build_stage, checked_job
from pp_tp.split.plan import StageSpec

Kind = tuple[bool, tuple, bool]  # pp_tp.planner.moe.stage_kind
Probe = tuple[bool, tuple[str, ...], bool]  # a measured stage of the small model: (embed, block keys, head)


@dataclass(frozen=True)
class Measured:
    """One measured stage: TP/EP-local parameter shapes as {(dim0, rest): count}, dense and experts apart, the
    TP-local elements of each block and of the rest (FSDP units), and saved activation bytes of microbatches of
    one and two sequences."""

    shapes: Counter
    experts: Counter  # expert-parallel parameters: FSDP shards them over dp_shard / ep
    blocks: tuple[int, ...]
    rest: int
    act: int
    act2: int  # at a microbatch of two sequences: activations are affine in the microbatch (rotary slices)
    recompute: int = 0  # what the backward's recompute of one checkpointed module saves, at one and two
    recompute2: int = 0
    held: int = 0  # the masks context parallel keeps cached (pp_tp.planner.context.held_mask_bytes)
    fresh: tuple[int, int, int] = (0, 0, 0)  # under full AC, its first block's own saves (activations.Saved)
    fresh2: tuple[int, int, int] = (0, 0, 0)
    block_input: int = 0  # under full AC, what its first block's checkpoint keeps of the hidden state, at one and two
    block_input2: int = 0

    def local(self, dp_shard: int, ep: int) -> int:
        """Elements of the largest (first) FSDP shard."""
        return _sharded(self.shapes, dp_shard) + _sharded(self.experts, dp_shard // ep)

    @property
    def tp_local(self) -> int:
        return _sharded(self.shapes, 1) + _sharded(self.experts, 1)

    @property
    def unit(self) -> int:
        """The largest FSDP unit's TP-local elements (a block, or the stage's own parameters)."""
        return max([*self.blocks, self.rest])


def _measured(params: list, blocks: list, one: Saved, two: Saved, held: int, first: bool = False) -> Measured:
    """A probe's Measured from its parameters, blocks and Saved at microbatches of one and two sequences (`first`:
    a stage of its first block alone, read at that block's end)."""
    sizes = tuple(sum(tp_local_numel(p) for p in b.parameters()) for b in blocks)
    total = sum(tp_local_numel(p) for p in params)
    act1, act2 = (one.first_block, two.first_block) if first else (one.act, two.act)
    return Measured(
        Counter(_shape(p) for p in params if not is_expert(p)), Counter(_shape(p) for p in params if is_expert(p)),
        sizes, total - sum(sizes), act1, act2, one.recompute, two.recompute, held, one.fresh, two.fresh,
        one.block_input, two.block_input,
    )  # fmt: skip


def _sharded(shapes: Counter, n: int) -> int:
    """Elements of the first of `n` FSDP shards of parameters of these shapes (torch.chunk's rows)."""
    return sum(k * math.ceil(d0 / n) * rest for (d0, rest), k in shapes.items())


def _shape(p) -> tuple[int, int]:
    """(dim 0, elements per row) of the parameter as one TP/EP rank holds it, all-gathered over DP."""
    shape = tp_local_shape(p)
    d0 = shape[0] if shape else 1
    return d0, math.prod(shape) // max(d0, 1)


def _plus(acc: Counter, add: Counter, sub: Counter) -> None:
    """acc += add - sub, keeping negative counts until the sum is done."""
    acc.update(add)
    acc.subtract(sub)


class StageCostCache:
    """Stage costs of one job's model under any layout; measurements are keyed by (tp, AC, ep, cp, probe)."""

    def __init__(self, cfg: JobConfig, model, layout):
        self.cfg, self.model, self.layout = cfg, model, layout
        self._measured: dict[tuple[int, str, int, Probe], Measured] = {}
        self._costs: dict[tuple, StageCost] = {}
        self.dims = layout.dims(model)
        # Few blocks are all a measurement needs (two of each kind); an HF model keeps its config.json's shape.
        every = max(cfg.model.moe_every, 1) if cfg.model.n_experts else 1
        few = {"n_layers": min(2 * every, cfg.model.n_layers)} if not cfg.model.hf_path else {}
        self._small = dataclasses.replace(cfg.model, **few)
        small = build_model(self._small, "meta")
        # The small model's block keys by signature (the full model's blocks are measured on these).
        self._keys: dict[Signature, list[str]] = {}
        for key, sig in block_signatures(small, layout).items():
            self._keys.setdefault(sig, []).append(key)
        self._first = layout.block_keys(small)[0] if self._keys else None

    def _spec(self, probe: Probe) -> StageSpec:
        embed, keys, head = probe
        fqns = (list(self.layout.first.modules) if embed else []) + [f"{self.layout.blocks}.{b}" for b in keys]
        fqns += list(self.layout.last.modules) if head else []
        return StageSpec(0, 0, embed, list(keys), head, fqns)

    def _measure(self, tp: int, ac: str, ep: int, cp: int, probes: list[Probe]) -> None:
        """Builds each probe as a rank would (pp_tp.planner.stage_build) and runs it on a fake world of ep x cp x tp
        ranks (pp = 1, dp_shard = ep; ep and cp never both > 1), one sequence; shapes are read all-gathered over DP
        (FSDP shards over dp_shard x cp), so dp_shard = ep and cp shard nothing that is counted."""
        pcfg = dataclasses.replace(
            self.cfg.parallel, pp=1, tp=tp, ep=ep, cp=cp, dp_shard=ep, dp_replicate=1, activation_checkpoint=ac,
            compile=False, float8=False, fsdp_reshard_after_forward="default", fsdp_grad_reduce="step",
            schedule="1F1B", stages_per_rank=1, split="balanced", layers_per_stage=None, stage_fqns=None,
        )  # fmt: skip
        seq, dim = self.cfg.training.seq_len, self.layout.dims(self.model).dim
        with fake_world(ep * cp * tp), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            mesh = make_mesh("cpu", pcfg, ep * cp * tp)
            fake = FakeTensorMode(allow_non_fake_inputs=True)
            # a lone first block is read off its pair's forward at that block's end, not built apart
            alone = {(False, p[1][:1], False) for p in probes if not p[0] and not p[2] and len(p[1]) == 2}
            alone &= set(probes)
            for probe in (p for p in probes if p not in alone):
                model = build_model(self._small, "meta")  # the passes change modules in place
                # checked per model: an HF layout knows its own model's blocks (their layer types by identity)
                checked = checked_job(model, self.cfg, pcfg, mesh)
                fsdp = FsdpPolicy.for_rank(checked.parallel, 0)
                stage = build_stage(model, checked, self._spec(probe), mesh, fsdp)
                with fake, balanced_routing():
                    one, two = (stage_activation_bytes(stage, mesh, checked.parallel, mb, seq, dim) for mb in (1, 2))
                held, blocks = held_mask_bytes(stage), stage.block_modules()
                self._measured[(tp, ac, ep, cp, probe)] = _measured(list(stage.parameters()), blocks, one, two, held)
                if (False, probe[1][:1], False) in alone and len(probe[1]) == 2:
                    second = {id(p) for p in blocks[1].parameters()}
                    params = [p for p in stage.parameters() if id(p) not in second]
                    self._measured[(tp, ac, ep, cp, (False, probe[1][:1], False))] = _measured(
                        params, blocks[:1], one, two, held, first=True
                    )

    def _get(self, tp: int, ac: str, ep: int, cp: int, probes: list[Probe]) -> list[Measured]:
        missing = [k for k in dict.fromkeys(probes) if (tp, ac, ep, cp, k) not in self._measured]
        missing = [k for k in missing if k[1] or not self._scaled(tp, ac, ep, cp, k)]
        if missing:
            self._measure(tp, ac, ep, cp, missing)
        return [self._measured[(tp, ac, ep, cp, k)] for k in probes]

    def _scaled(self, tp: int, ac: str, ep: int, cp: int, edges: Probe) -> bool:
        """Stores the edge stage `edges` (no block) at cp > 2 from its cp = 2 measurement, and says whether it could:
        an edge stage saves a constant (scalars) plus what grows with the tokens a cp rank holds, mb x seq / cp
        (assumed, see the module docstring; parameters do not depend on cp, and an edge has no attention to cache
        masks for). At cp = 2 the microbatches of one and two sequences give the two parts apart."""
        if cp <= 2:
            return False
        try:
            (two,) = self._get(tp, ac, ep, 2, [edges])
        except ConfigError:
            return False  # cp = 2 refused here: measure at cp itself
        per_sequence = two.act2 - two.act  # at cp = 2
        if two.held or two.recompute or (2 * per_sequence) % cp:
            return False
        constant, per_sequence = two.act - per_sequence, 2 * per_sequence // cp
        self._measured[(tp, ac, ep, cp, edges)] = dataclasses.replace(
            two, act=constant + per_sequence, act2=constant + 2 * per_sequence
        )
        return True

    def _probes(self, kind: Kind, ac: str = "full") -> tuple[list[Probe], list[tuple[Probe, Probe]]]:
        """The stage's parts measured alone: its edges (no block) and its first block, and per further block the
        plain pair (x, that block) and (x) whose difference is what the block adds wherever it is (x: the small
        model's first block). Under full AC a further block of x's kind adds what x's checkpoint keeps of its
        hidden state (assumed, see the module docstring): its pair is (x, x), read off x's own measurement."""
        embed, sigs, head = kind
        parts = [(embed, (), head)] if embed or head else []
        parts += [(False, (self._keys[sigs[0]][0],), False)] if sigs else []
        pairs = []
        single = (False, (self._first,), False)
        for sig in sigs[1:]:
            if ac == "full" and self._first in self._keys[sig]:
                pairs.append((single, single))
                continue
            key = next(k for k in self._keys[sig] if k != self._first)
            pairs.append(((False, (self._first, key), False), single))
        return parts, pairs

    def cost(self, tp: int, ac: str, ep: int, cp: int, kind: Kind, dp_shard: int, microbatch: int) -> StageCost:
        """The StageCost the full dry run would measure for this stage kind and layout (FSDP over dp_shard x cp)."""
        key = (tp, ac, ep, cp, kind, dp_shard, microbatch)
        if key not in self._costs:
            embed, _, head = kind
            probes, pairs = self._probes(kind, ac)
            measured = self._get(tp, ac, ep, cp, [*probes, *(p for pair in pairs for p in pair)])
            parts, rest = measured[: len(probes)], measured[len(probes) :]
            shapes, experts = Counter(), Counter()
            act1 = act2 = recompute1 = recompute2 = held = 0
            for part in parts:  # the edges and the first block add (see the module docstring)
                shapes.update(part.shapes)
                experts.update(part.experts)
                act1, act2 = act1 + part.act, act2 + part.act2
                recompute1, recompute2 = max(recompute1, part.recompute), max(recompute2, part.recompute2)
                held += part.held
            for (with_block, alone), two, single in zip(pairs, rest[::2], rest[1::2]):  # what each further block adds
                if with_block == alone:  # (x, x): x's parameters and the hidden state its checkpoint keeps
                    shapes.update(single.shapes)
                    experts.update(single.experts)
                    act1, act2 = act1 + single.block_input, act2 + single.block_input2
                    continue
                _plus(shapes, two.shapes, single.shapes)
                _plus(experts, two.experts, single.experts)
                act1, act2 = act1 + two.act - single.act, act2 + two.act2 - single.act2
            blocks = tuple(b for part in parts for b in part.blocks) + tuple(two.blocks[-1] for two in rest[::2])
            edges = sum(part.rest for part in parts)
            probe = Measured(+shapes, +experts, blocks, edges, act1, act2)
            act, recompute = _at(act1, act2, microbatch), _at(recompute1, recompute2, microbatch)
            pcfg = dataclasses.replace(self.cfg.parallel, tp=tp, cp=cp)
            buffers, transient = boundary_extras(embed, head, pcfg, microbatch, self.cfg.training.seq_len, self.dims)
            self._costs[key] = StageCost(
                probe.local(dp_shard * cp, ep),
                probe.tp_local,
                act,
                probe.unit,
                buffers,
                transient + recompute,
                held,
            )
        return self._costs[key]

    def floor(self, tp: int, ac: str, ep: int, cp: int, kind: Kind, dp_shard: int, microbatch: int) -> StageCost:
        """A StageCost no larger in any field than this stage kind's under AC `ac` ("none" or "selective"), from the
        "full" AC measurement alone. Assumed (BENCHMARKS.md "Planner search time at 1024 ranks", checked by
        tests/test_planner_search.py): parameters, buffers and cp's masks do not depend on AC; checkpointing fewer
        modules saves at least what full AC saves; the edges save the same under any AC (a stage of no block has
        nothing to checkpoint); and each block of the first block's kind saves at least the storages it allocates
        and still holds at its end (activations.Saved.fresh, read off full AC's recompute of that block, which runs
        after the forward, so tables and masks the blocks share are not its own): all of them under "none", those
        saved outside attention under "selective", whose recompute saves at least those saved inside it."""
        full = self.cost(tp, "full", ep, cp, kind, dp_shard, microbatch)
        embed, sigs, head = kind
        pcfg = dataclasses.replace(self.cfg.parallel, tp=tp, cp=cp)
        _, transient = boundary_extras(embed, head, pcfg, microbatch, self.cfg.training.seq_len, self.dims)
        act, recompute = full.act_bytes, 0
        if sigs:
            *edges, block = self._get(tp, "full", ep, cp, self._probes(kind)[0])
            at = [_at(one, two, microbatch) for one, two in zip(block.fresh, block.fresh2)]
            own = sum(_at(e.act, e.act2, microbatch) for e in edges) + sigs.count(sigs[0]) * at[ac == "selective"]
            act = max(act, own)
            if ac == "none":
                act = max(act, full.transient_bytes - transient)  # its first block's recompute: what it saves
            else:
                recompute = at[2]
        return dataclasses.replace(full, act_bytes=act, transient_bytes=transient + recompute)


def _at(one: int, two: int, microbatch: int) -> int:
    """A size measured at microbatches of one and two sequences, at `microbatch` (affine in it)."""
    return one + (microbatch - 1) * (two - one)
