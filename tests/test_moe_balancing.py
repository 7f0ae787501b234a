"""MoE load balancing under pipelining (pp_tp/runtime/balancing.py) against a plain one-process computation of the
same definitions: hooks on the routers of the plain model, per DP share and microbatch, aux_l = E * sum_e (c_e / T)
* mean_t softmax(logits)_e added to the token loss with weight coef / (microbatches * dp); after each optimizer step
every expert bias moves by rate * sign(mean(c) - c) with c the step's slots per expert. Checked at pp2 x ep2 with
uneven padding on ZBVZeroBubble and Interleaved1F1B (and pp2 x tp2, pp2 x dp2 with full activation checkpointing): loss,
aux_loss, tokens per expert, every full gradient, and parameters and expert biases after two steps; plus the
one-line refusals."""

from __future__ import annotations

import parity_utils as pu
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hf_utils import SEQ, VOCAB, seeded_state
from test_hf_families import make
from test_model_moe import MOE, MOE_SIGMOID

import pp_tp
from pp_tp.base.tensors import persistent_buffers
from pp_tp.config import JobConfig, ModelConfig, ParallelConfig, TrainingConfig, validate
from pp_tp.errors import ConfigError
from pp_tp.models.reference.model import ModelArgs
from pp_tp.parallel.mesh import dp_rank, dp_size
from pp_tp.preflight import PreflightInputs, preflight

TOL = 1e-5
EP = dict(pp=2, dp_shard=2, ep=2, microbatches=2)


def _model(name: str, device: str = "cpu") -> torch.nn.Module:
    """A reference MoE (by its args' name) or an HF family of tests/test_hf_families.py."""
    args = {"moe": MOE, "moe_sigmoid": MOE_SIGMOID}.get(name)
    return pu.make_model(args, device=device) if args is not None else make(name, device)


def _routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every MoE layer's router by the layer's FQN (reference feed_forward.gate, HF mlp.gate)."""
    return {n.rpartition(".")[0]: m for n, m in model.named_modules() if n.endswith(".gate") and hasattr(m, "weight")}


def _plain_step(model, ids, labels, dp: int, m: int, coef: float) -> tuple[float, float, dict[str, torch.Tensor]]:
    """One step of the plain model on the global batch, cut as the pipeline cuts it: the token loss over the global
    count plus coef * the mean over (DP share, microbatch) of sum_l aux_l; returns (loss, aux, slots per layer)."""
    seen: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    hooks = [
        r.register_forward_hook(lambda mod, args, out, layer=layer: seen.append((layer, out[0], out[2])))
        for layer, r in _routers(model).items()
    ]
    count = int((labels != -100).sum())
    loss = aux_total = 0.0
    slots: dict[str, torch.Tensor] = {}
    for chunk_ids, chunk_labels in zip(ids.chunk(dp * m), labels.chunk(dp * m)):
        seen.clear()
        out = model(chunk_ids)
        logits = out.logits if hasattr(out, "logits") else out
        lm = F.cross_entropy(logits.flatten(0, 1).float(), chunk_labels.flatten(), ignore_index=-100, reduction="sum")
        aux = torch.zeros(())
        for layer, router_logits, index in seen:
            probs = router_logits.float().softmax(-1)
            tokens, experts = probs.shape
            c = torch.bincount(index.flatten(), minlength=experts)
            slots[layer] = slots.get(layer, 0) + c
            aux = aux + experts * sum(c[e] / tokens * probs[:, e].mean() for e in range(experts))
        (lm / count + coef * aux / (dp * m)).backward()
        loss += float(lm) / count
        aux_total += coef * float(aux) / (dp * m)
    for h in hooks:
        h.remove()
    return loss, aux_total, slots


def _plain_run(name: str, state: dict, batch: tuple, dp: int, m: int, coef: float, rate: float, steps: int) -> dict:
    """The plain model's `steps` (AdamW, then the bias update by the step's slots): per step its loss, aux loss and
    slots per layer; the first step's gradients; the parameters and persistent buffers after the last."""
    torch.manual_seed(0)
    model = _model(name)
    model.load_state_dict(state, strict=False)
    opt = pu.adamw()(list(model.parameters()))
    out: dict = {"loss": [], "aux": [], "slots": []}
    for step in range(steps):
        opt.zero_grad()
        loss, aux, slots = _plain_step(model, *batch, dp, m, coef)
        for key, value in (("loss", loss), ("aux", aux), ("slots", slots)):
            out[key].append(value)
        if step == 0:
            out["grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        with torch.no_grad():
            for b, c in zip(_biases(model, sorted(slots)) if rate else (), (slots[k].float() for k in sorted(slots))):
                b += rate * torch.sign(c.mean() - c)
    out["params"] = {k: p.detach().clone() for k, p in model.named_parameters()}
    out["buffers"] = {k: b.clone() for k, b in persistent_buffers(model).items()}
    return out


def balancing_case(name: str, kw: dict, coef: float, rate: float, steps: int = 2, owner: int = 0) -> dict:
    """Per rank: worst relative errors of loss, aux_loss, gradients (first step), parameters and persistent buffers
    (after `steps`), and whether tokens_per_expert equalled the plain slot counts on every step. The plain run is the
    same on every rank: rank `owner` runs it and sends it to the others."""
    pcfg = pu.pcfg_of(**kw)
    mesh = pp_tp.build_mesh(pcfg)
    hf = name not in ("moe", "moe_sigmoid")
    state = seeded_state(_model(name)) if hf else pu.reference_state(MOE if name == "moe" else MOE_SIGMOID)
    args = ModelArgs(vocab_size=VOCAB) if hf else MOE
    ids, labels = pu.batch(args, 8, SEQ, pad=True)
    plain = [None]
    if dist.get_rank() == owner:
        plain = [_plain_run(name, state, (ids, labels), dp_size(mesh), pcfg.microbatches, coef, rate, steps)]
    dist.broadcast_object_list(plain, src=owner)
    want = plain[0]
    torch.manual_seed(0)  # every rank's generator alike again at the build (the owner drew for its plain run)
    moe = pp_tp.MoEConfig(aux_loss_coef=coef, bias_update_rate=rate)
    pipe = pp_tp.build_pipeline(_model(name, "meta"), mesh, pcfg, state_dict=state, moe=moe)
    opt = pu.adamw()([p for part in pipe.model_parts for p in part.parameters()])
    per = ids.shape[0] // dp_size(mesh)
    share = slice(dp_rank(mesh) * per, (dp_rank(mesh) + 1) * per)
    errs = {"loss": 0.0, "aux": 0.0, "grad": 0.0}
    counts_equal = True
    for step in range(steps):
        opt.zero_grad()
        got_loss = float(pipe.step(ids[share], labels[share]))
        want_loss, want_aux = want["loss"][step], want["aux"][step]
        errs["loss"] = max(errs["loss"], abs(got_loss - want_loss) / want_loss)
        errs["aux"] = max(errs["aux"], abs(pipe.moe_stats["aux_loss"] - want_aux) / max(want_aux, 1e-30))
        got_counts = pipe.moe_stats["tokens_per_expert"]
        counts_equal &= all(torch.equal(c, want["slots"][step][k]) for k, c in got_counts.items())
        if step == 0:
            got = {k: pu.full_tensor(p.grad) for part in pipe.model_parts for k, p in part.named_parameters()}
            errs["grad"] = max(pu.rel_err(g, want["grads"][k]) for k, g in got.items())
        opt.step()
        pipe.update_expert_bias()
    errs["param"] = max(pu.rel_err(pu.full_tensor(p), want["params"][k]) for part in pipe.model_parts
                        for k, p in part.named_parameters())  # fmt: skip
    want_b = want["buffers"]
    got_b = {k: b for part in pipe.model_parts for k, b in persistent_buffers(part).items()}
    errs["buffer"] = max((pu.rel_err(b, want_b[k]) for k, b in got_b.items()), default=0.0)
    moved = max((float((want_b[k] - state[k]).abs().max()) for k in got_b if "bias" in k), default=0.0)
    return {**errs, "counts_equal": counts_equal, "layers": len(got_counts), "bias_moved": moved,
            "aux_loss": pipe.moe_stats["aux_loss"]}  # fmt: skip


def _biases(model: torch.nn.Module, layers: list[str]) -> list[torch.Tensor]:
    """Each layer's expert-bias buffer (reference expert_bias, HF e_score_correction_bias), in `layers`' order."""
    buffers = persistent_buffers(model)
    return [next(b for k, b in buffers.items() if k.startswith(layer + ".gate.")) for layer in layers]


CASES = [
    # reference softmax router: aux loss and bias together; full activation checkpointing (recompute counted once)
    ("moe", dict(pp=2, dp_shard=2, ep=2, microbatches=4, schedule="ZBVZeroBubble"), 0.1, 1e-2),  # split backward
    ("moe", dict(pp=2, dp_shard=2, microbatches=2, schedule="1F1B", activation_checkpoint="full"), 0.1, 0.0),
    ("moe", dict(**EP, schedule="Interleaved1F1B", stages_per_rank=2), 0.1, 0.0),
    ("mixtral_moe", dict(**EP, schedule="Interleaved1F1B", stages_per_rank=2), 0.1, 0.0),
    ("moe", dict(pp=2, tp=2, microbatches=2, schedule="1F1B"), 0.1, 0.0),  # router whole on both TP ranks
    ("moe_sigmoid", dict(**EP, schedule="1F1B"), 0.0, 1e-2),
    ("deepseek_v3", dict(**EP, schedule="1F1B"), 0.0, 1e-2),
    # context parallel: the EP group spans the cp ranks; slots summed over cp for aux_l and the bias update
    ("moe", dict(pp=2, cp=2, ep=2, microbatches=2, schedule="1F1B"), 0.1, 1e-2),
]


def run_cases(cases: list) -> list[dict]:
    """Every case; each case's plain run on another rank in turn."""
    return [balancing_case(*case, owner=i % dist.get_world_size()) for i, case in enumerate(cases)]


def test_balancing_equals_the_plain_computation(world):
    results = world(4).run(run_cases, CASES)
    for i, case in enumerate(CASES):
        assert sum(per_rank[i]["layers"] for per_rank in results) > 0, case  # some rank compared its counts
    for per_rank in results:
        for case, r in zip(CASES, per_rank):
            assert all(r[e] <= TOL for e in ("loss", "aux", "grad", "param", "buffer")), (case, r)
            assert r["counts_equal"], (case, r)
            coef, rate = case[2], case[3]
            assert (r["aux_loss"] > 0) == (coef > 0), (case, r)  # 0.0 without an auxiliary loss
            assert (r["bias_moved"] > 0) == (rate > 0), (case, r)  # the update really moved the biases


# --- refusals, one line each, before any collective ---------------------------------------------------------


def _preflight(name: str, **moe) -> None:
    pcfg = pp_tp.config.resolve_parallel(ParallelConfig(dp_shard=1), 1)
    preflight(_model(name, "meta"), pcfg, PreflightInputs("cpu", SEQ, moe=pp_tp.MoEConfig(**moe)))


@pytest.mark.parametrize(
    ("name", "moe", "match"),
    [
        ("moe_sigmoid", dict(aux_loss_coef=0.01), r"moe.aux_loss_coef = 0.01 needs each MoE layer's softmax router"),
        ("deepseek_v3", dict(aux_loss_coef=0.01), r"has no router pp_tp reads them from exactly .*sigmoid"),
        ("mixtral_moe", dict(bias_update_rate=0.001), r"moe.bias_update_rate = 0.001 moves .* declares none"),
        ("llama", dict(aux_loss_coef=0.01), r"has no mixture-of-experts layers pp_tp knows"),
    ],
)
def test_balancing_the_model_cannot_honour_is_refused_in_one_line(name, moe, match):
    with pytest.raises(ConfigError, match=match) as e:
        _preflight(name, **moe)
    assert "\n" not in str(e.value)


def test_moe_keys_are_checked_with_the_config():
    """`[moe]` bounds in validate (what `pp-tp check` runs), one line; split-backward schedules are accepted."""
    job = JobConfig(model=ModelConfig(), training=TrainingConfig(seq_len=16))
    job.moe = pp_tp.MoEConfig(aux_loss_coef=-1.0)
    with pytest.raises(ConfigError, match=r"^moe.aux_loss_coef = -1.0 must be >= 0[^\n]*$"):
        validate(job, world_size=1)
    job.moe = pp_tp.MoEConfig(aux_loss_coef=0.01)
    job.parallel = ParallelConfig(pp=2, schedule="ZBVZeroBubble", microbatches=4)
    assert validate(job, world_size=2).moe.aux_loss_coef == 0.01
