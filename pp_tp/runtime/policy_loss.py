"""Per-token log-probabilities of given labels and the built-in GRPO loss (`loss_fn="grpo"`) over them.

Both read the last stage's logits as they arrive: whole, or this TP rank's vocabulary shard (`parallel.loss_parallel`),
where torch's vocab-parallel cross-entropy with reduction="none" gives every token's -log p(label) from a max and a
sum over the shards (all-reduced), never a [B, S, V] gather; its backward stays vocab-parallel inside
`loss_parallel()`, which the pipeline holds around the whole schedule step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from pp_tp.base.tensors import full_tensor
from pp_tp.errors import ConfigError
from pp_tp.runtime.loss import IGNORE_INDEX, vocab_parallel


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, tp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """float32 [.., S]: log softmax(logits)[label] per token, 0.0 where the label is -100 (differentiable)."""
    x = vocab_parallel(logits, tp_mesh)
    nll = F.cross_entropy(x.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return -full_tensor(nll).reshape(labels.shape)


@dataclass(frozen=True)
class GrpoLoss:
    """The GRPO token loss, summed over non-ignored tokens (the pipeline divides by their global count):
    r = exp(logp - old_logprobs); loss_t = -min(r A, clip(r, 1 - clip, 1 + clip) A)
    + kl_coef (exp(ref - logp) - (ref - logp) - 1), the k3 KL term only when `ref_logprobs` is given;
    A = advantages per row ([B]) or per token ([B, S]). `[training] grpo_clip`, `grpo_kl_coef`."""

    clip: float = 0.2
    kl_coef: float = 0.05
    needs: tuple[str, ...] = ("advantages", "old_logprobs")
    per_token: tuple[str, ...] = ("old_logprobs", "ref_logprobs")  # must be [B, S]; advantages may be [B]

    def __post_init__(self):
        if not 0.0 < self.clip < 1.0 or self.kl_coef < 0.0:
            raise ConfigError(
                f"grpo clip = {self.clip}, kl coef = {self.kl_coef}: need 0 < training.grpo_clip < 1 and "
                "training.grpo_kl_coef >= 0"
            )

    def terms(self, logp: torch.Tensor, labels: torch.Tensor, extras: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The per-token loss [.., S] from the tokens' log-probs, 0 where the label is ignored."""
        keep = labels != IGNORE_INDEX
        old = torch.where(keep, extras["old_logprobs"].to(logp.dtype), logp.detach())  # r = 1 where ignored
        adv = extras["advantages"].to(logp.dtype)
        adv = adv[:, None] if adv.dim() == 1 else adv
        ratio = torch.exp(logp - old)
        loss = -torch.minimum(ratio * adv, ratio.clamp(1.0 - self.clip, 1.0 + self.clip) * adv)
        if "ref_logprobs" in extras:
            d = torch.where(keep, extras["ref_logprobs"].to(logp.dtype), logp.detach()) - logp
            loss = loss + self.kl_coef * (torch.exp(d) - d - 1.0)
        return torch.where(keep, loss, torch.zeros_like(loss))

    def on_logits(
        self, logits: torch.Tensor, labels: torch.Tensor, extras: Mapping[str, torch.Tensor], tp_mesh: DeviceMesh | None
    ) -> torch.Tensor:
        """The microbatch's summed loss from the last stage's logits (vocab-parallel under a `tp_mesh`)."""
        return self.terms(token_logprobs(logits, labels, tp_mesh), labels, extras).sum()
