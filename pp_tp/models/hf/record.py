"""One record of a Hugging Face family's forward, and the one way pp_tp stops a forward early.

Everything pp_tp learns about a family by running it comes from a `Record`, one per (model class, small config,
transformers version): the small copy (small.py) built once, seeded, fp32, CPU, with every dropout rate 0; one eval
forward on seeded ids with a pre- and post-hook on every module, which records each call (module, arguments,
output, in the order calls return); and, on an untouched copy in training mode with spread values (`seeded_values`),
one training forward recording the order of module calls and where the CPU generator advanced. The detectors are
functions of it: structure (discover.py), what each layer is handed (handed.py), the head path (head_path.py),
threaded state (threaded.py), grouped experts (experts.py), randomness (randomness.py); what they derive, and what the
probes of a single module (routers, packed experts) and the self-check find for the family, is kept in the record's
`memo`, so nothing else in the adapter caches. The caller's RNG state is never touched. `run_until` runs a forward
until given modules are reached (the prologue replay: prologue.py).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pp_tp.base.disk_memo import disk_memo, source_digest
from pp_tp.base.tensors import persistent_buffers
from pp_tp.errors import ConfigError
from pp_tp.models.hf.small import small_config
from pp_tp.parallel.rng import DROPOUT_MODULES

ROWS, SEQ = 2, 6  # the eval forward's ids
TRAIN_ROWS, TRAIN_SEQ = 4, 32  # the training forward's ids (long enough for noise on near ties to show)
# A training forward's events in order: ("pre", fqn) / ("post", fqn) around each module's forward, ("draw", fqns)
# where the CPU generator advanced while the modules `fqns` were running (outermost first; the innermost's own code
# drew, between its children's calls).
Event = tuple[str, Any]


@dataclasses.dataclass
class Call:
    """One module call: its name (model-relative; "" the model itself), the module, what it was handed and
    returned."""

    name: str
    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any = None
    kind: str = "module"  # how a view names it: "module", "layer" or "wrapper" (trace.py)


class Stop(Exception):
    """Raised by `run_until`'s hooks once every module it waits for was reached: the rest of the forward is not
    needed."""


def is_dropout_key(key: str) -> bool:
    """A config key holding a dropout rate (`attention_dropout`, GPT-2's `attn_pdrop`), not layer drop."""
    return "dropout" in key or key.endswith("pdrop")


def without_dropout(config: Any) -> Any:
    """A copy with every positive `*dropout*` float key at 0 (dropout has pp_tp's discipline; it is not asked here)."""
    out = copy.deepcopy(config)
    for key, value in config.to_dict().items():
        if is_dropout_key(key) and isinstance(value, float) and value > 0 and hasattr(out, key):
            setattr(out, key, 0.0)
    return out


def quiet(model: nn.Module) -> nn.Module:
    """`model` with every dropout module at rate 0 (attention kernels read the rate off the module: GPT-2)."""
    for module in model.modules():
        if isinstance(module, DROPOUT_MODULES):
            module.p = 0.0
    return model


@torch.no_grad()
def seeded_values(model: nn.Module, seed: int, params: str | None = "spread", zero_buffers: bool = False) -> None:
    """Seeded values in place, every draw from one generator seeded `seed`: `params` "spread": N(0, 0.05), norm
    weights around 1 (router scores far from the init's, so noise that only acts on near ties, sparsemixer's jitter,
    shows); "stir": N(0, 0.1) added (no zero bias or unit norm left, so a bias added twice or a dropped scale shows);
    None: left. `zero_buffers`: all-zero floating persistent buffers (router biases at init) get N(0, 0.1), so a
    composition that dropped or mangled one would show (the self-check, the router probe, bench/family_sweep.py)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters() if params else ():
        if params == "stir":
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
            continue
        owner, _, leaf = name.rpartition(".")
        norm = leaf == "weight" and "norm" in type(model.get_submodule(owner)).__name__.lower()
        p.copy_(torch.randn(p.shape, generator=gen) * 0.05 + (1.0 if norm else 0.0))
    for b in persistent_buffers(model).values() if zero_buffers else ():
        if b.is_floating_point() and not b.any():
            b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=b.dtype))


class _Hooks:
    """Pre- and post-hooks on every module of `model`: each call (in the order calls return), and with `events` the
    calls' boundaries and the generator's advances between them."""

    def __init__(self, model: nn.Module, events: bool):
        self.calls: list[Call] = []
        self.events: list[Event] | None = [] if events else None
        self.open: list[Call] = []
        self.state = torch.get_rng_state()
        self.handles = []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))

    def _mark(self, kind: str, name: str) -> None:
        if self.events is None:
            return
        now = torch.get_rng_state()
        if self.open and not torch.equal(now, self.state):
            self.events.append(("draw", tuple(c.name for c in self.open)))
        self.state = now
        self.events.append((kind, name))

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._mark("pre", name)
            self.open.append(Call(name, module, args, kwargs))

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            self._mark("post", name)
            call = self.open.pop()
            call.out = out
            self.calls.append(call)

        return hook

    def __enter__(self) -> _Hooks:
        return self

    def __exit__(self, *_: Any) -> None:
        for h in self.handles:
            h.remove()


def run_until(model: nn.Module, stops: dict[nn.Module, Any], **inputs: Any) -> dict[Any, Call]:
    """The call of each module of `stops` (module -> key; its first call) in `model(**inputs)`, which stops once all
    were reached; those the forward never reached are missing."""
    reached: dict[Any, Call] = {}

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        reached.setdefault(stops[module], Call("", module, args, kwargs))
        if len(reached) == len(stops):
            raise Stop

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in stops]
    try:
        model(**inputs)
    except Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return reached


class Record:
    """The small copy of a family, its eval forward's calls, and (on first use) its training forward's calls and
    generator advances; `memo` holds what is derived from them and the family's probes."""

    def __init__(self, cls: type, small: Any):
        self.cls, self.small = cls, small
        self.memo: dict[Any, Any] = {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.model = quiet(cls(without_dropout(small)).to(torch.float32).eval())
        self._pristine = copy.deepcopy(self.model)  # the training forward's copy, and the self-check's
        self.ids = torch.randint(0, small.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
        self.error: Exception | None = None  # why the eval forward did not run
        self.calls: list[Call] = []
        with _Hooks(self.model, events=False) as hooks, torch.no_grad():
            try:
                self.model(input_ids=self.ids, use_cache=False)
            except Exception as e:  # noqa: BLE001 - each detector says what a copy that does not run means to it
                self.error = e
        self.calls = hooks.calls
        self._train: tuple[list[Event], bool] | Exception | None = None

    def copy(self) -> nn.Module:
        """A fresh copy of the seeded small model (eval), for a check that changes values."""
        return copy.deepcopy(self._pristine)

    def derived(self, key: Any, compute: Callable[[], Any], on_disk: bool = False) -> Any:
        """`compute()`, once per record and key; `on_disk` (a JSON value, `key` a string): once per machine for
        the family's class, its file, the small config and the versions (base/disk_memo.py), so the ranks of a node
        share one computation."""
        if key not in self.memo:
            digest = source_digest(self.cls) if on_disk else None
            if digest is None:
                self.memo[key] = compute()
            else:
                parts = [self.cls.__module__, self.cls.__qualname__, digest, *_config_key(self.small)]
                self.memo[key] = disk_memo([*parts, torch.__version__, key], compute)
        return self.memo[key]

    def train(self) -> tuple[list[Event], bool]:
        """The training forward (spread values, seed 1, every dropout rate 0): its events, and whether the generator
        advanced at all; raises what the forward raised. Its calls are not kept (nothing reads them)."""
        if self._train is None:
            model = spread_copy(self._pristine)
            shape, gen = (TRAIN_ROWS, TRAIN_SEQ), torch.Generator().manual_seed(0)
            ids = torch.randint(0, self.small.vocab_size, shape, generator=gen)
            try:
                with torch.random.fork_rng(devices=[]), torch.no_grad(), _Hooks(model, events=True) as hooks:
                    torch.manual_seed(1)
                    before = torch.get_rng_state()
                    model(input_ids=ids, use_cache=False)
                    self._train = (hooks.events or [], not torch.equal(before, torch.get_rng_state()))
            except Exception as e:  # noqa: BLE001 - re-raised to the detector asking
                self._train = e
        if isinstance(self._train, Exception):
            raise self._train
        return self._train


def spread_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` in training mode with spread values."""
    trained = copy.deepcopy(model).train()
    seeded_values(trained, 0)
    return trained


_RECORDS: dict[tuple[type, str, str], Record] = {}


def _config_key(small: Any) -> tuple[str, str]:
    """The small config and the transformers version a record is a function of (beside its class)."""
    import transformers  # here, so importing pp_tp does not import transformers

    return small.to_json_string(use_diff=False), transformers.__version__


def record_of(model: nn.Module) -> Record:
    """The record of `model`'s family (its class and small config), built on first use."""
    small = small_config(model.config)
    key = (type(model), *_config_key(small))
    if key not in _RECORDS:
        try:
            _RECORDS[key] = Record(type(model), small)
        except Exception as e:  # noqa: BLE001 - transformers cannot build the small copy (Zamba with one hybrid layer)
            layers = getattr(small, "num_hidden_layers", "small")  # not every config names its depth so
            why = f"{layers}-layer copy ({type(e).__name__}: {str(e)[:120]})".replace("\n", " ")
            raise ConfigError(
                f"model {type(model).__name__}: transformers cannot build its {why}, which pp_tp traces"
            ) from None
    return _RECORDS[key]
