"""The structural guarantee that a Hugging Face model is never trained silently wrong.

Before anything is built, the generic layout's composed forward (embedding -> blocks as the layout calls
them -> norm -> head, with the model-level extras; built on meta and materialized as a pipelined rank does,
so restored buffers are checked too) runs against the model's own `forward` on a small copy
of its config: 2+ layers covering every attention and MLP type, tiny widths kept self-consistent, a sequence
longer than any sliding window, CPU, fp32, fixed seed, every parameter and persistent buffer copied. A family
whose forward does anything the layout does not know is refused in one line naming its class. The verdict is
deterministic (every rank reaches the same one) and cached per (class, small config), so it costs seconds once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from pp_tp.base.tensors import persistent_buffers
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelLayout
from pp_tp.materialize import materialize
from pp_tp.split.plan import StageSpec
from pp_tp.stages.stage_module import StageModule

SEQ = 12  # longer than the sliding window set below, so window masks really cut
WINDOW = 4
TOLERANCE = 1e-5


# Width keys shrunk to these values wherever the config has them (MoE and MLA dims included).
_SIZES = {
    "num_attention_heads": 4,
    "hidden_size": 64,
    "intermediate_size": 96,
    "vocab_size": 128,
    "vocab_size_per_layer_input": 128,  # Gemma 3n / 4 per-layer embeddings: 262144 rows by default
    "moe_intermediate_size": 32,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "linear_num_heads": 4,  # Kimi-Linear's KDA heads (32 x 128 by default: GBs in the reference chunked kernel)
    "linear_head_dim": 16,
}
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
_MOE_COUNTS = ("num_experts_per_tok", "n_shared_experts")  # set on a MoE family even where its default leaves None


def small_config(config):
    """A copy of `config` with tiny widths and just enough layers to cover each attention and MLP type.

    Dims the model derives from others keep their relation (MLA's head_dim is its rope dim, qk_head_dim the sum
    of rope and nope dims), so the copy is as self-consistent as the original."""
    if getattr(config, "is_heterogeneous", False):
        return _small_per_layer(config)
    small = copy.deepcopy(config)
    get = lambda key: getattr(config, key, None)  # noqa: E731
    types = list(dict.fromkeys(get("layer_types") or []))
    n_layers = max(2, len(types))
    heads, kv = config.num_attention_heads, get("num_key_value_heads") or config.num_attention_heads
    sizes = dict(_SIZES, num_hidden_layers=n_layers)
    # Full MHA keeps 4 KV heads, GQA 2 (so parallel.tp = 2 still divides them), MQA 1.
    sizes["num_key_value_heads"] = 4 if kv >= heads else (1 if kv == 1 else 2)
    moe = [key for key in _EXPERT_COUNTS if hasattr(config, key)]
    for key in moe:  # a MoE family whose default config leaves its counts unset gets them too
        sizes[key] = min(get(key) or 4, 4)
    if moe:
        sizes["num_experts_per_tok"] = min(get("num_experts_per_tok") or 2, 2)
        if hasattr(config, "n_shared_experts"):
            sizes["n_shared_experts"] = 1 if get("n_shared_experts") is None else min(get("n_shared_experts"), 1)
    if (get("n_group") or 1) > 1:  # group-limited routing: 2 groups of 2 experts, one group picked
        sizes.update(n_group=2, topk_group=1)
    if get("first_k_dense_replace"):  # one dense layer, then MoE layers
        sizes["first_k_dense_replace"] = 1
    if get("qk_rope_head_dim") is not None and get("head_dim") == get("qk_rope_head_dim"):
        sizes["head_dim"] = _SIZES["qk_rope_head_dim"]
    else:
        sizes["head_dim"] = 16
    if get("rotary_dim") is not None:  # partial rotary over a fixed channel count (GPT-J, CodeGen)
        sizes["rotary_dim"] = 8
    if get("qk_head_dim") is not None:
        sizes["qk_head_dim"] = _SIZES["qk_rope_head_dim"] + _SIZES["qk_nope_head_dim"]
    for key, value in sizes.items():
        if getattr(small, key, None) is not None or key in moe or (moe and key in _MOE_COUNTS):
            setattr(small, key, value)
    for key in ("sliding_window", "attention_chunk_size"):  # windows and chunks shorter than SEQ really cut
        if getattr(small, key, None) is not None:
            setattr(small, key, WINDOW)
    if get("word_embed_proj_dim") == get("hidden_size"):  # OPT: equal dims mean no project_in / project_out
        small.word_embed_proj_dim = small.hidden_size
    if types and not isinstance(getattr(type(small), "layer_types", None), property):
        small.layer_types = (types * n_layers)[:n_layers]
    for key in ("attn_layer_period", "expert_layer_period"):  # Jamba: types derived from periods; 2 covers both
        if isinstance(get(key), int) and isinstance(get(key.replace("period", "offset")), int):
            setattr(small, key, 2)
            setattr(small, key.replace("period", "offset"), 1)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(small, key, None), int) and getattr(small, key) >= 128:
            setattr(small, key, 0)
    return small


def _small_per_layer(config):
    """small_config of a config with per-layer values (transformers' `config.per_layer_config[i]`: Gemma 4's head_dim,
    Dots3's head counts): the global values shrunk as for any config, one small layer per distinct (layer type,
    per-layer values) of the original, each per-layer value scaled by the factor its global value shrank by (Gemma 4's
    full-attention layers keep twice the head_dim of its sliding ones)."""
    attrs = sorted(config.per_layer_attributes)
    values = [{a: getattr(layer, a) for a in attrs} for layer in config.per_layer_config]
    types = getattr(config, "layer_types", None)
    first: dict[tuple, int] = {}
    for i, v in enumerate(values):
        first.setdefault((types[i] if types else None, tuple(v.items())), i)
    reps = list(first.values())
    reps = (reps * 2)[: max(2, len(reps))]
    flat = copy.deepcopy(config)
    flat.per_layer_config = None  # the global values, readable again
    small = small_config(flat)
    small.num_hidden_layers = len(reps)
    if types:
        small.layer_types = [types[i] for i in reps]
    small.per_layer_config = {
        j: {a: _scaled(a, values[i][a], getattr(flat, a, None), getattr(small, a, None)) for a in attrs}
        for j, i in enumerate(reps)
    }
    return small


def _scaled(key: str, value, before, after):
    """One layer's value of `key` in the small copy: windows as short as the global one, integer widths scaled as
    the global width was, anything else as it is."""
    if key in ("sliding_window", "attention_chunk_size"):
        return None if value is None else WINDOW
    numbers = all(isinstance(x, int) and not isinstance(x, bool) for x in (value, before, after))
    if not numbers or before == after or not before:
        return value
    return max(1, round(value * after / before))


def _materialized_stage(
    cls: type, small, reference: nn.Module, compose: Callable[[nn.Module], ModelLayout]
) -> StageModule:
    """The whole small model as one stage, built the way pipelined ranks build theirs (`materialize`: on meta,
    allocated, buffers from the layout, then parameters and persistent buffers from `reference` by FQN)."""
    with torch.device("meta"):
        meta = cls(small)
    layout = compose(meta)
    keys = layout.block_keys(meta)
    fqns = [layout.embed] + [f"{layout.blocks}.{k}" for k in keys] + [layout.norm, layout.head]
    stage = StageModule(meta, layout, StageSpec(0, 0, True, keys, True, fqns))
    values = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    materialize(stage, meta, torch.device("cpu"), values=values)
    return stage.to(torch.float32).eval()


@torch.no_grad()
def stir_zero_buffers(model: nn.Module, gen: torch.Generator) -> None:
    """All-zero float persistent buffers (router biases at init) get small values drawn from `gen`, so a
    composition that dropped or mangled one would show in the logits (the self-check and bench/family_sweep.py)."""
    for b in persistent_buffers(model).values():
        if b.is_floating_point() and not b.any():
            b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=b.dtype))


_VERDICTS: dict[tuple[type, str], str | None] = {}


def _verdict(cls: type, small, compose: Callable[[nn.Module], ModelLayout]) -> str | None:
    """None when the composition equals the model's forward on the small config, else why not. Deterministic:
    fixed seeds (the caller's RNG state untouched), every value copied, so every rank reaches the same verdict."""
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = cls(small).to(torch.float32).eval()
            stir_zero_buffers(model, torch.Generator().manual_seed(1))
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
    try:
        small = small_config(model.config)
    except Exception as e:  # noqa: BLE001 - a config that cannot be shrunk cannot be checked: refused
        raise ConfigError(
            f"model {type(model).__name__}: its config cannot be shrunk for pp_tp's self-check "
            f"({type(e).__name__}: {str(e)[:120]}); register a layout for it: pp_tp.extend.register_layout"
        ) from None
    key = (type(model), small.to_json_string(use_diff=False))
    if key not in _VERDICTS:
        _VERDICTS[key] = _verdict(type(model), small, compose)
    why = _VERDICTS[key]
    if why is not None:
        raise ConfigError(
            f"model {type(model).__name__}: {why}; pp_tp refuses it rather than train it differently "
            "(register a layout for it: pp_tp.extend.register_layout)"
        )
