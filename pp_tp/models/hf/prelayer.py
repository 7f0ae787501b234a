"""What a Hugging Face family's forward does to the input embedding's output in its own code before the next module
it calls (CTRL's sqrt(d) scale and sinusoidal positions, RecurrentGemma's bfloat16 normalizer), replayed per
microbatch by the family's own forward: on a stand-in of the model's class and config built on meta, whose input
embedding hands on the stage's embedding output and whose own buffers hold what its init rule gives them, stopped
where it calls that module. Accepted only where the replay reproduces the traced small copy exactly (discover.py and
handed.py ask `replay_target`); the self-check then proves the whole composition.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pp_tp.base._torch import is_persistent_buffer
from pp_tp.models.hf.buffers import _without_parameters
from pp_tp.models.hf.extras import after_embed
from pp_tp.models.hf.record import Call, record_of, run_until


def hidden_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The hidden state a module call was handed: its first argument, else its `hidden_states` keyword (or first)."""
    return args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))


class _Given(nn.Module):
    """The stand-in's input embedding: it returns the stage's embedding output for this call."""

    def __init__(self) -> None:
        super().__init__()
        self.value: torch.Tensor | None = None

    def forward(self, *_: Any, **__: Any) -> torch.Tensor | None:
        return self.value


class Replay:
    """The family's own code between its input embedding and `target` (model-relative), per microbatch."""

    def __init__(self, cls: type, config: Any, target: str):
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = cls(config)
        emb = model.get_input_embeddings()
        name = next(n for n, m in model.named_modules() if m is emb)
        parent, _, leaf = name.rpartition(".")
        self.owner = model.get_submodule(parent)
        self.given = _Given()
        setattr(self.owner, leaf, self.given)
        self.masters = _own_buffers(model, self.owner)
        self.model, self.target = model, model.get_submodule(target)
        self._cast: dict[tuple[torch.device, torch.dtype], dict[str, torch.Tensor]] = {}

    def __call__(
        self, ids: torch.Tensor, h: torch.Tensor, position_ids: torch.Tensor | None, training: bool
    ) -> torch.Tensor:
        key = (h.device, h.dtype)
        if key not in self._cast:
            self.model.to(h.dtype)  # meta parameters: the dtype the family's code may read off them
            self._cast[key] = {n: b.to(h.device, h.dtype) for n, b in self.masters.items()}
        for name, buffer in self._cast[key].items():  # reset: a forward may reassign its own (CTRL's table)
            setattr(self.owner, name, buffer)
        self.model.train(training)
        self.given.value = h
        positions = {} if position_ids is None else {"position_ids": position_ids}
        try:
            reached = run_until(self.model, {self.target: 0}, input_ids=ids, use_cache=False, **positions)
        finally:
            self.given.value = None
        if not reached:
            raise RuntimeError("the replayed forward did not reach its target module")
        return hidden_input(reached[0].args, reached[0].kwargs)


def _own_buffers(model: nn.Module, owner: nn.Module) -> dict[str, torch.Tensor]:
    """`owner`'s own buffers with the values the family's init rule gives them (fp32 CPU where they are wider);
    raises where one is persistent (a checkpoint's value, not the rule's), not floating or left unset by the rule."""
    masters = {}
    for name, b in list(owner.named_buffers(recurse=False)):
        if is_persistent_buffer(owner, name) or not b.is_floating_point():
            raise ValueError(f"buffer {name} is persistent or not floating")
        masters[name] = torch.full(b.shape, float("nan"), dtype=b.dtype, device="cpu")
        setattr(owner, name, masters[name])
    _without_parameters(model, owner, recurse=False)
    if any(bool(b.isnan().any()) for b in masters.values()):
        raise ValueError("a buffer gets no value from the init rule")
    return masters


def replay_target(model: nn.Module, calls: list[Call], embed: str, ids: torch.Tensor, prefix: str) -> str | None:
    """The name of the first module the traced `model` (the small copy) calls after its input embedding `embed`
    (names relative to `prefix`), where the forward changed the embedding's output in its own code before it (past
    extras.after_embed) and a `Replay` hands it exactly what the traced forward did; None otherwise."""
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
        replay = Replay(type(model), model.config, f"{prefix}.{target.name}")
        with torch.no_grad():
            got = replay(ids, e, None, training=model.training)
    except Exception:  # noqa: BLE001 - a forward the replay cannot run is not reproduced: refused elsewhere
        return None
    return target.name if isinstance(got, torch.Tensor) and torch.equal(got, given) else None


def replay_for(model: nn.Module, target: str) -> Replay:
    """The `Replay` of `model`'s class and config up to `target` (model-relative), built once (kept in the family's
    record)."""
    key = ("replay", model.config.to_json_string(use_diff=False), target)
    return record_of(model).derived(key, lambda: Replay(type(model), model.config, target))
