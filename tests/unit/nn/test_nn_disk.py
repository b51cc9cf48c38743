"""bagpipe.nn's modules with their full tables on disk (storage="disk": storage.DiskRows behind a DRAM budget):
the same training as nn.EmbeddingBag bit for bit, whatever the device cache and the DRAM cache evict, and a
process that holds the caches, not the table."""


import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from bagpipe.nn import CachedEmbeddingBag, CachedEmbeddingBagCollection, Lookahead
from bagpipe.nn.host import HostTable, host_table
from bagpipe.storage.disk import DiskRows
from bagpipe.storage.memory import MemoryRows
from bagpipe.optim import RowWise, make_row_optimizer
from bagpipe.storage import StorageSpec
from helpers.nn_pairs import DIM, NUM_ROWS, module_pair, squared_loss, zipf_batches


def _disk(tmp_path: Path, *, budget_rows: int = 20) -> StorageSpec:
    """A DRAM cache of about ``budget_rows`` rows (Adam's records): far fewer than the rows that come and go."""
    return StorageSpec("disk", tmp_path, budget_rows * 100)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("policy", ["lru", "lookahead-prefetch"])
def test_training_on_disk_equals_the_reference_bit_for_bit(tmp_path, optimizer, policy):
    batches = zipf_batches(40)
    reference, reference_optimizer, cached = module_pair(optimizer, cache_rows=60, storage=_disk(tmp_path))
    assert isinstance(cached.rows.host.tier, DiskRows) and cached.rows.host.path.parent == tmp_path
    for ids, offsets, target in batches:
        reference_optimizer.zero_grad()
        squared_loss(reference(ids, offsets), target).backward()
        reference_optimizer.step()
    loop = Lookahead(batches, cached, lookahead=8, prefetch=True) if policy != "lru" else batches
    for ids, offsets, target in loop:
        squared_loss(cached(ids, offsets), target).backward()
    disk = cached.rows.host.stats()
    assert cached.rows.stats["rows_written_back"] > 3 * cached.rows.index.capacity
    assert disk["disk_rows_written"] > 100 and disk["disk_rows_read"] > 100  # the file, not only its DRAM cache
    assert torch.equal(reference.weight.detach(), cached.weight)
    if optimizer != "sgd":
        assert torch.equal(reference_optimizer.state[reference.weight]["rows"], cached.rows.host.rows(0, NUM_ROWS)[1])


def test_a_row_evicted_between_forward_and_backward_is_stepped_on_disk(tmp_path):
    weight = torch.randn(NUM_ROWS, DIM)
    reference = nn.EmbeddingBag(NUM_ROWS, DIM, mode="sum", sparse=True, _weight=weight.clone())
    stepper = RowWise(reference.parameters(), make_row_optimizer("adam", lr=0.1))
    cached = CachedEmbeddingBag(NUM_ROWS, DIM, cache_rows=4, mode="sum", optimizer="adam", lr=0.1,
                                _weight=weight.clone(), storage=_disk(tmp_path, budget_rows=0))
    first, second = torch.tensor([[0, 1, 2, 3]]), torch.tensor([[4, 5, 6, 7]])
    (cached(first).sum() + 2 * cached(second).sum()).backward()  # the second evicts the first's rows
    (reference(first).sum() + 2 * reference(second).sum()).backward()
    stepper.step()
    assert torch.equal(reference.weight.detach(), cached.weight)


def test_a_collection_on_disk_equals_one_in_memory(tmp_path):
    shapes = [(50, 4), (300, 8), (20, 4), (100, 8)]
    generator = torch.Generator().manual_seed(4)
    weights = [torch.randn(*shape, generator=generator) for shape in shapes]
    modules = [CachedEmbeddingBagCollection(shapes, cache_rows=[40, 60], optimizer="adam", lr=0.05, weights=weights,
                                            storage=storage) for storage in ("memory", _disk(tmp_path))]
    for _ in range(25):
        inputs = [torch.randint(0, rows, (8, 2), generator=generator) for rows, _ in shapes]
        targets = [torch.randn(8, dim, generator=generator) for _, dim in shapes]
        for module in modules:
            sum(squared_loss(out, target) for out, target in zip(module(inputs), targets)).backward()
    memory, disk = modules
    assert [type(rows.host.tier) for rows in disk.spaces] == [DiskRows, DiskRows]
    assert sum(rows.stats["rows_written_back"] for rows in disk.spaces) > 100
    assert sum(rows.host.stats()["disk_rows_read"] for rows in disk.spaces) > 50
    for t in range(len(shapes)):
        assert torch.equal(memory.weight(t), disk.weight(t)), t
    assert all(torch.equal(m.host.rows(0, m.num_rows)[1], d.host.rows(0, d.num_rows)[1])
               for m, d in zip(memory.spaces, disk.spaces))


def test_the_file_is_the_modules_and_goes_with_it(tmp_path):
    cached = CachedEmbeddingBag(1000, 8, cache_rows=10, optimizer="sgd", storage=StorageSpec("disk", tmp_path / "tables", 1 << 16))
    path = cached.rows.host.path
    assert path.exists() and path.parent == tmp_path / "tables"
    assert cached.weight.shape == (1000, 8) and float(cached.weight.std()) == pytest.approx(1.0, abs=0.05)
    del cached
    gc.collect()
    assert not path.exists()
    with pytest.raises(ValueError, match="storage must be one of memory, disk"):
        CachedEmbeddingBag(10, 2, cache_rows=4, optimizer="sgd", storage="ssd")


def test_a_memory_table_and_a_disk_table_answer_alike(tmp_path):
    """The two host tiers under random reads, writes, steps and whole-range reads and writes."""
    rng = np.random.default_rng(0)
    optimizer = make_row_optimizer("adam", lr=0.1)
    width = optimizer.state_width(3)
    initial = torch.from_numpy(rng.standard_normal((500, 3)).astype(np.float32))
    memory = HostTable(MemoryRows(initial.clone(), state_width=width, versioned=False))
    disk = host_table(StorageSpec("disk", tmp_path, 30 * 80), num_rows=500, dim=3, state_width=width,
                      blocks=[initial[:123], initial[123:]])
    for step in range(200):
        keys = np.unique(rng.integers(0, 500, 40))
        kind = step % 4
        if kind == 0:
            rows = torch.from_numpy(rng.standard_normal((len(keys), 3)).astype(np.float32))
            state = torch.from_numpy(rng.random((len(keys), width)).astype(np.float32))  # Adam's: non-negative
            for table in (memory, disk):
                table.write(keys, rows, state)
        elif kind == 1:
            grads = torch.from_numpy(rng.standard_normal((len(keys), 3)).astype(np.float32))
            for table in (memory, disk):
                table.step(optimizer, keys, grads)
        elif kind == 2:
            assert all(torch.equal(a, b) for a, b in zip(memory.read(keys), disk.read(keys)))
        else:
            start = int(rng.integers(0, 400))
            rows = torch.from_numpy(rng.standard_normal((50, 3)).astype(np.float32))
            for table in (memory, disk):
                table.set_rows(start, rows)
    assert all(torch.equal(a, b) for a, b in zip(memory.rows(0, 500), disk.rows(0, 500)))
    with pytest.raises(ValueError, match="hold 10 rows, the table 20"):
        host_table(StorageSpec("disk", tmp_path, 0), num_rows=20, dim=3, state_width=0, blocks=[torch.zeros(10, 3)])
    disk.close()
    assert list(tmp_path.iterdir()) == []


def test_a_host_table_is_closed_for_good_and_leaves_no_file_behind(tmp_path):
    """Closing a table deletes its file and ends its use (a late read-ahead must not read a reused descriptor); a
    table in memory given a directory, or one whose opening fails, leaves no file there; rows set from another
    dtype are set a block at a time."""
    disk = host_table(StorageSpec("disk", tmp_path, 1 << 12), num_rows=20_000, dim=2, state_width=0,
                      blocks=[torch.zeros(20_000, 2)])
    disk.set_rows(5, torch.arange(40_000, dtype=torch.float64).view(20_000, 2)[:19_995])
    assert disk.read(np.array([4, 5, 19_999]))[0].tolist() == [[0.0, 0.0], [0.0, 1.0], [39_988.0, 39_989.0]]
    disk.close()
    disk.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="this table is closed"):
        disk.read(np.array([0]))
    memory = host_table(StorageSpec("memory"), num_rows=3, dim=2, state_width=0, blocks=[torch.zeros(3, 2)])
    assert memory.path is None and memory.views
    with pytest.raises(ValueError, match="zero optimizer state"):
        host_table(StorageSpec("disk", tmp_path, 0), num_rows=3, dim=2, state_width=1, blocks=[torch.zeros(3, 2)],
                   state=torch.zeros(3, 1))
    assert list(tmp_path.iterdir()) == []
