"""What tensor parallelism leaves whole on every TP rank, for the startup report and the family sweep.

A module whose Linear layers no TP rule splits (a mixer split by no head, an MLP the family's plan leaves out, MLA's
latent projections) runs whole on every TP rank: its input is the replicated activation, so every rank computes the
same output and the same parameter gradients (exact, no communication, its weights held whole on every rank).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from pp_tp.layout import ModelLayout
from pp_tp.parallel.tensor_parallel import block_plan, verify
from pp_tp.parallel.tp_styles import TP_STYLES


def _splits(style: str) -> bool:
    """Whether TP style `style` splits what it is applied to (else it only places activations)."""
    record = TP_STYLES[style]
    return record.sharded_dim is not None or record.head_params or record.parts > 1 or record.splits_mixer


def _shards(fqn: str, resolved: dict[str, str]) -> bool:
    """Whether a rule of `resolved` (a block's FQN -> style) splits the module at `fqn` or a module holding it."""
    return any((fqn == rule or fqn.startswith(rule + ".")) and _splits(style) for rule, style in resolved.items())


def splits_attention(model: nn.Module, layout: ModelLayout) -> bool:
    """Whether the TP plan splits anything inside some block's attention module (`layout.attention`): only then must
    its heads and KV heads divide by parallel.tp. Attention the plan leaves whole (DeepSeek-V4's, whose single KV
    head no TP degree divides) runs whole on every TP rank, exact. A block without that module counts as split: pp_tp
    cannot tell which of its rules are attention's, so the head checks stay, unless its plan splits nothing (Mamba's
    blocks, which run whole on every TP rank)."""
    prefix = layout.attention + "."
    for block in model.get_submodule(layout.blocks).children():
        resolved = verify(block, block_plan(block, layout)).resolved
        if not any(name == layout.attention for name, _ in block.named_modules()):
            if any(_splits(s) for s in resolved.values()):
                return True
            continue
        if any((rule == layout.attention or rule.startswith(prefix)) and _splits(s) for rule, s in resolved.items()):
            return True
    return False


def whole_on_tp(parts: Iterable[nn.Module]) -> dict[str, tuple[tuple[str, ...], int]]:
    """`whole_in_blocks` over these stages' (StageModules') blocks: what this rank holds and runs whole."""
    found: dict[str, tuple[tuple[str, ...], int]] = {}
    for part in parts:
        for name, (classes, count) in whole_in_blocks(part.block_modules(), part.layout).items():
            seen, before = found.get(name, ((), 0))
            found[name] = (tuple(sorted({*seen, *classes})), before + count)
    return dict(sorted(found.items()))


def whole_in_blocks(blocks: Iterable[nn.Module], layout: ModelLayout) -> dict[str, tuple[tuple[str, ...], int]]:
    """{block-relative module: (its classes, parameter count summed over `blocks`)} for the largest modules whose
    Linear layers the TP plan splits none of: every TP rank holds and runs them whole (a mixer split by no head, an
    MLP the family's plan leaves out, MLA's latent projections)."""
    found: dict[str, tuple[set[str], int]] = {}
    for block in blocks:
        resolved = verify(block, block_plan(block, layout)).resolved
        linears = [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]
        whole = {n for n in linears if not _shards(n, resolved)}
        for top in {_largest(n, linears, whole) for n in whole}:
            module = block.get_submodule(top)
            classes, count = found.get(top, (set(), 0))
            found[top] = (classes | {type(module).__name__}, count + sum(p.numel() for p in module.parameters()))
    return {k: (tuple(sorted(c)), n) for k, (c, n) in sorted(found.items())}


def _largest(name: str, linears: list[str], whole: set[str]) -> str:
    """The highest module holding `name` below the block whose Linear layers are all in `whole`."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        holder = ".".join(parts[:i])
        if all(n in whole for n in linears if n.startswith(holder + ".")):
            return holder
    return name
