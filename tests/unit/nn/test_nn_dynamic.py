"""bagpipe.nn.DynamicEmbeddingBag: a cached bag over any int64 id, its rows made as it trains, equal bit for bit to a
fixed nn.EmbeddingBag holding the rows a reference run of raw ids makes (embeddings.dynamic: the same numbering,
the same keyed initial rows, the same default row), with admission, evictions and a reload."""

import numpy as np
import pytest
import torch
from torch import nn

from bagpipe.embeddings.dynamic import RowNumbering, init_keyed
from bagpipe.nn.dynamic import DynamicEmbeddingBag
from bagpipe.optim import RowWise, make_row_optimizer

DIM = 4


class Split:
    def __init__(self, ids):
        self.ids, self.rows = ids, len(ids)


def arriving_keys(count: int, *, seed: int) -> np.ndarray:
    """Raw keys of one table, ``count`` look-ups: a popular few and a long tail that keeps arriving."""
    generator = np.random.default_rng(seed)
    popular = generator.integers(0, 2**63 - 1, size=40, dtype=np.int64)
    keys = np.where(generator.random(count) < 0.6, popular[generator.zipf(1.5, count) % 40],
                    generator.integers(0, 2**63 - 1, size=count, dtype=np.int64) // 2**40)  # tail: some repeat
    return keys.reshape(-1, 1)


def squared_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()


# (with rows retired: unused for a while, or past a budget; their numbers made again, in the cache or on the host)
@pytest.mark.parametrize("optimizer, min_count, cache_rows, retire_after, budget", [
    ("adam", 1, 30, 0, 0), ("adagrad", 2, 16, 0, 0), ("sgd", 3, 200, 0, 0), ("adam", 1, 40, 3, 0),
    ("adagrad", 2, 30, 0, 20), ("sgd", 1, 60, 4, 40)])
def test_a_dynamic_bag_trains_as_the_reference_table_of_the_rows_its_run_makes(optimizer, min_count, cache_rows,
                                                                               retire_after, budget):
    keys = arriving_keys(24 * 32, seed=1)
    batches = [slice(i * 32, (i + 1) * 32) for i in range(24)]
    numbering = RowNumbering.of_run(Split(keys), batches, min_count=min_count, retire_after=retire_after,
                                    budget=budget)
    rows = numbering.table_rows[0]
    generator = torch.Generator().manual_seed(3)
    targets = [torch.randn(32, DIM, generator=generator) for _ in batches]
    reference = nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True,
                                _weight=init_keyed(numbering.row_keys(0), seed=7, table=2, dim=DIM, num_rows=rows))
    stepper = RowWise(reference.parameters(), make_row_optimizer(optimizer, lr=0.05))
    options = dict(cache_rows=cache_rows, init_rows=rows, seed=7, table=2, row_min_count=min_count, mode="sum",
                   optimizer=optimizer, lr=0.05, retire_after=retire_after, row_budget=budget)
    bag = DynamicEmbeddingBag(DIM, **options)
    for iteration, (rows_of, target) in enumerate(zip(batches, targets)):
        stepper.zero_grad()
        (made_again, new_keys), = numbering.resets(iteration)  # (retired numbers reused: made again, fresh state)
        if len(made_again):
            with torch.no_grad():
                reference.weight[torch.from_numpy(made_again)] = init_keyed(new_keys, seed=7, table=2, dim=DIM,
                                                                            num_rows=rows)
            if "rows" in stepper.state[reference.weight]:
                stepper.state[reference.weight]["rows"][torch.from_numpy(made_again)] = 0.0
        numbered = numbering.training_ids(numbering.numbered(keys[rows_of]), iteration)
        squared_loss(reference(torch.from_numpy(numbered)), target).backward()
        stepper.step()
        squared_loss(bag(torch.from_numpy(keys[rows_of])), target).backward()
        if iteration == 11:  # a reload mid-run trains on as the saved module would have
            saved, counted = bag.state_dict(), bag.default_lookups
            bag = DynamicEmbeddingBag(DIM, **options)
            bag.load_state_dict(saved)
    assert bag.num_embeddings == rows and torch.equal(bag.weight, reference.weight.detach())
    np.testing.assert_array_equal(bag.row_keys(), numbering.stored_row_keys()[0])
    assert counted + bag.default_lookups == numbering.default_lookups  # (0 without admission)
    assert (sum(numbering.rows_retired) > 0) == bool(retire_after or budget) and (not budget or rows == budget + 1)
    if cache_rows < rows:
        assert bag.rows.stats["rows_written_back"] > 0, (rows, bag.rows.stats)  # rows made were evicted
    # in eval mode an id without a row looks the default row up and makes none
    bag.eval()
    alive = int(np.flatnonzero(bag.row_keys() >= 0)[0])
    out = bag(torch.tensor([[5], [int(bag.row_keys()[alive])]]))
    assert bag.num_embeddings == rows
    assert torch.equal(out[0], bag.weight[0]) and torch.equal(out[1], bag.weight[alive])


def test_a_dynamic_bag_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="the 'disk' tier cannot yet: storage='disk' is not supported"):
        DynamicEmbeddingBag(DIM, cache_rows=10, init_rows=10, storage="disk", optimizer="sgd", lr=0.1)
    bag = DynamicEmbeddingBag(DIM, cache_rows=10, init_rows=10, optimizer="sgd", lr=0.1)
    with pytest.raises(ValueError, match="non-negative int64"):
        bag(torch.tensor([[3], [-2]]))
    # a batch whose rows do not fit is refused before it makes a row or counts a look-up
    with pytest.raises(ValueError, match="touches 30 distinct rows, more than the cache's 10"):
        bag(torch.arange(30).view(30, 1))
    assert bag.num_embeddings == 1 and bag.life.ids.count == 0
    with pytest.raises(NotImplementedError, match="accumulate"):
        bag.accumulate()
    admitting = DynamicEmbeddingBag(DIM, cache_rows=10, init_rows=10, row_min_count=3, optimizer="sgd", lr=0.1)
    admitting(torch.tensor([[4], [4], [9]])).sum().backward()
    with pytest.raises(RuntimeError, match="row_min_count 2 would have given one"):
        DynamicEmbeddingBag(DIM, cache_rows=10, init_rows=10, row_min_count=2, optimizer="sgd",
                            lr=0.1).load_state_dict(admitting.state_dict())


def test_a_dynamic_bags_warm_up_preloads_the_rows_its_ids_have_and_makes_none():
    bag = DynamicEmbeddingBag(DIM, cache_rows=8, init_rows=10, optimizer="sgd", lr=0.1, policy="lfu")
    bag(torch.tensor([[2**60], [7], [2**40]])).sum().backward()
    loaded = DynamicEmbeddingBag(DIM, cache_rows=8, init_rows=10, optimizer="sgd", lr=0.1, policy="lfu")
    loaded.load_state_dict(bag.state_dict())  # (its cache empty)
    assert loaded.warm_up(torch.tensor([2**60, 2**60, 99, 7]), fraction=1.0) == 3  # rows 1, 2 and the default row
    assert loaded.num_embeddings == 4 and loaded.rows.index.resident_rows == 3
