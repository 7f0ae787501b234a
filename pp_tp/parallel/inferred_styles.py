"""TP styles for the Megatron pairs pp_tp infers in families that declare no TP plan (models/hf/tp_infer.py).

- `Conv1DParallel`: transformers' `Conv1D` (GPT-2, OpenAI GPT) is a Linear storing its weight transposed ([in, out]),
  split on its output (weight dim 1, bias dim 0; per part for a fused [q|k|v]) or on its input (weight dim 0, bias
  whole, added once after the all-reduce). Home-made: torch's ColwiseParallel / RowwiseParallel take only nn.Linear
  and nn.Embedding.
- `LocalHeads`: an attention module whose forward reads its head counts and widths from its own attributes (GPT-2's
  `split_size`, BLOOM's `num_heads`) gets this rank's values (`localize`), and the per-head tensors its family computes
  for all heads at once (ALiBi biases: BLOOM's `alibi`, MPT's `position_bias`) are sliced to this rank's heads as they
  come in (`heads_slice`). Home-made: torch's styles shard weights, not a module's integers or its other inputs.
The self-check in tp_infer.py runs the same `localize` and `heads_slice` on a shrunk copy, so what it proves is what
these styles do.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from pp_tp.base._torch import StridedShard
from pp_tp.errors import ConfigError

# Head counts and the widths they make (heads x head_dim) that attention modules read in their forward, by the names
# transformers' families give them; divided by the TP degree where a module holds them as ints.
HEAD_NAMES = ("num_heads", "n_heads", "n_head", "num_attention_heads", "num_key_value_heads", "num_kv_heads")
WIDTH_NAMES = ("split_size", "embed_dim", "hidden_size", "all_head_size", "d_model_size", "kv_projection_size")


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D: `nf` output features, weight [in, nf]."""
    w = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2


def localizable(module: nn.Module) -> list[str]:
    """The int attributes of `module` (its own, and head counts of its `config`) that `localize` divides."""
    own = [n for n in (*HEAD_NAMES, *WIDTH_NAMES) if type(vars(module).get(n)) is int]
    config = getattr(module, "config", None)
    return own + [f"config.{n}" for n in HEAD_NAMES if type(getattr(config, n, None)) is int]


def localize(module: nn.Module, tp: int, where: str = "") -> None:
    """Divides `localizable(module)` by `tp` (its config as a copy of its own); one line when one does not divide."""
    names = localizable(module)
    config = getattr(module, "config", None)
    local = copy.copy(config) if any(n.startswith("config.") for n in names) else config
    for name in names:
        owner, attr = (local, name[7:]) if name.startswith("config.") else (module, name)
        value = getattr(owner, attr)
        if value % tp:
            raise ConfigError(
                f"{where or type(module).__name__}.{name} = {value} is not divisible by parallel.tp = {tp}; "
                "set parallel.tp to a divisor of it"
            )
        setattr(owner, attr, value // tp)
    if local is not config:
        module.config = local


def head_count(module: nn.Module) -> int | None:
    """The module's query head count (its first `HEAD_NAMES` int), before `localize`."""
    return next((vars(module)[n] for n in HEAD_NAMES if type(vars(module).get(n)) is int), None)


def heads_slice(t: torch.Tensor, heads: int, batch: int, rank: int, tp: int) -> torch.Tensor:
    """This rank's heads of a tensor computed for all `heads`: [batch * heads, ...] (BLOOM's alibi) or with a dim of
    size `heads` (MPT's [heads, 1, seq] position_bias)."""
    local = heads // tp
    if t.shape[0] == batch * heads:
        return t.view(batch, heads, *t.shape[1:])[:, rank * local : (rank + 1) * local].reshape(-1, *t.shape[1:])
    dim = list(t.shape).index(heads)
    return t.narrow(dim, rank * local, local)


def slice_inputs(module: nn.Module, names: tuple[str, ...], rank: int, tp: int, heads: int):  # noqa: ANN201
    """A forward pre-hook (with kwargs) slicing the arguments `names` of `module` to this rank's heads."""
    params = list(inspect.signature(module.forward).parameters)

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        first = args[0] if args else kwargs.get(params[0])
        batch = first.shape[0]
        args, kwargs = list(args), dict(kwargs)
        for name in names:
            if name in kwargs and isinstance(kwargs[name], torch.Tensor):
                kwargs[name] = heads_slice(kwargs[name], heads, batch, rank, tp)
            elif (
                name in params and params.index(name) < len(args) and isinstance(args[params.index(name)], torch.Tensor)
            ):
                args[params.index(name)] = heads_slice(args[params.index(name)], heads, batch, rank, tp)
        return tuple(args), kwargs

    return hook


class LocalHeads(ParallelStyle):
    """This rank's head counts and widths on an attention module, and its per-head inputs `computed` sliced."""

    def __init__(self, computed: tuple[str, ...] = ()):
        super().__init__()
        self.computed = computed

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        heads, tp = head_count(module), device_mesh.size()
        localize(module, tp)
        if self.computed and heads:
            hook = slice_inputs(module, self.computed, device_mesh.get_local_rank(), tp, heads)
            module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class Conv1DParallel(ParallelStyle):
    """transformers' Conv1D split on its output features (`column`, per part when it packs `parts` equal blocks) or on
    its input features; the forward runs on the local shards (see the module docstring)."""

    def __init__(self, column: bool, parts: int = 1):
        super().__init__()
        self.column, self.parts = column, parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, dim = device_mesh.size(), 1 if self.column else 0
        if module.weight.shape[dim] % (tp * self.parts):
            raise ConfigError(
                f"{type(module).__name__} weight {tuple(module.weight.shape)}: dim {dim} does not split into "
                f"{self.parts} part(s) over parallel.tp = {tp}; set parallel.tp to a divisor of it"
            )

        def split(d: int) -> Shard:
            return StridedShard(d, split_factor=self.parts) if self.parts > 1 else Shard(d)

        placements = {"weight": split(dim), "bias": split(0) if self.column else Replicate()}
        for name, p in list(module.named_parameters(recurse=False)):
            shard = distribute_tensor(p, device_mesh, [placements[name]], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))
        column = self.column

        def forward(x: torch.Tensor) -> torch.Tensor:
            w = module.weight.to_local()  # differentiable: the gradient comes back with the weight's placement
            b = module.bias.to_local() if module.bias is not None else None
            if column:  # the input gradient, partial over this rank's features, all-reduced where x became a DTensor
                if not isinstance(x, DTensor):
                    x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                x = x.to_local(grad_placements=[Partial()])
            y = (x.reshape(-1, x.shape[-1]) @ w).view(*x.shape[:-1], -1)
            if not column:
                y = DTensor.from_local(y, device_mesh, [Partial()], run_check=False)
                y = y.redistribute(device_mesh, [Replicate()]).to_local()  # the one forward all-reduce
            return y if b is None else y + b

        module.forward = forward
        return module
