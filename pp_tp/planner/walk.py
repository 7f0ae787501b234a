"""A step, action by action, on one pp rank: the bytes that come and go (saved activations, all-gathered
parameters, unsharded gradients) and the FSDP collectives each stage issues, under its FSDP policy.

The rules are FSDP2's as torch's PipelineStage drives it (pp_tp.runtime.grad_reduce adds the reducing
backwards): a policy that keeps parameters gathered gathers each stage once, at its first forward; the
others gather a unit for its forward and reshard after it; a backward gathers what is sharded and, unless
it reduces and reshards, leaves the stage gathered; a non-reducing backward leaves the stage's unsharded
gradients accumulated; a reducing one reduce-scatters unit by unit (one unit's gradients live at a time;
after a split weight backward, the whole stage's) and the step's end reduces what is left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, OVERLAP_F_B

from pp_tp.base._torch import Action
from pp_tp.config.fsdp_policy import FsdpPolicy


@dataclass(frozen=True)
class StageBytes:
    """One stage's sizes on a rank: activations of a microbatch, its parameters gathered (and its largest
    unit's), its unsharded gradients in the accumulation dtype (and its largest unit's)."""

    act: int
    gathered: int = 0
    unit_gathered: int = 0
    grads: int = 0
    unit_grads: int = 0


@dataclass
class Walk:
    """The peak of the step's coming-and-going bytes and what it was made of, and collectives per stage."""

    peak: int = 0
    act: int = 0
    gathered: int = 0
    grads: int = 0
    all_gathers: dict[int, int] = field(default_factory=dict)
    reduce_scatters: dict[int, int] = field(default_factory=dict)


class _Flags(dict):
    """Per-stage flags that keep the sum of the flagged stages' weights (a walk notes it at every action)."""

    def __init__(self, weights: dict[int, int]):
        super().__init__((s, False) for s in weights)
        self.weights, self.total = weights, 0

    def __setitem__(self, s: int, on: bool) -> None:
        if on != self[s]:
            self.total += self.weights[s] if on else -self.weights[s]
        super().__setitem__(s, on)


class _Rank:
    def __init__(self, sizes: dict[int, StageBytes], policy: FsdpPolicy, microbatches: int):
        self.sizes, self.m = sizes, microbatches
        self.keep, self.every = not policy.reshards_params, policy.grad_reduce_every
        self.acts = 0
        self.gathered = _Flags({s: z.gathered for s, z in sizes.items()})
        self.grads_held = _Flags({s: z.grads for s, z in sizes.items()})
        self.backwards = {s: 0 for s in sizes}
        self.out = Walk(all_gathers={s: 0 for s in sizes}, reduce_scatters={s: 0 for s in sizes})

    def _held(self) -> tuple[int, int]:
        return self.gathered.total, self.grads_held.total

    def _note(self, extra_gathered: int = 0, extra_grads: int = 0) -> None:
        gathered, grads = self._held()
        gathered, grads = gathered + extra_gathered, grads + extra_grads
        if self.acts + gathered + grads > self.out.peak:
            self.out.peak = self.acts + gathered + grads
            self.out.act, self.out.gathered, self.out.grads = self.acts, gathered, grads

    def _gather(self, s: int) -> None:
        if not self.gathered[s]:
            self.out.all_gathers[s] += 1

    def forward(self, s: int) -> None:
        size, keep = self.sizes[s], self.keep
        self._gather(s)
        self.acts += size.act
        self.gathered[s] = keep or self.gathered[s]
        self._note(0 if self.gathered[s] else size.unit_gathered)
        self.gathered[s] = keep

    def backward(self, s: int, weight_only: bool = False) -> None:
        size, keep, every = self.sizes[s], self.keep, self.every
        if not weight_only:
            self._gather(s)
        self.backwards[s] += 1
        n = self.backwards[s]
        if every is None or (n % every and n < self.m):
            self.gathered[s] = self.grads_held[s] = True  # torch's nosync backward: all gathered, grads kept
            self._note()
            if n == self.m:  # torch's REDUCE_GRAD at the step's end
                self.out.reduce_scatters[s] += 1
                self.grads_held[s] = False
                self.gathered[s] = keep
        elif weight_only:  # the whole stage's weight gradients, then reduced
            self.grads_held[s] = False
            self._note(0, size.grads)
            self.out.reduce_scatters[s] += 1
        else:  # unit by unit: gathered (unless kept) and reduced as its backward finishes
            self.grads_held[s] = False
            self.gathered[s] = keep
            self._note(0 if keep else size.unit_gathered, size.unit_grads)
            self.out.reduce_scatters[s] += 1
        if n == self.m:
            self.gathered[s] = keep  # REDUCE_GRAD reshards what the policy does not keep
        self.acts -= size.act


def walk_step(actions: list[Action], sizes: dict[int, StageBytes], policy: FsdpPolicy, microbatches: int) -> Walk:
    """Walks one rank's compute actions (F, B, I, W, overlapped F+B) through a step under the rank's FSDP
    policy; see the module docstring."""
    rank = _Rank(sizes, policy, microbatches)
    for action in actions:
        for a in action.sub_actions if action.computation_type == OVERLAP_F_B else (action,):
            if a.computation_type == FORWARD:
                rank.forward(a.stage_index)
            elif a.computation_type == FULL_BACKWARD:
                rank.backward(a.stage_index)
            elif a.computation_type == BACKWARD_INPUT:
                rank._gather(a.stage_index)
                rank.gathered[a.stage_index] = True
            elif a.computation_type == BACKWARD_WEIGHT:
                rank.backward(a.stage_index, weight_only=True)
    return rank.out
