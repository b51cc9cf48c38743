"""Wide & Deep (Cheng et al. 2016): a linear model over the raw features beside an MLP over their
embeddings, trained jointly.

The wide part's weights of a feature's values are 1-wide tables (zeros at first) beside the deep
part's ``emb_dim``-wide ones: two embedding spaces, both planned and cached. Dense features enter
both parts. (The paper also crosses chosen features in the wide part; crosses are data
engineering, left to the data.)
"""

from __future__ import annotations

import torch
from torch import nn

from bagpipe.data.schema import Schema
from bagpipe.embeddings import Embeddings, TableConfig, one_per_feature
from bagpipe.models.base import RecModel, check_ctr_data, fields
from bagpipe.models.layers import mlp


def linear_tables(schema: Schema) -> list[TableConfig]:
    """A 1-wide table of weights per sparse feature, starting at zero (a linear model's)."""
    return [TableConfig(name=f"{f.name}.linear", num_rows=f.cardinality, dim=1, features=(i,), init="zeros")
            for i, f in enumerate(schema.features)]


def tables(config, schema: Schema) -> list[TableConfig]:
    return one_per_feature(schema, config.emb_dim) + linear_tables(schema)


def check(config, schema: Schema) -> None:
    check_ctr_data("wide-deep", schema)


class WideDeep(RecModel):
    def __init__(self, *, num_dense: int, num_features: int, emb_dim: int, deep_sizes: tuple[int, ...],
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.num_features = num_features
        self.wide_dense = nn.Linear(num_dense, 1) if num_dense else None
        self.bias = nn.Parameter(torch.zeros(1))
        self.deep = mlp((num_dense + num_features * emb_dim, *deep_sizes, 1), relu_last=False, dropout=dropout)

    @classmethod
    def from_config(cls, config, schema: Schema) -> "WideDeep":
        return cls(num_dense=schema.num_dense, num_features=len(schema.features), emb_dim=config.emb_dim,
                   deep_sizes=config.sizes("deep_mlp"), dropout=config.dropout)

    def early_params(self) -> list[nn.Parameter]:
        return list(self.deep.parameters())

    def forward(self, dense_x: torch.Tensor, embeddings: Embeddings) -> torch.Tensor:
        features = self.num_features
        deep_in = torch.cat([dense_x, fields(embeddings, range(features)).flatten(1)], dim=1)
        wide = fields(embeddings, range(features, 2 * features)).sum(dim=(1, 2)) + self.bias
        if self.wide_dense is not None:
            wide = wide + self.wide_dense(dense_x).squeeze(1)
        return wide + self.deep(deep_in).squeeze(1)
