"""The trainer's optimizers: AdamW with foreach kernels on parts that mix DTensor and plain parameters."""

from __future__ import annotations

import parity_utils as pu
import torch

import pp_tp
from pp_tp.config import TrainingConfig
from pp_tp.train.trainer import build_optimizers


def foreach_case() -> dict:
    """TP without FSDP leaves the norms plain beside DTensor weights, a mix torch's foreach kernels refuse: the
    trainer's AdamW steps such a part with foreach per kind of tensor, and lands where per-tensor AdamW lands."""
    pcfg = pu.pcfg_of(tp=2)
    t = TrainingConfig()
    params, lr = {}, None
    for kind in ("trainer", "per_tensor"):
        pipe = pp_tp.build_pipeline(pu.make_model(device="meta"), pp_tp.build_mesh(pcfg), pcfg)
        if kind == "trainer":
            optimizers, _ = build_optimizers(pipe.model_parts, t)
            lr = optimizers[0].param_groups[0]["lr"]  # the LR schedule's first value (warm-up)
        else:
            optimizers = [
                torch.optim.AdamW(part.parameters(), lr=lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
                for part in pipe.model_parts
            ]
        for _ in range(2):
            pipe.step(*pu.batch(pu.TINY, 4, 8))
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        params[kind] = {k: pu.full_tensor(p).detach() for part in pipe.model_parts for k, p in part.named_parameters()}
        if kind == "trainer":
            groups = [(opt.defaults["foreach"], len(opt.param_groups)) for opt in optimizers]
    err = max(pu.rel_err(params["trainer"][k], params["per_tensor"][k]) for k in params["per_tensor"])
    return {"groups": groups, "err": err}


def test_optimizers_step_parts_mixing_dtensors_and_plain_tensors_with_foreach(world):
    for r in world(2).run(foreach_case):
        assert r["groups"] == [(True, 2)]  # DTensor weights and plain norms, one group each
        assert r["err"] < 1e-6
