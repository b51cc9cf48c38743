"""Caser (Tang & Wang 2018): next-item recommendation from convolutions over a user's last L items.

The last L items' embeddings form an L x d "image": vertical filters (L x 1, ``vertical_filters``
of them) weigh the positions, horizontal filters (h x d for every h in 1..L, ``horizontal_filters``
each) capture item sequences and are max-pooled over time. A dense layer turns them into z, and
the score of item j is ``W_j . [z; P_u] + b_j``. Every embedding is a cached table: users (d),
input items (d), output items (2d) and item biases (1), the last two read for the target and the
sampled negative items alike: three embedding spaces. The loss is the binary cross-entropy of the
targets against the negatives, as the paper trains it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bagpipe.data.schema import NEXT_ITEM_FEATURES, Schema
from bagpipe.embeddings import Embeddings, TableConfig
from bagpipe.models.base import RecModel
from bagpipe.models.layers import StepDropout

FEATURES = NEXT_ITEM_FEATURES


def tables(config, schema: Schema) -> list[TableConfig]:
    users, items = schema.features[0].cardinality, schema.features[1].cardinality
    d = config.emb_dim
    return [TableConfig(name="user", num_rows=users, dim=d, features=(0,), init="normal"),
            TableConfig(name="item", num_rows=items, dim=d, features=(1,), init="normal"),
            TableConfig(name="item.out", num_rows=items, dim=2 * d, features=(2, 3), init="normal"),
            TableConfig(name="item.bias", num_rows=items, dim=1, features=(2, 3), init="zeros")]


def check(config, schema: Schema) -> None:
    names = tuple(f.name for f in schema.features)
    if names != FEATURES:
        raise ValueError(f"caser trains on next-item sequences (features {', '.join(FEATURES)}, as `bagpipe "
                         f"preprocess` makes them from an interaction log); this data has {', '.join(names)}")
    if schema.features[1].cardinality != schema.features[2].cardinality:
        raise ValueError("caser: the history and the targets must number the same items")


class Caser(RecModel):
    task = "next-item"

    def __init__(self, *, history: int, targets: int, emb_dim: int, vertical: int, horizontal: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.targets, d = targets, emb_dim
        self.vertical = nn.Parameter(torch.empty(vertical, history).uniform_(-1.0 / history, 1.0 / history))
        self.horizontal = nn.ModuleList(nn.Linear(h * d, horizontal) for h in range(1, history + 1))
        self.dropout = StepDropout(dropout)
        self.fc1 = nn.Linear(vertical * d + horizontal * history, d)

    @classmethod
    def from_config(cls, config, schema: Schema) -> "Caser":
        return cls(history=schema.features[1].width, targets=schema.features[2].width, emb_dim=config.emb_dim,
                   vertical=config.vertical_filters, horizontal=config.horizontal_filters, dropout=config.dropout)

    def early_params(self) -> list[nn.Parameter]:
        return list(self.fc1.parameters())

    def represent(self, embeddings: Embeddings) -> torch.Tensor:
        """``[z; P_u]``: ``[B, 2d]``, what every item's output embedding is scored against."""
        user, items = embeddings[0], embeddings[1]  # [B, d], [B, L, d] (zeros where the history is short)
        batch = items.shape[0]
        out_v = torch.matmul(self.vertical, items).flatten(1)
        out_h = []
        for height, linear in enumerate(self.horizontal, start=1):
            windows = items.unfold(1, height, 1).transpose(2, 3).reshape(batch, -1, height * items.shape[2])
            out_h.append(F.relu(linear(windows)).amax(dim=1))
        z = F.relu(self.fc1(self.dropout(torch.cat([out_v, *out_h], dim=1))))
        return torch.cat([z, user], dim=1)

    def forward(self, dense_x: torch.Tensor, embeddings: Embeddings) -> torch.Tensor:
        """Scores ``[B, T + N]`` of the targets, then the negatives."""
        x = self.represent(embeddings)
        weights = torch.cat([embeddings[2], embeddings[3]], dim=1)  # [B, T + N, 2d]
        biases = torch.cat([embeddings[4], embeddings[5]], dim=1).squeeze(2)
        return torch.matmul(weights, x.unsqueeze(2)).squeeze(2) + biases

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        positive, negative = output[:, :self.targets], output[:, self.targets:]
        return (F.binary_cross_entropy_with_logits(positive, torch.ones_like(positive))
                + F.binary_cross_entropy_with_logits(negative, torch.zeros_like(negative)))

    def score_all(self, embeddings: Embeddings, item_out: torch.Tensor, item_bias: torch.Tensor) -> torch.Tensor:
        """Every item's score ``[B, items]``, from the whole output tables."""
        return self.represent(embeddings) @ item_out.T + item_bias.T
