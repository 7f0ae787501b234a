"""The one replay of a Hugging Face family's own forward from its input embedding to its layers, per microbatch.

What a family's forward computes in its own code rather than in a module: the first stage's hidden input (CTRL's
sqrt(d) scale and sinusoidal positions, RecurrentGemma's bfloat16 normalizer) and what it hands its layers from the
microbatch's shape and positions (BLOOM's `alibi`, MPT's `position_bias`, Beam's per-type `attention_scaling`). The
family's own forward runs on a weightless stand-in: its class and config built on meta, its input embedding
returning the stage's hidden state, every module with weights outside the layer list passing its hidden input on
(BLOOM's `word_embeddings_layernorm`: a stage's hidden state is not the embedding's output anyway), its layers passing
their hidden input on, and its buffers outside the layers at the values the family's init rule gives them (CTRL's
table, rotary frequencies). It stops where the forward calls a given module (the hidden path) or once the first layer
of each layer type is called (the layer arguments). Nothing is adopted unless the same replay of the small copy's
config reproduces its recorded forward (`replay_target` below, discover._prove_shape_only, position_args.py); the
self-check then proves the whole composition. Not reproduced, so refused in one line: layer arguments that depend on
what a module with weights computes before the layers, or on a layer's output beyond its hidden state. Of the sweep's
families (docs/family_sweep.md), those with such code (CTRL, RecurrentGemma, BLOOM, MPT, Beam) are all reproduced by
this one replay; none needs more.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from pp_tp.base._torch import is_persistent_buffer
from pp_tp.models.hf.buffers import _without_parameters
from pp_tp.models.hf.extras import after_embed
from pp_tp.models.hf.mixers import FULL
from pp_tp.models.hf.record import Call, record_of, run_until
from pp_tp.models.hf.trace import bound_arguments

SLIDING = "sliding_attention"
_MEMO = 8  # distinct microbatch shapes / position-id sets remembered


def layer_types_of(config: Any, n_layers: int) -> list[str]:
    """Each of the first `n_layers` layers' type, as the model's forward picks its mask (mixers.LayerMasks refuses
    one it cannot)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types[:n_layers])
    return [SLIDING if getattr(config, "sliding_window", None) is not None else FULL] * n_layers


def hidden_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The hidden state a module call was handed: its first argument, else its `hidden_states` keyword (or first)."""
    return args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))


class _Given(nn.Module):
    """The stand-in's input embedding: it returns the stage's hidden state for this call."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.value: torch.Tensor | None = None

    def forward(self, *_: Any, **__: Any) -> torch.Tensor | None:
        return self.value


def _passed(*args: Any, **kwargs: Any) -> Any:
    """A weightless module's forward: its hidden input, handed on (a learned position embedding's addend: 0)."""
    first = hidden_input(args, kwargs)
    if isinstance(first, torch.Tensor) and first.is_floating_point():
        return first
    return torch.zeros((), device=first.device if isinstance(first, torch.Tensor) else None)


class Prologue:
    """The family's forward on a weightless stand-in of `cls(config)`, up to a module or its layers (`blocks`,
    model-relative; None: the hidden path only)."""

    def __init__(self, cls: type, config: Any, blocks: str | None):
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = cls(config)
        emb = model.get_input_embeddings()
        name = next(n for n, m in model.named_modules() if m is emb)
        parent, _, leaf = name.rpartition(".")
        self.given = _Given(emb.weight.shape[-1])
        setattr(model.get_submodule(parent), leaf, self.given)
        layers = model.get_submodule(blocks) if blocks is not None else nn.ModuleList()
        for layer in layers:
            layer.forward = _passed  # the instance's: bound_arguments reads the class's signature
        types = layer_types_of(config, len(layers))
        self.first = {layers[types.index(t)]: t for t in dict.fromkeys(types)}
        self.masters = _outside(model, model, layers)
        self.model, self.config = model, config
        self._cast: dict[tuple[torch.device, torch.dtype], list[tuple[nn.Module, str, torch.Tensor]]] = {}
        self._memo: OrderedDict[tuple[Any, ...], dict[str, dict[str, Any]]] = OrderedDict()

    def _run(self, stops: dict[nn.Module, Any], h: torch.Tensor, training: bool, **inputs: Any) -> dict:
        key = (h.device, h.dtype)
        if key not in self._cast:
            self.model.to(h.dtype)  # meta parameters: the dtype the family's code may read off them
            self._cast[key] = [(m, n, b.to(h.device, h.dtype)) for m, n, b in self.masters]
        for module, name, buffer in self._cast[key]:  # reset: a forward may reassign its own (CTRL's table)
            setattr(module, name, buffer)
        if self.model.training != training:
            self.model.train(training)
        self.given.value = h
        try:
            return run_until(self.model, stops, use_cache=False, **inputs)
        finally:
            self.given.value = None

    def hidden(
        self, target: str, ids: torch.Tensor, h: torch.Tensor, position_ids: torch.Tensor | None, training: bool
    ) -> torch.Tensor:
        """What the forward hands `target` (model-relative) when its input embedding returns `h` for `ids`."""
        positions = {} if position_ids is None else {"position_ids": position_ids}
        reached = self._run({self.model.get_submodule(target): 0}, h, training, input_ids=ids, **positions)
        if not reached:
            raise RuntimeError("the replayed forward did not reach its target module")
        return hidden_input(reached[0].args, reached[0].kwargs)

    def layer_args(
        self,
        rows: int,
        position_ids: torch.Tensor,
        dtype: torch.dtype,
        keys: tuple[str, ...],
        positions: bool = True,
        training: bool = False,
    ) -> dict[str, dict[str, Any]]:
        """{layer type: {key: value}}: what the forward hands the first layer of each type for `rows` rows at
        `position_ids` ([1 or rows, S]; with `positions` False only their shape and device are read, so the forward
        makes its own); a type it does not reach is missing. Remembered for the last few shapes and position ids."""
        device, seq = position_ids.device, position_ids.shape[-1]
        cpu = position_ids.cpu() if positions else None
        key = (rows, seq, dtype, device, keys, training, None if cpu is None else (cpu.shape, cpu.numpy().tobytes()))
        if key not in self._memo:
            h = torch.zeros(rows, seq, self.given.width, dtype=dtype, device=device)
            ids = torch.zeros(rows, seq, dtype=torch.long, device=device)
            inputs = {"position_ids": position_ids} if positions else {}
            with torch.no_grad():
                reached = self._run(self.first, h, training, input_ids=ids, **inputs)
            got = {t: bound_arguments(c.module, c.args, c.kwargs)[0] for t, c in reached.items()}
            self._memo[key] = {t: {k: a.get(k) for k in keys} for t, a in got.items()}
            if len(self._memo) > _MEMO:
                self._memo.popitem(last=False)
        return self._memo[key]


def _outside(model: nn.Module, module: nn.Module, layers: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Below `module`, outside `layers`: each module with weights passes its hidden input on (`_passed`) unless it
    holds the layers; each other module's non-persistent floating buffers get the family's init-rule values (fp32 CPU
    masters where they are wider). Persistent buffers (a checkpoint's values, not the rule's) and those the rule
    leaves unset stay on meta: a forward reading one does not run, so nothing is adopted from it."""
    nan = {
        name: torch.full(b.shape, float("nan"), dtype=b.dtype, device="cpu")
        for name, b in module.named_buffers(recurse=False)
        if not is_persistent_buffer(module, name) and b.is_floating_point()
    }
    for name, b in nan.items():
        setattr(module, name, b)
    if nan:
        _without_parameters(model, module, recurse=False)
    masters = []
    for name, b in nan.items():
        unset = bool(b.isnan().any())
        setattr(module, name, b.to("meta") if unset else b)
        masters += [] if unset else [(module, name, b)]
    for child in module.children():
        if child is layers or isinstance(child, _Given):
            continue
        if any(m is layers or isinstance(m, _Given) for m in child.modules()):
            masters += _outside(model, child, layers)
        elif any(True for _ in child.parameters()):
            child.forward = _passed
        else:
            masters += _outside(model, child, layers)
    return masters


def replay_target(model: nn.Module, calls: list[Call], embed: str, ids: torch.Tensor, prefix: str) -> str | None:
    """The name of the first module the traced `model` (the small copy) calls after its input embedding `embed`
    (names relative to `prefix`), where the forward changed the embedding's output in its own code before it (past
    extras.after_embed) and the prologue replay hands it exactly what the traced forward did; None otherwise."""
    calls = [c for c in calls if c.kind != "wrapper"]
    at = next((i for i, c in enumerate(calls) if c.name == embed), None)
    if at is None or at + 1 >= len(calls):
        return None
    target = calls[at + 1]
    given = hidden_input(target.args, target.kwargs)
    with torch.no_grad():
        e = model.get_input_embeddings()(ids)  # afresh: the forward may have changed the traced output in place
    after = after_embed(model.config)
    plain = after(e) if after is not None else e
    if not isinstance(given, torch.Tensor) or given.shape != plain.shape or torch.equal(given, plain):
        return None
    try:
        with torch.no_grad():
            got = Prologue(type(model), model.config, None).hidden(
                f"{prefix}.{target.name}", ids, e, None, training=model.training
            )
    except Exception:  # noqa: BLE001 - a forward the replay cannot run is not reproduced: refused elsewhere
        return None
    return target.name if isinstance(got, torch.Tensor) and torch.equal(got, given) else None


def prologue_of(model: nn.Module, blocks: str | None) -> Prologue:
    """The `Prologue` of `model`'s class and config (its layers `blocks`), built once (kept in the family's
    record)."""
    key = ("prologue", model.config.to_json_string(use_diff=False), blocks)
    return record_of(model).derived(key, lambda: Prologue(type(model), model.config, blocks))


class LayerArgs:
    """Per layer type, the arguments of `keys` the family's forward hands that type's layers, from the microbatch's
    shape (and, with `positions`, its position ids): the prologue replay, per microbatch."""

    def __init__(self, prologue: Prologue, keys: tuple[str, ...], positions: bool):
        self.prologue, self.keys, self.positions = prologue, keys, positions

    def __call__(self, position_ids: torch.Tensor, rows: int, dtype: torch.dtype) -> dict[str, dict[str, Any]]:
        return self.prologue.layer_args(rows, position_ids, dtype, self.keys, self.positions)
