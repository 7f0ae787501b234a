"""Any Hugging Face decoder LM, laid out from what the model declares about itself.

The embedding, blocks and final norm come from the config's `base_model_pp_plan` under the model's
`base_model_prefix`, or, for a family declaring none, from its own forward (discover.py); the head is
`get_output_embeddings()`. Blocks are called the way the model's own
forward calls them: masks built per microbatch by transformers' own mask functions (causal or sliding
window, per layer type), position ids, rotary embeddings from the model's rotary module (per layer
type where it has several), and what the family's forward computes from the batch's shape alone (ALiBi biases, by
its own code, replayed: prologue.py); with packed documents' position ids, transformers' packed-sequence masks. What
the forward does outside its modules (embedding multipliers, logit scaling, final softcapping) is carried into
the first and last stage. `self_check` then proves the composition equal to the model's own forward on a
small copy, or refuses the family in one line.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from typing import Any

from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.layout import Edge, ModelDims, ModelLayout, in_order
from pp_tp.models.hf import carried, hyper, per_layer_inputs
from pp_tp.models.hf.block_context import BlockContext, block_ids, layer_types_of
from pp_tp.models.hf.buffers import init_buffers
from pp_tp.models.hf.discover import EmbedCall, PpPlan, computed_inputs, discover, embedding_parent
from pp_tp.models.hf.experts import experts_spec
from pp_tp.models.hf.extras import after_embed, after_head
from pp_tp.models.hf.handed import Handed, handed
from pp_tp.models.hf.head_path import before_head
from pp_tp.models.hf.per_layer_inputs import PerLayerInputs
from pp_tp.models.hf.randomness import check_randomness
from pp_tp.models.hf.self_check import self_check
from pp_tp.models.hf.skipped import skipped_layers, skipping
from pp_tp.models.hf.threaded import threaded_state, unread
from pp_tp.models.hf.tp_plan import block_tp_plan, declared_tp_plan
from pp_tp.parallel.tensor_parallel import rules_present

NO_LIMIT = 1 << 20  # max_seq_len of a family declaring no position limit


def is_hf_model(model: nn.Module) -> bool:
    """A transformers PreTrainedModel, its subclasses and remote-code models included (no import of transformers
    unless the caller already imported it)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _refuse(model: nn.Module, why: str) -> ConfigError:
    return ConfigError(f"model {type(model).__name__}: {why}")


def _pp_plan(model: nn.Module) -> PpPlan:
    """The declared base_model_pp_plan: embedding -> parameterless modules -> layers -> parameterless modules ->
    norm under base_model_prefix (or, where the model has no such attribute, the module holding the embedding), or
    for a model declaring none, its structure found from its forward (discover.py; the self-check then proves the
    composition); anything else is refused."""
    plan = getattr(model.config, "base_model_pp_plan", None)
    if not plan:
        return _standard_plan(model) or discover(model)
    prefix = model.base_model_prefix
    prefix = prefix if isinstance(getattr(model, prefix, None), nn.Module) else embedding_parent(model)
    base = model.get_submodule(prefix)
    names = list(plan)
    missing = [n for n in names if not isinstance(_submodule(base, n), nn.Module)]
    if missing:
        raise _refuse(
            model,
            f"its base_model_pp_plan names {missing[0]!r}, which {type(base).__name__} does not have (its forward "
            "runs other modules); register a layout for it",
        )
    firsts = {n: inputs[0] if inputs else None for n, (inputs, _) in plan.items()}
    weighted = [n for n in names[1:-1] if any(True for _ in base.get_submodule(n).parameters())]
    if (
        len(names) < 3
        or firsts[names[0]] != "input_ids"
        or len(weighted) != 1
        or firsts[weighted[0]] != "hidden_states"
    ):
        raise _refuse(
            model,
            f"base_model_pp_plan {plan} is not embedding -> layers -> norm (with only parameterless modules between "
            "them); register a layout for it",
        )
    embed, blocks, norm = names[0], weighted[0], names[-1]
    at = names.index(blocks)
    return PpPlan(embed, tuple(names[1:at]), blocks, tuple(names[at + 1 : -1]), norm, base=prefix)


def _submodule(base: nn.Module, name: str) -> nn.Module | None:
    try:
        return base.get_submodule(name)
    except AttributeError:
        return None


def _standard_plan(model: nn.Module) -> PpPlan | None:
    """embed_tokens -> layers -> norm beside the input embedding, the structure most decoder LMs without a declared
    pp plan have (no trace needed); None otherwise."""
    prefix = embedding_parent(model)
    names = dict(model.get_submodule(prefix).named_children())
    standard = (
        names.get("embed_tokens") is model.get_input_embeddings()
        and isinstance(names.get("layers"), nn.ModuleList)
        and "norm" in names
    )
    return PpPlan("embed_tokens", (), "layers", (), "norm", base=prefix) if standard else None


def _module_name(model: nn.Module, module: nn.Module | None, what: str) -> str:
    for name, m in model.named_modules():
        if m is module and name:
            return name
    raise _refuse(model, f"has no {what} module; pp_tp needs one")


def _dims(model: nn.Module) -> ModelDims:
    """The model's dims. With per-layer values (transformers' `config.per_layer_config[i]`: Gemma 4's head_dim,
    Dots3's head counts) heads, KV heads, FFN width and head_dim are each the greatest common divisor over the layers,
    so the preflight's TP divisibility test passes exactly when every layer's own values divide."""
    c = model.config
    layers = list(c.per_layer_config) if getattr(c, "is_heterogeneous", False) else [c]

    def shared(read: Any) -> int:
        return math.gcd(*(read(layer) or 0 for layer in layers))

    # A family without attention (Mamba, RWKV): its mixer's head count (Mamba2's num_heads), else one head.
    heads = shared(lambda layer: getattr(layer, "num_attention_heads", None) or getattr(layer, "num_heads", None) or 1)
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    return ModelDims(
        c.num_hidden_layers,
        c.hidden_size,
        heads,
        shared(lambda layer: getattr(layer, "num_key_value_heads", None)) or heads,
        shared(lambda layer: getattr(layer, "intermediate_size", None)) or 4 * c.hidden_size,
        c.vocab_size,
        _max_positions(c),
        tied,
        head_dim=shared(lambda layer: getattr(layer, "head_dim", None)),
        streams=hyper.streams(c) or per_layer_inputs.streams(model, embedding_parent(model)),
    )


def _max_positions(config: Any) -> int:
    """The longest sequence the model's positions cover; a family with none declared (ALiBi: BLOOM) has no limit
    pp_tp knows of (MPT names its limit max_seq_len)."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "max_seq_len", None) or NO_LIMIT


def _params(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)


def _kernel_dropout(model: nn.Module) -> str | None:
    """Attention dropout inside a kernel other than eager or SDPA (which draw from torch's default generator, whose
    state pp_tp forks per TP rank): pp_tp cannot tell where its masks come from, so it refuses it on sharded heads."""
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    rate = getattr(model.config, "attention_dropout", 0.0) or 0.0
    if impl in ("eager", "sdpa") or not rate:
        return None
    return (
        f"model {type(model).__name__}: attention_dropout = {rate} inside the {impl!r} attention kernel on TP-sharded "
        "heads, whose masks pp_tp cannot place per TP rank; set parallel.tp = 1, attention_dropout = 0 or "
        'attn_implementation = "sdpa"'
    )


def specialize(model: nn.Module) -> ModelLayout:
    """This model's layout, proven equal to its own forward on a small copy (self_check); refused in one
    line where it cannot be."""
    layout = compose(model)
    self_check(model, compose)
    return check_randomness(model, layout)


def compose(model: nn.Module) -> ModelLayout:
    """The layout read off the model's declarations; refuses (one line) what it cannot describe."""
    if getattr(model.config, "output_router_logits", False):
        raise _refuse(
            model,
            "output_router_logits = true adds transformers' whole-batch auxiliary loss, which a pipeline cannot "
            "compute; set it to false in the model config and use [moe] aux_loss_coef (per layer and microbatch)",
        )
    pp_plan = _pp_plan(model)
    prefix = pp_plan.base
    base = model.get_submodule(prefix)
    embed_key, blocks_key = pp_plan.embed, pp_plan.blocks
    if base.get_submodule(embed_key) is not model.get_input_embeddings():
        raise _refuse(model, f"{prefix}.{embed_key} is not get_input_embeddings(); register a layout for it")
    head = _module_name(model, model.get_output_embeddings(), "output embedding")
    extra, collapse, ple_held = _outside_plan(model, pp_plan)
    blocks = list(base.get_submodule(blocks_key).children())
    found = handed(model, blocks_key) if prefix == embedding_parent(model) else None
    ple = per_layer_inputs.find(model, prefix, found, ple_held)
    rotary = next((f"{prefix}.{n}" for n in extra if "position_ids" in _params(base.get_submodule(n).forward)), None)
    skipped = _refuse_untraceable(model, blocks_key, found)
    _refuse_cross_layer_inputs(model, f"{prefix}.{blocks_key}", blocks, found)
    streams = hyper.streams(model.config) or (2 if ple is not None else 1)
    carry = carried.find(model, f"{prefix}.{blocks_key}", found, streams)
    types = layer_types_of(model.config, len(blocks))
    block_kwargs = _params(blocks[0].forward) | pp_plan.block_kwargs | pp_plan.computed | carry.keys
    context = {"attention_mask", "position_ids", "position_embeddings"}
    if not block_kwargs & context and _takes_var_keywords(blocks[0]):
        block_kwargs |= context  # a layer naming none of them hands its **kwargs on (DeepSeek-V4)
    computed = computed_inputs(model, pp_plan) if pp_plan.computed else None
    ctx = BlockContext(model, rotary, types, block_kwargs, found, computed, pp_plan.mask_dtype)
    pre = tuple(n for n in (found.pre if found is not None else ()) if n not in pp_plan.after_embed)
    attention = next((n for n, m in blocks[0].named_children() if "Attention" in type(m).__name__), "self_attn")
    tp_plan, tp_refusal = block_tp_plan(model, blocks_key, blocks, pp_plan.computed)
    # The family's plan covers every config of it (dense layers, shared experts, ...): keep what this one has.
    tp_plan = rules_present(tp_plan, blocks)
    tp_refusal = tp_refusal or _kernel_dropout(model) or _computed_refusal(model, pp_plan)
    return dataclasses.replace(
        HF,
        specialize=None,
        dims=carry.dims(_dims),
        blocks=f"{prefix}.{blocks_key}",
        shared=tuple(f"{prefix}.{name}" for name in extra),
        block_inputs=ctx.inputs,
        # Positions from the ids' shape, biases from the batch's shape: packed documents' positions reach neither.
        document_block_inputs=None if pp_plan.positions_from_ids or pp_plan.computed else ctx.document_inputs,
        **carry.steps(
            _stream_steps(pp_plan, model, ple, (pre, tuple(ple_held), collapse), head, skipping(ctx.call, skipped))
        ),
        tp_plan=tp_plan,
        tp_refusal=tp_refusal,
        experts_spec=experts_spec(model, blocks_key, blocks),
        attention=attention,
        block_ids=block_ids(model, f"{prefix}.{blocks_key}", blocks, found),
        static_block_inputs=True,  # masks and rotary tables from the microbatch's shape only (no padding mask)
    )


def _computed_refusal(model: nn.Module, pp_plan: PpPlan) -> str | None:
    """Layer arguments computed for all heads at once (ALiBi biases) are split with their heads by an inferred plan,
    whose proof covers them (tp_infer.py); a declared plan's attention styles do not slice them."""
    if not pp_plan.computed or not declared_tp_plan(model.config):
        return None
    return (
        f"model {type(model).__name__}: its forward hands its layers {sorted(pp_plan.computed)} computed for all "
        "attention heads, which pp_tp does not split over TP ranks; set parallel.tp = 1"
    )


def _outside_plan(model: nn.Module, pp_plan: PpPlan) -> tuple[list[str], tuple[str, ...], list[str]]:
    """The base model's children outside the plan: parameterless ones every stage shares (rotary tables), a
    hyper-connection family's stream collapse (hc_head), which the last stage runs before its norm, and the modules
    computing per-layer inputs (Gemma 4), which the first stage holds; any other module with weights, and any weight
    of a wrapper (BERT's `encoder`) outside the plan's modules, is refused."""
    base = model.get_submodule(pp_plan.base)
    plan = {pp_plan.embed, pp_plan.blocks, pp_plan.norm, *pp_plan.after_embed, *pp_plan.before_norm} - {""}
    wrappers = {name.split(".")[0] for name in plan if "." in name}
    extra = [name for name, child in base.named_children() if name not in plan | wrappers]
    weighted = [name for name in extra if any(True for _ in base.get_submodule(name).parameters())]
    weighted += [
        f"{w}.{name}"
        for w in sorted(wrappers)
        for name, _ in base.get_submodule(w).named_parameters()
        if not any(f"{w}.{name}".startswith(f"{p}.") for p in plan)
    ]
    collapse = hyper.collapse_modules(model.config, weighted)
    weighted = [name for name in weighted if name not in collapse]
    held = [] if pp_plan.adds_positions else per_layer_inputs.candidates(model, pp_plan.base, weighted)
    weighted = [name for name in weighted if name not in held]
    if weighted:
        raise _refuse(
            model,
            f"{pp_plan.base}.{weighted[0]} holds weights outside embedding/layers/norm; register a layout for it",
        )
    return [name for name in extra if name not in (*collapse, *held)], collapse, held


def _stream_steps(
    pp_plan: PpPlan,
    model: nn.Module,
    ple: PerLayerInputs | None,
    outside: tuple[tuple[str, ...], ...],
    head: str,
    call: Any,
) -> dict[str, Any]:
    """The two edges and `call_block`: how the stream is made, handed from layer to layer and ended. The first stage
    runs the embedding, the config's transform after it and the parameterless modules the forward runs before the
    first layer (`outside`: those, the modules computing per-layer inputs, the stream's collapse), or its own path
    where the forward adds more than the embedding (learned positions: EmbedCall; per-layer inputs packed beside the
    hidden state, which each layer reads its slice of and the last stage drops before its norm); `call` (the block
    context's, passing skipped layers by) hands the stream on; the last stage runs the stream's end (hyper streams'
    collapse), the norm ("" in the plan: none), the modules between it and the head, the head, and the config's
    logit transform."""
    base, config = pp_plan.base, model.config
    pre, ple_held, collapse = outside
    run = tuple(f"{base}.{n}" for n in (*pp_plan.after_embed, *pre))
    first = (f"{base}.{pp_plan.embed}", *run, *(f"{base}.{n}" for n in ple_held))
    after = after_embed(config)
    norm = f"{base}.{pp_plan.norm}" if pp_plan.norm else ""
    ends = (*(f"{base}.{n}" for n in (*pp_plan.before_norm, *collapse)), norm, *before_head(model), head)
    if ple is not None:
        embed = Edge(first, ple.embed_call(first[0], after, run))
        return dict(first=embed, call_block=ple.call(call), last=in_order(ple.drop, *ends, after_head(config)))
    steps = hyper.stream_calls(config, call)
    last = in_order(steps["before_norm"], *ends, after_head(config))
    embed = (
        Edge(first, EmbedCall(pp_plan, after)) if pp_plan.adds_positions else in_order(*first[:1], after, *first[1:])
    )
    return dict(first=embed, call_block=steps["call_block"], last=last)


def _takes_var_keywords(block: nn.Module) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(block.forward).parameters.values())


def _refuse_untraceable(model: nn.Module, blocks_key: str, found: Handed | None) -> frozenset[int]:
    """The layers the traced forward (`found`) skips (Mllama's cross-attention layers on text alone: skipped.py);
    refuses what it shows a stage cannot do the same way: layers looped or reordered (Dory's recurrent section), or
    the embedding's output changed by the forward's own code before the first layer (CTRL's scale and sinusoidal
    positions, RecurrentGemma's normalizer)."""
    if found is None:
        return frozenset()
    skipped = skipped_layers(model, blocks_key, found)
    blocks_fqn = f"{embedding_parent(model)}.{blocks_key}"
    if skipped is None:
        raise _refuse(
            model,
            f"its forward runs the layers of {blocks_fqn} of its small copy in the order {list(found.runs)} (looped "
            "or skipped on token ids alone), while pp_tp runs each layer once, in order; register a layout for it",
        )
    if found.changed_before is not None:
        raise _refuse(
            model,
            f"its forward changes the embedding's output outside any module before it runs {found.changed_before} "
            "(a scale or positions of its own code), which pp_tp does not carry into the first stage; register a "
            "layout for it",
        )
    return skipped


def _refuse_cross_layer_inputs(
    model: nn.Module, blocks_fqn: str, blocks: list[nn.Module], found: Handed | None
) -> None:
    """Refuses layers that need more than the hidden state, the block context and the token ids: a value the
    previous layer returned that the traced forward (`found`) really hands on, or keys and values another layer
    computed (Gemma 4's `num_kv_shared_layers`, which the model's own forward hands from layer to layer)."""
    blocks_key = blocks_fqn.rpartition(".")[2]
    threaded = threaded_state(model, blocks_key, blocks[0])
    # Threaded in the source, but None for every layer in a forward without cache (RWKV's `state`), or read by no
    # layer (GLM-MoE-DSA's `prev_topk_indices` where every layer has its own indexer): nothing to carry.
    handed_on = threaded and (found is None or any(layer.get(threaded[0]) is not None for layer in found.layers))
    if handed_on and not unread(model, blocks_key, threaded[0]):
        raise _refuse(
            model,
            f"its forward hands each layer the previous layer's {threaded[2]!r} (as {threaded[1]!r}), which pp_tp "
            "does not carry from layer to layer or across stages; register a layout for it",
        )
    shared = getattr(model.config, "num_kv_shared_layers", 0) or 0
    if shared:
        raise _refuse(
            model,
            f"num_kv_shared_layers = {shared}: its last layers reuse keys and values earlier layers computed, which "
            "pp_tp does not carry from layer to layer or across stages; set it to 0",
        )


def _unspecialized(*_: Any) -> Any:
    raise AssertionError("the generic Hugging Face layout is used only through specialize(model)")


HF = ModelLayout(
    name="hf",
    matches=is_hf_model,
    dims=_unspecialized,
    first=in_order(),
    blocks="",
    last=in_order(),
    shared=(),
    block_inputs=_unspecialized,
    call_block=_unspecialized,
    init_buffers=init_buffers,
    specialize=specialize,
)
