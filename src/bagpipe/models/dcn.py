"""Deep & Cross Network: explicit feature crosses beside an MLP over the same input.

The input x0 is the dense features and every embedding, concatenated (width d). Each cross layer
keeps x and adds a cross with x0: the DCN of Wang et al. 2017 (``cross_kind = "vector"``) with a
weight vector, ``x' = x0 (x . w) + b + x``; DCN-v2 (Wang et al. 2021, ``"matrix"``) with a matrix,
``x' = x0 * (W x + b) + x``, full or of low rank r (``W = U V``, ``cross_rank``). The cross
network's and the MLP's outputs are concatenated into one logit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from bagpipe.data.schema import Schema
from bagpipe.embeddings import Embeddings, TableConfig, one_per_feature
from bagpipe.models.base import RecModel, check_ctr_data, fields
from bagpipe.models.layers import mlp


def tables(config, schema: Schema) -> list[TableConfig]:
    return one_per_feature(schema, config.emb_dim)


def check(config, schema: Schema) -> None:
    check_ctr_data("dcn", schema)


class CrossLayer(nn.Module):
    def __init__(self, width: int, *, kind: str, rank: int) -> None:
        super().__init__()
        self.kind = kind
        self.bias = nn.Parameter(torch.zeros(width))
        bound = 1.0 / math.sqrt(width)
        if kind == "vector":
            self.weight = nn.Parameter(torch.empty(width).uniform_(-bound, bound))
        elif rank:
            self.down = nn.Parameter(torch.empty(rank, width).uniform_(-bound, bound))  # V: width -> rank
            self.up = nn.Parameter(torch.empty(width, rank).uniform_(-1.0 / math.sqrt(rank), 1.0 / math.sqrt(rank)))
        else:
            self.weight = nn.Parameter(torch.empty(width, width).uniform_(-bound, bound))
        self.rank = rank

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "vector":
            return x0 * (x @ self.weight).unsqueeze(1) + self.bias + x
        mixed = (x @ self.down.T) @ self.up.T if self.rank else x @ self.weight.T
        return x0 * (mixed + self.bias) + x


class DCN(RecModel):
    def __init__(self, *, num_dense: int, num_features: int, emb_dim: int, deep_sizes: tuple[int, ...],
                 cross_layers: int, cross_kind: str = "vector", cross_rank: int = 0, dropout: float = 0.0) -> None:
        super().__init__()
        self.num_features = num_features
        width = num_dense + num_features * emb_dim
        self.cross = nn.ModuleList(CrossLayer(width, kind=cross_kind, rank=cross_rank) for _ in range(cross_layers))
        self.deep = mlp((width, *deep_sizes), relu_last=True, dropout=dropout)
        self.output = nn.Linear(width + deep_sizes[-1], 1)

    @classmethod
    def from_config(cls, config, schema: Schema) -> "DCN":
        return cls(num_dense=schema.num_dense, num_features=len(schema.features), emb_dim=config.emb_dim,
                   deep_sizes=config.sizes("deep_mlp"), cross_layers=config.cross_layers, cross_kind=config.cross_kind,
                   cross_rank=config.cross_rank, dropout=config.dropout)

    def early_params(self) -> list[nn.Parameter]:
        return list(self.output.parameters())

    def forward(self, dense_x: torch.Tensor, embeddings: Embeddings) -> torch.Tensor:
        x0 = torch.cat([dense_x, fields(embeddings, range(self.num_features)).flatten(1)], dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.output(torch.cat([x, self.deep(x0)], dim=1)).squeeze(1)
