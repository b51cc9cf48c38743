"""bagpipe.nn.CachedEmbeddingBag against nn.EmbeddingBag: the same lookups, the same training, O(cache) memory."""

from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest
import torch
from torch import nn

from bagpipe.nn import (CLEANUP_FRACTION, CachedEmbeddingBag, CachedEmbeddingBagCollection, CachedTables, Lookahead,
                        SlotIndex)
from bagpipe.planner.keys import KeyTable
from bagpipe.optim import RowWise, make_row_optimizer
from bagpipe.storage import StorageSpec
from helpers.nn_pairs import DIM, NUM_ROWS, module_pair, squared_loss, zipf_batches
from helpers.paths import REPO


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("shape", ["offsets", "2d", "last-offset"])
def test_lookups_and_gradients_equal_embedding_bag(mode, shape):
    torch.manual_seed(3)
    weight = torch.randn(NUM_ROWS, DIM)
    include_last = shape == "last-offset"
    reference = nn.EmbeddingBag(NUM_ROWS, DIM, mode=mode, include_last_offset=include_last, _weight=weight.clone())
    cached = CachedEmbeddingBag(NUM_ROWS, DIM, cache_rows=50, mode=mode, include_last_offset=include_last,
                                _weight=weight.clone(), optimizer="sgd", lr=0.5)
    for _ in range(5):
        if shape == "2d":
            ids, offsets = torch.randint(0, NUM_ROWS, (7, 4)), None
        else:
            ids = torch.randint(0, NUM_ROWS, (20,))
            offsets = torch.tensor([0, 3, 3, 9, 20] if include_last else [0, 3, 3, 9, 19])  # an empty bag too
        weights = torch.rand(ids.shape, requires_grad=True) if mode == "sum" else None
        weights_copy = weights.detach().clone().requires_grad_(True) if mode == "sum" else None
        expected, got = reference(ids, offsets, weights), cached(ids, offsets, weights_copy)
        assert torch.equal(expected, got)
        target = torch.randn_like(expected)
        squared_loss(expected, target).backward()
        squared_loss(got, target).backward()
        if mode == "sum":  # a dot product of a row and a bag's gradient, whose summation order the kernel may
            # choose by the row's address (seen: 1-ulp differences between a table's row and the cache's copy)
            assert torch.allclose(weights.grad, weights_copy.grad, rtol=1e-6, atol=1e-5)
        # SGD at lr 0.5 on the cached rows: the step the fused optimizer took is the reference's gradient
        touched = torch.unique(ids[:20] if include_last else ids)
        with torch.no_grad():
            reference.weight[touched] -= 0.5 * reference.weight.grad[touched]
            reference.weight.grad = None
        assert torch.allclose(reference.weight.detach(), cached.weight, atol=1e-6)


def _sorted_again(ids):
    raise AssertionError("a batch the plan placed was sorted again")


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("policy", ["lru", "lfu", "lookahead", "lookahead-prefetch"])
def test_training_equals_the_reference_bit_for_bit_with_evictions_every_iteration(optimizer, policy, monkeypatch):
    batches = zipf_batches(40)
    reference, reference_optimizer, cached = module_pair(optimizer, cache_rows=60, policy="lru" if policy.startswith(
        "lookahead") else policy)
    for ids, offsets, target in batches:
        reference_optimizer.zero_grad()
        squared_loss(reference(ids, offsets), target).backward()
        reference_optimizer.step()
    loop = Lookahead(batches, cached, lookahead=8, prefetch=policy == "lookahead-prefetch") \
        if policy.startswith("lookahead") else batches
    if policy.startswith("lookahead"):  # a planned batch's ids are placed where the planner's sort put them
        monkeypatch.setattr("bagpipe.nn.rows.unique_inverse", _sorted_again)
    fetched = []  # rows fetched so far, as each iteration starts (lookahead fetches before handing a batch out)
    for ids, offsets, target in loop:
        fetched.append(cached.rows.stats["rows_fetched"])
        squared_loss(cached(ids, offsets), target).backward()
    assert min(np.diff(fetched)) > 0, "the cache is meant to be too small to keep the rows a batch needs again"
    assert cached.rows.stats["rows_written_back"] > 3 * cached.rows.index.capacity
    assert torch.equal(reference.weight.detach(), cached.weight)
    if optimizer != "sgd":
        state = cached.rows.host.rows(0, cached.num_embeddings)[1]  # (views of the host table in memory)
        assert torch.equal(reference_optimizer.state[reference.weight]["rows"], state)


def test_lookahead_hits_more_than_lru_and_lfu():
    batches = zipf_batches(150, bags=32, num_rows=NUM_ROWS, skew=1.1)
    rates = {}
    for policy in ("lru", "lfu", "lookahead"):
        _, _, cached = module_pair("sgd", cache_rows=80, policy="lru" if policy == "lookahead" else policy)
        loop = Lookahead(batches, cached, lookahead=32) if policy == "lookahead" else batches
        for ids, offsets, target in loop:
            squared_loss(cached(ids, offsets), target).backward()
        rates[policy] = cached.rows.hit_rate()
    assert rates["lookahead"] > max(rates["lru"], rates["lfu"]), rates


def test_row_wise_sgd_and_adagrad_match_torch_optim_on_sparse_gradients():
    """RowWise is the torch.optim update for sparse gradients (up to rounding), with per-row state."""
    batches = zipf_batches(20)
    generator = torch.Generator().manual_seed(0)  # (the weights, as the batches, whatever ran before in the process)
    for name, torch_optimizer in (("sgd", torch.optim.SGD), ("adagrad", torch.optim.Adagrad)):
        weight = torch.randn(NUM_ROWS, DIM, generator=generator)
        ours, theirs = (nn.EmbeddingBag(NUM_ROWS, DIM, mode="sum", sparse=True, _weight=weight.clone())
                        for _ in range(2))
        row_optimizer = make_row_optimizer(name, lr=0.05)
        steps = [RowWise(ours.parameters(), row_optimizer),
                 torch_optimizer(theirs.parameters(), lr=0.05, **({"eps": row_optimizer.eps} if name == "adagrad"
                                                                   else {}))]
        for ids, offsets, target in batches:
            for module, step in zip((ours, theirs), steps):
                step.zero_grad()
                squared_loss(module(ids, offsets), target).backward()
                step.step()
        assert torch.allclose(ours.weight, theirs.weight, rtol=1e-5, atol=1e-6), name


def test_row_wise_refuses_dense_gradients():
    module = nn.EmbeddingBag(10, 2, mode="sum")
    module(torch.tensor([[1, 2]])).sum().backward()
    with pytest.raises(ValueError, match="sparse gradients"):
        RowWise(module.parameters(), make_row_optimizer("sgd", lr=0.1)).step()


def test_a_row_evicted_between_forward_and_backward_is_updated_on_the_host():
    weight = torch.randn(NUM_ROWS, DIM)
    reference = nn.EmbeddingBag(NUM_ROWS, DIM, mode="sum", sparse=True, _weight=weight.clone())
    cached = CachedEmbeddingBag(NUM_ROWS, DIM, cache_rows=4, mode="sum", optimizer="sgd", lr=0.1,
                                _weight=weight.clone())
    first, second = torch.tensor([[0, 1, 2, 3]]), torch.tensor([[4, 5, 6, 7]])
    offsets = None
    loss = cached(first, offsets).sum() + 2 * cached(second, offsets).sum()  # the second evicts the first's rows
    assert cached.rows.index.locate(np.arange(4)).max() == -1
    loss.backward()
    (reference(first).sum() + 2 * reference(second).sum()).backward()
    with torch.no_grad():
        reference.weight.add_(reference.weight.grad.to_dense(), alpha=-0.1)
    assert torch.allclose(reference.weight, cached.weight, atol=1e-6)


def test_a_backward_right_after_its_forward_steps_the_slots_the_lookup_found(monkeypatch):
    """No row came or went between them (the index's version is the lookup's): the rows are not looked for in
    the index again; after an eviction they are (the test above)."""
    cached = CachedEmbeddingBag(NUM_ROWS, DIM, cache_rows=8, mode="sum", optimizer="adagrad", lr=0.1)
    output = cached(torch.tensor([[0, 1, 2, 3]]))
    located = []
    locate = cached.rows.index.locate
    monkeypatch.setattr(cached.rows.index, "locate", lambda keys: located.append(len(keys)) or locate(keys))
    output.sum().backward()
    assert located == []
    first = cached(torch.tensor([[0, 1, 2, 3]]))
    cached(torch.tensor([[4, 5, 6, 7, 8]]))  # (evicts some of the first's rows: their slots changed hands)
    located.clear()
    first.sum().backward()
    assert located == [4]


def test_a_batch_larger_than_the_cache_is_a_clear_error():
    cached = CachedEmbeddingBag(NUM_ROWS, DIM, cache_rows=10, optimizer="sgd")
    with pytest.raises(ValueError, match="touches 11 distinct rows, more than the cache's 10"):
        cached(torch.arange(11).view(1, 11))
    with pytest.raises(IndexError, match="id 400 out of range"):
        cached(torch.tensor([[1, NUM_ROWS]]))
    with pytest.raises(ValueError, match="offsets is required"):
        cached(torch.tensor([1, 2]))


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_state_dict_is_the_full_table_and_loads_into_either_module(tmp_path, storage):
    batches = zipf_batches(10)
    # on disk: a DRAM cache of about 20 of Adagrad's records, far fewer than the rows that come and go
    _, _, cached = module_pair("adagrad", cache_rows=60,
                         storage=StorageSpec("disk", tmp_path, 2000) if storage == "disk" else storage)
    for ids, offsets, target in batches:
        squared_loss(cached(ids, offsets), target).backward()
    state = cached.state_dict()
    assert list(state) == ["weight", "optimizer_state"] and state["weight"].shape == (NUM_ROWS, DIM)
    plain = nn.EmbeddingBag(NUM_ROWS, DIM, mode="sum")
    plain.load_state_dict(state, strict=False)  # the optimizer state is the cached module's own
    ids, offsets, _ = batches[0]
    assert torch.equal(plain(ids, offsets), cached(ids, offsets))
    # and back: new weights replace the cached rows too; the optimizer state starts afresh
    with torch.no_grad():
        plain.weight.mul_(2.0)
    cached.load_state_dict(plain.state_dict())
    assert torch.equal(plain(ids, offsets), cached(ids, offsets))
    assert torch.equal(cached.weight, plain.weight.detach())
    assert not cached.rows.host.rows(0, NUM_ROWS)[1].any()
    with pytest.raises(RuntimeError, match="Unexpected key"):
        cached.load_state_dict({"weight": plain.weight.detach(), "other": torch.zeros(1)})


def test_memory_besides_the_host_table_is_of_the_cache_size():
    num_rows, cache_rows = 2_000_000, 500
    cached = CachedEmbeddingBag(num_rows, 4, cache_rows=cache_rows, mode="sum", optimizer="adam")
    table_sized = [name for name, buffer in cached.named_buffers() if buffer.shape[0] >= num_rows]
    index = cached.rows.index
    arrays = [value for part in (index, index.table, index.history) for value in vars(part).values()
              if isinstance(value, np.ndarray)]
    assert not table_sized and len(arrays) >= 6 and all(len(a) <= 4 * cache_rows for a in arrays)
    rng = np.random.default_rng(0)
    tracemalloc.start()
    for _ in range(20):
        ids = torch.from_numpy(rng.integers(0, num_rows, 400))
        cached(ids, torch.arange(0, 400, 4)).sum().backward()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1_000_000, f"{peak} bytes of numpy/Python memory at peak: something table-sized was made"
    # full, but for the share an eviction round frees beyond what its batch needs
    assert cache_rows - int(CLEANUP_FRACTION * cache_rows) <= cached.rows.index.resident_rows <= cache_rows


def test_slot_index_keeps_its_keys_and_evicts_the_least_recent():
    index = SlotIndex(4, policy="lru")
    index.admit(np.array([1, 2]))
    index.admit(np.array([3, 4]))
    index.admit(np.array([1]))
    admission = index.admit(np.array([5, 6]))
    assert admission.evict_keys.tolist() == [2, 3]  # (3 and 4 were used alike: the lower slot goes)
    rng = np.random.default_rng(1)
    for policy in ("lru", "lfu"):
        index = SlotIndex(50, policy=policy)
        for _ in range(200):
            keys = np.unique(rng.integers(0, 300, 30))
            admission = index.admit(keys)
            assert np.array_equal(index.slot_key[admission.batch_slots], keys)
            resident, slots = index.resident()
            assert np.all(np.diff(resident) > 0) and np.array_equal(index.slot_key[slots], resident)
            assert index.resident_rows == (index.slot_key >= 0).sum() <= 50
            assert not np.isin(admission.evict_keys, keys).any()


def test_lookahead_refuses_a_loop_that_looks_up_other_rows_and_stops_its_thread():
    batches = zipf_batches(30)
    _, _, cached = module_pair("sgd", cache_rows=60)
    threads = threading.active_count()
    with pytest.raises(ValueError, match="used outside the plan"):
        for ids, offsets, target in Lookahead(batches, cached, lookahead=4, prefetch=True):
            squared_loss(cached((ids + 1) % NUM_ROWS, offsets), target).backward()
    assert threading.active_count() == threads


def test_a_lookahead_loop_left_early_leaves_a_consistent_module():
    batches = zipf_batches(30)
    reference, reference_optimizer, cached = module_pair("adam", cache_rows=60)
    for ids, offsets, target in batches[:12]:
        reference_optimizer.zero_grad()
        squared_loss(reference(ids, offsets), target).backward()
        reference_optimizer.step()
    for i, (ids, offsets, target) in enumerate(Lookahead(batches, cached, lookahead=4, prefetch=True)):
        squared_loss(cached(ids, offsets), target).backward()
        if i == 11:
            break
    assert torch.equal(reference.weight.detach(), cached.weight)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_lookahead_prefetch_reads_rows_after_the_step_that_wrote_them_back(optimizer):
    """Two disjoint batches in turn and a cache that holds one: every step writes back the rows the next
    step fetches, so a read ahead that did not wait for the step before would read them stale."""
    first, second = torch.arange(0, 40).view(8, 5), torch.arange(40, 80).view(8, 5)
    target = torch.randn(8, DIM, generator=torch.Generator().manual_seed(5))
    batches = [(first if i % 2 == 0 else second, None, target) for i in range(30)]
    reference, reference_optimizer, cached = module_pair(optimizer, cache_rows=40)
    for ids, offsets, target in batches:
        reference_optimizer.zero_grad()
        squared_loss(reference(ids, offsets), target).backward()
        reference_optimizer.step()
    for ids, offsets, target in Lookahead(batches, cached, lookahead=4, prefetch=True):
        squared_loss(cached(ids, offsets), target).backward()
    assert cached.rows.stats["rows_fetched"] == 30 * 40
    assert torch.equal(reference.weight.detach(), cached.weight)


def test_a_collection_equals_one_embedding_bag_per_table_bit_for_bit():
    shapes = [(50, 4), (300, 8), (20, 4), (100, 8)]
    generator = torch.Generator().manual_seed(2)
    weights = [torch.randn(*shape, generator=generator) for shape in shapes]
    references = [nn.EmbeddingBag(*shape, mode="sum", sparse=True, _weight=w.clone()) for shape, w in
                  zip(shapes, weights)]
    steppers = [RowWise(r.parameters(), make_row_optimizer("adagrad", lr=0.1)) for r in references]
    collection = CachedEmbeddingBagCollection(shapes, cache_rows=[40, 90], optimizer="adagrad", lr=0.1,
                                              weights=weights)
    assert [rows.index.capacity for rows in collection.spaces] == [40, 90]  # one cache per width
    batches = []
    for _ in range(30):
        inputs = [torch.randint(0, rows, (12, 2), generator=generator) for rows, _ in shapes]
        inputs[1] = torch.randint(0, 300, (30,), generator=generator)  # a 1-D input with offsets too
        offsets = [None, torch.tensor([0, 4, 4, 10, 20, 22, 25, 26, 27, 28, 29, 29]), None, None]
        batches.append((inputs, offsets, [torch.randn(12, dim, generator=generator) for _, dim in shapes]))
    for loop in ("reference", "collection"):
        for inputs, offsets, targets in (Lookahead(batches, collection, ids=lambda b: b[0], lookahead=4, prefetch=True)
                                         if loop == "collection" else batches):
            if loop == "reference":
                outputs = [r(x, o) for r, x, o in zip(references, inputs, offsets)]
                for stepper in steppers:
                    stepper.zero_grad()
            else:
                outputs = collection(inputs, offsets)
            sum(squared_loss(out, target) for out, target in zip(outputs, targets)).backward()
            if loop == "reference":
                for stepper in steppers:
                    stepper.step()
    assert sum(rows.stats["rows_written_back"] for rows in collection.spaces) > 100
    for t, reference in enumerate(references):
        assert torch.equal(reference.weight.detach(), collection.weight(t)), t
    plain = nn.Module()
    plain.embedding_bags = nn.ModuleList(nn.EmbeddingBag(*shape) for shape in shapes)
    plain.load_state_dict(collection.state_dict(), strict=False)  # (the optimizer state: no place in it)
    assert torch.equal(plain.embedding_bags[3].weight, references[3].weight)


@pytest.mark.parametrize("optimizer, policy, slices", [("adagrad", "lookahead", 1), ("sgd", "lru", 1),
                                                       ("adam", "lfu", 2), ("adam", "lookahead", 2)])
def test_cached_tables_train_a_model_as_the_reference_does(small_binary, optimizer, policy, slices):
    from bagpipe.config import ModelConfig, TrainConfig
    from bagpipe.data.batches import iterate_batches
    from bagpipe.data.binary import open_dataset
    from bagpipe.train.reference import build_model, build_tables, train_step

    split = open_dataset(small_binary).train
    config = TrainConfig(data="-", run_dir="-", optimizer=optimizer, lr=0.05, seed=7,
                         model=ModelConfig(emb_dim=8, arch_mlp_bot="13-16-8", arch_mlp_top="16-1"))
    batches = list(iterate_batches(split, batch_size=64, iterations=50))
    results = []
    for cached in (False, True):
        model, tables = build_model(config, split.schema), build_tables(config, split.schema)
        dense_optimizer = tables.optimizer.dense_optimizer(model.parameters())
        loop = batches
        if cached:
            tables = CachedTables.over(tables, cache_rows=tables.layout.split_cache(500, batch_size=64),
                                  policy="lru" if policy == "lookahead" else policy)
            loop = Lookahead(batches, tables, ids=lambda batch: batch.ids, lookahead=8) if policy == "lookahead" \
                else batches
        for iteration, batch in enumerate(loop):
            train_step(model, tables, dense_optimizer, batch, slices=slices, seed=config.seed, iteration=iteration)
        results.append(([tables.table(t).clone() for t in range(split.num_tables)], model.state_dict()))
    stats = tables.cache_stats()
    assert stats["rows_written_back"] > 0 and stats["rows_fetched"] > sum(stats["cache_rows"])  # evicted, refetched
    for want, got in zip(results[0][0], results[1][0], strict=True):
        assert torch.equal(want, got)
    for name, value in results[0][1].items():
        assert torch.equal(results[1][1][name], value), name


def test_key_table_agrees_with_a_dict_through_inserts_removals_and_rebuilds():
    rng = np.random.default_rng(4)
    table, reference = KeyTable(300), {}
    for round_ in range(400):
        absent = np.setdiff1d(rng.integers(0, 10_000, 40), np.fromiter(reference, dtype=np.int64, count=len(reference)))
        absent = absent[:max(0, 300 - len(reference))]
        table.insert(absent, absent * 7 + round_)
        reference.update(zip(absent.tolist(), (absent * 7 + round_).tolist()))
        if reference and round_ % 2:
            gone = rng.choice(np.fromiter(reference, dtype=np.int64), min(len(reference), 35), replace=False)
            table.remove(gone)
            for key in gone.tolist():
                del reference[key]
        probe = rng.integers(0, 10_000, 200)
        assert table.get(probe).tolist() == [reference.get(k, -1) for k in probe.tolist()]
        assert table.live == len(reference)
    assert table.gone <= len(table.keys) // 4  # rebuilt along the way


def test_slot_index_takes_online_admissions_after_planned_moves():
    index = SlotIndex(6, policy="lru", cleanup_fraction=0.0)
    index.move(evict_keys=np.zeros(0, dtype=np.int64), evict_slots=np.zeros(0, dtype=np.int64),
               fetch_keys=np.array([10, 11, 12]), fetch_slots=np.array([5, 0, 3]))
    admission = index.admit(np.array([11, 20, 21, 22]))
    assert admission.evict_keys.tolist() == [] and sorted(admission.fetch_slots.tolist()) == [1, 2, 4]
    admission = index.admit(np.array([30]))
    assert admission.evict_keys.tolist() in ([10], [12])  # the least recently used: planned, never looked up
    with pytest.raises(ValueError, match="used outside the plan"):
        index.move(evict_keys=np.array([11]), evict_slots=np.array([5]), fetch_keys=np.zeros(0, dtype=np.int64),
                   fetch_slots=np.zeros(0, dtype=np.int64))


@pytest.mark.parametrize("policy, optimizer, storage", [("lookahead", "adagrad", "memory"), ("lru", "adam", "memory"),
                                                      ("lookahead", "adam", "disk")])
def test_the_cached_dlrm_example_ends_where_the_plain_loop_does(tmp_path, policy, optimizer, storage):
    import importlib.util

    path = REPO / "examples" / "cached_dlrm.py"
    spec = importlib.util.spec_from_file_location("cached_dlrm", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    common = ["--rows-per-table", "2000", "--cache-rows", "3000", "--batch-size", "128", "--iterations", "30",
              "--optimizer", optimizer, "--policy", policy]
    on_disk = ["--storage", "disk", "--storage-dir", str(tmp_path / "tables"), "--storage-budget-mb", "0.5"]
    cached = example.main([*common, "--embeddings", "cached", "--save", str(tmp_path / "cached.pt"),
                           *(on_disk if storage == "disk" else [])])
    example.main([*common, "--embeddings", "plain", "--save", str(tmp_path / "plain.pt")])
    assert cached["hit_rate"] < 0.95  # 3,000 of 52,000 rows cached: rows came and went
    ours, theirs = (torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in ("cached", "plain"))
    assert ours["dense"].keys() == theirs["dense"].keys()
    extra = set(ours["embeddings"]) - set(theirs["embeddings"])  # the cached tables' optimizer state besides
    assert set(theirs["embeddings"]) <= set(ours["embeddings"]) and all(k.endswith(".optimizer_state") for k in extra)
    for part in ("dense", "embeddings"):
        for name, value in theirs[part].items():
            assert torch.equal(ours[part][name], value), name


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_warm_up_preloads_the_hottest_rows_and_training_stays_exact(policy):
    batches = zipf_batches(30, skew=1.2)
    reference, reference_optimizer, cached = module_pair("adagrad", cache_rows=80, policy=policy)
    _, _, cold = module_pair("adagrad", cache_rows=80, policy=policy)
    sample = torch.cat([ids for ids, _, _ in batches[:10]])
    assert cached.warm_up(sample, fraction=0.5) == 40
    counts = np.bincount(sample.numpy(), minlength=NUM_ROWS)
    preloaded, _ = cached.rows.index.resident()
    assert counts[preloaded].min() >= np.sort(counts)[-40]  # the 40 most counted rows (ties aside)
    for ids, offsets, target in batches:
        reference_optimizer.zero_grad()
        squared_loss(reference(ids, offsets), target).backward()
        reference_optimizer.step()
        for module in (cached, cold):
            squared_loss(module(ids, offsets), target).backward()
    assert torch.equal(reference.weight.detach(), cached.weight)
    assert cached.rows.stats["rows_preloaded"] == 40
    assert cached.rows.stats["rows_fetched"] < cold.rows.stats["rows_fetched"]


def test_cached_tables_look_up_an_unplanned_batch_as_the_reference_does(small_binary):
    from bagpipe.config import ModelConfig, TrainConfig
    from bagpipe.data.batches import iterate_batches
    from bagpipe.data.binary import open_dataset
    from bagpipe.train.reference import build_tables

    split = open_dataset(small_binary).train
    config = TrainConfig(data="-", run_dir="-", seed=3, model=ModelConfig(emb_dim=8, arch_mlp_bot="13-16-8",
                                                                            arch_mlp_top="16-1"))
    batches = list(iterate_batches(split, batch_size=32, iterations=3))
    reference = build_tables(config, split.schema)
    tables = CachedTables.over(build_tables(config, split.schema), cache_rows=reference.layout.split_cache(800, batch_size=32))
    loop = iter(Lookahead(batches, tables, ids=lambda batch: batch.ids, lookahead=2))
    planned = next(loop)
    for ids in (planned.ids, planned.ids[:5], batches[1].ids):  # the planned batch, a part of it, another one
        (want, want_lookups), (got, got_lookups) = reference.lookup(ids), tables.lookup(ids)
        assert all(torch.equal(a, b) for a, b in zip(want.spaces, got.spaces))
        assert [len(lookup.index) for lookup in want_lookups] == [len(lookup.index) for lookup in got_lookups]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_an_lr_scheduler_drives_the_fused_optimizer_as_it_drives_rowwise_bit_for_bit(optimizer):
    """The table's learning rate is a param group: a StepLR over FusedOptimizer changes the rate the rows step
    with from the next backward on, as the same StepLR over the reference's RowWise does, so both end equal."""
    from bagpipe.nn import FusedOptimizer

    reference, reference_optimizer, cached = module_pair(optimizer, cache_rows=40)
    fused = FusedOptimizer(nn.Sequential(nn.Identity(), cached))  # (found inside a model)
    assert [(g["name"], g["lr"]) for g in fused.param_groups] == [(optimizer, 0.05)]
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.1) for o in (reference_optimizer, fused)]
    for ids, offsets, target in zipf_batches(10):
        squared_loss(reference(ids, offsets), target).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        squared_loss(cached(ids, offsets), target).backward()
        fused.step()
        for schedule in schedules:
            schedule.step()
    assert fused.param_groups[0]["lr"] == pytest.approx(0.05 * 0.1 ** 3)
    assert torch.equal(reference.weight.detach(), cached.weight)
    unscheduled, unscheduled_optimizer, _ = module_pair(optimizer, cache_rows=40)  # (and the rate did change the end)
    for ids, offsets, target in zipf_batches(10):
        squared_loss(unscheduled(ids, offsets), target).backward()
        unscheduled_optimizer.step()
        unscheduled_optimizer.zero_grad()
    assert not torch.equal(unscheduled.weight.detach(), cached.weight)


def test_the_fused_optimizer_saves_and_loads_its_rate_and_refuses_a_model_without_tables():
    from bagpipe.nn import FusedOptimizer

    _, _, cached = module_pair("adam", cache_rows=40)
    fused = FusedOptimizer(cached)
    fused.param_groups[0]["lr"] = 0.01
    again = FusedOptimizer(cached)  # (takes the module's rate over from now on)
    again.load_state_dict(fused.state_dict())
    assert again.param_groups[0]["lr"] == 0.01 and cached.rows.lr_of() == 0.01
    ids, offsets, target = zipf_batches(1)[0]
    squared_loss(cached(ids, offsets), target).backward()
    assert cached.rows.optimizer.lr == 0.01
    with pytest.raises(ValueError, match="no cached tables"):
        FusedOptimizer(nn.Linear(2, 2))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_cached_embedding_equals_nn_embedding_stepped_by_rowwise(optimizer):
    """nn.Embedding's counterpart: ids of any shape (repeats, across evictions) give the same rows, and the rows
    stepped in backward end equal to nn.Embedding(sparse=True) + RowWise."""
    from bagpipe.nn import CachedEmbedding

    weight = torch.randn(NUM_ROWS, DIM, generator=torch.Generator().manual_seed(4))
    reference = nn.Embedding(NUM_ROWS, DIM, sparse=True, _weight=weight.clone())
    reference_optimizer = RowWise(reference.parameters(), make_row_optimizer(optimizer, lr=0.05))
    cached = CachedEmbedding(NUM_ROWS, DIM, cache_rows=60, optimizer=optimizer, lr=0.05, _weight=weight.clone())
    generator = torch.Generator().manual_seed(5)
    for _ in range(12):
        ids = torch.randint(0, NUM_ROWS, (8, 3, 2), generator=generator)
        target = torch.randn(8, 3, 2, DIM, generator=generator)
        expected, got = reference(ids), cached(ids)
        assert got.shape == (8, 3, 2, DIM) and torch.equal(expected, got)
        squared_loss(expected, target).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        squared_loss(got, target).backward()
    assert cached.rows.stats["rows_written_back"] > 0  # (rows were evicted and fetched again)
    assert torch.equal(reference.weight.detach(), cached.weight)
    with pytest.raises(ValueError, match="padding_idx"):
        CachedEmbedding(NUM_ROWS, DIM, cache_rows=60, optimizer="sgd", padding_idx=0)


def test_a_model_with_cached_tables_reloads_strictly_into_its_plain_twin():
    """The export-and-reload recipe (docs/nn.md): a model trained with cached tables, saved, loads with
    strict=True into the same model with nn.EmbeddingBag/nn.Embedding in their places once the tables'
    optimizer state is left out, and computes the same outputs."""
    import io

    from bagpipe.nn import CachedEmbedding, without_optimizer_state

    def model(bag, emb):
        return nn.ModuleDict({"bag": bag, "emb": emb, "head": nn.Linear(DIM, 1)})

    cached = model(CachedEmbeddingBag(NUM_ROWS, DIM, cache_rows=40, mode="sum", optimizer="adam", lr=0.05),
                   CachedEmbedding(NUM_ROWS, DIM, cache_rows=40, optimizer="adagrad", lr=0.05))
    for ids, offsets, target in zipf_batches(6):
        out = cached["head"](cached["bag"](ids, offsets) + cached["emb"](ids[offsets]))
        ((out.squeeze(1) - target.sum(1)) ** 2).sum().backward()
    buffer = io.BytesIO()
    torch.save(cached.state_dict(), buffer)  # as a user saves a model
    buffer.seek(0)
    saved = torch.load(buffer)
    assert {k for k in saved if k.endswith("optimizer_state")} == {"bag.optimizer_state", "emb.optimizer_state"}
    plain = model(nn.EmbeddingBag(NUM_ROWS, DIM, mode="sum"), nn.Embedding(NUM_ROWS, DIM))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        plain.load_state_dict(saved)
    plain.load_state_dict(without_optimizer_state(saved), strict=True)
    ids, offsets, _ = zipf_batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(plain["head"](plain["bag"](ids, offsets) + plain["emb"](ids[offsets])),
                           cached["head"](cached["bag"](ids, offsets) + cached["emb"](ids[offsets])))
