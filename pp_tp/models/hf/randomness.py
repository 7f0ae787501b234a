"""Randomness in a Hugging Face family's own training forward beyond dropout (router jitter, sparsemixer sampling,
layer drop), found by running it, not by a list of families.

Such draws come from torch's default generator, like dropout's, so pp_tp's dropout discipline (parallel/rng.py)
holds them too: each stage forward runs on its stage's stream (seeded by stage and dp rank: the same on the stage's
TP ranks, different across dp replicas), and only a TP-sharded region (a column-parallel output to the next
row-parallel input) runs on a per-TP-rank fork. A draw outside every region is therefore identical on every TP rank,
so a decision taken on replicated activations (which experts a token goes to) is too; a draw inside a region is not,
and pp_tp cannot tell whether it acts on sharded or replicated values. So the small copy of the config (the
self-check's) with every dropout off runs its training forward twice from two different seeds; where the outputs
differ, a third run records, per layer, the order of its modules' calls and the calls between which the generator
advanced. Replaying that order against the styles the TP plan gives each module (which open and close a region)
shows whether any draw falls inside a region: then the layout refuses parallel.tp > 1 in one line; else the family
is accepted. The config key whose zero makes the two forwards equal is named (found by trying each positive float
key): comparisons with another build (`pp-tp parity`, the family sweep) turn it off (`switch_off_noise`); a family
whose noise no single key turns off is refused. Fixed seeds, CPU, fp32 and a cache per (class, small config): every
rank reaches the same verdict.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.layout import ModelLayout
from pp_tp.models.hf.self_check import small_config
from pp_tp.parallel.rng import DROPOUT_MODULES
from pp_tp.parallel.tensor_parallel import block_plan, verify
from pp_tp.parallel.tp_styles import TP_STYLES

_ROWS, _SEQ = 4, 32
# One layer's calls in its forward's order: ("pre", name) / ("post", name) around each module's forward (names
# layer-relative, "" the layer itself), ("draw", name) where the generator advanced inside the module `name` ran.
Event = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class Noise:
    """A family's random draws beyond dropout: the config keys (and values) whose zero turns them off."""

    keys: dict[str, float]


_VERDICTS: dict[tuple[type, str], Noise | str | None] = {}
_EVENTS: dict[tuple[type, str, str], tuple[tuple[Event, ...], ...]] = {}


def is_dropout_key(key: str) -> bool:
    """A config key holding a dropout rate (`attention_dropout`, GPT-2's `attn_pdrop`), not layer drop."""
    return "dropout" in key or key.endswith("pdrop")


def _without_dropout(config: Any) -> Any:
    """A copy with every positive `*dropout*` float key at 0 (dropout has pp_tp's discipline; it is not asked here)."""
    quiet = copy.deepcopy(config)
    for key, value in config.to_dict().items():
        if is_dropout_key(key) and isinstance(value, float) and value > 0 and hasattr(quiet, key):
            setattr(quiet, key, 0.0)
    return quiet


@torch.no_grad()
def _spread(model: nn.Module) -> None:
    """Seeded values N(0, 0.05), norm weights around 1: router scores far from the init's, so noise that only acts
    on near ties (sparsemixer's jitter) shows in one of the two value sets."""
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        norm = leaf == "weight" and "norm" in type(model.get_submodule(owner)).__name__.lower()
        p.copy_(torch.randn(p.shape, generator=gen) * 0.05 + (1.0 if norm else 0.0))


def _quiet_model(cls: type, config: Any) -> nn.Module:
    """`cls(config)` in training mode, fp32, seeded, every dropout module at rate 0."""
    torch.manual_seed(0)
    model = cls(config).to(torch.float32).train()
    for module in model.modules():
        if isinstance(module, DROPOUT_MODULES):
            module.p = 0.0  # attention kernels read the rate off the module (GPT-2)
    return model


def _ids(config: Any) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (_ROWS, _SEQ), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _draws(cls: type, config: Any) -> bool:
    """Whether two training forwards of `cls(config)` from different seeds differ (dropout modules at rate 0),
    with the model's own init and with spread values."""
    with torch.random.fork_rng(devices=[]):
        model = _quiet_model(cls, config)
        ids = _ids(config)
        for values in ("init", "spread"):
            if values == "spread":
                _spread(model)
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
            quiet = copy.deepcopy(config)
            setattr(quiet, key, 0.0)
            try:
                if not _draws(cls, quiet):
                    keys.append(key)
            except Exception:  # noqa: BLE001, S112 - a key the model cannot run without is not the noise's
                continue
    return keys


class _Recorder:
    """Hooks on every module of each layer: the calls in order, and a draw wherever the CPU generator's state
    changed since the previous call boundary (attributed to the module running then)."""

    def __init__(self, layers: list[nn.Module]):
        self.events: list[list[Event]] = [[] for _ in layers]
        self.current: int | None = None
        self.stack: list[str] = []
        self.state = torch.get_rng_state()
        self.handles = []
        for i, layer in enumerate(layers):
            for name, module in layer.named_modules():
                self.handles.append(module.register_forward_pre_hook(lambda m, a, i=i, n=name: self._pre(i, n)))
                self.handles.append(module.register_forward_hook(lambda m, a, o, i=i, n=name: self._post(i, n)))

    def _mark(self) -> None:
        now = torch.get_rng_state()
        if self.current is not None and not torch.equal(now, self.state):
            self.events[self.current].append(("draw", self.stack[-1]))
        self.state = now

    def _pre(self, i: int, name: str) -> None:
        self._mark()
        self.current = i if name == "" else self.current
        self.stack.append(name)
        self.events[i].append(("pre", name))

    def _post(self, i: int, name: str) -> None:
        self._mark()
        self.stack.pop()
        self.events[i].append(("post", name))
        self.current = None if name == "" else self.current

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def _layer_events(cls: type, config: Any, blocks: str) -> tuple[tuple[Event, ...], ...]:
    """Each layer's calls and draws in one training forward of the small copy (spread values, as `_draws`)."""
    with torch.random.fork_rng(devices=[]):
        model = _quiet_model(cls, config)
        _spread(model)
        recorder = _Recorder(list(model.get_submodule(blocks).children()))
        try:
            torch.manual_seed(1)
            model(input_ids=_ids(config), use_cache=False)
        finally:
            recorder.remove()
    return tuple(tuple(e) for e in recorder.events)


def _verdict(cls: type, config: Any) -> Noise | str | None:
    """None when the forward draws nothing outside dropout, the refusal text when no single key turns its draws
    off, else the Noise."""
    try:
        if not _draws(cls, config):
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


def _tp_refusal(model: nn.Module, layout: ModelLayout, noise: Noise, small: Any) -> str | None:
    """Why parallel.tp > 1 cannot hold the noise (a draw inside a region under the layout's TP plan), or None."""
    key = (type(model), small.to_json_string(use_diff=False), layout.blocks)
    if key not in _EVENTS:
        _EVENTS[key] = _layer_events(type(model), small, layout.blocks)
    with torch.device("meta"):
        layers = list(type(model)(small).get_submodule(layout.blocks).children())
    for i, (layer, events) in enumerate(zip(layers, _EVENTS[key])):
        styles = verify(layer, block_plan(layer, layout)).resolved
        drawer = _region_draw(events, styles)
        if drawer is not None:
            keys = " or ".join(f"{k} = {v}" for k, v in noise.keys.items())
            return (
                f"model {type(model).__name__}: its training forward draws random numbers ({keys}) in "
                f"{layout.blocks}.{i}.{drawer}, inside a tensor-parallel sharded region, where each TP rank draws "
                f"its own; set parallel.tp = 1 or {' or '.join(noise.keys)} to 0 in the model config"
            )
    return None


def _noise(model: nn.Module) -> tuple[Noise | str | None, Any]:
    """The cached verdict for `model`'s family and its small copy with dropout off."""
    small = _without_dropout(small_config(model.config))
    key = (type(model), small.to_json_string(use_diff=False))
    if key not in _VERDICTS:
        _VERDICTS[key] = _verdict(type(model), small)
    return _VERDICTS[key], small


def check_randomness(model: nn.Module, layout: ModelLayout | None = None) -> ModelLayout | None:
    """`layout`, refusing parallel.tp > 1 (its tp_refusal) where a draw beyond dropout falls inside a TP-sharded
    region; refuses `model` in one line where no single config key turns such draws off (cached). Without a
    layout, any draw beyond dropout is refused (the key that turns it off named)."""
    noise, small = _noise(model)
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
        why = _tp_refusal(model, layout, noise, small)
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
