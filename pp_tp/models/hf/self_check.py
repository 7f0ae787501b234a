"""The structural guarantee that a Hugging Face model is never trained silently wrong.

Before anything is built, the generic layout's composed forward (embedding -> blocks as the layout calls
them -> norm -> head, with the model-level extras; built on meta and materialized as a pipelined rank does,
so restored buffers are checked too) runs against the model's own `forward` on a small copy
of its config: 2+ layers covering every attention type, tiny widths, a sequence longer than any sliding
window, CPU, fp32, fixed seed. A family whose forward does anything the layout does not know is refused
in one line naming its class. The verdict is cached per (class, small config), so it costs seconds once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.stages.layouts import ModelLayout
from pp_tp.stages.plan import StageSpec
from pp_tp.stages.stage_module import StageModule

SEQ = 12  # longer than the sliding window set below, so window masks really cut
WINDOW = 4
TOLERANCE = 1e-5


def small_config(config):
    """A copy of `config` with tiny widths and just enough layers to cover each attention type."""
    small = copy.deepcopy(config)
    types = list(dict.fromkeys(getattr(config, "layer_types", None) or []))
    n_layers = max(2, len(types))
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    small_kv = 4 * kv // heads if (4 * kv) % heads == 0 and kv <= heads else 4
    sizes = {
        "num_hidden_layers": n_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": max(1, small_kv),
        "hidden_size": 64,
        "intermediate_size": 96,
        "vocab_size": 128,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_local_experts": min(getattr(config, "num_local_experts", 4) or 4, 4),
        "num_experts": min(getattr(config, "num_experts", 4) or 4, 4),
        "num_experts_per_tok": min(getattr(config, "num_experts_per_tok", 2) or 2, 2),
    }
    for key, value in sizes.items():
        if hasattr(small, key) and getattr(small, key) is not None:
            setattr(small, key, value)
    if getattr(small, "sliding_window", None) is not None:
        small.sliding_window = WINDOW
    if types:
        small.layer_types = (types * n_layers)[:n_layers]
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(small, key, None), int) and getattr(small, key) >= 128:
            setattr(small, key, 0)
    return small


def _materialized_stage(
    cls: type, small, reference: nn.Module, compose: Callable[[nn.Module], ModelLayout]
) -> StageModule:
    """The whole small model as one stage, built the way pipelined ranks build theirs: on meta, materialized
    with `to_empty`, buffers restored by the layout, parameters copied from `reference` under canonical keys."""
    with torch.device("meta"):
        meta = cls(small)
    layout = compose(meta)
    keys = layout.block_keys(meta)
    fqns = [layout.embed] + [f"{layout.blocks}.{k}" for k in keys] + [layout.norm, layout.head]
    stage = StageModule(meta, layout, StageSpec(0, 0, True, keys, True, fqns))
    stage.to_empty(device="cpu")
    layout.init_buffers(stage, meta)
    values = dict(reference.named_parameters())
    with torch.no_grad():
        for name, p in stage.named_parameters():
            p.copy_(values[stage.checkpoint_keys[name]])
    return stage.to(torch.float32).eval()


_VERDICTS: dict[tuple[type, str], str | None] = {}


def _verdict(cls: type, small, compose: Callable[[nn.Module], ModelLayout]) -> str | None:
    """None when the composition equals the model's forward on the small config, else why not."""
    torch.manual_seed(0)
    try:
        model = cls(small).to(torch.float32).eval()
        stage = _materialized_stage(cls, small, model, compose)
        ids = torch.randint(0, small.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = model(input_ids=ids).logits
            got = stage(ids)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the small copy is a reason to refuse
        return f"its 2-layer copy could not run through pp_tp's layout ({type(e).__name__}: {str(e)[:120]})"
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    return None if err <= TOLERANCE else f"its own forward differs from pp_tp's composition by {err:.1e} (relative)"


def self_check(model: nn.Module, compose: Callable[[nn.Module], ModelLayout]) -> None:
    """Refuses `model` in one line when its family's forward is not what `compose` describes."""
    small = small_config(model.config)
    key = (type(model), small.to_json_string(use_diff=False))
    if key not in _VERDICTS:
        _VERDICTS[key] = _verdict(type(model), small, compose)
    why = _VERDICTS[key]
    if why is not None:
        raise ConfigError(
            f"model {type(model).__name__}: {why}; pp_tp refuses it rather than train it differently "
            "(register a layout for it: pp_tp.extend.register_layout)"
        )
