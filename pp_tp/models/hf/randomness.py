"""Randomness in a Hugging Face family's own training forward beyond dropout (router jitter, sparsemixer sampling,
layer drop), found by running it, not by a list of families.

Such draws come from torch's default generator, like dropout's, so pp_tp's dropout discipline (parallel/rng.py)
holds them too: each stage forward runs on its stage's stream (seeded by stage and dp rank: the same on the stage's
TP ranks, different across dp replicas), and only a TP-sharded region (a column-parallel output to the next
row-parallel input) runs on a per-TP-rank fork. A draw outside every region is therefore identical on every TP rank,
so a decision taken on replicated activations (which experts a token goes to) is too; a draw inside a region is not,
and pp_tp cannot tell whether it acts on sharded or replicated values. So the family's recorded training forward
(record.py: the small copy, every dropout off) shows whether the generator advanced at all; only where it did, two
training forwards from two different seeds decide whether the draws change the output, and the record's events give,
per layer, the order of its modules' calls and the calls between which the generator advanced. Replaying that order
against the styles the TP plan gives each module (which open and close a region) shows whether any draw falls inside
a region: then the layout refuses parallel.tp > 1 in one line; else the family is accepted. The config key whose zero
makes the two forwards equal is named (found by trying each positive float key): comparisons with another build
(`pp-tp parity`, the family sweep) turn it off (`switch_off_noise`); a family whose noise no single key turns off is
refused. Fixed seeds, CPU, fp32 and the verdict kept in the family's record: every rank reaches the same verdict.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.layout import ModelLayout
from pp_tp.models.hf.record import (
    TRAIN_ROWS,
    TRAIN_SEQ,
    Event,
    Record,
    quiet,
    record_of,
    seeded_values,
    without_dropout,
)
from pp_tp.parallel.tensor_parallel import block_plan, verify
from pp_tp.parallel.tp_styles import TP_STYLES


@dataclasses.dataclass(frozen=True)
class Noise:
    """A family's random draws beyond dropout: the config keys (and values) whose zero turns them off."""

    keys: dict[str, float]


@torch.no_grad()
def _draws(cls: type, config: Any) -> bool:
    """Whether two training forwards of `cls(config)` from different seeds differ (dropout modules at rate 0),
    with the model's own init and with spread values."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = quiet(cls(config).to(torch.float32).train())
        ids = torch.randint(0, config.vocab_size, (TRAIN_ROWS, TRAIN_SEQ), generator=torch.Generator().manual_seed(0))
        for values in ("init", "spread"):
            if values == "spread":
                seeded_values(model, 0)
            outs = []
            for seed in (1, 2):
                torch.manual_seed(seed)
                outs.append(model(input_ids=ids, use_cache=False).logits)
            if not torch.equal(outs[0], outs[1]):
                return True
    return False


def _noise_keys(cls: type, config: Any) -> list[str]:
    """The positive float config keys whose zero alone makes the two forwards equal."""
    keys = []
    for key, value in sorted(config.to_dict().items()):
        if isinstance(value, float) and not isinstance(value, bool) and value > 0 and hasattr(config, key):
            off = copy.deepcopy(config)
            setattr(off, key, 0.0)
            try:
                if not _draws(cls, off):
                    keys.append(key)
            except Exception:  # noqa: BLE001, S112 - a key the model cannot run without is not the noise's
                continue
    return keys


def _layer_events(events: list[Event], layer: str) -> tuple[Event, ...]:
    """The events of the recorded training forward inside the layer `layer` (fqn), named relative to it ("" the
    layer itself), each draw attributed to the innermost module of the layer that was running."""
    inside = lambda name: name == layer or name.startswith(f"{layer}.")  # noqa: E731
    relative = lambda name: name[len(layer) + 1 :]  # noqa: E731
    out = []
    for kind, name in events:
        if kind == "draw":
            running = [n for n in name if inside(n)]
            if running:
                out.append((kind, relative(running[-1])))
        elif inside(name):
            out.append((kind, relative(name)))
    return tuple(out)


def _verdict(record: Record) -> Noise | str | None:
    """None when the forward draws nothing outside dropout, the refusal text when no single key turns its draws
    off, else the Noise. The recorded training forward shows whether the generator advanced at all; only where it
    did do two seeds' forwards decide."""
    cls, config = record.cls, without_dropout(record.small)
    try:
        if not record.train()[1] or not _draws(cls, config):
            return None
    except Exception:  # noqa: BLE001 - a copy that cannot run here is the self-check's to refuse, not this check's
        return None
    keys = _noise_keys(cls, config)
    if not keys:
        return (
            f"model {cls.__name__}: its training forward draws random numbers outside dropout (a random draw no "
            "single config key turns off), which pp_tp's parity checks cannot switch off to compare; register a "
            "layout for it"
        )
    return Noise({k: getattr(config, k) for k in keys})


def _region_draw(events: tuple[Event, ...], styles: dict[str, str]) -> str | None:
    """The module drawing inside a TP-sharded region when the layer's calls replay against `styles` (layer-relative
    FQN -> style): a region opens after an "opens" style's output and closes before a "closes" style's input or at
    the layer's end, as parallel/rng.py's ShardedRegions; None when every draw falls outside."""
    region = False
    for kind, name in events:
        record = TP_STYLES[styles[name]].dropout if name in styles else None
        if kind == "draw" and region:
            return name
        if kind == "pre" and record == "closes":
            region = False
        elif kind == "post" and (record == "opens" or name == ""):
            region = record == "opens"
    return None


def _tp_refusal(model: nn.Module, layout: ModelLayout, noise: Noise, record: Record) -> str | None:
    """Why parallel.tp > 1 cannot hold the noise (a draw inside a region under the layout's TP plan), or None."""
    events = record.train()[0]
    for i, layer in enumerate(record.model.get_submodule(layout.blocks).children()):
        styles = verify(layer, block_plan(layer, layout)).resolved
        drawer = _region_draw(_layer_events(events, f"{layout.blocks}.{i}"), styles)
        if drawer is not None:
            keys = " or ".join(f"{k} = {v}" for k, v in noise.keys.items())
            return (
                f"model {type(model).__name__}: its training forward draws random numbers ({keys}) in "
                f"{layout.blocks}.{i}.{drawer}, inside a tensor-parallel sharded region, where each TP rank draws "
                f"its own; set parallel.tp = 1 or {' or '.join(noise.keys)} to 0 in the model config"
            )
    return None


def _noise(model: nn.Module) -> tuple[Noise | str | None, Record]:
    """The verdict for `model`'s family (kept in its record and on disk, the Noise as its keys)."""
    record = record_of(model)

    def compute() -> dict | str | None:
        verdict = _verdict(record)
        return {"keys": verdict.keys} if isinstance(verdict, Noise) else verdict

    kept = record.derived("noise", compute, on_disk=True)
    return (Noise(kept["keys"]) if isinstance(kept, dict) else kept), record


def check_randomness(model: nn.Module, layout: ModelLayout | None = None) -> ModelLayout | None:
    """`layout`, refusing parallel.tp > 1 (its tp_refusal) where a draw beyond dropout falls inside a TP-sharded
    region; refuses `model` in one line where no single config key turns such draws off (cached). Without a
    layout, any draw beyond dropout is refused (the key that turns it off named)."""
    noise, record = _noise(model)
    if isinstance(noise, str):
        raise ConfigError(noise)
    if noise is None or layout is None:
        if noise is not None:
            keys = " or ".join(f"{k} = {v}" for k, v in noise.keys.items())
            raise ConfigError(
                f"model {type(model).__name__}: its training forward draws random numbers outside dropout ({keys}); "
                f"set {' or '.join(noise.keys)} to 0 in the model config"
            )
        return layout
    if layout.tp_refusal:
        return layout
    try:
        why = _tp_refusal(model, layout, noise, record)
    except ConfigError as e:  # pp_tp cannot replay the plan on the small copy: no proof for parallel.tp > 1
        why = (
            f"model {type(model).__name__}: its random draws beyond dropout cannot be placed against its TP plan ({e})"
        )
    return dataclasses.replace(layout, tp_refusal=why) if why else layout


def noise_keys(model: nn.Module) -> dict[str, float]:
    """The config keys (and their values) whose zero turns `model`'s draws beyond dropout off; {} for none."""
    noise, _ = _noise(model)
    return dict(noise.keys) if isinstance(noise, Noise) else {}


def switch_off_noise(module: nn.Module, keys: dict[str, float]) -> list[str]:
    """Sets each of `keys` to 0 on every config a module of `module` holds and on every module copying it at init
    (PhiMoE's router keeps its own `router_jitter_noise`): a comparison with another build needs no random draws.
    Call it on each build after building (pp_tp's own checks see the noise on). Returns what was on."""
    owners: list[Any] = list(module.modules())
    owners += list({id(c): c for m in owners if (c := getattr(m, "config", None)) is not None}.values())
    found = set()
    for key in keys:
        for owner in owners:
            value = getattr(owner, key, None)
            if isinstance(value, float) and value > 0:
                setattr(owner, key, 0.0)
                found.add(key)
    return sorted(found)
