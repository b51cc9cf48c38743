"""Multi-valued features (bags padded with -1): pooling as nn.EmbeddingBag does, and cached
training equal to the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bagpipe.train.single import gather_tables, train_cached_batches
from bagpipe.data.batches import Batch
from bagpipe.data.schema import PAD
from bagpipe.embeddings import Embeddings, EmbeddingTables
from bagpipe.models.dlrm import DLRM
from bagpipe.optim import make_row_optimizer
from bagpipe.train.reference import train_step
from helpers.layouts import layout_of

SIZES, WIDTHS = [30, 50, 20, 40], [4, 1, 3, 4]
BATCH, DIM, ITERATIONS = 32, 8, 60


def random_ids(generator: torch.Generator, *, batch: int) -> torch.Tensor:
    """[batch, 12] ids: each feature's bag of 0..width skewed ids (small ids are hot), then PAD."""
    columns = []
    for size, width in zip(SIZES, WIDTHS):
        ids = (torch.rand(batch, width, generator=generator) ** 3 * size).to(torch.int64)
        if width > 1:
            lengths = torch.randint(0, width + 1, (batch, 1), generator=generator)
            ids = torch.where(torch.arange(width) < lengths, ids, PAD)
        columns.append(ids)
    return torch.cat(columns, dim=1)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bag_pooling_matches_embedding_bag(mode):
    generator = torch.Generator().manual_seed(0)
    ids = random_ids(generator, batch=16)
    tables = EmbeddingTables(layout=layout_of(SIZES, DIM, widths=WIDTHS), optimizer=make_row_optimizer("sgd", lr=0.1),
                             seed=1)
    embeddings, _ = tables.lookup(ids)
    start = 0
    for t, width in enumerate(WIDTHS):
        bag = nn.EmbeddingBag.from_pretrained(tables.table(t), mode=mode, padding_idx=None)
        feature = ids[:, start:start + width]
        start += width
        values = [row[row >= 0] for row in feature]
        offsets = torch.tensor([0] + [len(v) for v in values[:-1]]).cumsum(0)
        torch.testing.assert_close(embeddings.pooled(t, mode), bag(torch.cat(values), offsets))
        if width > 1:
            assert embeddings[t].shape == (16, width, DIM)
            assert (embeddings[t][feature < 0] == 0).all()  # an empty place embeds to zeros
    empty = (ids[:, :4] < 0).all(dim=1)
    assert empty.any() and (embeddings.pooled(0, mode)[empty] == 0).all()  # an empty bag pools to zeros


class PooledDLRM(DLRM):
    """DLRM over bags pooled by ``mode``."""

    def __init__(self, mode: str) -> None:
        super().__init__(num_tables=len(SIZES), emb_dim=DIM, bottom_sizes=(13, 16, DIM), top_sizes=(16, 1))
        self.mode = mode

    def forward(self, dense_x: torch.Tensor, embeddings: Embeddings) -> torch.Tensor:
        pooled = torch.stack([embeddings.pooled(i, self.mode) for i in range(len(embeddings))], dim=1)
        return super().forward(dense_x, pooled)


@pytest.mark.parametrize("optimizer, mode", [("adagrad", "sum"), ("adam", "mean")])
def test_cached_multi_hot_training_equals_reference(optimizer, mode):
    generator = torch.Generator().manual_seed(4)
    batches = [Batch(dense_x=torch.randn(BATCH, 13, generator=generator), ids=random_ids(generator, batch=BATCH),
                     target=torch.randint(0, 2, (BATCH,), generator=generator).float())
               for _ in range(ITERATIONS)]
    layout = layout_of(SIZES, DIM, widths=WIDTHS)
    row_optimizer = make_row_optimizer(optimizer, lr=0.05)

    def model() -> PooledDLRM:
        torch.manual_seed(2)
        return PooledDLRM(mode)

    ref_model = model()
    tables = EmbeddingTables(layout=layout, optimizer=row_optimizer, seed=9)
    ref_dense = row_optimizer.dense_optimizer(ref_model.parameters())
    for batch in batches:
        train_step(ref_model, tables, ref_dense, batch)

    cached_model = model()
    stores = train_cached_batches(cached_model, row_optimizer.dense_optimizer(cached_model.parameters()), batches,
                                  layout=layout, row_optimizer=row_optimizer, seed=9, cache_rows=100, lookahead=5,
                                  num_shards=2)
    # more distinct rows than the 100-row cache holds: rows were evicted and fetched again
    keys = torch.cat([torch.from_numpy(layout.keys(b.ids.numpy())[0]).flatten() for b in batches])
    assert len(torch.unique(keys[keys >= 0])) > 100
    for t, got in enumerate(gather_tables(stores, layout)):
        assert torch.equal(got, tables.table(t)), f"table {t}"
    for (name, got), want in zip(cached_model.state_dict().items(), ref_model.state_dict().values()):
        assert torch.equal(got, want), name
