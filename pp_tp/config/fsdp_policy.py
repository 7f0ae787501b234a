"""The FSDP policy of one pp rank, resolved once from `parallel.fsdp_reshard_after_forward` and
`parallel.fsdp_grad_reduce`, and the rules of those two keys.

Either key holds one value for every pp rank, a list with one value per pp rank (what the planner writes for
"auto"), or "auto" (pp_tp.planner.auto picks per pp rank under `parallel.memory_budget_gib`). `FsdpPolicy.for_rank`
is the one place a rank's values become what it does: validation resolves every rank's values to refuse a bad
one, the planner walks the policy (pp_tp.planner.walk), the runtime applies it (`fully_shard` in
pp_tp.parallel.fsdp, reducing stages in pp_tp.runtime.grad_reduce). A new value is a branch here and in what
executes it.

fsdp_reshard_after_forward:
  default  pp > 1: keep parameters gathered for the whole step (one all-gather per unit per step, not one
           per microbatch); pp = 1: torch's own default (reshard blocks, keep the root)
  always   reshard after every forward (all-gather again in backward and for every microbatch)
  never    keep gathered
  int n    reshard to groups of n ranks (a divisor of dp_shard)
fsdp_grad_reduce:
  step        torch's way: unsharded gradients accumulate until the step's one reduce-scatter
  microbatch  = 1
  int k       reduce-scatter after every k-th microbatch backward of a stage, accumulating sharded:
              ceil(m / k) reduce-scatters per unit per step (k >= m is "step")
"""

from __future__ import annotations

from dataclasses import dataclass

from pp_tp.config.schema import CHOICES, ParallelConfig
from pp_tp.errors import ConfigError

KEYS = ("fsdp_reshard_after_forward", "fsdp_grad_reduce")


def uses_fsdp(pcfg: ParallelConfig) -> bool:
    """FSDP wraps the stages when there is data or context parallelism (cp ranks hold the same parameters, FSDP over
    dp_shard x cp sums their gradients) or bf16 mixed precision (FSDP's policy casts)."""
    return pcfg.dp > 1 or pcfg.cp > 1 or pcfg.mixed_precision == "bf16"


def per_rank(value: str | int | list[str | int], pp: int) -> list[str | int]:
    """An FSDP policy key as one value per pp rank."""
    return list(value) if isinstance(value, list) else [value] * pp


@dataclass(frozen=True)
class FsdpPolicy:
    """One pp rank's FSDP policy, resolved. `shards`: FSDP wraps the stages at all (`uses_fsdp`);
    `reshard_after_forward`: `fully_shard`'s argument (None: torch's default); `grad_reduce_every`: reduce-scatter
    after every k-th microbatch backward of a stage (None: once per step, torch's way)."""

    shards: bool
    reshard_after_forward: bool | int | None
    grad_reduce_every: int | None

    @classmethod
    def for_rank(cls, pcfg: ParallelConfig, pp_rank: int) -> FsdpPolicy:
        """Rank `pp_rank`'s policy from a validated `[parallel]`; "auto" must have been resolved by the planner."""
        reshard = per_rank(pcfg.fsdp_reshard_after_forward, pcfg.pp)[pp_rank]
        reduce = per_rank(pcfg.fsdp_grad_reduce, pcfg.pp)[pp_rank]
        if "auto" in (reshard, reduce):
            raise ConfigError(
                'parallel.fsdp_reshard_after_forward / fsdp_grad_reduce = "auto" is resolved by the planner before '
                "the process group starts; call pp_tp.planner.resolve_auto(cfg, world_size) first (pp-tp train does)"
            )
        return cls.of(pcfg, reshard, reduce)

    @classmethod
    def of(cls, pcfg: ParallelConfig, reshard: str | int, reduce: str | int) -> FsdpPolicy:
        """The policy one (fsdp_reshard_after_forward, fsdp_grad_reduce) pair of values gives under `pcfg`'s
        degrees and microbatches: a rank's, or one the planner tries for "auto". ConfigError for a bad value."""
        every = _grad_reduce_every(reduce, pcfg)
        shards = uses_fsdp(pcfg)
        return cls(shards, _reshard_after_forward(reshard, pcfg), every if shards else None)

    @property
    def keeps_params_gathered(self) -> bool:
        """FSDP keeps parameters all-gathered from a step's first forward to its gradient reduction."""
        return self.shards and self.reshard_after_forward is False

    @property
    def reshards_params(self) -> bool:
        """Parameters come and go within a step: FSDP reshards them after a forward or a reducing backward."""
        return self.shards and self.reshard_after_forward is not False


def _reshard_after_forward(value: str | int, pcfg: ParallelConfig) -> bool | int | None:
    if isinstance(value, int):
        if value < 1 or pcfg.dp_shard % value:
            raise ConfigError(
                f"parallel.fsdp_reshard_after_forward = {value} must be an integer >= 1 dividing "
                f"parallel.dp_shard = {pcfg.dp_shard} (the group size to reshard to); "
                f'use a divisor of {pcfg.dp_shard}, or "default", "always", "never"'
            )
        return value
    if value == "default":
        return None if pcfg.pp == 1 else False
    return {"always": True, "never": False}[value]


def _grad_reduce_every(value: str | int, pcfg: ParallelConfig) -> int | None:
    if isinstance(value, int) and value < 1:
        raise ConfigError(
            f"parallel.fsdp_grad_reduce = {value} must be an integer >= 1 (reduce-scatter after every k-th "
            'microbatch backward); use an integer >= 1, "microbatch" or "step"'
        )
    if value == "step" or (isinstance(value, int) and value >= pcfg.microbatches):
        return None
    return 1 if value == "microbatch" else value


def check_policy_keys(p: ParallelConfig) -> None:
    """The two keys on the config alone (`p` with dp_shard resolved): lists hold one known value per pp rank and
    none "auto", every rank's values resolve as `FsdpPolicy.for_rank` will, and "auto" has a budget to fit."""
    for key in KEYS:
        _check_list(p, key)
    for reshard, reduce in zip(per_rank(p.fsdp_reshard_after_forward, p.pp), per_rank(p.fsdp_grad_reduce, p.pp)):
        if reshard != "auto":
            _reshard_after_forward(reshard, p)
        if reduce != "auto":
            _grad_reduce_every(reduce, p)
    for key in KEYS:
        if getattr(p, key) == "auto" and p.memory_budget_gib is None:
            raise ConfigError(
                f'parallel.{key} = "auto" picks the policy that fits parallel.memory_budget_gib, which is '
                "unset; set parallel.memory_budget_gib (GiB per rank) or choose the policy yourself"
            )


def _check_list(p: ParallelConfig, key: str) -> None:
    value = getattr(p, key)
    if not isinstance(value, list):
        return  # a single value's type and string were checked with its field
    if len(value) != p.pp or "auto" in value:
        raise ConfigError(
            f"parallel.{key} = {value} must hold one policy per pp rank ({p.pp}), none of them "
            f'"auto"; give {p.pp} entries or one policy for all ranks'
        )
    for v in value:
        if isinstance(v, str) and v not in CHOICES["parallel"][key]:
            raise ConfigError(
                f"parallel.{key} entry {v!r} is not one of {', '.join(CHOICES['parallel'][key])}; fix that entry"
            )


def schedule_reshard(p: ParallelConfig) -> str | int:
    """The reshard value the schedule check sees: one that reshards between a split backward's halves if any
    rank has one ("auto" only picks what the schedule allows), else "default"."""
    values = [v for v in per_rank(p.fsdp_reshard_after_forward, p.pp) if v not in ("auto", "default", "never")]
    return values[0] if values else "default"
