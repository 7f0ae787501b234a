"""Head-split tensor parallel for linear-attention and state-space mixers (gated delta net, Mamba2): the mixer's own
forward on this TP rank's heads, at Megatron's minimum (one all-reduce forward, one backward, per mixer and microbatch).

The mixer's input enters replicated and is read locally with a Partial gradient (all-reduced once in backward, like
"replicate_input"); every parameter is read as this rank's share of the heads (key heads with their value heads;
Mamba2 groups with their heads), out_proj's weight as its columns; the mixer's output, out_proj's partial sums, is
all-reduced once in forward and out_proj's bias added after. Reducing the mixer's output rather than out_proj's keeps
fused kernels that take out_proj's weight themselves (Mamba2's training path with mamba_ssm) right; it assumes, as the
mixers here do, that the forward returns out_proj's output. The head counts and widths the forward reads
(`MixerSplit.local`) become this rank's on the module, so transformers' own forward runs unchanged on local tensors.
Home-made: torch's styles split a Linear weight in one contiguous slice and no module's own parameters, while a mixer
packs several head-indexed segments into one weight (q | k | v; z | x | B | C | dt) and keeps per-head parameters.

Each parameter is described by its head segments along one dim (`Segments`), and held as follows:
- one segment: `Shard(dim)` (a per-key-head grouped layout such as Qwen3-Next's in_proj_qkvz is one segment);
- equal segments of a 2-D weight: `_StridedShard(dim, split_factor=parts)`, this rank's slice of every segment;
- unequal segments (q | k | v when key_dim != value_dim, Mamba2's in_proj), or several in a tensor that is not 2-D
  (FSDP shards dim 0 of those, parallel/fsdp.py): no torch placement holds one rank's rows, so the tensor stays whole
  on every TP rank (Replicate), is read by this rank's rows, and its Partial gradient is summed once per step
  (reduce_partial_grads): memory and a per-step all-reduce of a whole weight, the compute still split;
- shared by every head (the gated norm's weight over head_dim): Replicate, Partial gradient summed once per step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from pp_tp.base._torch import StridedShard, swap_parameters
from pp_tp.errors import ConfigError

# (heads, width of one head) per segment along a parameter's split dim, in storage order.
Segments = tuple[tuple[int, int], ...]
_PARTIAL = (Partial(),)


@dataclass(frozen=True)
class MixerSplit:
    """What a head split reads from a mixer module: everything is an attribute transformers' module holds."""

    style: str  # the TP style name, for errors
    heads: str  # the head count every segment's split follows (key heads: value heads are grouped with them)
    local: tuple[str, ...]  # int attributes the forward reads, divided by tp on the module (this rank's counts)
    out: str  # the output projection: its columns split, the mixer's output all-reduced, its bias added after
    # The module -> {parameter FQN: (dim, segments), or None when every head shares it}; FQNs the module lacks are
    # ignored, a parameter missing from the table is refused.
    params: Callable[[nn.Module], dict[str, tuple[int, Segments] | None]]
    # The module -> why its split would not be exact (a norm wider than a rank's heads), or None.
    inexact: Callable[[nn.Module], str | None] = lambda module: None


@dataclass(frozen=True)
class Cut:
    """How one parameter is held over TP and read on a rank."""

    placement: Placement
    dim: int = 0
    rows: Segments | None = None  # read by this rank's share of each segment (a Replicate parameter); None: local
    after: bool = False  # the output projection's bias: left out of the mixer, added once after the all-reduce

    @property
    def whole(self) -> bool:
        """Held whole on every TP rank."""
        return self.placement.is_replicate()


def _gated_delta_net_params(m: nn.Module) -> dict[str, tuple[int, Segments] | None]:
    """Transformers' gated delta nets (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, ...): value head j reads key head
    j // (num_v_heads // num_k_heads) (repeat_interleave in the delta rule), so key head h's group is contiguous."""
    nk, nv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    group = nv // nk
    qkv = ((nk, dk), (nk, dk), (nv, dv))
    per_value_head = (0, ((nv, 1),))
    norm = getattr(getattr(m, "norm", None), "weight", None)
    return {
        "conv1d.weight": (0, qkv),
        "conv1d.bias": (0, qkv),
        "A_log": per_value_head,
        "dt_bias": per_value_head,
        # A norm over head_v_dim shares its weight across heads; one weight per value channel splits with them.
        "norm.weight": (0, ((nv, dv),)) if norm is not None and norm.numel() == nv * dv else None,
        # Qwen3-Next: rows grouped per key head, [q, k, v (group heads), z (group heads)] and [b, a] (its
        # fix_query_key_value_ordering): one segment of key heads.
        "in_proj_qkvz.weight": (0, ((nk, 2 * dk + 2 * group * dv),)),
        "in_proj_ba.weight": (0, ((nk, 2 * group),)),
        # Qwen3.5: q | k | v packed, then separate z, b, a.
        "in_proj_qkv.weight": (0, qkv),
        "in_proj_z.weight": (0, ((nv, dv),)),
        "in_proj_b.weight": per_value_head,
        "in_proj_a.weight": per_value_head,
        "out_proj.weight": (1, ((nv, dv),)),
    }


GATED_DELTA_NET = MixerSplit(
    style="gated_delta_net",
    heads="num_k_heads",
    local=("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim"),
    out="out_proj",
    params=_gated_delta_net_params,
)


def _mamba2_params(m: nn.Module) -> dict[str, tuple[int, Segments] | None]:
    """Transformers' Mamba2 mixers (Mamba2, NemotronH, Bamba, Zamba2, ...): in_proj packs [z | x | B | C | dt], the
    conv runs over [x | B | C]; head h reads group h // (num_heads // n_groups) (repeat_interleave in the scan)."""
    nh, hd, ng, ds = m.num_heads, m.head_dim, m.n_groups, m.ssm_state_size
    xbc = ((nh, hd), (ng, ds), (ng, ds))
    per_head = (0, ((nh, 1),))
    return {
        "in_proj.weight": (0, ((nh, hd), *xbc, (nh, 1))),
        "in_proj.bias": (0, ((nh, hd), *xbc, (nh, 1))),
        "conv1d.weight": (0, xbc),
        "conv1d.bias": (0, xbc),
        "A_log": per_head,
        "dt_bias": per_head,
        "D": per_head,
        "norm.weight": (0, ((nh, hd),)),
        "out_proj.weight": (1, ((nh, hd),)),
    }


def _mamba2_inexact(m: nn.Module) -> str | None:
    """The gated norm must normalize within a group (a rank holds whole groups), not across the intermediate size."""
    size = getattr(getattr(m, "norm", None), "group_size", None)
    if size != m.intermediate_size // m.n_groups:
        return f"its gated norm's group_size is {size}, not intermediate_size // n_groups (a norm across TP ranks)"
    return None


MAMBA2 = MixerSplit(
    style="mamba2",
    heads="n_groups",
    local=("num_heads", "n_groups", "intermediate_size", "conv_dim"),
    out="out_proj",
    params=_mamba2_params,
    inexact=_mamba2_inexact,
)


def _cut(shape: torch.Size, dim: int, segments: Segments) -> Cut:
    if len(segments) == 1:
        return Cut(Shard(dim), dim)
    if len(shape) == 2 and len({h * w for h, w in segments}) == 1:
        return Cut(StridedShard(dim, split_factor=len(segments)), dim)
    return Cut(Replicate(), dim, segments)


def plan_head_split(module: nn.Module, split: MixerSplit, tp: int, where: str) -> dict[str, Cut]:
    """How each parameter of `module` is held at `tp` (`Cut.whole`: what stays whole on every TP rank, for a startup
    report); refuses in one line, before any collective, what cannot be split exactly (a head count `tp` does not
    divide, a norm across ranks, a parameter or shape the split does not know). `where` names the module."""
    missing = [a for a in (split.heads, *split.local, split.out) if not hasattr(module, a)]
    if missing:
        raise ConfigError(
            f"{where} ({type(module).__name__}) has no attribute {missing[0]!r}, which TP style {split.style!r} "
            "reads; use another style for it or set parallel.tp = 1"
        )
    heads = getattr(module, split.heads)
    bad = [a for a in split.local if not isinstance(getattr(module, a), int) or getattr(module, a) % tp]
    if heads % tp or bad:
        name, value = (split.heads, heads) if heads % tp else (bad[0], getattr(module, bad[0]))
        raise ConfigError(
            f"{where}.{name} = {value} is not divisible by parallel.tp = {tp} (TP style {split.style!r} splits "
            f"{type(module).__name__} by {split.heads}); set parallel.tp to a divisor of {heads}"
        )
    reason = split.inexact(module)
    if reason:
        raise ConfigError(
            f"{where} ({type(module).__name__}): TP style {split.style!r} cannot split it exactly: {reason}; "
            "set parallel.tp = 1 or let the mixer run whole on every TP rank"
        )
    table = split.params(module)
    cuts: dict[str, Cut] = {}
    for fqn, p in module.named_parameters():
        if fqn == f"{split.out}.bias":
            cuts[fqn] = Cut(Replicate(), after=True)
            continue
        if fqn not in table:
            raise ConfigError(
                f"{where}.{fqn}: TP style {split.style!r} does not know this parameter of {type(module).__name__}; "
                "set parallel.tp = 1 or let the mixer run whole on every TP rank"
            )
        entry = table[fqn]
        if entry is None:
            cuts[fqn] = Cut(Replicate())
            continue
        dim, segments = entry
        if p.shape[dim] != sum(h * w for h, w in segments) or any(h % tp for h, _ in segments):
            raise ConfigError(
                f"{where}.{fqn}: dim {dim} of {tuple(p.shape)} is not the head layout {list(segments)} "
                f"(heads, width) TP style {split.style!r} splits over parallel.tp = {tp}; set parallel.tp = 1"
            )
        cuts[fqn] = _cut(p.shape, dim, segments)
    return cuts


def _rows(segments: Segments, rank: int, tp: int) -> torch.Tensor:
    """This rank's indices along the split dim: its contiguous share of each segment's heads."""
    rows, offset = [], 0
    for heads, width in segments:
        size = heads // tp * width
        rows.append(torch.arange(offset + rank * size, offset + (rank + 1) * size))
        offset += heads * width
    return torch.cat(rows)


def _local(p: torch.Tensor, cut: Cut, rows: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor the mixer's forward reads on this rank: its shard, or its rows of a whole (Replicate) parameter
    (gradient Partial: this rank back-propagates its heads' share); None for the bias added after the all-reduce."""
    if cut.after:
        return None
    if not cut.whole:
        return p.to_local()
    whole = p.to_local(grad_placements=_PARTIAL)
    return whole if rows is None else whole.index_select(cut.dim, rows.to(whole.device))


class HeadSplitMixer(ParallelStyle):
    """Splits a mixer module by heads over the TP mesh (see the module docstring); applied to the mixer itself."""

    def __init__(self, split: MixerSplit):
        super().__init__()
        self.split = split

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        cuts = plan_head_split(module, self.split, tp, type(module).__name__)
        rows = {}
        for fqn, cut in cuts.items():
            owner_name, _, name = fqn.rpartition(".")
            owner = module.get_submodule(owner_name)
            p = getattr(owner, name)
            held = distribute_tensor(p, device_mesh, [cut.placement], src_data_rank=self.src_data_rank)
            owner.register_parameter(name, nn.Parameter(held, requires_grad=p.requires_grad))
            rows[fqn] = _rows(cut.rows, rank, tp) if cut.rows is not None else None
        for attr in self.split.local:
            setattr(module, attr, getattr(module, attr) // tp)
        first = next(iter(inspect.signature(module.forward).parameters))
        forward = module.forward
        bias = f"{self.split.out}.bias"

        def local_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            # The input read locally with a Partial gradient: one all-reduce when backward leaves the DTensor.
            if args:
                args = (_partial_grad(args[0], device_mesh), *args[1:])
            else:
                kwargs = {**kwargs, first: _partial_grad(kwargs[first], device_mesh)}
            with _reading(module, cuts, rows):
                partial = forward(*args, **kwargs)
            # The output projection's partial sums (this rank's heads), all-reduced once; the bias added once.
            out = DTensor.from_local(partial, device_mesh, _PARTIAL, run_check=False)
            out = out.redistribute(device_mesh, (Replicate(),)).to_local()
            return out + module.get_parameter(bias).to_local() if bias in cuts else out

        module.forward = local_forward
        return module


def _partial_grad(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).to_local(grad_placements=_PARTIAL)


@contextmanager
def _reading(module: nn.Module, cuts: dict[str, Cut], rows: dict[str, torch.Tensor | None]) -> Iterator[None]:
    """The mixer's parameters read as this rank's local tensors while inside."""
    owners: dict[str, dict[str, torch.Tensor | None]] = {}
    for fqn, cut in cuts.items():
        owner, _, name = fqn.rpartition(".")
        owners.setdefault(owner, {})[name] = _local(module.get_parameter(fqn), cut, rows[fqn])
    saved = [(module.get_submodule(o), swap_parameters(module.get_submodule(o), t)) for o, t in owners.items()]
    try:
        yield
    finally:
        for owner, params in saved:
            swap_parameters(owner, params)
