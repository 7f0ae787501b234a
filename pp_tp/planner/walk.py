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


class _Walker:
    """One rank's state along the walk: per-stage flags, and the flagged stages' sizes summed as the flags change
    (slots and plain ints: the layout search walks millions of actions)."""

    __slots__ = ("acts", "backwards", "every", "gathered", "gathered_total", "grads_held", "grads_total", "keep",
                 "m", "out", "sizes")  # fmt: skip

    def __init__(self, sizes: dict[int, StageBytes], policy: FsdpPolicy, microbatches: int):
        self.sizes, self.m = sizes, microbatches
        self.keep, self.every = not policy.reshards_params, policy.grad_reduce_every
        self.out = Walk(all_gathers={s: 0 for s in sizes}, reduce_scatters={s: 0 for s in sizes})
        self.gathered = {s: False for s in sizes}  # the stage's parameters are all-gathered now
        self.grads_held = {s: False for s in sizes}  # its unsharded gradients are kept now
        self.backwards = {s: 0 for s in sizes}
        self.acts = self.gathered_total = self.grads_total = 0

    def flag_gathered(self, s: int, on: bool) -> None:
        if on != self.gathered[s]:
            self.gathered_total += self.sizes[s].gathered if on else -self.sizes[s].gathered
            self.gathered[s] = on

    def flag_grads(self, s: int, on: bool) -> None:
        if on != self.grads_held[s]:
            self.grads_total += self.sizes[s].grads if on else -self.sizes[s].grads
            self.grads_held[s] = on

    def note(self, gathered: int, grads: int) -> None:
        """The peak so far, and what it was made of, given the bytes gathered and of gradients held now."""
        out = self.out
        if self.acts + gathered + grads > out.peak:
            out.peak = self.acts + gathered + grads
            out.act, out.gathered, out.grads = self.acts, gathered, grads

    def forward(self, s: int) -> None:
        """Gathered for its forward (the unit, or the whole stage if kept or already gathered); resharded after
        unless the policy keeps it."""
        size, was, keep = self.sizes[s], self.gathered[s], self.keep
        if not was:
            self.out.all_gathers[s] += 1
        self.acts += size.act
        if keep or was:
            self.gathered_total += 0 if was else size.gathered
            self.note(self.gathered_total, self.grads_total)
        else:
            self.note(self.gathered_total + size.unit_gathered, self.grads_total)
        if was and not keep:
            self.gathered_total -= size.gathered
        self.gathered[s] = keep

    def backward(self, s: int, weight_only: bool) -> None:
        size, keep, every = self.sizes[s], self.keep, self.every
        if not weight_only and not self.gathered[s]:
            self.out.all_gathers[s] += 1
        self.backwards[s] += 1
        n = self.backwards[s]
        if every is None or (n % every and n < self.m):  # torch's nosync backward: all gathered, grads kept
            self.flag_gathered(s, True)
            self.flag_grads(s, True)
            self.note(self.gathered_total, self.grads_total)
            if n == self.m:  # torch's REDUCE_GRAD at the step's end
                self.out.reduce_scatters[s] += 1
                self.flag_grads(s, False)
                self.flag_gathered(s, keep)
        elif weight_only:  # the whole stage's weight gradients, then reduced
            self.flag_grads(s, False)
            self.note(self.gathered_total, self.grads_total + size.grads)
            self.out.reduce_scatters[s] += 1
        else:  # unit by unit: gathered (unless kept) and reduced as its backward finishes
            self.flag_grads(s, False)
            self.flag_gathered(s, keep)
            self.note(self.gathered_total + (0 if keep else size.unit_gathered), self.grads_total + size.unit_grads)
            self.out.reduce_scatters[s] += 1
        if n == self.m:
            self.flag_gathered(s, keep)  # REDUCE_GRAD reshards what the policy does not keep
        self.acts -= size.act


def walk_step(actions: list[Action], sizes: dict[int, StageBytes], policy: FsdpPolicy, microbatches: int) -> Walk:
    """Walks one rank's compute actions (F, B, I, W, overlapped F+B) through a step under the rank's FSDP
    policy; see the module docstring."""
    rank = _Walker(sizes, policy, microbatches)
    for action in actions:
        for a in action.sub_actions if action.computation_type == OVERLAP_F_B else (action,):
            kind = a.computation_type
            if kind == FORWARD:
                rank.forward(a.stage_index)
            elif kind == FULL_BACKWARD or kind == BACKWARD_WEIGHT:
                rank.backward(a.stage_index, kind == BACKWARD_WEIGHT)
            elif kind == BACKWARD_INPUT:
                if not rank.gathered[a.stage_index]:
                    rank.out.all_gathers[a.stage_index] += 1
                rank.flag_gathered(a.stage_index, True)
    return rank.out
