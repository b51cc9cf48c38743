"""Layers the models share: MLPs, and dropout that every mode draws alike."""

from __future__ import annotations

import math

import torch
from torch import nn


class StepDropout(nn.Module):
    """Dropout whose mask is a function of (seed, iteration, part, layer) alone.

    ``nn.Dropout`` draws from the process's RNG stream, which a trainer and the reference's slice
    of the same iteration advance differently; this one is keyed (``set_dropout_step``), so
    trainer t and slice t drop the same units and the modes stay equal bit for bit.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.key = (0, 0, 0, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        generator = torch.Generator().manual_seed(hash(self.key) & (2**63 - 1))
        # drawn on the CPU whatever x's device: the same units dropped on a GPU as on the CPU
        keep = torch.rand(x.shape, generator=generator) >= self.p
        return x * keep.to(x) / (1.0 - self.p)


def set_dropout_step(model: nn.Module, *, seed: int, iteration: int, part: int) -> None:
    """Key every StepDropout of ``model`` for (seed, iteration, part): the part is the trainer, or the
    reference's slice."""
    layers = [m for m in model.modules() if isinstance(m, StepDropout)]
    for index, layer in enumerate(layers):
        layer.key = (seed, iteration, part, index)


def mlp(sizes: tuple[int, ...], *, relu_last: bool, dropout: float = 0.0) -> nn.Sequential:
    """Linear layers of ``sizes`` with ReLUs (and dropout) between, and after the last with ``relu_last``."""
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        linear = nn.Linear(fan_in, fan_out)
        # DLRM's initialisation: Glorot-like normal weights, 1/sqrt(fan_out) normal biases.
        nn.init.normal_(linear.weight, 0.0, math.sqrt(2.0 / (fan_in + fan_out)))
        nn.init.normal_(linear.bias, 0.0, math.sqrt(1.0 / fan_out))
        layers.append(linear)
        if relu_last or index < len(sizes) - 2:
            layers.append(nn.ReLU())
            if dropout:
                layers.append(StepDropout(dropout))
    return nn.Sequential(*layers)
