"""Layers the models share."""

from __future__ import annotations

import math

from torch import nn


def mlp(sizes: tuple[int, ...], *, relu_last: bool) -> nn.Sequential:
    """Linear layers of ``sizes`` with ReLUs between (and after the last with ``relu_last``)."""
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        linear = nn.Linear(fan_in, fan_out)
        # DLRM's initialisation: Glorot-like normal weights, 1/sqrt(fan_out) normal biases.
        nn.init.normal_(linear.weight, 0.0, math.sqrt(2.0 / (fan_in + fan_out)))
        nn.init.normal_(linear.bias, 0.0, math.sqrt(1.0 / fan_out))
        layers.append(linear)
        if relu_last or index < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)
