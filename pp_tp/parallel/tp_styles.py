"""TP styles: one record per style name, in one registry that the built-ins and plugins fill alike.

A plan maps module FQNs to style names; everything pp_tp needs to know about a style (the torch ParallelStyle
it applies, what the checks before any collective must verify, what it does to dropout's random streams) is its
`TPStyle` record, so a style registered by a plugin is checked, planned and given dropout streams like a built-in.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from pp_tp.base._torch import local_tensor
from pp_tp.parallel.declared_tp import ConvChannelParallel
from pp_tp.parallel.inferred_styles import Conv1DParallel, LocalHeads
from pp_tp.parallel.local_styles import PackedColwise, ReplicatedPartialGrad, localize_heads, shard_head_params
from pp_tp.parallel.mixer_tp import GATED_DELTA_NET, MAMBA2, HeadSplitMixer

# What a style does to a TP-sharded dropout region (parallel/rng.py): "opens" (its output is this rank's feature or
# head shard: the TP rank's stream forks there), "closes" (it reads the shard and hands on a replicated activation:
# the stage's stream is back before it runs), "neutral" (it hands on a replicated activation, or only prepares
# inputs). None: not known, so dropout next to it is refused (preflight.check_dropout).
DropoutRegion = Literal["opens", "closes", "neutral"]


@dataclass(frozen=True)
class TPStyle:
    """One TP style: how to apply it and what the plan checks and the dropout streams must know about it."""

    # A fresh torch ParallelStyle per module; None leaves the module whole on every TP rank.
    factory: Callable[[], ParallelStyle | None]
    # The nn.Linear / nn.Conv2d weight dim it splits, checked against parallel.tp before any collective (None: no
    # such weight split; the embedding's vocabulary is checked with the model shape).
    sharded_dim: int | None = None
    # Equal parts the sharded dim packs (gate and up: 2), each split over TP, so each must divide by parallel.tp.
    parts: int = 1
    # A column-parallel output all-gathered back to full width: what follows it sees whole activations.
    gathered: bool = False
    # It only prepares the module's inputs: the module's Linear layers still need rules of their own.
    input_only: bool = False
    # An input style that also splits the module's own per-head parameters by heads (dim 0).
    head_params: bool = False
    # Valid only inside a replicate_input sub-block: it leaves its input gradient partial for that all-reduce.
    in_region: bool = False
    dropout: DropoutRegion | None = None
    # The mixer it goes on (a module, not a Linear) is split by heads whole: its own input and output collectives,
    # its own checks when applied (parallel/mixer_tp.py).
    splits_mixer: bool = False

    def __post_init__(self) -> None:
        if self.dropout not in (None, "opens", "closes", "neutral"):
            raise ValueError(f"TPStyle.dropout = {self.dropout!r}; use 'opens', 'closes', 'neutral' or None")
        if self.parts < 1 or (self.parts > 1 and self.sharded_dim is None):
            raise ValueError(f"TPStyle.parts = {self.parts} needs parts >= 1 and, above 1, a sharded_dim")
        if self.head_params and not self.input_only:
            raise ValueError("TPStyle.head_params is a kind of input style; set input_only = True as well")


# Style name -> record: the one table plans, checks and dropout streams read.
TP_STYLES: dict[str, TPStyle] = {}


def register_tp_style(name: str, style: TPStyle) -> None:
    """Adds (or replaces) a style name plans may use; the built-ins come in through here too."""
    if not isinstance(style, TPStyle):
        raise TypeError(f"register_tp_style({name!r}, ...) takes a pp_tp.extend.TPStyle record, not {style!r}")
    TP_STYLES[name] = style


class ReplicateInput(ParallelStyle):
    """Makes a sub-block's hidden-state input a Replicate DTensor (Megatron's f); other arguments pass untouched.

    The column-parallel layers reading it return Partial input gradients that autograd adds up locally;
    leaving the DTensor in backward all-reduces the sum once. Everything in the module that reads the
    hidden state must therefore be a TP-styled layer. The hidden state is the first positional argument,
    or, when the caller passes everything by keyword, the keyword named like the forward's first parameter.
    Not PrepareModuleInput: that needs the module's exact positional arity, which differs between models.
    `local_heads`: the module slices a per-part-split q/k/v projection by its head counts (local_styles.py).
    `head_params`: the module's own parameters hold one entry per head (GPT-OSS's sinks): split by heads and read
    as this rank's shard inside its forward (local_styles.py).
    """

    def __init__(self, local_heads: bool = False, head_params: bool = False):
        super().__init__()
        self.local_heads = local_heads
        self.head_params = head_params

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters), None)
        if self.local_heads:
            localize_heads(module, device_mesh.size())
        if self.head_params:
            shard_head_params(module, device_mesh, self.src_data_rank)

        def replicate(x: torch.Tensor) -> DTensor:
            return DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
            if args:
                return (replicate(args[0]), *args[1:]), kwargs
            if first not in kwargs:
                raise TypeError(
                    f"{type(mod).__name__} (TP style 'replicate_input') got no positional argument "
                    f"and no {first!r} keyword to replicate"
                )
            return args, {**kwargs, first: replicate(kwargs[first])}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class _OwnedLocal(torch.autograd.Function):
    """A replicated DTensor's local tensor itself, not `to_local`'s view of it: autograd forbids modifying a custom
    Function's view in place, and families add into a row-parallel output in place (Llama 4's MoE:
    `shared_expert(x).add_(routed)`). No copy: the DTensor is the all-reduce's fresh result, read by nothing else."""

    @staticmethod
    def forward(ctx: Any, dtensor: DTensor) -> torch.Tensor:  # noqa: D102
        ctx.mesh, ctx.placements = dtensor.device_mesh, dtensor.placements
        return local_tensor(dtensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> DTensor:  # noqa: D102
        return DTensor.from_local(grad, ctx.mesh, ctx.placements, run_check=False)


class OwnedRowwise(RowwiseParallel):
    """RowwiseParallel whose local output is a tensor of its own (`_OwnedLocal`), so it may be modified in place.
    The all-reduce is waited for at once, as the first use of `to_local`'s view would."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001, ANN205
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return _OwnedLocal.apply(outputs) if use_local_output else outputs


_BUILT_IN = {
    # Weight and bias sharded on out_features; the output stays this rank's feature (head) shard.
    "colwise": TPStyle(lambda: ColwiseParallel(use_local_output=True), sharded_dim=0, dropout="opens"),
    # Same, with the output all-gathered: the default head, full-vocabulary logits on every TP rank.
    "colwise_gather_output": TPStyle(
        lambda: ColwiseParallel(output_layouts=Replicate(), use_local_output=True),
        sharded_dim=0,
        gathered=True,
        dropout="neutral",
    ),
    # Weight sharded on in_features; the partial sums are all-reduced, the bias is added once.
    "rowwise": TPStyle(lambda: OwnedRowwise(use_local_output=True), sharded_dim=1, dropout="closes"),
    # Weight sharded on in_features, the replicated input sliced locally, the partial sums all-reduced
    # (after a gathered column-parallel layer, e.g. HF's fused projections).
    "rowwise_split_input": TPStyle(
        lambda: OwnedRowwise(input_layouts=Replicate(), use_local_output=True), sharded_dim=1, dropout="closes"
    ),
    # nn.Embedding sharded on the vocabulary; each rank looks up its rows, the sum is all-reduced: the output it
    # hands on is replicated, and its input is token ids, never a sharded activation (neutral). Its output a tensor of
    # its own (OwnedRowwise): CTRL's forward scales the embedding's output in place.
    "vocab_parallel": TPStyle(
        lambda: OwnedRowwise(input_layouts=Replicate(), use_local_output=True), dropout="neutral"
    ),
    # Per part: a Linear packing 2 (gate, up) or 3 equal parts (q, k, v) on its output, each split over TP, so the
    # local output is every part's shard in order (local_styles.py); no gather.
    "colwise_packed2": TPStyle(lambda: PackedColwise(2), sharded_dim=0, parts=2, dropout="opens"),
    "colwise_packed3": TPStyle(lambda: PackedColwise(3), sharded_dim=0, parts=3, dropout="opens"),
    # Column-parallel on a replicated module's output inside the sub-block (MLA's kv_b_proj): input gradient partial.
    "colwise_in_region": TPStyle(lambda: PackedColwise(1), sharded_dim=0, in_region=True, dropout="opens"),
    # Whole on every TP rank inside a replicate_input sub-block (MLA's latent projections and norms): gradients
    # Partial, the parameters' summed once per step (reduce_partial_grads), the input's by the sub-block's all-reduce.
    "replicated_partial_grad": TPStyle(ReplicatedPartialGrad, in_region=True, dropout="neutral"),
    # Replicated weights on a head-sharded input (q/k norms): the weights become Replicate DTensors, so
    # their gradients come out Partial and are summed over TP once per step (reduce_partial_grads).
    # The norm acts on the last dim only, so naming dim 2 (heads of [b, s, h, d]) as sharded is bookkeeping.
    "replicated_with_grad_allreduce": TPStyle(
        lambda: SequenceParallel(sequence_dim=2, use_local_output=True), dropout="neutral"
    ),
    # Left whole on every TP rank; listed so verify() does not report its Linear layers as forgotten.
    "replicate": TPStyle(lambda: None, dropout="neutral"),
    # On an attention / MLP module: one all-reduce of its input gradient per microbatch (ReplicateInput).
    "replicate_input": TPStyle(ReplicateInput, input_only=True, dropout="neutral"),
    # The same on an attention module reading head counts to slice a per-part-split q/k/v projection.
    "replicate_input_local_heads": TPStyle(
        lambda: ReplicateInput(local_heads=True), input_only=True, dropout="neutral"
    ),
    # The same on an attention module whose own parameters hold one entry per head (sinks): split by heads.
    "replicate_input_head_params": TPStyle(
        lambda: ReplicateInput(head_params=True), input_only=True, head_params=True, dropout="neutral"
    ),
    # A plain 1x1 nn.Conv2d split on output / input channels (declared with _tp_col / _tp_row; declared_tp.py):
    # the column conv hands on its channel shard, the row conv all-reduces back to whole channels, like Linear pairs.
    "conv_colwise": TPStyle(lambda: ConvChannelParallel(column=True), sharded_dim=0, dropout="opens"),
    "conv_rowwise": TPStyle(lambda: ConvChannelParallel(column=False), sharded_dim=1, dropout="closes"),
    # transformers' Conv1D (weight [in, out]; GPT-2) split on its output (weight dim 1), whole or per part, or on its
    # input (weight dim 0; its own check when applied); and an attention module's head counts and widths made this
    # rank's, wherever its layers sit below it (Moshi's q_proj.linear), so not an input-only style (pairs inferred for
    # families without a plan: inferred_styles.py, models/hf/tp_infer.py).
    "conv1d_colwise": TPStyle(lambda: Conv1DParallel(column=True), sharded_dim=1, dropout="opens"),
    "conv1d_colwise_packed2": TPStyle(lambda: Conv1DParallel(True, 2), sharded_dim=1, parts=2, dropout="opens"),
    "conv1d_colwise_packed3": TPStyle(lambda: Conv1DParallel(True, 3), sharded_dim=1, parts=3, dropout="opens"),
    "conv1d_rowwise": TPStyle(lambda: Conv1DParallel(column=False), sharded_dim=0, dropout="closes"),
    "local_heads": TPStyle(LocalHeads, dropout="neutral"),
    # On a gated delta net mixer (linear attention): split by key heads with their value heads, input replicated,
    # out_proj row-parallel, its own checks at apply time (mixer_tp.py); it hands on a replicated activation.
    "gated_delta_net": TPStyle(lambda: HeadSplitMixer(GATED_DELTA_NET), dropout="neutral", splits_mixer=True),
    # The same on a Mamba2 mixer, split by groups (n_groups) with their heads.
    "mamba2": TPStyle(lambda: HeadSplitMixer(MAMBA2), dropout="neutral", splits_mixer=True),
}
for _name, _style in _BUILT_IN.items():
    register_tp_style(_name, _style)
