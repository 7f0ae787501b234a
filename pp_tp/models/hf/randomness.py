"""Randomness in a Hugging Face family's own training forward beyond dropout (router jitter, sparsemixer sampling,
layer drop), found by running it, not by a list of families.

pp_tp gives dropout a discipline (pp_tp/parallel/rng.py: one stream per TP rank where activations are sharded, the
same where they are replicated); any other random draw in a forward has none: TP ranks holding the same token could
route it differently, and the all-reduced expert sums would be garbage, silently. So the small copy of the config
(the self-check's) with every dropout off runs its training forward twice on the same input from two different
seeds; if the outputs differ, the family is refused in one line naming the config key whose zero makes them equal
(found by trying each positive float key), or, where no single key does, saying so. Fixed seeds, CPU, fp32 and a
cache per (class, small config): every rank reaches the same verdict.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.models.hf.self_check import small_config
from pp_tp.parallel.rng import DROPOUT_MODULES

_ROWS, _SEQ = 4, 32
_VERDICTS: dict[tuple[type, str], str | None] = {}


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


@torch.no_grad()
def _draws(cls: type, config: Any) -> bool:
    """Whether two training forwards of `cls(config)` from different seeds differ (dropout modules at rate 0),
    with the model's own init and with spread values."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config).to(torch.float32).train()
        for module in model.modules():
            if isinstance(module, DROPOUT_MODULES):
                module.p = 0.0  # attention kernels read the rate off the module (GPT-2)
        ids = torch.randint(0, config.vocab_size, (_ROWS, _SEQ), generator=torch.Generator().manual_seed(0))
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


def _verdict(cls: type, config: Any) -> str | None:
    """None when the forward draws nothing outside dropout, else the refusal text."""
    try:
        if not _draws(cls, config):
            return None
    except Exception:  # noqa: BLE001 - a copy that cannot run here is the self-check's to refuse, not this check's
        return None
    keys = _noise_keys(cls, config)
    if keys:
        what = " or ".join(f"{k} = {getattr(config, k)}" for k in keys)
        fix = f"set {' or '.join(keys)} to 0 in the model config"
    else:
        what, fix = "a random draw no single config key turns off", "register a layout for it"
    return (
        f"model {cls.__name__}: its training forward draws random numbers outside dropout ({what}), which pp_tp "
        f"cannot make identical on every TP rank or match in its parity check; {fix}"
    )


def check_randomness(model: nn.Module) -> None:
    """Refuses `model` in one line when its family's training forward is random beyond dropout (cached)."""
    small = _without_dropout(small_config(model.config))
    key = (type(model), small.to_json_string(use_diff=False))
    if key not in _VERDICTS:
        _VERDICTS[key] = _verdict(type(model), small)
    if _VERDICTS[key] is not None:
        raise ConfigError(_VERDICTS[key])
