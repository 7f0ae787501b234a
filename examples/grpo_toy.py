"""A tiny RL loop that learns: GRPO on the day and month patterns of pp_tp/data/patterns.txt, at pp2 x tp2 on CPU.

    torchrun --nproc-per-node 4 examples/grpo_toy.py [--steps 40]

Prompts are "after monday comes" and "july comes before" (word tokens); a completion is two sampled tokens, rewarded
1 when it is the right word and ".". Each step samples G completions of each of the 18 prompts. The three
post-training calls of `Pipeline`:
- rollouts come from a plain copy of the model (the stand-in for vLLM / SGLang) refreshed after every update from
  `pipe.iter_full_state_dict()`; G samples per prompt, advantages normalized within each prompt's group;
- the old log-probs come from `pipe.logprobs(ids, labels)` (forward only);
- the update is `pipe.step(ids, labels, extras={"advantages", "old_logprobs"}, loss_fn="grpo")`, twice per batch.
Before RL it runs a few plain cross-entropy steps on sentences of the right *form* with random words ("after friday
comes march."), so the model starts by answering some day or month (reward about 0.1), never taught which one.
Every rank samples the same batch (same weights, same generator), as `Pipeline.step` wants of every rank.
"""

from __future__ import annotations

import argparse
import os
import re

import torch
import torch.distributed as dist

import pp_tp
from pp_tp.models.reference.model import ModelArgs, Transformer

PATTERNS = os.path.join(os.path.dirname(pp_tp.__file__), "data", "patterns.txt")
DAYS = "monday tuesday wednesday thursday friday saturday sunday".split()
MONTHS = "january february march april may june july august september october november december".split()
WORDS = ["after", "comes", "before", "."] + DAYS + MONTHS
ID = {w: i for i, w in enumerate(WORDS)}
ARGS = ModelArgs(vocab_size=24, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=8)


def tasks() -> list[tuple[list[int], int]]:
    """(prompt ids, answer id) for every day and month pattern in the shipped text."""
    text = open(PATTERNS).read().lower()
    days = {(a, b) for a, b in re.findall(r"after (\w+) comes (\w+)\.", text)}
    months = {(a, b) for a, b in re.findall(r"(\w+) comes before (\w+)\.", text) if a in MONTHS}
    out = [([ID["after"], ID[a], ID["comes"]], ID[b]) for a, b in sorted(days)]
    return out + [([ID[a], ID["comes"], ID["before"]], ID[b]) for a, b in sorted(months)]


def form_batch(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sentences of the right form with random words (pretraining): ids and aligned labels, [n, 4]."""
    rows = []
    for _ in range(n):
        day = bool(torch.randint(2, (1,), generator=gen))
        pool = DAYS if day else MONTHS
        a, b = (pool[int(i)] for i in torch.randint(len(pool), (2,), generator=gen))
        rows.append(["after", a, "comes", b, "."] if day else [a, "comes", "before", b, "."])
    tokens = torch.tensor([[ID[w] for w in r] for r in rows])
    return tokens[:, :-1], tokens[:, 1:]


@torch.no_grad()
def rollouts(policy: Transformer, prompts: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Two sampled tokens after each prompt: [n, 5] whole sequences."""
    seq = prompts
    for _ in range(2):
        probs = torch.softmax(policy(seq)[:, -1].float(), -1)
        seq = torch.cat([seq, torch.multinomial(probs, 1, generator=gen)], 1)
    return seq


def refresh(policy: Transformer, pipe) -> None:
    """The inference copy takes the trainer's weights, one full tensor at a time (every rank drains the iterator)."""
    state = policy.state_dict()
    for name, tensor in pipe.iter_full_state_dict():
        state[name].copy_(tensor)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--pretrain", type=int, default=30)
    p.add_argument("--group", type=int, default=8)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    pcfg = pp_tp.ParallelConfig(pp=2, tp=2, dp_shard=1, schedule="1F1B", microbatches=2, mixed_precision="fp32",
                                embedding="vocab_parallel", loss_parallel=True)  # fmt: skip
    torch.manual_seed(0)
    policy = Transformer(ARGS)  # the inference copy; its initial weights are the trainer's too
    policy.eval()
    with torch.device("meta"):
        meta = Transformer(ARGS)
    pipe = pp_tp.build_pipeline(meta, pp_tp.build_mesh(pcfg), pcfg, state_dict=policy.state_dict())
    opt = torch.optim.AdamW([q for part in pipe.model_parts for q in part.parameters()], lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)  # the same on every rank: every rank sees the same batch
    talk = dist.get_rank() == 0
    for i in range(a.pretrain):
        opt.zero_grad()
        loss = pipe.step(*form_batch(gen, 32))
        opt.step()
        if talk and (i + 1) % 10 == 0:
            print(f"pretrain {i + 1} ce {float(loss):.3f}", flush=True)
    table = tasks()
    for step in range(a.steps):
        refresh(policy, pipe)
        prompts = torch.tensor([t[0] for t in table]).repeat_interleave(a.group, 0)  # every prompt, G times
        answers = torch.tensor([t[1] for t in table]).repeat_interleave(a.group, 0)
        seq = rollouts(policy, prompts, gen)
        reward = ((seq[:, 3] == answers) & (seq[:, 4] == ID["."])).float()
        groups = reward.view(len(table), a.group)
        adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
        ids, labels = seq[:, :-1], seq[:, 1:].clone()
        labels[:, :2] = -100  # the prompt's own tokens are not the policy's actions
        extras = {"advantages": adv, "old_logprobs": pipe.logprobs(ids, labels)}
        for _ in range(2):
            opt.zero_grad()
            loss = pipe.step(ids, labels, extras=extras, loss_fn="grpo")
            opt.step()
        if talk:
            print(f"step {step} reward {reward.mean():.3f} loss {float(loss):.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
