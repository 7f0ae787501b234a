"""How a Hugging Face layer is called inside a stage: with the keywords its family's own forward hands it (masks
per layer type from transformers' mask functions, position ids, rotary tables per layer type, what the family computes
from the batch's shape such as ALiBi biases), built once per microbatch and shared by the stage's blocks."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from pp_tp.base._torch import tree_flatten
from pp_tp.errors import ConfigError
from pp_tp.models.hf.discover import SUPPLIED
from pp_tp.models.hf.handed import Handed
from pp_tp.models.hf.mixers import LayerMasks, mask_without_cache
from pp_tp.models.hf.position_args import position_args
from pp_tp.models.hf.prologue import LayerArgs, layer_types_of
from pp_tp.models.hf.trace import same

__all__ = ["BlockContext", "block_ids", "layer_types_of"]  # layer_types_of: prologue.py's, read here by layout.py


class BlockContext:
    """What every block of one microbatch needs besides the hidden state: masks, rotary embeddings, and what the
    family's own code computes from the microbatch's shape (ALiBi biases, `computed`: the prologue replay's)."""

    def __init__(
        self,
        model: nn.Module,
        rotary: str | None,
        layer_types: list[str],
        block_kwargs: set[str],
        found: Handed | None = None,
        computed: LayerArgs | None = None,
        mask_dtype: torch.dtype | None = None,
    ):
        """`found`: what the family's own forward hands each layer of its small copy (handed.py), adopted where it
        differs from the defaults below; None where the copy was not traced (the self-check still proves it)."""
        self.config = model.config
        self.computed = computed
        self.mask_dtype = mask_dtype
        self.rotary = rotary
        self.layer_types = layer_types  # per global layer index
        self.masks = LayerMasks(model, layer_types)
        self.block_kwargs = block_kwargs
        self.required: dict[type, tuple[str, ...]] = {}  # per layer class, its arguments without default
        self.per_type_rotary = (
            rotary is not None and "layer_type" in inspect.signature(model.get_submodule(rotary).forward).parameters
        )
        # A rotary keyed by table names of its own, none a layer type (DeepSeek-V4's 'main' / 'compress'): the
        # forward hands every layer all its tables. Keyed by some layer types only (LFM3's attention types beside
        # its 'conv' layers): each layer gets its type's table, or None.
        own = getattr(model.get_submodule(rotary), "layer_types", None) if self.per_type_rotary else None
        types = set(layer_types)
        self.all_tables = tuple(own) if own and not types & set(own) else ()
        self.tables = self.all_tables or tuple(sorted(types & set(own) if own else types))
        self.no_rotary: set[str] = set()  # layer types the forward hands no rotary tables (LaraMini's global layers)
        self.position_args: LayerArgs | None = None  # per layer type, from the position ids (Beam's query scale)
        self.tables_per_row = False  # one row of rotary tables broadcast over the batch, unless the forward builds more
        if found is not None:
            self._adopt(model, found)

    def _adopt(self, model: nn.Module, found: Handed) -> None:
        """Takes what the family's own forward hands each layer type (`found`, on its small copy) where it differs
        from the default: keywords it passes through `**kwargs`, None for rotary tables, another of transformers'
        mask functions (Moshi: a causal mask although the config sets a window; Doge: a materialized one); a mask
        none of them builds is refused in one line."""
        from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING as MAPPING

        config = found.config
        types = layer_types_of(config, len(found.layers))
        h = torch.zeros(found.rows, found.seq, config.hidden_size)  # the traced forward's shape
        positions = torch.arange(found.seq).unsqueeze(0)
        built = self.masks.build(config, h, positions) if self.masks.family is None else None
        candidates = list({id(f): f for f in MAPPING.values() if not isinstance(f, dict)}.values())
        for kind, kwargs in zip(types, found.layers):
            self.block_kwargs |= {k for k in kwargs if k in SUPPLIED}
            self.tables_per_row |= _batch_rows(kwargs.get("position_embeddings"), found.rows)
            if "position_embeddings" in kwargs and kwargs["position_embeddings"] is None and self.rotary is not None:
                self.no_rotary.add(kind)
            mask = kwargs.get("attention_mask")
            if built is None or "attention_mask" not in kwargs or same(mask, self._as_handed(built[kind])):
                continue
            kw = {"config": config, "inputs_embeds": h, "attention_mask": None, "position_ids": positions}
            maker = next((f for f in candidates if same(self._as_handed(_try(f, kw)), mask)), None)
            if maker is None:
                raise ConfigError(
                    f"model {type(model).__name__}: its forward hands its {kind!r} layers an attention mask none of "
                    "transformers' mask functions builds; register a layout for it (pp_tp.extend.register_layout)"
                )
            self.masks.makers[kind] = maker
            built[kind] = _try(maker, kw)  # the mask it builds: later layers of this type compare with it
        handled = SUPPLIED | {"input_ids", "shared_kv_states"} | set(self.computed.keys if self.computed else ())
        self.position_args, keys = position_args(model, found, types, handled)
        self.block_kwargs |= set(keys)

    def _as_handed(self, mask: Any) -> Any:
        """A mask as the family's forward hands it to its layers: MPT's additive mask as bool (True: masked)."""
        if self.mask_dtype == torch.bool and isinstance(mask, torch.Tensor) and mask.is_floating_point():
            return mask.to(torch.bool)
        return mask

    def inputs(self, stage: nn.Module, h: torch.Tensor) -> tuple[Any, ...]:
        """Masks by attention type, position ids and position embeddings for this microbatch."""
        return self.document_inputs(stage, h, torch.arange(h.shape[1], device=h.device).unsqueeze(0))

    def document_inputs(self, stage: nn.Module, h: torch.Tensor, position_ids: torch.Tensor) -> tuple[Any, ...]:
        """The same for given per-token position ids: where they restart (packed documents), transformers' own
        mask functions keep attention inside each document (sliding windows included)."""
        masks = self.masks.build(self.config, h, position_ids)
        embeddings: Any = None
        if self.rotary is not None:
            # One row of tables per batch row only where the model's own forward builds them so (Qwen4-Exp's
            # indexer picks each row's tables by batch index); one row broadcasts over the batch for the others.
            rows = position_ids.expand(h.shape[0], -1) if self.tables_per_row else position_ids
            rotary = stage.get_submodule(self.rotary)
            if self.per_type_rotary:
                # A type the forward hands no tables may have none to build (Beam's NoPE full-attention layers).
                embeddings = {t: rotary(h, rows, t) for t in self.tables if t not in self.no_rotary}
            else:
                embeddings = rotary(h, rows)
        per_type = self.position_args(position_ids, h.shape[0], h.dtype) if self.position_args is not None else {}
        computed = {}
        if self.computed is not None:  # equal for every layer (discover.py proves it): the first layer's
            computed = next(iter(self.computed(position_ids, h.shape[0], h.dtype).values()))
        return position_ids, masks, embeddings, computed, per_type

    def call(
        self, block: nn.Module, h: torch.Tensor, extras: tuple[Any, ...], index: int, **handed: Any
    ) -> torch.Tensor:
        """One decoder layer, called with the keywords the model's own forward passes it; `extras` end with the
        microbatch's token ids where the layers read them (layout.block_ids); `handed`: what the caller hands this
        layer alone (its per-layer input: per_layer_inputs.py)."""
        position_ids, masks, embeddings, computed, per_type, *ids = extras
        kind = self.layer_types[index]
        kwargs = {
            "attention_mask": self._as_handed(masks[kind]),
            "position_ids": position_ids,
            "past_key_values": None,
            "use_cache": False,
            "shared_kv_states": {},  # Gemma 4 layers store their K/V for later ones; compose refuses any that reuse
            "input_ids": ids[0] if ids else None,
            **computed,
            **per_type.get(kind, {}),
            **handed,
        }
        if embeddings is not None:
            per_layer = self.per_type_rotary and not self.all_tables
            kwargs["position_embeddings"] = embeddings.get(kind) if per_layer else embeddings
            kwargs["position_embeddings"] = None if kind in self.no_rotary else kwargs["position_embeddings"]
        given = {k: v for k, v in kwargs.items() if k in self.block_kwargs}
        if type(block) not in self.required:
            self.required[type(block)] = _required_of(type(block))
        out = block(h, **{**dict.fromkeys(self.required[type(block)]), **given})
        return out[0] if isinstance(out, (tuple, list)) else out  # GPT-1's blocks return a list


def _batch_rows(tables: Any, rows: int) -> bool:
    """Whether the traced forward handed a layer rotary tables with one row per batch row (`rows` > 1 of them)."""
    return any(isinstance(t, torch.Tensor) and t.dim() > 2 and t.shape[0] == rows for t in tree_flatten(tables)[0])


def _required_of(cls: type) -> tuple[str, ...]:
    """A layer class's arguments without default beyond the hidden state: one the block context does not supply is
    None (Falcon's `alibi` without ALiBi), as the family's forward passes it; the self-check proves the composition."""
    params = list(inspect.signature(cls.forward).parameters.values())[2:]  # past self and the hidden state
    return tuple(p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _try(maker: Any, kwargs: dict[str, Any]) -> Any:
    """`maker`'s mask, or a marker no mask equals where it cannot build one for this config (no window set)."""
    try:
        return maker(**kwargs, **mask_without_cache(maker))
    except (ValueError, TypeError, AttributeError):
        return _try


def block_ids(model: nn.Module, blocks_fqn: str, blocks: list[nn.Module], found: Handed | None) -> bool:
    """Whether the layers read the batch's token ids: a module of theirs requires `input_ids` (DeepSeek-V4's hash
    routers). Every stage then gets them and hands each layer `input_ids`, as the traced forward (`found`) shows the
    model's own forward does; one it does not show doing so is refused in one line."""
    for i, block in enumerate(blocks):
        for name, module in block.named_modules():
            ids = inspect.signature(module.forward).parameters.get("input_ids")
            if ids is None or ids.default is not inspect.Parameter.empty:
                continue
            if found is None or not all(_are_ids(layer.get("input_ids"), found) for layer in found.layers):
                raise ConfigError(
                    f"model {type(model).__name__}: {blocks_fqn}.{i}.{name} ({type(module).__name__}) routes by the "
                    "token ids, which its forward does not hand every layer as `input_ids`; register a layout for it"
                )
            return True
    return False


def _are_ids(value: Any, found: Handed) -> bool:
    """A traced layer argument that is the batch's token ids: integers of the ids' shape."""
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and tuple(value.shape) == found.ids_shape
