"""The pipeline structure of a Hugging Face causal LM that declares no `base_model_pp_plan`, found by running it.

transformers declares no pipeline plan for most of its causal LMs (GPT-2's `wte`/`wpe`/`h`/`ln_f`, OPT's
`decoder.layers`), though their structure is embedding -> blocks -> norm under other names. Names alone prove
nothing, so the family's own forward runs once on a small copy of its config (the self-check's: seeded, CPU, fp32)
with a hook on every child of the module holding the input embedding and on every element of its layer lists; the
calls it records are the structure: the layers are the one `ModuleList` whose elements run once each, in order, and
nothing else in between; what runs before them is the embedding first, then modules on the hidden state (dropout,
norms) and learned position embeddings (called with position ids, added); after them, parameterless modules and
one final norm. Every argument the forward hands a layer must be one pp_tp's block context supplies (mask, positions,
rotary tables) or empty: ALiBi tensors and the like are refused by name. Anything else is refused in one line; what
is accepted is still proven equal to the family's own forward by the self-check. Deterministic and cached per
(class, small config), so every rank reaches the same structure.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn

from pp_tp.errors import ConfigError
from pp_tp.models.hf.self_check import small_config

# What pp_tp's block context hands a layer (pp_tp/models/hf/layout.py:BlockContext.call); any other argument the
# family's forward passes a layer must be None or False.
SUPPLIED = frozenset({"attention_mask", "position_ids", "position_embeddings", "use_cache", "cache", "past_key_values"})
_ROWS, _SEQ = 2, 6

# A position call's argument: ("positions", None) position ids, ("ones", dtype) an all-ones [B, S] mask, ("value", v)
# a Python constant.
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

    @property
    def adds_positions(self) -> bool:
        return any(s.args is not None for s in self.steps)


def _refuse(model: nn.Module, why: str) -> ConfigError:
    return ConfigError(f"model {type(model).__name__}: {why}; register a layout for it (pp_tp.extend.register_layout)")


def embedding_parent(model: nn.Module) -> str:
    """Model-relative name of the module holding the input embedding (where a family keeps its layers too)."""
    emb = model.get_input_embeddings()
    name = next((n for n, m in model.named_modules() if m is emb), "")
    if "." not in name:
        raise _refuse(model, "its input embedding is not inside a base model")
    return name.rpartition(".")[0]


@dataclasses.dataclass
class _Call:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any


def _trace(model: nn.Module, base: nn.Module, ids: torch.Tensor) -> list[_Call]:
    """The calls of `base`'s children and of their layer lists' elements, in order, on one forward of `model`."""
    calls: list[_Call] = []
    handles = []
    targets = []
    for name, child in base.named_children():
        targets.append((name, child))
        if isinstance(child, nn.ModuleList):
            targets += [(f"{name}.{i}", m) for i, m in enumerate(child)]
    for name, module in targets:
        hook = lambda m, a, k, o, name=name: calls.append(_Call(name, a, k, o))  # noqa: E731
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return calls


def _is_ids(args: tuple[Any, ...], ids: torch.Tensor) -> bool:
    """Whether the call's first argument is the input ids (the forward may have reshaped them)."""
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].shape == ids.shape and torch.equal(args[0], ids)


def _role(value: Any, ids: torch.Tensor) -> Role | None:
    """What a position embedding's argument is, or None when pp_tp cannot rebuild it per microbatch."""
    if not isinstance(value, torch.Tensor):
        return ("value", value) if value is None or isinstance(value, (bool, int, float)) else None
    if value.dim() != 2 or value.shape[-1] != _SEQ or _is_ids((value,), ids):
        return None
    if torch.equal(value.long(), torch.arange(_SEQ).expand_as(value)) and not value.is_floating_point():
        return ("positions", None)
    if value.shape == ids.shape and bool((value == 1).all()):
        return ("ones", value.dtype)
    return None


def _step(model: nn.Module, base: nn.Module, call: _Call, ids: torch.Tensor) -> Step | None:
    """The pre-layer call as a Step; None for a parameterless module returning a tuple (rotary tables: shared)."""
    module = base.get_submodule(call.name)
    weighted = any(True for _ in module.parameters())
    if isinstance(call.out, (tuple, list)) and not weighted:
        return None
    first = call.args[0] if call.args else None
    hidden = isinstance(first, torch.Tensor) and first.is_floating_point() and first.dim() == 3
    if hidden and first.shape[:2] == ids.shape and len(call.args) == 1 and not call.kwargs:
        return Step(call.name)
    out = call.out
    if not hidden and isinstance(out, torch.Tensor) and out.is_floating_point() and out.shape[-2] == _SEQ:
        args = tuple(_role(a, ids) for a in call.args)
        kwargs = tuple((k, _role(v, ids)) for k, v in call.kwargs.items())
        roles = [*args, *(r for _, r in kwargs)]
        if ("positions", None) in roles and None not in roles:
            return Step(call.name, args, kwargs)  # type: ignore[arg-type]
    raise _refuse(model, f"its forward calls {call.name} before its layers in a way pp_tp cannot rebuild")


def _layer_kwargs(model: nn.Module, block: nn.Module, call: _Call) -> frozenset[str]:
    """Keywords the forward passes a layer through its `**kwargs` that pp_tp supplies; refuses any other non-empty
    argument (ALiBi, position biases) by name."""
    signature = inspect.signature(block.forward)
    bound = signature.bind(*call.args, **call.kwargs).arguments
    passed: dict[str, Any] = {}
    via_kwargs: set[str] = set()
    for name, value in bound.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            passed.update(value)
            via_kwargs.update(value)
        else:
            passed[name] = value
    first = next(iter(bound))
    for key, value in passed.items():
        if key != first and key not in SUPPLIED and value is not None and value is not False:
            raise _refuse(model, f"its forward hands its layers {key!r}, which pp_tp does not compute")
    return frozenset(via_kwargs & SUPPLIED)


def _analyse(model: nn.Module, base: nn.Module, calls: list[_Call], ids: torch.Tensor) -> PpPlan:
    """The structure the recorded calls show, or a one-line refusal."""
    lists = {c.name.rpartition(".")[0] for c in calls if "." in c.name}
    if len(lists) != 1:
        raise _refuse(model, f"its forward runs {len(lists)} layer lists, not one, between embedding and norm")
    blocks = lists.pop()
    at = [i for i, c in enumerate(calls) if c.name.startswith(blocks + ".")]
    want = [f"{blocks}.{i}" for i in range(len(base.get_submodule(blocks)))]
    if [calls[i].name for i in at] != want or at != list(range(at[0], at[0] + len(at))):
        raise _refuse(model, f"its forward does not run {blocks}'s layers once each, in order, one after another")
    pre, post = calls[: at[0]], calls[at[-1] + 1 :]
    names = [c.name for c in pre + post]
    if len(set(names)) != len(names):
        raise _refuse(model, f"its forward calls {max(set(names), key=names.count)} more than once")
    embed = _embed_name(model, base)
    if not pre or pre[0].name != embed or not _is_ids(pre[0].args, ids):
        raise _refuse(model, f"its forward does not start with its input embedding {embed}")
    if not post:
        raise _refuse(model, "its forward runs no final norm after its layers")
    if any(any(True for _ in base.get_submodule(c.name).parameters()) for c in post[:-1]):
        raise _refuse(model, f"its forward runs {[c.name for c in post]} after its layers; pp_tp runs one final norm")
    steps = tuple(s for c in pre[1:] if (s := _step(model, base, c, ids)) is not None)
    return PpPlan(
        embed,
        tuple(s.name for s in steps),
        blocks,
        tuple(c.name for c in post[:-1]),
        post[-1].name,
        steps=steps,
        block_kwargs=frozenset().union(
            *(_layer_kwargs(model, base.get_submodule(calls[i].name), calls[i]) for i in at)
        ),
    )


def _embed_name(model: nn.Module, base: nn.Module) -> str:
    """The input embedding's name inside `base`."""
    emb = model.get_input_embeddings()
    return next((n for n, m in base.named_children() if m is emb), "")


_FOUND: dict[tuple[type, str], PpPlan | str] = {}


def discover(model: nn.Module) -> PpPlan:
    """The structure of `model`'s family from one traced forward of a small copy (cached); refused in one line
    where the calls do not show embedding -> layers -> norm."""
    small = small_config(model.config)
    key = (type(model), small.to_json_string(use_diff=False))
    if key not in _FOUND:
        try:
            _FOUND[key] = _discover(type(model), small)
        except ConfigError as e:
            _FOUND[key] = str(e)
    found = _FOUND[key]
    if isinstance(found, str):
        raise ConfigError(found)
    return dataclasses.replace(found, base=embedding_parent(model))


def _discover(cls: type, small: Any) -> PpPlan:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(small).to(torch.float32).eval()
    base = model.get_submodule(embedding_parent(model))
    ids = torch.randint(0, small.vocab_size, (_ROWS, _SEQ), generator=torch.Generator().manual_seed(0))
    try:
        calls = _trace(model, base, ids)
    except Exception as e:  # noqa: BLE001 - a family whose small copy does not run cannot be traced: refused
        raise _refuse(model, f"its 2-layer copy did not run ({type(e).__name__}: {str(e)[:120]})") from None
    return _analyse(model, base, calls, ids)


class EmbedCall:
    """The first stage's input to the first block for a discovered structure with learned positions: the
    embedding, the model-level transform after it, then each step in the forward's order."""

    def __init__(self, plan: PpPlan, after: Any):
        self.plan, self.after = plan, after

    def _value(self, role: Role, ids: torch.Tensor, positions: torch.Tensor) -> Any:
        kind, value = role
        if kind == "positions":
            return positions
        return torch.ones(ids.shape, dtype=value, device=ids.device) if kind == "ones" else value

    def __call__(self, stage: nn.Module, ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        base = self.plan.base
        h = stage.get_submodule(f"{base}.{self.plan.embed}")(ids)
        h = self.after(h) if self.after is not None else h
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
