"""CachedEmbeddingBagCollection looks up a space (the tables of one width) at once: the same training as one
nn.EmbeddingBag per table bit for bit, a fixed number of operations whatever the number of tables, its optimizer
state in its state dict, ids that are not integers refused; and row_sums, the one rule every row gradient sums by."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from bagpipe.embeddings import row_sums
from bagpipe.nn import CachedEmbeddingBagCollection, Lookahead
from bagpipe.opcount import OpCounter
from bagpipe.optim import RowWise, make_row_optimizer

LR = 0.05


def squared_loss(outputs, targets) -> torch.Tensor:
    return sum(((out - target) ** 2).sum() for out, target in zip(outputs, targets))


def zipf_batches(shapes, count: int, *, bags: int = 12, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [([torch.randint(0, rows, (bags, 3), generator=generator) for rows, _ in shapes],
             [torch.randn(bags, dim, generator=generator) for _, dim in shapes]) for _ in range(count)]


# -- the rule every row gradient sums by --------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=40), st.integers(0, 2**31 - 1))
def test_row_sums_are_each_rows_values_added_in_the_order_they_came(index, seed):
    values = torch.randn(len(index), 3, generator=torch.Generator().manual_seed(seed))
    values *= torch.logspace(-6, 6, len(index)).unsqueeze(1)  # magnitudes apart: a different order rounds otherwise
    distinct, sums = row_sums(torch.tensor(index), values)
    assert distinct.tolist() == sorted(set(index))
    for row, total in zip(distinct.tolist(), sums):
        fold = None
        for i, key in enumerate(index):
            if key == row:
                fold = values[i].clone() if fold is None else fold + values[i]
        assert torch.equal(total, fold)


def test_row_sums_of_a_row_do_not_depend_on_the_other_rows_in_the_tensor():
    """What lets a space's tables be looked up at once: a row's sum is the same alone or among many (coalesce's
    unstable sort at small sizes does not give this)."""
    generator = torch.Generator().manual_seed(1)
    parts = [(torch.randint(0, 50, (2048,), generator=generator), torch.randn(2048, 4, generator=generator))
             for _ in range(5)]
    index = torch.cat([keys + 50 * p for p, (keys, _) in enumerate(parts)])
    _, together = row_sums(index, torch.cat([values for _, values in parts]))
    alone = torch.cat([row_sums(keys, values)[1] for keys, values in parts])
    assert torch.equal(together, alone)


# -- one lookup per space: the same training, a fixed cost --------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mixed_inputs_and_per_sample_weights_train_as_one_bag_per_table(optimizer):
    """2-D and 1-D inputs, per-sample weights on some tables of a space and not others, an empty bag."""
    shapes = [(40, 4), (90, 4), (30, 6), (60, 4)]
    weights = [torch.randn(*shape, generator=torch.Generator().manual_seed(t)) for t, shape in enumerate(shapes)]
    references = [nn.EmbeddingBag(*shape, mode="sum", sparse=True, _weight=w.clone()) for shape, w in
                  zip(shapes, weights)]
    stepper = RowWise([p for r in references for p in r.parameters()], make_row_optimizer(optimizer, lr=LR))
    collection = CachedEmbeddingBagCollection(shapes, cache_rows=[60, 20], optimizer=optimizer, lr=LR,
                                              weights=weights)
    generator = torch.Generator().manual_seed(3)
    for _ in range(12):
        inputs = [torch.randint(0, rows, (5, 3), generator=generator) for rows, _ in shapes]
        inputs[1] = torch.randint(0, 90, (11,), generator=generator).int()
        offsets = [None, torch.tensor([0, 3, 3, 7, 9]), None, None]
        sample_weights = [None, torch.rand(11, generator=generator), None, torch.rand(5, 3, generator=generator)]
        targets = [torch.randn(5, dim, generator=generator) for _, dim in shapes]
        squared_loss(collection(inputs, offsets, sample_weights), targets).backward()
        stepper.zero_grad()
        squared_loss([r(x, o, w) for r, x, o, w in zip(references, inputs, offsets, sample_weights)], targets).backward()
        stepper.step()
    assert sum(rows.stats["rows_written_back"] for rows in collection.spaces) > 0
    for t, reference in enumerate(references):
        assert torch.equal(collection.weight(t), reference.weight.detach()), t


def test_accumulating_over_mixed_inputs_and_weights_steps_as_one_bag_per_table():
    """accumulate() holds each table's gradients apart, whichever of the space's poolings (with or without
    per-sample weights) reached the leaf first."""
    shapes = [(40, 4), (90, 4), (60, 4)]
    weights = [torch.randn(*shape, generator=torch.Generator().manual_seed(t)) for t, shape in enumerate(shapes)]
    references = [nn.EmbeddingBag(*shape, mode="sum", sparse=True, _weight=w.clone()) for shape, w in
                  zip(shapes, weights)]
    stepper = RowWise([p for r in references for p in r.parameters()], make_row_optimizer("adagrad", lr=LR))
    collection = CachedEmbeddingBagCollection(shapes, cache_rows=100, optimizer="adagrad", lr=LR, weights=weights)
    generator = torch.Generator().manual_seed(8)
    for _ in range(3):
        micro_batches = []
        for _ in range(3):
            inputs = [torch.randint(0, rows, (5, 3), generator=generator) for rows, _ in shapes]
            inputs[1] = torch.randint(0, 90, (9,), generator=generator)
            offsets = [None, torch.tensor([0, 2, 2, 5, 7]), None]
            sample_weights = [torch.rand(5, 3, generator=generator), None, torch.rand(5, 3, generator=generator)]
            micro_batches.append((inputs, offsets, sample_weights, [torch.randn(5, 4, generator=generator)] * 3))
        with collection.accumulate():
            for inputs, offsets, sample_weights, targets in micro_batches:
                squared_loss(collection(inputs, offsets, sample_weights), targets).backward()
        stepper.zero_grad()
        for inputs, offsets, sample_weights, targets in micro_batches:
            squared_loss([r(x, o, w) for r, x, o, w in zip(references, inputs, offsets, sample_weights)], targets).backward()
        stepper.step()
    for t, reference in enumerate(references):
        assert torch.equal(collection.weight(t), reference.weight.detach()), t


def _embedding_ops(num_tables: int) -> OpCounter:
    """The operations of one steady iteration of a collection (forward, backward, fused steps), Adagrad."""
    shapes = [(1000, 8)] * num_tables
    collection = CachedEmbeddingBagCollection(shapes, cache_rows=200 * num_tables, optimizer="adagrad", lr=LR)
    batches = zipf_batches(shapes, 4, bags=32)
    for inputs, _ in batches[:3]:
        torch.autograd.backward(collection(inputs), [torch.ones(32, 8)] * num_tables)
    inputs, _ = batches[3]
    grads = [torch.ones(32, 8)] * num_tables
    with OpCounter() as ops:
        torch.autograd.backward(collection(inputs), grads)
    return ops


def test_an_iteration_dispatches_as_many_operations_at_26_tables_as_at_2():
    """Per space, not per table: the embedding side's operations do not grow with the number of tables (before
    the lookups went by space: 182 at 4 tables, 1,128 at 26), and no value is read back from a tensor."""
    few, many = _embedding_ops(2), _embedding_ops(26)
    assert many.counts == few.counts, (few.counts, many.counts)
    assert many.total < 60 and many.host_reads == 0, many.counts


# -- what a state dict holds, what an id may be -------------------------------------------------------------------

def test_a_reloaded_collection_trains_on_as_the_saved_one_would():
    shapes = [(50, 4), (80, 4), (30, 6)]
    batches = zipf_batches(shapes, 16, bags=6, seed=4)
    make = lambda: CachedEmbeddingBagCollection(shapes, cache_rows=[40, 20], optimizer="adam", lr=LR,  # noqa: E731
                                                weights=[torch.zeros(*shape) + t for t, shape in enumerate(shapes)])
    saved, whole = make(), make()
    for inputs, targets in Lookahead(batches[:8], saved, ids=lambda b: b[0], lookahead=3):
        squared_loss(saved(inputs), targets).backward()
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()))
    assert set(state) == {f"embedding_bags.{t}.{name}" for t in range(3) for name in ("weight", "optimizer_state")}
    reloaded = make()
    reloaded.load_state_dict(state)
    for inputs, targets in batches:  # one collection all the way, the other from the state dict on
        squared_loss(whole(inputs), targets).backward()
    for inputs, targets in batches[8:]:
        squared_loss(reloaded(inputs), targets).backward()
    for t in range(3):
        assert torch.equal(reloaded.weight(t), whole.weight(t)), t
    weights_only = make()
    weights_only.load_state_dict({k: v for k, v in state.items() if k.endswith("weight")})  # a fresh optimizer
    assert torch.equal(weights_only.weight(0), saved.weight(0))
    with pytest.raises(RuntimeError, match="size mismatch"):
        weights_only.load_state_dict({**state, "embedding_bags.2.optimizer_state": torch.zeros(30, 4)})


@pytest.mark.parametrize("ids", [torch.tensor([[1.9]]), torch.tensor([[float("nan")]]), torch.tensor([[True]])])
def test_ids_that_are_not_integers_are_refused_and_the_module_still_works(ids):
    from bagpipe.nn import CachedEmbeddingBag

    collection = CachedEmbeddingBagCollection([(10, 2), (10, 2)], cache_rows=8, optimizer="sgd", lr=LR)
    bag = CachedEmbeddingBag(10, 2, cache_rows=4, optimizer="sgd", lr=LR)
    with pytest.raises(ValueError, match="table 1: ids must be integers"):
        collection([torch.tensor([[1]]), ids])
    with pytest.raises(ValueError, match="integer ids"):
        bag(ids)
    valid = torch.tensor([[1, 2]])
    assert collection([valid, valid])[1].shape == (1, 2) and bag(valid).shape == (1, 2)
    assert collection.spaces[0].index.resident()[0].tolist() == [1, 2, 11, 12]  # nothing of the refused input


def test_bad_offsets_name_their_table():
    collection = CachedEmbeddingBagCollection([(10, 2), (10, 2)], cache_rows=8, optimizer="sgd", lr=LR)
    with pytest.raises(ValueError, match="table 1: offsets must start at 0"):
        collection([torch.tensor([[1]]), torch.tensor([1, 2, 3])], [None, torch.tensor([1, 2])])
    with pytest.raises(IndexError, match="table 0: an id outside"):
        collection([torch.tensor([[10]]), torch.tensor([[1]])])


@pytest.mark.parametrize("inputs, error, message", [
    (torch.tensor([[1, 2], [3, 4], [5, 6]]), ValueError, "3 inputs for 2 tables: give one tensor of ids per table"),
    ([torch.tensor([[1]])] * 3, ValueError, "3 inputs for 2 tables"),
    ([torch.tensor([[-1]]), torch.tensor([[1]])], IndexError, r"table 0: an id outside \[0, 50\)"),
    ([torch.tensor([[1]]), torch.tensor([[60]])], IndexError, r"table 1: an id outside \[0, 60\)"),
    ([torch.tensor([[1.0]]), torch.tensor([[1]])], ValueError, "table 0: ids must be integers"),
])
def test_lookahead_refuses_inputs_the_collection_could_not_look_up_as_the_collection_does(inputs, error, message):
    """The planner reads a batch's ids before the module sees them: ids of the wrong shape, type or range are
    refused there in the module's own words, not as an IndexError from inside the planner."""
    tables = CachedEmbeddingBagCollection([(50, 4), (60, 4)], cache_rows=20, optimizer="sgd", lr=0.1)
    with pytest.raises(error, match=message):
        next(iter(Lookahead([(inputs,)], tables)))
    with pytest.raises(error, match=message):
        tables(inputs)


def test_a_collections_spaces_all_step_at_its_param_groups_rate():
    from bagpipe.nn import FusedOptimizer

    tables = CachedEmbeddingBagCollection([(50, 4), (60, 8)], cache_rows=20, optimizer="adagrad", lr=0.1)
    fused = FusedOptimizer([tables])
    assert len(fused.param_groups) == 1 and len(fused.param_groups[0]["params"]) == 2  # two widths, two spaces
    fused.param_groups[0]["lr"] = 0.025
    outputs = tables([torch.tensor([[1, 2]]), torch.tensor([[3]])])
    sum(o.sum() for o in outputs).backward()
    assert [space.optimizer.lr for space in tables.cached_spaces()] == [0.025, 0.025]
