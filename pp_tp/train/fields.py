"""Synthetic gridded fields for the CREDIT-style model (data.source = "fields"): nothing to download.

Sample i is a smooth random field of `channels` variables on an `image_size` x `image_size` periodic grid (a few
low-wavenumber waves with random amplitudes and phases, a function of (seed, i) only) and, as its target, the same
field one time step later under uniform advection (shifted one cell east and one north) with the variables mixed
by a fixed linear map: a map a small model learns visibly, like a one-step forecast.
"""

from __future__ import annotations

import math

import torch

from pp_tp.base.seeded_init import seeded_generator

WAVES = 3  # random waves per variable


class SyntheticFields:
    """Endless (input field, next field) pairs, each `[channels, image_size, image_size]`."""

    num_samples = None

    def __init__(self, seed: int, channels: int, image_size: int):
        self.seed, self.channels, self.size = seed, channels, image_size
        mix = torch.randn(channels, channels, generator=seeded_generator(seed, "fields.mix"))
        self.mix = torch.eye(channels) + 0.3 * mix / math.sqrt(channels)

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = seeded_generator(self.seed, f"fields.{index}")
        c, n = self.channels, self.size
        k = torch.randint(1, 4, (c, WAVES, 2), generator=gen).float()
        amp = torch.randn(c, WAVES, 1, 1, generator=gen)
        phase = 2 * math.pi * torch.rand(c, WAVES, 1, 1, generator=gen)
        grid = 2 * math.pi * torch.arange(n) / n
        arg = k[..., 0, None, None] * grid[:, None] + k[..., 1, None, None] * grid[None, :] + phase
        field = (amp * torch.sin(arg)).sum(1)
        nxt = torch.einsum("ij,jhw->ihw", self.mix, torch.roll(field, shifts=(1, 1), dims=(1, 2)))
        return field, nxt
