"""Cached training (planner + row stores + trainer cache) equals the reference trainer."""

import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bagpipe.cache import RowCache
from bagpipe.train.single import gather_tables, train_cached
from bagpipe.config import ModelConfig, TrainConfig
from bagpipe.data.binary import open_dataset
from bagpipe.optim import make_row_optimizer
from bagpipe.train.reference import build_model, build_tables, train_step
from bagpipe.data.batches import iterate_batches
from bagpipe.storage import RowStore
from helpers.layouts import layout_of

ITERATIONS, BATCH = 60, 64


def run_reference(split, config):
    model = build_model(config, split.schema)
    tables = build_tables(config, split.schema)
    dense_optimizer = tables.optimizer.dense_optimizer(model.parameters())
    for batch in iterate_batches(split, batch_size=BATCH, iterations=ITERATIONS):
        train_step(model, tables, dense_optimizer, batch)
    return model, [tables.table(t) for t in range(split.num_tables)], tables.layout


@pytest.mark.parametrize("optimizer, policy, shards", [("adagrad", "lookahead", 2), ("sgd", "lru", 1),
                                                       ("adam", "lookahead", 3)])
def test_cached_training_equals_reference(small_binary, tmp_path, optimizer, policy, shards):
    split = open_dataset(small_binary).train
    config = TrainConfig(data="-", run_dir="-", optimizer=optimizer, lr=0.05, seed=7,
                         model=ModelConfig(emb_dim=8, arch_mlp_bot="13-16-8", arch_mlp_top="16-1"))
    row_optimizer = make_row_optimizer(optimizer, lr=config.lr)
    ref_model, ref_tables, layout = run_reference(split, config)

    model = build_model(config, split.schema)
    stores = train_cached(model, row_optimizer.dense_optimizer(model.parameters()), split, layout=layout,
                          row_optimizer=row_optimizer, seed=config.seed, batch_size=BATCH, iterations=ITERATIONS,
                          cache_rows=600, lookahead=4, policy=policy, num_shards=shards)
    # The small cache (600 of 861 rows) forces evictions and re-fetches.
    assert (np.concatenate([s.rows.read_range(0, s.num_rows)[2] for s in stores[0]]) > 0).any()
    for got, want in zip(gather_tables(stores, layout), ref_tables, strict=True):
        assert torch.equal(got, want)  # the same steps in the same order: bit for bit
    for name, value in ref_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_fetch_waits_for_a_delayed_write_back():
    optimizer = make_row_optimizer("adagrad", lr=0.1)
    store = RowStore(layout=layout_of([10, 6], 2), space=0, optimizer=optimizer, seed=0, shard=1, num_shards=2)
    keys = np.array([3, 11])
    new_rows, new_state = torch.ones(2, 2), torch.full((2, 2), 5.0)

    def late_writer():
        time.sleep(0.3)
        store.write_back(keys, new_rows, new_state, version=4)

    writer = threading.Thread(target=late_writer)
    writer.start()
    rows, state = store.fetch(keys, np.array([4, 4]), timeout=10.0)
    writer.join()
    assert torch.equal(rows, new_rows) and torch.equal(state, new_state)
    with pytest.raises(TimeoutError, match="wants version 5"):
        store.fetch(keys, np.array([5, 4]), timeout=0.2)
    with pytest.raises(ValueError, match="does not hold"):
        store.fetch(np.array([2]), np.array([-1]), timeout=0.1)


def test_cache_memory_is_bounded_by_its_slots_and_refuses_a_disagreeing_plan():
    cache = RowCache(capacity=4, dim=3, optimizer=make_row_optimizer("sgd", lr=1.0))
    cache.install(np.array([2, 0]), np.array([10**12, 5]), torch.ones(2, 3), torch.zeros(2, 0))
    assert cache.resident_rows == 2 and cache.slot_key.nbytes == 4 * 8  # no array over the 10**12 rows
    with pytest.raises(KeyError, match="slot 0 is holding row 5, the plan expects row 6"):
        cache.evict(np.array([0]), np.array([6]))
    with pytest.raises(KeyError, match="slot 2 is holding row"):
        cache.install(np.array([2]), np.array([7]), torch.ones(1, 3), torch.zeros(1, 0))
    with pytest.raises(ValueError, match="outside the cache"):
        cache.install(np.array([4]), np.array([7]), torch.ones(1, 3), torch.zeros(1, 0))
    with pytest.raises(ValueError, match="named twice"):
        cache.install(np.array([1, 1]), np.array([7, 8]), torch.ones(2, 3), torch.zeros(2, 0))
    rows, _ = cache.evict(np.array([2]), np.array([10**12]))
    assert torch.equal(rows, torch.ones(1, 3)) and cache.resident_rows == 1
    with pytest.raises(KeyError, match="slot 2 is free"):
        cache.evict(np.array([2]), np.array([10**12]))


def test_a_caches_state_dict_gives_another_the_same_slots_and_refills_check_their_rows():
    """What a lost trainer's replacement takes (runtime/trainer/recovery.py): the slots, their rows and state."""
    cache = RowCache(capacity=5, dim=2, optimizer=make_row_optimizer("adagrad", lr=0.1))
    cache.install(np.array([3, 1]), np.array([40, 7]), torch.arange(4.0).view(2, 2), torch.ones(2, 2))
    cache.apply(np.array([3]), torch.ones(1, 2))
    state = cache.state_dict()
    other = RowCache(capacity=5, dim=2, optimizer=make_row_optimizer("adagrad", lr=0.1))
    other.load_state_dict(state)
    assert other.resident_rows == 2 and other.slot_key.tolist() == [-1, 7, -1, 40, -1]
    assert torch.equal(other.weights, cache.weights) and torch.equal(other.state, cache.state)
    cache.apply(np.array([1]), torch.ones(1, 2))
    assert torch.equal(state["weights"][1], other.weights[1])  # copies: the state dict did not follow
    with pytest.raises(ValueError, match="cannot be loaded"):
        RowCache(capacity=4, dim=2, optimizer=make_row_optimizer("sgd", lr=1.0)).load_state_dict(state)
    other.install(np.array([1]), np.array([7]), torch.zeros(1, 2), torch.zeros(1, 2), refill=True)  # read again
    assert torch.equal(other.weights[1], torch.zeros(2)) and other.resident_rows == 2
    with pytest.raises(KeyError, match="slot 3 is holding row 40"):
        other.install(np.array([3]), np.array([41]), torch.zeros(1, 2), torch.zeros(1, 2), refill=True)


def test_batch_view_puts_rows_synced_now_first_and_maps_every_id_to_its_row():
    from bagpipe.cache import BatchRows, batch_view
    from bagpipe.planner import PlannerConfig, plan

    steps = list(plan([np.array([5, 3, 5, 9]), np.array([9, 7])],
                      PlannerConfig(num_rows=10, cache_rows=4, lookahead=2)))
    flat = np.array([[5, 3], [5, 9]])
    rows = BatchRows()
    rows.load(batch_view(steps[0]))
    view = rows.at(flat)
    assert view.keys.tolist() == [9, 3, 5] and view.num_now == 1  # 9 is used again at iteration 1
    assert view.positions.tolist() == [[2, 1], [2, 0]]
    assert (view.keys[view.positions] == flat).all()
    slot_of = dict(zip(steps[0].batch_keys.tolist(), steps[0].batch_slots.tolist()))
    assert view.slots.tolist() == [slot_of[k] for k in view.keys.tolist()]
    assert rows.at(np.array([9, 9, 3])).positions.tolist() == [0, 0, 1]
    # keys anywhere in a 2^40 key space (nothing sized by it), and PAD at the empty place after the rows
    from bagpipe.cache import BatchView

    sparse = BatchRows()
    sparse.load(BatchView(np.array([2**40 - 1, 7, 2**39]), np.array([4, 5, 6]), 0, np.zeros(0, dtype=np.int32)))
    assert sparse.at(np.array([[7, -1], [2**39, 2**40 - 1]])).positions.tolist() == [[1, 3], [2, 0]]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([50, 2**31 - 1, 2**40]), st.integers(1, 40), st.integers(1, 6),
       st.sampled_from([0.0, 0.3]))
def test_the_planners_place_for_each_id_is_what_a_search_finds(seed, num_rows, batch, width, pad):
    """``plan(..., inverse=True)`` places every id among its batch's rows as it sorts them; batch_view(step, keys)
    turns that into each id's place in the view (PAD at the empty place): the positions BatchRows finds by
    searching, for any key space and PAD. The decisions are those of a plan without it; a step planned without it
    cannot be asked for positions."""
    from bagpipe.cache import BatchRows, batch_view
    from bagpipe.data.schema import PAD
    from bagpipe.embeddings import valid_keys
    from bagpipe.planner import PlannerConfig, plan

    rng = np.random.default_rng(seed)
    matrices = [np.where(rng.random((batch, width)) < pad, PAD, rng.integers(0, num_rows, (batch, width)))
                for _ in range(6)]
    config = PlannerConfig(num_rows=num_rows, cache_rows=batch * width + 5, lookahead=2)
    placed = list(plan([valid_keys(m) for m in matrices], config, inverse=True))
    plain = list(plan([valid_keys(m) for m in matrices], config))
    for step, same, keys in zip(placed, plain, matrices + [None]):
        for name in ("fetch_keys", "fetch_slots", "evict_keys", "evict_slots", "batch_keys", "batch_slots"):
            assert np.array_equal(getattr(step, name), getattr(same, name)), name
        assert not len(same.batch_inverse)
        if keys is None:  # the final flush
            continue
        searched = BatchRows()
        searched.load(batch_view(step))
        view = batch_view(step, keys)
        assert view.positions.dtype == np.int32 and view.positions.shape == keys.shape
        assert np.array_equal(view.positions, searched.at(keys).positions)
        assert np.array_equal(view.keys, batch_view(step).keys) and view.num_now == batch_view(step).num_now
        if (keys != PAD).any():
            with pytest.raises(ValueError, match="inverse=True"):
                batch_view(same, keys)


@pytest.mark.parametrize("optimizer, trainers, shards, cache_rows, keep_within", [
    ("sgd", 2, 1, 520, 0), ("adagrad", 3, 2, 420, 0), ("adam", 4, 1, 360, 0), ("adagrad", 2, 2, 520, 3),
    ("adam", 3, 1, 420, 6)])
def test_partitioned_training_equals_the_sliced_reference(small_binary, optimizer, trainers, shards, cache_rows,
                                                          keep_within):
    """The partitioned plan carried out in one process (each trainer its own cache, rows summed among their users
    only, hand-offs through the servers) ends bit for bit where --mode reference --slices T does."""
    from bagpipe.train.single import train_partitioned_batches

    split = open_dataset(small_binary).train
    config = TrainConfig(data="-", run_dir="-", optimizer=optimizer, lr=0.05, seed=7,
                         model=ModelConfig(emb_dim=8, arch_mlp_bot="13-16-8", arch_mlp_top="16-1"))
    row_optimizer = make_row_optimizer(optimizer, lr=config.lr)
    batches = list(iterate_batches(split, batch_size=96, iterations=40))
    ref_model = build_model(config, split.schema)
    tables = build_tables(config, split.schema)
    ref_optimizer = tables.optimizer.dense_optimizer(ref_model.parameters())
    for i, batch in enumerate(batches):
        train_step(ref_model, tables, ref_optimizer, batch, slices=trainers, seed=config.seed, iteration=i)
    model = build_model(config, split.schema)
    stores = train_partitioned_batches(model, row_optimizer.dense_optimizer(model.parameters()), batches,
                                       layout=tables.layout, row_optimizer=row_optimizer, seed=config.seed,
                                       cache_rows=cache_rows, lookahead=6, trainers=trainers, num_shards=shards,
                                       keep_within=keep_within)
    # (each trainer's small cache forces evictions, re-fetches and hand-offs between trainers)
    assert (np.concatenate([s.rows.read_range(0, s.num_rows)[2] for s in stores[0]]) > 0).any()
    for got, want in zip(gather_tables(stores, tables.layout), [tables.table(t) for t in range(split.num_tables)],
                         strict=True):
        assert torch.equal(got, want)
    for name, value in ref_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
