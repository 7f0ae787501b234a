"""Dropout's random streams under pipeline, data and tensor parallelism (Megatron's discipline, on torch's generators).

torch's dropout (modules, `F.dropout`, SDPA's `dropout_p`) draws from the device's default generator, so pp_tp
swaps that generator's state rather than handing dropout a generator of its own:

- every stage has its own stream, seeded from (seed, stage index, dp rank): the same on a stage's TP ranks,
  different across stages and dp replicas. A stage forward runs on it and gives the caller's state back.
- a TP-sharded region (from a column-parallel layer's sharded output to the row-parallel layer's input) runs on a
  stream forked from the stage's with the TP rank, so head and feature shards draw independent masks; the stage's
  stream is back before the row layer, so every replicated activation draws the same mask on every TP rank.
- the fork's seed is drawn from the stage's stream, so activation checkpointing's recompute (which restores the
  stream as it was at the block's start) forks alike and redraws the same masks.

Which styles open and close a region is each style's record (`TPStyle.dropout`, parallel/tp_styles.py).

Any other draw a model's forward makes from the default generator (PhiMoE's sparsemixer routing) rides the same
streams: outside every region it is identical on a stage's TP ranks and differs across stages and dp replicas;
models/hf/randomness.py refuses TP where such a draw would fall inside a region.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pp_tp.base.seeded_init import seed_of
from pp_tp.parallel.tp_styles import TP_STYLES

if TYPE_CHECKING:  # annotations only: the stage is built elsewhere
    from pp_tp.stages.stage_module import StageModule

DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
DEVICES = ("cpu", "cuda")  # the device types whose default generators pp_tp swaps


def active_dropout(module: nn.Module) -> list[str]:
    """Where `module` drops activations in training: dropout modules with p > 0 and float attributes named like
    `*dropout*` above 0 (the rates HF modules pass to `F.dropout` and to attention kernels)."""
    found = []
    for name, m in module.named_modules():
        if isinstance(m, DROPOUT_MODULES) and m.p > 0:
            found.append(name)
        for attr, value in vars(m).items():
            if "dropout" in attr and isinstance(value, float) and value > 0:
                found.append(f"{name}.{attr}" if name else attr)
    return found


def switch_off_dropout(module: nn.Module) -> list[str]:
    """Sets every rate `active_dropout` finds, and the `*dropout*` floats of the module's `config` (a forward may read
    its rate there), to 0: a comparison with another build needs no random masks. Returns what was on."""
    found = active_dropout(module)
    config = getattr(module, "config", None)
    for owner in [*module.modules(), *([config] if config is not None else [])]:
        if isinstance(owner, DROPOUT_MODULES):
            owner.p = 0.0
        for attr, value in list(vars(owner).items()):
            if "dropout" in attr and isinstance(value, float) and value > 0:
                found += [f"config.{attr}"] if owner is config else []
                setattr(owner, attr, 0.0)
    return found


class Generators:
    """The default generators a stage's ops draw from: the CPU one, and on CUDA the current device's."""

    def __init__(self, device_type: str):
        self.cuda = device_type == "cuda"

    def get(self) -> list[torch.Tensor]:
        return [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if self.cuda else [])

    def set(self, states: list[torch.Tensor]) -> None:
        torch.set_rng_state(states[0])
        if self.cuda:
            torch.cuda.set_rng_state(states[1])

    def seed(self, value: int) -> None:
        torch.default_generator.manual_seed(value)
        if self.cuda:
            torch.cuda.default_generators[torch.cuda.current_device()].manual_seed(value)


class StageStream:
    """One stage's stream: swapped in around each training forward of the stage, its state kept between them."""

    def __init__(self, stage: nn.Module, seed: int, stage_index: int, dp_rank: int, device_type: str):
        self.generators = Generators(device_type)
        outer = self.generators.get()
        self.generators.seed(seed_of(seed, f"dropout/stage{stage_index}/dp{dp_rank}"))
        self.state = self.generators.get()
        self.generators.set(outer)
        self._outer: list[torch.Tensor] | None = None
        stage.register_forward_pre_hook(self._enter)
        stage.register_forward_hook(self._leave)

    def _enter(self, module: nn.Module, args: Any) -> None:
        if module.training:
            self._outer = self.generators.get()
            self.generators.set(self.state)

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._outer is not None:
            self.state = self.generators.get()
            self.generators.set(self._outer)
            self._outer = None


class ShardedRegions:
    """The TP rank's fork of the stage stream, open from a column-parallel layer's output to the next row-parallel
    layer's input (or the block's end, whichever comes first)."""

    def __init__(self, device_type: str, tp_rank: int):
        self.generators = Generators(device_type)
        self.tp_rank = tp_rank
        self._stage_state: list[torch.Tensor] | None = None

    def open(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._stage_state is None and module.training:
            draw = int(torch.randint(1 << 62, (1,)))  # from the stage stream: alike on every TP rank
            self._stage_state = self.generators.get()
            self.generators.seed(seed_of(draw, f"tp{self.tp_rank}"))

    def close(self, *_: Any) -> None:
        if self._stage_state is not None:
            self.generators.set(self._stage_state)
            self._stage_state = None


def install_sharded_regions(stage: StageModule, resolved: Mapping[str, str], device_type: str, tp_rank: int) -> None:
    """Forks the stream at every block's column-parallel outputs and joins it at its row-parallel inputs and at the
    block's end; `resolved`: stage FQN -> style name, as the TP pass applied them."""
    regions = ShardedRegions(device_type, tp_rank)
    for key, block in zip(stage.spec.blocks, stage.block_modules()):
        prefix = f"{stage.layout.blocks}.{key}."
        for fqn, style in resolved.items():
            if fqn.startswith(prefix) and TP_STYLES[style].dropout == "opens":
                stage.get_submodule(fqn).register_forward_hook(regions.open)
            elif fqn.startswith(prefix) and TP_STYLES[style].dropout == "closes":
                stage.get_submodule(fqn).register_forward_pre_hook(regions.close)
        block.register_forward_hook(regions.close)
