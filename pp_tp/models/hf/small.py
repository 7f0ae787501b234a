"""The small copy of a Hugging Face config every check of a family runs: tiny widths kept self-consistent, just
enough layers to cover each combination of per-layer values, windows shorter than the checked sequences. The record
of a family's forward (record.py) is keyed by it, and the self-check proves the layout on it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

WINDOW = 4  # attention windows and chunks in the copy: shorter than every sequence a check runs


# Width keys shrunk to these values wherever the config has them (MoE and MLA dims included).
_SIZES = {
    "num_attention_heads": 4,
    "hidden_size": 64,
    "intermediate_size": 96,
    "vocab_size": 128,
    "unpadded_vocab_size": 128,  # Inkling 2's logits width (200058 by default)
    "encoder_hash_byte_group_vocab": 128,  # BLT's hash n-gram embeddings (500002 rows by default)
    "hidden_size_global": 64,  # BLT's local encoder / decoder: the global transformer's width
    "vocab_size_per_layer_input": 128,  # Gemma 3n / 4 per-layer embeddings: 262144 rows by default
    "moe_intermediate_size": 32,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "linear_num_heads": 4,  # Kimi-Linear's KDA heads (32 x 128 by default: GBs in the reference chunked kernel)
    "linear_head_dim": 16,
    "ffn_hidden_size": 96,  # Falcon
    # State-space and recurrent mixers (Mamba, Mamba2 and its hybrids, xLSTM): heads x head width = expand x hidden
    # (8 x 16 = 2 x 64); 2 groups, so a TP rank holds whole groups; chunks shorter than SEQ, so the scan crosses chunks.
    "num_heads": 8,  # where it is not num_attention_heads by another name (GPT-Neo)
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "n_mamba_heads": 2,
    "state_size": 16,
    "mamba_d_state": 16,
    "n_groups": 2,
    "mamba_n_groups": 2,
    "mamba_ngroups": 2,
    "chunk_size": 8,
    "mamba_chunk_size": 8,
    "time_step_rank": 4,  # ceil(hidden_size / 16), Mamba's "auto"
    "mamba_dt_rank": 4,
}
# Widths transformers derives from others in the config's own __init__ (stored, so not re-derived on a copy): each
# recomputed from the shrunk values where the config has it.
_DERIVED: dict[str, Callable[[Any, Any], Any]] = {
    # (small, original) -> value; widths kept at the multiple of hidden_size they were.
    "attention_hidden_size": lambda s, o: o.attention_hidden_size * s.hidden_size // o.hidden_size,
    "lru_width": lambda s, o: o.lru_width * s.hidden_size // o.hidden_size,
    "embedding_dim": lambda s, o: o.embedding_dim * s.hidden_size // o.hidden_size,
    "attention_head_dim": lambda s, o: s.attention_hidden_size // s.num_attention_heads,  # Zamba: 2 x hidden / heads
    "mamba_headdim": lambda s, o: s.mamba_expand * s.hidden_size // s.n_mamba_heads,
    "mamba_d_ssm": lambda s, o: s.mamba_n_heads * s.mamba_d_head,
    "kv_channels": lambda s, o: s.hidden_size // s.num_attention_heads,
    "num_query_groups": lambda s, o: s.num_attention_heads,
    "num_blocks": lambda s, o: s.num_hidden_layers,
    "hybrid_layer_ids": lambda s, o: [i for i, t in enumerate(s.layers_block_type) if t == "hybrid"],
}
# Attention windows and chunks (BLT's local encoder takes its window from `local_attention_window_len`).
_WINDOWS = ("sliding_window", "attention_chunk_size", "local_attention_window_len")
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
_MOE_COUNTS = ("num_experts_per_tok", "n_shared_experts")  # set on a MoE family even where its default leaves None


def small_config(config):
    """A copy of `config` with tiny widths and just enough layers to cover each combination of per-layer values
    (layer types, block types, ...).

    Dims the model derives from others keep their relation (MLA's head_dim is its rope dim, qk_head_dim the sum
    of rope and nope dims, `_DERIVED`), so the copy is as self-consistent as the original. A value the config only
    derives (a property without setter: Falcon's head_dim, Bamba's layers_block_type) is left to derive itself."""
    if getattr(config, "is_heterogeneous", False):
        return _small_per_layer(config)
    small = copy.deepcopy(config)
    get = lambda key: getattr(config, key, None)  # noqa: E731
    lists, reps = _per_layer(config)
    sizes = _widths(config, len(reps))
    heads, moe = get("num_attention_heads"), [key for key in _EXPERT_COUNTS if hasattr(config, key)]
    # A default config leaving head_dim or num_key_value_heads None where the model reads it as a number (HunYuan,
    # Ministral, Nemotron): the copy states the values None stands for (hidden / heads, full MHA).
    unset = {"head_dim", "num_key_value_heads"} if heads and get("qk_rope_head_dim") is None else set()
    for key, value in sizes.items():
        if getattr(small, key, None) is not None or key in moe or (moe and key in _MOE_COUNTS):
            _set(small, key, value)
        elif key in unset and hasattr(small, key):
            _set(small, key, value)
    for key in _WINDOWS:  # windows and chunks shorter than SEQ really cut
        if getattr(small, key, None) is not None:
            _set(small, key, WINDOW)
    proj = get("word_embed_proj_dim")
    if proj is not None and proj == get("hidden_size"):  # OPT: equal dims mean no project_in / project_out
        small.word_embed_proj_dim = small.hidden_size
    _shrink_lists(small, config, lists, reps, sizes)
    if _kv_shared(config):  # Gemma 3n: the last layers reuse K/V; the kept ones among them stay last
        small.num_kv_shared_layers = sum(i >= config.num_hidden_layers - _kv_shared(config) for i in reps)
    for key in ("attn_layer_period", "expert_layer_period"):  # Jamba: types derived from periods; 2 covers both
        if isinstance(get(key), int) and isinstance(get(key.replace("period", "offset")), int):
            setattr(small, key, 2)
            setattr(small, key.replace("period", "offset"), 1)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(small, key, None), int) and getattr(small, key) >= 128:
            setattr(small, key, 0)
    from transformers import PretrainedConfig  # here, so importing pp_tp does not import transformers

    subs = [k for k in getattr(config, "sub_configs", {}) if isinstance(get(k), PretrainedConfig)]
    for key in subs:  # BLT: its encoder, global and decoder configs, each shrunk
        setattr(small, key, small_config(get(key)))
    _retie_sub_configs(small, subs)
    for key, derive in _DERIVED.items():
        if get(key) is not None:
            _set(small, key, derive(small, config))
    return small


def _retie_sub_configs(small, subs: list[str]) -> None:
    """The shrunk sub-configs as the config's own __post_init__ derives them from the shrunk whole (BLT: its global
    transformer's projection in, its local encoder's window), by rebuilding it; a config that will not rebuild keeps
    them as shrunk (its own validation refusing the rebuild is no reason to refuse the copy)."""
    if not subs:
        return
    try:
        rebuilt = type(small)(**small.to_dict())
    except Exception:  # noqa: BLE001 - see above
        return
    for key in subs:
        setattr(small, key, getattr(rebuilt, key))


def _widths(config, n_layers: int) -> dict:
    """The small copy's widths and counts (`_SIZES`, head counts kept MHA / GQA / MQA, MoE counts, MLA and rotary
    relations); set where the config has the key."""
    get = lambda key: getattr(config, key, None)  # noqa: E731
    sizes = dict(_SIZES, num_hidden_layers=n_layers)
    heads = get("num_attention_heads")
    for key in ("num_key_value_heads", "num_kv_heads"):
        kv = get(key) or heads
        if heads and kv:  # full MHA keeps 4 KV heads, GQA 2 (so parallel.tp = 2 still divides them), MQA 1
            sizes[key] = 4 if kv >= heads else (1 if kv == 1 else 2)
    moe = [key for key in _EXPERT_COUNTS if hasattr(config, key)]
    for key in moe:  # a MoE family whose default config leaves its counts unset gets them too
        sizes[key] = min(get(key) or 4, 4)
    if moe:
        sizes["num_experts_per_tok"] = min(get("num_experts_per_tok") or 2, 2)
        if hasattr(config, "n_shared_experts"):
            sizes["n_shared_experts"] = 1 if get("n_shared_experts") is None else min(get("n_shared_experts"), 1)
    if (get("n_group") or 1) > 1:  # group-limited routing: 2 groups of 2 experts, one group picked
        sizes.update(n_group=2, topk_group=1)
    for key in ("first_k_dense_replace", "num_dense_layers"):  # one dense layer, then MoE layers (LFM2-MoE's name)
        if get(key):
            sizes[key] = 1
    fraction = _rotary_fraction(config)
    if get("qk_rope_head_dim") is not None and get("head_dim") == get("qk_rope_head_dim"):
        sizes["head_dim"] = _SIZES["qk_rope_head_dim"]
    elif (
        get("qk_rope_head_dim") is not None
        and fraction
        and (get("head_dim") or 0) * fraction == get("qk_rope_head_dim")
    ):
        sizes["head_dim"] = round(_SIZES["qk_rope_head_dim"] / fraction)  # Dots3: rotary part of head_dim = rope dim
    else:
        sizes["head_dim"] = 16
    if get("rotary_dim") is not None:  # partial rotary over a fixed channel count (GPT-J, CodeGen)
        sizes["rotary_dim"] = 8
    if get("qk_head_dim") is not None:
        sizes["qk_head_dim"] = _SIZES["qk_rope_head_dim"] + _SIZES["qk_nope_head_dim"]
    if type(config).attribute_map.get("num_attention_heads") == "num_heads":
        del sizes["num_heads"]
    return sizes


def _shrink_lists(small, config, lists: dict, reps: list[int], sizes: dict) -> None:
    """The per-layer lists of `config` on `small`, which keeps the layers `reps`."""
    indices = _layer_indices(config, getattr(config, "num_hidden_layers", None))
    for key, values in lists.items():  # a per-layer width (Gemma 3n's intermediate_size) shrunk as the global one
        if key in indices:  # a list of layer indices (Flint's mlp_only_layers), renumbered over the kept layers
            _set(small, key, [j for j, i in enumerate(reps) if values[i]])
            continue
        kept = [values[i] for i in reps]
        if key in sizes and all(isinstance(v, int) and v > 0 for v in kept):
            kept = [max(1, round(v * sizes[key] / max(values))) for v in kept]
        # The layer types as long as the copy; any other list cycled to its length before, the copy's own layers
        # first (a caller adding layers to the copy, as the tests do, reads on).
        types = key in ("layer_types", type(config).attribute_map.get("layer_types"))
        _set(small, key, kept if types else (kept * len(values))[: len(values)])


def _rotary_fraction(config) -> float | None:
    """The partial_rotary_factor the config's rope parameters share (top level or per layer type), else None."""
    rope = getattr(config, "rope_parameters", None) or {}
    found = {config.to_dict().get("partial_rotary_factor")}
    found |= {v.get("partial_rotary_factor") for v in rope.values() if isinstance(v, dict)}
    found.add(rope.get("partial_rotary_factor") if isinstance(rope, dict) else None)
    found.discard(None)
    return found.pop() if len(found) == 1 else None


def _set(config, key: str, value) -> None:
    """Sets `key` unless the config only derives it (a property without setter, possibly behind attribute_map)."""
    try:
        setattr(config, key, value)
    except AttributeError:
        pass


def _per_layer(config) -> tuple[dict[str, list], list[int]]:
    """The config's per-layer lists (those as long as num_hidden_layers: layer types, block types, ...) and the
    original layers the small copy keeps: the first of each distinct combination of their values, at least 2. Where
    such a list is only derived (a property without setter, RecurrentGemma's block pattern), the copy keeps the
    first layers, up to the last of those."""
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= 2:
        return {}, [0, 1]
    lists: dict[str, list] = {}
    for key in [*config.to_dict(), "layer_types"]:
        value = getattr(config, key, None)
        if value == list(range(n)):  # a list of layer indices (LFM2's full_attn_idxs: every layer), not per layer
            continue
        if isinstance(value, list) and len(value) == n and not any(value is v for v in lists.values()):
            lists[key] = value
    for key, indices in _layer_indices(config, n).items():  # each layer's membership, a per-layer value
        lists[key] = [i in indices for i in range(n)]
    shared = _kv_shared(config)  # layers reusing earlier layers' keys and values: a kind of their own
    first: dict[tuple, int] = {}
    for i in range(n):
        first.setdefault((i >= n - shared, *(repr(v[i]) for v in lists.values())), i)
    reps = list(first.values())
    probe = copy.deepcopy(config)
    settable = {k: v for k, v in lists.items() if _settable(probe, k)}
    if len(settable) < len(lists) and not isinstance(getattr(config, "attn_layer_period", None), int):  # Jamba: below
        return settable, list(range(max(2, max(reps) + 1)))
    return settable, (reps * 2)[: max(2, len(reps))]


def _layer_indices(config, n) -> dict[str, list[int]]:
    """The config's lists of layer indices (Flint's `mlp_only_layers`): increasing ints below num_hidden_layers,
    a proper non-empty subset, so each layer's membership is a per-layer value the small copy must cover."""
    if not isinstance(n, int):
        return {}
    out = {}
    for key in config.to_dict():
        value = getattr(config, key, None)
        if (
            isinstance(value, list)
            and 0 < len(value) < n
            and all(type(v) is int for v in value)
            and all(a < b for a, b in zip(value, value[1:]))
            and 0 <= value[0]
            and value[-1] < n
        ):
            out[key] = value
    return out


def _kv_shared(config) -> int:
    value = getattr(config, "num_kv_shared_layers", 0)
    return value if isinstance(value, int) else 0


def _settable(config, key: str) -> bool:
    """Whether `key` can be set on `config` (tried on it: pass a copy)."""
    try:
        setattr(config, key, getattr(config, key))
    except AttributeError:
        return False
    return True


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
    if key in _WINDOWS:
        return None if value is None else WINDOW
    numbers = all(isinstance(x, int) and not isinstance(x, bool) for x in (value, before, after))
    if not numbers or before == after or not before:
        return value
    return max(1, round(value * after / before))
