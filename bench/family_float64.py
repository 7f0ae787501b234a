"""The sweep's float64 column (`bench/family_sweep.py --float64`) for one family on one rank: pp_tp's build in float64
(parallel.dtype = "float64") against the plain model in float64, one step, both float64 throughout (what the model's
own code asks in fp32 runs in float64: pp_tp/parity/widen.py). Where the math is the same the two differ by float64
roundoff only, so the worst relative error over the loss and every full gradient says, with no tolerance and no fp32
yardstick, whether the layout computes what the model computes (pp_tp.parity.float64.BOUND: 1e-10)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch

import pp_tp
from pp_tp.base.tensors import full_tensor
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.models.hf.randomness import switch_off_noise
from pp_tp.parity import ReferenceRun, dp_share
from pp_tp.parity.float64 import float64_model
from pp_tp.parity.lockstep import tensor_err
from pp_tp.parity.widen import Float64Throughout


def float64_column(
    model: torch.nn.Module,
    pcfg: pp_tp.ParallelConfig,
    ids: torch.Tensor,
    labels: torch.Tensor,
    noise: dict,
    one_line: Any,
    no_update: Any,
) -> dict[str, Any]:
    """This rank's worst relative error (`f64_err`) and its tensor (`f64_name`) of the float64 build of `model` (fp32,
    unstepped; turned float64 in place) against its plain float64 run on the whole batch; `f64_note` instead where
    either could not run (`one_line` words the error). `noise`: the random draws both run without."""
    plain = copy.deepcopy(model)
    switch_off_noise(plain, noise)
    pcfg = replace(pcfg, dtype="float64")
    try:
        pipe = pp_tp.build_pipeline(model, pp_tp.build_mesh(pcfg), pcfg)
        for part in pipe.model_parts:
            switch_off_noise(part, noise)
        ref = ReferenceRun(float64_model(plain, layout_for(plain)), no_update)
        torch.manual_seed(0)
        ref.step(ids, labels)
        with Float64Throughout():
            torch.manual_seed(0)
            loss = pipe.step(dp_share(pipe.mesh, ids), dp_share(pipe.mesh, labels)).item()
    except ConfigError as e:
        return {"f64_note": f"float64 refused: {str(e)[:100]}"}
    except Exception as e:  # noqa: BLE001 - the column's finding, not the sweep's end
        return {"f64_note": f"float64: {one_line(e)}"}
    want = {k: p.grad for k, p in ref.model.named_parameters()}
    worst = ("loss", abs(loss - ref.losses[-1]) / max(abs(ref.losses[-1]), 1e-300))
    for part in pipe.model_parts:
        for local, p in part.named_parameters():
            name = part.checkpoint_keys[local]
            err = tensor_err(None if p.grad is None else full_tensor(p.grad), want[name])
            if not err <= worst[1]:  # NaN counts as worst
                worst = (name, err)
    return {"f64_name": worst[0], "f64_err": worst[1]}
