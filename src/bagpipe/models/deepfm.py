"""DeepFM (Guo et al. 2017): a factorization machine and an MLP sharing one set of embeddings.

The FM's first-order terms are 1-wide embeddings (zeros at first) beside the ``emb_dim``-wide
factors: two embedding spaces, both planned and cached. The second-order term is the sum of the
factors' pairwise inner products, computed as 0.5 * ((sum v)^2 - sum v^2). Dense features enter
the first-order term and the MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from bagpipe.data.schema import Schema
from bagpipe.embeddings import Embeddings, TableConfig, one_per_feature
from bagpipe.models.base import RecModel, check_ctr_data, fields
from bagpipe.models.layers import mlp
from bagpipe.models.wide_deep import linear_tables


def tables(config, schema: Schema) -> list[TableConfig]:
    return one_per_feature(schema, config.emb_dim) + linear_tables(schema)


def check(config, schema: Schema) -> None:
    check_ctr_data("deepfm", schema)


class DeepFM(RecModel):
    def __init__(self, *, num_dense: int, num_features: int, emb_dim: int, deep_sizes: tuple[int, ...],
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.num_features = num_features
        self.dense_linear = nn.Linear(num_dense, 1) if num_dense else None
        self.bias = nn.Parameter(torch.zeros(1))
        self.deep = mlp((num_dense + num_features * emb_dim, *deep_sizes, 1), relu_last=False, dropout=dropout)

    @classmethod
    def from_config(cls, config, schema: Schema) -> "DeepFM":
        return cls(num_dense=schema.num_dense, num_features=len(schema.features), emb_dim=config.emb_dim,
                   deep_sizes=config.sizes("deep_mlp"), dropout=config.dropout)

    def early_params(self) -> list[nn.Parameter]:
        return list(self.deep.parameters())

    def forward(self, dense_x: torch.Tensor, embeddings: Embeddings) -> torch.Tensor:
        features = self.num_features
        factors = fields(embeddings, range(features))  # [B, F, D]
        first = fields(embeddings, range(features, 2 * features)).sum(dim=(1, 2)) + self.bias
        if self.dense_linear is not None:
            first = first + self.dense_linear(dense_x).squeeze(1)
        second = 0.5 * (factors.sum(dim=1).pow(2) - factors.pow(2).sum(dim=1)).sum(dim=1)
        deep = self.deep(torch.cat([dense_x, factors.flatten(1)], dim=1)).squeeze(1)
        return first + second + deep
