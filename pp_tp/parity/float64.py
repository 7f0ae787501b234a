"""The pipelined build in float64 against the plain model in float64: no tolerance tuned to the fp32 roundoff.

Where the pipeline computes the same math as the model, only summed in another order (microbatches, TP and DP
reductions), the two float64 runs differ by float64 roundoff, about 1e-15 relative, amplified by the conditioning of
each tensor: a bound of 1e-10 leaves five orders of magnitude for that and still catches any real difference, which
shows up at the fp32 level or above. Both runs start from the same weights and step on their own from there (in
float64 their trajectories do not part as fp32 ones can, lockstep.py): loss, every full gradient, every parameter
after each optimizer step and the persistent buffers are compared after each step, per tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pp_tp.base.tensors import persistent_buffers
from pp_tp.layout import ModelLayout
from pp_tp.parity.lockstep import PipelineRun, ReferenceRun, tensor_err
from pp_tp.parity.shared import owners, step_on
from pp_tp.parity.widen import Float64Throughout

BOUND = 1e-10  # per tensor, max relative error of the float64 pipeline against the float64 plain model
KINDS = ("loss", "grads", "params", "buffers")


def float64_model(model: nn.Module, layout: ModelLayout) -> nn.Module:
    """`model` (in place) as a float64 build of it would be: every floating tensor float64, transformers' experts on
    their eager loop (grouped_mm refuses float64), and its non-persistent buffers recomputed in float64 by `layout`'s
    rule, as `build_pipeline` computes them for a float64 build: a cast would keep the fp32 rounding of a constant
    computed at init (Gemma 3's embedding scale sqrt(hidden): 5.656854152679443 cast, 5.656854249492381 computed,
    1.7e-8 apart: the loss 4.6e-11 and gradients 8.7e-8 apart at pp2 x tp2, float64 throughout). Persistent buffers
    keep their values."""
    kept = {k: b.clone() for k, b in persistent_buffers(model).items()}
    if hasattr(model, "set_experts_implementation"):  # a transformers model (a no-op for one without experts)
        model.set_experts_implementation("eager")
    model.to(torch.float64)
    with torch.no_grad():
        layout.init_buffers(model, model)
        for k, b in persistent_buffers(model).items():
            b.copy_(kept[k])
    return model


@dataclass(frozen=True)
class Worst:
    """One kind's worst tensor on this rank: its name and relative error."""

    name: str = ""
    err: float = 0.0


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], keys: dict[str, str]) -> Worst:
    worst = Worst()
    for k, t in got.items():
        name = keys.get(k, k)
        err = tensor_err(t, want.get(name))
        if err > worst.err or not worst.name or err != err:  # NaN is the worst
            worst = Worst(name, err)
    return worst


def lockstep_float64(
    run: PipelineRun, ref: ReferenceRun, batches: Iterable[tuple[torch.Tensor, ...]], widen: bool = True
) -> Iterator[tuple[float, float, dict[str, Worst]]]:
    """Per step: (the pipeline's loss, the plain model's, the worst tensor per kind on this rank). `run`'s build and
    `ref`'s model must both be float64; the reference steps on one rank and is mirrored (pp_tp/parity/shared.py).
    `widen`: both step under `Float64Throughout` (pp_tp/parity/widen.py), so what the model's own code computes in
    fp32 is float64 in both; False keeps those fp32 parts (the two then agree there only to fp32 roundoff)."""
    dtypes = {p.dtype for part in run.pipe.model_parts for p in part.parameters()} | {
        p.dtype for p in ref.model.parameters()
    }
    if dtypes != {torch.float64}:
        raise ValueError(f"lockstep_float64 compares float64 builds; the parameters are {sorted(map(str, dtypes))}")
    ref.widen = widen  # the reference widens its own steps (lockstep.ReferenceRun)
    owner, _ = owners(shared=True)
    loaded = _worst(run.params(), ref.params(), run.keys)
    for i, batch in enumerate(batches):
        with Float64Throughout() if widen else contextlib.nullcontext():
            got = run.step(*batch)
        step_on(((owner, ref),), batch)
        want = ref.losses[-1]
        params = _worst(run.params(), ref.params(), run.keys)
        worst = {
            "loss": Worst("loss", abs(got - want) / max(abs(want), 1e-300)),
            "grads": _worst(run.grads(), ref.grads(), run.keys),
            "params": params if i else max(params, loaded, key=lambda w: w.err),
            "buffers": _worst(run.buffers(), ref.buffers(), {}),
        }
        yield got, want, worst
