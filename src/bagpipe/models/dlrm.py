"""DLRM's dense part: bottom MLP, pairwise dot interaction, top MLP (Naumov et al. 2019).

The embeddings are an input, not a member: the same module trains with local tables (the
reference trainer) or with rows served by the cache. One table per sparse feature, all of the
embedding width, which the bottom MLP's output must match (the dots need one width).
"""

from __future__ import annotations

import torch
from torch import nn

from bagpipe.data.schema import Schema
from bagpipe.embeddings import Embeddings, TableConfig, one_per_feature
from bagpipe.models.base import RecModel
from bagpipe.models.layers import mlp


def tables(config, schema: Schema) -> list[TableConfig]:
    """One table per sparse feature, ``emb_dim`` wide."""
    return one_per_feature(schema, config.emb_dim)


def check(config, schema: Schema) -> None:
    inputs = config.sizes("arch_mlp_bot")[0]
    if inputs != schema.num_dense:
        raise ValueError(f"arch_mlp_bot starts with {inputs} inputs, but the data has "
                         f"{schema.num_dense} dense features")
    if not schema.one_hot_only:
        raise ValueError("dlrm embeds one id per sparse feature; this data has multi-valued features")


class DLRM(RecModel):
    """``forward(dense_x [B, num_dense], embeddings [B, T, D] or Embeddings) -> logits [B]``."""

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

    @classmethod
    def from_config(cls, config, schema: Schema) -> "DLRM":
        return cls(num_tables=len(schema.features), emb_dim=config.emb_dim,
                   bottom_sizes=config.sizes("arch_mlp_bot"), top_sizes=config.sizes("arch_mlp_top"))

    def early_params(self) -> list[nn.Parameter]:
        """The top MLP's: the backward completes their gradients first."""
        return list(self.top.parameters())

    def forward(self, dense_x: torch.Tensor, embeddings: torch.Tensor | Embeddings) -> torch.Tensor:
        if isinstance(embeddings, Embeddings):
            embeddings = embeddings.stack()
        if embeddings.dim() != 3 or embeddings.shape[1:] != (self.num_tables, self.emb_dim):
            raise ValueError(f"embeddings must be [B, {self.num_tables}, {self.emb_dim}], got {tuple(embeddings.shape)}")
        x = self.bottom(dense_x)
        features = torch.cat([x.unsqueeze(1), embeddings], dim=1)
        dots = torch.bmm(features, features.transpose(1, 2))
        interactions = dots.flatten(1).index_select(1, self.pair_index)
        return self.top(torch.cat([x, interactions], dim=1)).squeeze(1)
