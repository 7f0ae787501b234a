"""The pipeline structure of a Hugging Face causal LM that declares no `base_model_pp_plan`, found by running it.

transformers declares no pipeline plan for most of its causal LMs (GPT-2's `wte`/`wpe`/`h`/`ln_f`, OPT's
`decoder.layers`), though their structure is embedding -> blocks -> norm under other names. Names alone prove
nothing, so the family's own forward runs once on a small copy of its config (the self-check's: seeded, CPU, fp32)
with a hook on every child of the module holding the input embedding and the layers, through wrappers (BERT's
`embeddings`, `encoder`), and on every element of its layer lists; the calls it records are the structure: the layers
are the one `ModuleList` whose elements run once each, in order, and nothing else in between; what runs before them
is the embedding first, then modules on the hidden state (dropout, norms) and learned position embeddings (called
with position ids or the ids, added); after them, parameterless modules and at most one final norm (none: GPT-1).
Every argument the forward hands a layer must be one pp_tp's block context supplies (mask, positions, rotary tables),
empty, or a tensor proven to depend on the microbatch's shape only (ALiBi biases), which the family's own code then
computes per microbatch (`computed_inputs`: prologue.py). Anything else is refused in one line; what is accepted is
still proven equal to the family's own forward by the self-check. Deterministic and cached per (class, small
config), so every rank reaches the same structure.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.models.hf.carried import carries
from pp_tp.models.hf.prologue import LayerArgs, Prologue, hidden_input, layer_types_of, prologue_of, replay_target
from pp_tp.models.hf.record import SEQ, Call, Record, record_of
from pp_tp.models.hf.trace import bound_arguments, same, trace

# What pp_tp's block context hands a layer (pp_tp/models/hf/layout.py:BlockContext.call); any other argument the
# family's forward passes a layer must be None or False.
SUPPLIED = frozenset({"attention_mask", "position_ids", "position_embeddings", "use_cache", "cache", "past_key_values"})

# A position call's argument: ("positions", None) position ids, ("ids", None) the input ids (a module finding the
# positions from their shape: TrOCR's), ("ones", dtype) an all-ones [B, S] mask, ("value", v) a Python constant.
Role = tuple[str, Any]


@dataclasses.dataclass(frozen=True)
class Step:
    """One module the forward runs between the embedding and the layers: `h = m(h)`, or, with `args`, a learned
    position embedding `h = h + m(*args, **kwargs)` called with those roles."""

    name: str
    args: tuple[Role, ...] | None = None
    kwargs: tuple[tuple[str, Role], ...] = ()


@dataclasses.dataclass(frozen=True)
class PpPlan:
    """Embedding, blocks and norm under `base` (model-relative), the modules between them, and for a discovered
    structure its position steps and the keywords its forward passes a layer through `**kwargs`."""

    embed: str
    after_embed: tuple[str, ...]
    blocks: str
    before_norm: tuple[str, ...]
    norm: str
    base: str = ""
    steps: tuple[Step, ...] = ()
    block_kwargs: frozenset[str] = frozenset()
    computed: frozenset[str] = frozenset()  # layer arguments computed by the family's own code (computed_inputs)
    mask_dtype: torch.dtype | None = None  # the dtype of the mask the forward hands its layers (MPT's bool)
    replay_target: str = ""  # the module before which the forward's own code changes the embedding's output (CTRL)
    replay: Prologue | None = None  # that code, replayed for the model's own config (prologue.py)

    @property
    def adds_positions(self) -> bool:
        return bool(self.replay_target) or any(s.args is not None for s in self.steps)

    @property
    def positions_from_ids(self) -> bool:
        """A position step given the ids, not position ids: packed documents' positions cannot reach it."""
        return any(("ids", None) in (*(s.args or ()), *(r for _, r in s.kwargs)) for s in self.steps)


def _refuse(model: nn.Module, why: str) -> ConfigError:
    return ConfigError(f"model {type(model).__name__}: {why}; register a layout for it (pp_tp.extend.register_layout)")


def embedding_parent(model: nn.Module) -> str:
    """Model-relative name of the module holding the input embedding (where a family keeps its layers too)."""
    emb = model.get_input_embeddings()
    name = next((n for n, m in model.named_modules() if m is emb), "")
    if "." not in name:
        raise _refuse(model, "its input embedding is not inside a base model")
    return name.rpartition(".")[0]


def _is_ids(args: tuple[Any, ...], ids: torch.Tensor) -> bool:
    """Whether the call's first argument is the input ids (the forward may have reshaped them)."""
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].shape == ids.shape and torch.equal(args[0], ids)


def _role(value: Any, ids: torch.Tensor) -> Role | None:
    """What a position embedding's argument is, or None when pp_tp cannot rebuild it per microbatch."""
    if not isinstance(value, torch.Tensor):
        return ("value", value) if value is None or isinstance(value, (bool, int, float)) else None
    if _is_ids((value,), ids):
        return ("ids", None)
    if value.dim() != 2 or value.shape[-1] != SEQ:
        return None
    if torch.equal(value.long(), torch.arange(SEQ).expand_as(value)) and not value.is_floating_point():
        return ("positions", None)
    if value.shape == ids.shape and bool((value == 1).all()):
        return ("ones", value.dtype)
    return None


def _shared(base: nn.Module, call: Call) -> bool:
    """A parameterless module returning a tuple: rotary tables, which every stage holds and the block context calls
    per microbatch (once per layer type where the family has several), so the forward may call it more than once."""
    return isinstance(call.out, (tuple, list)) and not any(True for _ in base.get_submodule(call.name).parameters())


def _step(model: nn.Module, base: nn.Module, call: Call, ids: torch.Tensor) -> Step | None:
    """The pre-layer call as a Step; None for shared rotary tables."""
    if _shared(base, call):
        return None
    first = call.args[0] if call.args else None
    hidden = isinstance(first, torch.Tensor) and first.is_floating_point() and first.dim() == 3
    if hidden and first.shape[:2] == ids.shape and len(call.args) == 1 and not call.kwargs:
        return Step(call.name)
    out = call.out
    if not hidden and isinstance(out, torch.Tensor) and out.is_floating_point() and out.shape[-2] == SEQ:
        args = tuple(_role(a, ids) for a in call.args)
        kwargs = tuple((k, _role(v, ids)) for k, v in call.kwargs.items())
        roles = [*args, *(r for _, r in kwargs)]
        if (("positions", None) in roles or ("ids", None) in roles) and None not in roles:
            return Step(call.name, args, kwargs)  # type: ignore[arg-type]
    raise _refuse(model, f"its forward calls {call.name} before its layers in a way pp_tp cannot rebuild")


def _layer_kwargs(model: nn.Module, block: nn.Module, call: Call, index: int, first: Any) -> tuple[frozenset, dict]:
    """Keywords the forward passes a layer through its `**kwargs` that pp_tp supplies, and the tensors it passes
    that pp_tp does not (ALiBi biases: `_prove_shape_only` then decides); refuses any other non-empty argument. The
    layer's `index` and the first layer's hidden input `first` are what carried.py gives a layer (and proves)."""
    passed, via_kwargs = bound_arguments(block, call.args, call.kwargs)
    computed = {}
    for key, value in passed.items():
        if key in SUPPLIED or value is None or value is False or carries(value, index, first):
            continue
        if not isinstance(value, torch.Tensor):
            raise _refuse(model, f"its forward hands its layers {key!r}, which pp_tp does not compute")
        computed[key] = value
    return frozenset(via_kwargs & SUPPLIED), computed


def _prove_shape_only(record: Record, plan: PpPlan) -> None:
    """Refuses unless each computed layer argument (ALiBi biases) depends on the microbatch's shape only: the prologue
    replay of the small config (no weights, a hidden state of zeros, zero ids, in training mode so no dropout of the
    config's touches it) hands the first layer what the recorded forward handed it."""
    model, ids = record.model, record.ids
    layer = model.get_submodule(f"{plan.base}.{plan.blocks}")[0]
    first = next(c for c in record.calls if c.module is layer)
    want = bound_arguments(layer, first.args, first.kwargs)[0]
    keys = tuple(sorted(plan.computed))
    try:
        replay = Prologue(type(model), record.small, f"{plan.base}.{plan.blocks}")
        by_type = replay.layer_args(
            ids.shape[0], torch.arange(ids.shape[1]).unsqueeze(0), torch.float32, keys, False, True
        )
        got = by_type[layer_types_of(record.small, 1)[0]]
    except Exception as e:  # noqa: BLE001 - a replay that does not run proves nothing: refused
        got = {"": e}
    for key in keys:
        if not same(got.get(key), want[key]):
            raise _refuse(
                model, f"its forward hands its layers {key!r}, which depends on more than the microbatch's shape"
            )


def computed_inputs(model: nn.Module, plan: PpPlan) -> LayerArgs:
    """The layer arguments `plan` shows the family's forward computing from the microbatch's shape alone (ALiBi
    biases: BLOOM's `alibi`, MPT's `position_bias`), by the prologue replay of the model's own config; run once
    here, so a replay that cannot run is refused before any collective, not inside a step."""
    try:
        computed = LayerArgs(prologue_of(model, f"{plan.base}.{plan.blocks}"), tuple(sorted(plan.computed)), False)
        if not computed(torch.zeros(1, 2, dtype=torch.long), 1, torch.float32):
            raise RuntimeError("no layer reached")
    except Exception as e:  # noqa: BLE001
        why = f"its layers' {sorted(plan.computed)} cannot be computed for its config ({type(e).__name__})"
        raise _refuse(model, why) from None
    return computed


def _analyse(model: nn.Module, base: nn.Module, calls: list[Call], ids: torch.Tensor) -> PpPlan:
    """The structure the recorded calls show, or a one-line refusal."""
    wrappers = [c.name for c in calls if c.kind == "wrapper"]
    if len(set(wrappers)) != len(wrappers):
        raise _refuse(model, f"its forward calls {max(set(wrappers), key=wrappers.count)} more than once")
    calls = [c for c in calls if c.kind != "wrapper"]
    lists = {c.name.rpartition(".")[0] for c in calls if c.kind == "layer"}
    if len(lists) != 1:
        raise _refuse(model, f"its forward runs {len(lists)} layer lists, not one, between embedding and norm")
    blocks = lists.pop()
    at = [i for i, c in enumerate(calls) if c.kind == "layer"]
    want = [f"{blocks}.{i}" for i in range(len(base.get_submodule(blocks)))]
    if [calls[i].name for i in at] != want or at != list(range(at[0], at[0] + len(at))):
        raise _refuse(model, f"its forward does not run {blocks}'s layers once each, in order, one after another")
    first = hidden_input(calls[at[0]].args, calls[at[0]].kwargs)
    found = [_layer_kwargs(model, base.get_submodule(calls[i].name), calls[i], k, first) for k, i in enumerate(at)]
    if any(not same(computed, found[0][1]) for _, computed in found):
        raise _refuse(model, f"its forward hands its layers different {sorted(found[0][1])} (pp_tp computes one set)")
    block_kwargs = frozenset().union(*(supplied for supplied, _ in found))
    mask = bound_arguments(base.get_submodule(calls[at[0]].name), calls[at[0]].args, calls[at[0]].kwargs)[0].get(
        "attention_mask"
    )
    pre, post = calls[: at[0]], calls[at[-1] + 1 :]
    names = [c.name for c in pre + post if not _shared(base, c)]
    if len(set(names)) != len(names):
        raise _refuse(model, f"its forward calls {max(set(names), key=names.count)} more than once")
    embed = embed_name(model, base)
    if not pre or pre[0].name != embed:
        raise _refuse(model, f"its forward does not start with its input embedding {embed}")
    if not _is_ids(pre[0].args, ids):  # CPM-Ant: prompt tokens of its own put before the batch's
        raise _refuse(model, f"its forward hands its input embedding {embed} other ids than the batch's")
    if any(any(True for _ in base.get_submodule(c.name).parameters()) for c in post[:-1]):
        raise _refuse(model, f"its forward runs {[c.name for c in post]} after its layers; pp_tp runs one final norm")
    steps = tuple(s for c in pre[1:] if (s := _step(model, base, c, ids)) is not None)
    # No module after the layers: the family has no final norm (GPT-1, post-norm BERT layers), an identity one.
    return PpPlan(
        embed,
        tuple(s.name for s in steps),
        blocks,
        tuple(c.name for c in post[:-1]),
        post[-1].name if post else "",
        steps=steps,
        block_kwargs=block_kwargs,
        computed=frozenset(found[0][1]),
        mask_dtype=mask.dtype if isinstance(mask, torch.Tensor) else None,
        replay_target=replay_target(model, calls[: at[0] + 1], embed, ids, discovery_base(model)) or "",
    )


def embed_name(model: nn.Module, base: nn.Module) -> str:
    """The input embedding's name inside `base`."""
    emb = model.get_input_embeddings()
    return next((n for n, m in base.named_modules() if m is emb), "")


def discovery_base(model: nn.Module) -> str:
    """Model-relative name of the module the trace starts from: the one holding the input embedding, or, where
    that holds no layer list (BERT's `embeddings`), the nearest module above it that does."""
    name = embedding_parent(model)
    while "." in name and not any(isinstance(m, nn.ModuleList) for m in model.get_submodule(name).modules()):
        name = name.rpartition(".")[0]
    return name


def discover(model: nn.Module) -> PpPlan:
    """The structure of `model`'s family from its recorded forward (record.py); refused in one line where the calls
    do not show embedding -> layers -> norm."""
    found = record_of(model).derived("discover", lambda: _found(record_of(model)))
    if isinstance(found, str):
        raise ConfigError(found)
    base = discovery_base(model)
    replay = prologue_of(model, f"{base}.{found.blocks}") if found.replay_target else None
    return dataclasses.replace(found, base=base, replay=replay)


def _found(record: Record) -> PpPlan | str:
    """The structure the record shows, or the refusal's line."""
    try:
        return _discover(record)
    except ConfigError as e:
        return str(e)


def _discover(record: Record) -> PpPlan:
    model, ids, e = record.model, record.ids, record.error
    if e is not None:  # a family whose small copy does not run cannot be traced: refused
        raise _refuse(model, f"its 2-layer copy did not run ({type(e).__name__}: {str(e)[:120]})")
    base = model.get_submodule(discovery_base(model))
    calls = trace(record, discovery_base(model))
    plan = dataclasses.replace(_analyse(model, base, calls, ids), base=discovery_base(model))
    if plan.computed:
        _prove_shape_only(record, plan)
    return plan


class EmbedCall:
    """The first stage's input to the first block for a discovered structure with learned positions or code of its
    forward's own on the embedding's output: the embedding, the model-level transform after it (or that code,
    replayed: it includes the transform), then each step in the forward's order."""

    def __init__(self, plan: PpPlan, after: Any):
        self.plan, self.after = plan, after

    def _value(self, role: Role, ids: torch.Tensor, positions: torch.Tensor) -> Any:
        kind, value = role
        if kind == "positions":
            return positions
        if kind == "ids":
            return ids
        return torch.ones(ids.shape, dtype=value, device=ids.device) if kind == "ones" else value

    def __call__(self, stage: nn.Module, ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        base = self.plan.base
        h = stage.get_submodule(f"{base}.{self.plan.embed}")(ids)
        if self.plan.replay is not None:
            h = self.plan.replay.hidden(f"{base}.{self.plan.replay_target}", ids, h, position_ids, stage.training)
        elif self.after is not None:
            h = self.after(h)
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        for step in self.plan.steps:
            module = stage.get_submodule(f"{base}.{step.name}")
            if step.args is None:
                h = module(h)
                continue
            args = [self._value(r, ids, position_ids) for r in step.args]
            kwargs = {k: self._value(r, ids, position_ids) for k, r in step.kwargs}
            h = h + module(*args, **kwargs)
        return h
