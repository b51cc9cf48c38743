"""DLRM's dense part: bottom MLP, pairwise dot interaction, top MLP.

The embeddings are an input, not a member: the same module trains with local tables (the
reference trainer) or with rows served by the cache.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def mlp(sizes: tuple[int, ...], *, relu_last: bool) -> nn.Sequential:
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


class DLRM(nn.Module):
    """``forward(dense_x [B, num_dense], embeddings [B, T, D]) -> logits [B]``."""

    def __init__(self, *, num_tables: int, emb_dim: int, bottom_sizes: tuple[int, ...],
                 top_sizes: tuple[int, ...]) -> None:
        super().__init__()
        if bottom_sizes[-1] != emb_dim:
            raise ValueError(f"the bottom MLP must end in the embedding dimension {emb_dim}, got {bottom_sizes}")
        if top_sizes[-1] != 1:
            raise ValueError(f"the top MLP must end in one output, got {top_sizes}")
        self.num_tables = num_tables
        self.emb_dim = emb_dim
        num_features = num_tables + 1
        rows, cols = torch.tril_indices(num_features, num_features, offset=-1)
        # Flat positions of the strictly-lower-triangle pairs in a [F, F] dot matrix.
        self.register_buffer("pair_index", rows * num_features + cols, persistent=False)
        self.bottom = mlp(bottom_sizes, relu_last=True)
        self.top = mlp((emb_dim + len(self.pair_index), *top_sizes), relu_last=False)

    def forward(self, dense_x: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        if embeddings.dim() != 3 or embeddings.shape[1:] != (self.num_tables, self.emb_dim):
            raise ValueError(f"embeddings must be [B, {self.num_tables}, {self.emb_dim}], got {tuple(embeddings.shape)}")
        x = self.bottom(dense_x)
        features = torch.cat([x.unsqueeze(1), embeddings], dim=1)
        dots = torch.bmm(features, features.transpose(1, 2))
        interactions = dots.flatten(1).index_select(1, self.pair_index)
        return self.top(torch.cat([x, interactions], dim=1)).squeeze(1)
