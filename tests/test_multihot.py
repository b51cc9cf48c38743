"""Multi-hot bags: pooling as nn.EmbeddingBag does, and cached training equal to the reference."""

from __future__ import annotations

import pytest
import torch

from bagpipe.cached import gather_tables, train_cached_batches
from bagpipe.data.batches import Batch
from bagpipe.embeddings import Bags, EmbeddingTables
from bagpipe.models.dlrm import DLRM
from bagpipe.optim import make_row_optimizer
from bagpipe.reference import train_step

SIZES = [30, 50, 20, 40]
BATCH, DIM, ITERATIONS = 32, 8, 60


def random_bags(generator: torch.Generator, *, batch: int, mode: str, max_len: int = 4) -> Bags:
    lengths = torch.randint(0, max_len + 1, (batch, len(SIZES)), generator=generator)
    values = []
    for b in range(batch):
        for t, size in enumerate(SIZES):
            # skewed ids: small ids are hot, as in real data
            ids = (torch.rand(int(lengths[b, t]), generator=generator) ** 3 * size).to(torch.int64)
            values.append(ids)
    return Bags(torch.cat(values), lengths, mode)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bag_pooling_matches_embedding_bag(mode):
    generator = torch.Generator().manual_seed(0)
    bags = random_bags(generator, batch=16, mode=mode)
    tables = EmbeddingTables(table_sizes=SIZES, dim=DIM, optimizer=make_row_optimizer("sgd", lr=0.1), seed=1)
    pooled, _ = tables.lookup(bags)
    lengths = bags.lengths
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.flatten().cumsum(0)])
    for t in range(len(SIZES)):
        bag = torch.nn.EmbeddingBag.from_pretrained(tables.table(t), mode=mode)
        # the values of table t, bag by bag, with their offsets
        index = [torch.arange(int(starts[b * len(SIZES) + t]), int(starts[b * len(SIZES) + t + 1]))
                 for b in range(len(bags))]
        values = bags.values[torch.cat(index)]
        offsets = torch.tensor([0] + [len(i) for i in index[:-1]]).cumsum(0)
        torch.testing.assert_close(pooled[:, t], bag(values, offsets))
    assert (pooled[lengths == 0] == 0).all()  # an empty bag pools to zeros


def test_bags_slice_and_keys():
    bags = Bags(torch.tensor([1, 2, 0, 5, 3]), torch.tensor([[2, 0], [1, 2]]))
    offsets = torch.tensor([0, 10])
    assert bags.keys(offsets).tolist() == [1, 2, 0, 15, 13]  # sample 0: table 0 only
    second = bags.slice(slice(1, 2))
    assert second.values.tolist() == [0, 5, 3] and second.lengths.tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="add up"):
        Bags(torch.tensor([1]), torch.tensor([[2]]))


@pytest.mark.parametrize("optimizer, mode", [("adagrad", "sum"), ("adam", "mean")])
def test_cached_multi_hot_training_equals_reference(optimizer, mode):
    generator = torch.Generator().manual_seed(4)
    batches = [Batch(dense_x=torch.randn(BATCH, 13, generator=generator),
                     ids=random_bags(generator, batch=BATCH, mode=mode),
                     target=torch.randint(0, 2, (BATCH,), generator=generator).float())
               for _ in range(ITERATIONS)]
    row_optimizer = make_row_optimizer(optimizer, lr=0.05)

    def model() -> DLRM:
        torch.manual_seed(2)
        return DLRM(num_tables=len(SIZES), emb_dim=DIM, bottom_sizes=(13, 16, DIM), top_sizes=(16, 1))

    ref_model = model()
    tables = EmbeddingTables(table_sizes=SIZES, dim=DIM, optimizer=row_optimizer, seed=9)
    ref_dense = row_optimizer.dense_optimizer(ref_model.parameters())
    for batch in batches:
        train_step(ref_model, tables, ref_dense, batch)

    cached_model = model()
    stores = train_cached_batches(cached_model, row_optimizer.dense_optimizer(cached_model.parameters()), batches,
                                  table_sizes=SIZES, row_optimizer=row_optimizer, seed=9, cache_rows=100,
                                  lookahead=5, num_shards=2)
    # more distinct rows than the 100-row cache holds: rows were evicted and fetched again
    offsets = torch.tensor([0, 30, 80, 100])
    assert len(torch.unique(torch.cat([b.ids.keys(offsets) for b in batches]))) > 100
    for t, got in enumerate(gather_tables(stores, SIZES)):
        assert torch.equal(got, tables.table(t)), f"table {t}"
    for (name, got), want in zip(cached_model.state_dict().items(), ref_model.state_dict().values()):
        assert torch.equal(got, want), name
