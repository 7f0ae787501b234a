"""Synthetic labelled images for the ViT (data.source = "images"): nothing to download.

Each class has a fixed smooth pattern (a few low-wavenumber waves per channel, unit variance per pixel, drawn from
the seed). Sample i is its class's pattern plus unit Gaussian noise; its label and noise are a function of
(seed, i) only. A classifier must find the pattern under the noise: learnable in a few dozen steps, not at once.
"""

from __future__ import annotations

import math

import torch

from pp_tp.base.seeded_init import seeded_generator

WAVES = 3  # waves per channel in a class pattern


class SyntheticImages:
    """Endless (image `[channels, image_size, image_size]`, label: an int64 scalar) pairs."""

    num_samples = None

    def __init__(self, seed: int, channels: int, image_size: int, n_classes: int):
        self.seed, self.n_classes = seed, n_classes
        gen = seeded_generator(seed, "images.patterns")
        k = torch.randint(1, 4, (n_classes, channels, WAVES, 2), generator=gen).float()
        phase = 2 * math.pi * torch.rand(n_classes, channels, WAVES, 1, 1, generator=gen)
        grid = 2 * math.pi * torch.arange(image_size) / image_size
        arg = k[..., 0, None, None] * grid[:, None] + k[..., 1, None, None] * grid[None, :] + phase
        self.patterns = torch.sin(arg).sum(2) / math.sqrt(WAVES / 2)  # unit variance per pixel

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = seeded_generator(self.seed, f"images.{index}")
        label = torch.randint(0, self.n_classes, (), generator=gen)
        pattern = self.patterns[label]
        return pattern + torch.randn(pattern.shape, generator=gen), label
