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


def walk_step(actions: list[Action], sizes: dict[int, StageBytes], policy: FsdpPolicy, microbatches: int) -> Walk:
    """Walks one rank's compute actions (F, B, I, W, overlapped F+B) through a step under the rank's FSDP
    policy; see the module docstring. One loop over plain locals: the layout search walks millions of actions."""
    keep, every, m = not policy.reshards_params, policy.grad_reduce_every, microbatches
    out = Walk(all_gathers={s: 0 for s in sizes}, reduce_scatters={s: 0 for s in sizes})
    gathers, reduces = out.all_gathers, out.reduce_scatters
    gathered = {s: False for s in sizes}  # the stage's parameters are all-gathered now
    grads_held = {s: False for s in sizes}  # its unsharded gradients are kept now
    backwards = {s: 0 for s in sizes}
    acts = gathered_total = grads_total = peak = 0  # the flagged stages' sizes, summed as the flags change

    def flag_gathered(s: int, on: bool) -> None:
        nonlocal gathered_total
        if on != gathered[s]:
            gathered_total += sizes[s].gathered if on else -sizes[s].gathered
            gathered[s] = on

    def flag_grads(s: int, on: bool) -> None:
        nonlocal grads_total
        if on != grads_held[s]:
            grads_total += sizes[s].grads if on else -sizes[s].grads
            grads_held[s] = on

    def note(extra_gathered: int, extra_grads: int) -> None:  # the peak so far, and what it was made of
        nonlocal peak
        g, r = gathered_total + extra_gathered, grads_total + extra_grads
        if acts + g + r > peak:
            peak = acts + g + r
            out.act, out.gathered, out.grads = acts, g, r

    for action in actions:
        for a in action.sub_actions if action.computation_type == OVERLAP_F_B else (action,):
            kind, s = a.computation_type, a.stage_index
            if kind == FORWARD:  # gathered for its forward (the unit, or all if kept); resharded after unless kept
                size, was = sizes[s], gathered[s]
                if not was:
                    gathers[s] += 1
                acts += size.act
                if keep or was:  # the whole stage is gathered during its forward
                    gathered_total += 0 if was else size.gathered
                    g = gathered_total
                else:  # one unit at a time
                    g = gathered_total + size.unit_gathered
                if acts + g + grads_total > peak:  # note(), inlined: forwards are half of all actions
                    peak = acts + g + grads_total
                    out.act, out.gathered, out.grads = acts, g, grads_total
                if was and not keep:
                    gathered_total -= size.gathered  # resharded after its forward
                gathered[s] = keep
            elif kind == FULL_BACKWARD or kind == BACKWARD_WEIGHT:
                size, weight_only = sizes[s], kind == BACKWARD_WEIGHT
                if not weight_only and not gathered[s]:
                    gathers[s] += 1
                backwards[s] += 1
                n = backwards[s]
                if every is None or (n % every and n < m):  # torch's nosync backward: all gathered, grads kept
                    flag_gathered(s, True)
                    flag_grads(s, True)
                    note(0, 0)
                    if n == m:  # torch's REDUCE_GRAD at the step's end
                        reduces[s] += 1
                        flag_grads(s, False)
                        flag_gathered(s, keep)
                elif weight_only:  # the whole stage's weight gradients, then reduced
                    flag_grads(s, False)
                    note(0, size.grads)
                    reduces[s] += 1
                else:  # unit by unit: gathered (unless kept) and reduced as its backward finishes
                    flag_grads(s, False)
                    flag_gathered(s, keep)
                    note(0 if keep else size.unit_gathered, size.unit_grads)
                    reduces[s] += 1
                if n == m:
                    flag_gathered(s, keep)  # REDUCE_GRAD reshards what the policy does not keep
                acts -= size.act
            elif kind == BACKWARD_INPUT:
                if not gathered[s]:
                    gathers[s] += 1
                flag_gathered(s, True)
    out.peak = peak
    return out
