"""The disk tier: a store on disk answers every fetch, write-back, snapshot and restore exactly as the
memory tier does, whatever its DRAM cache evicts, and its process holds no more than its budget."""


import numpy as np
import pytest
import torch

from bagpipe.optim import make_row_optimizer
from bagpipe.storage import RowStore, StorageSpec
from bagpipe.storage.disk import SLOT_OVERHEAD_BYTES
from helpers.jobs import job_config
from helpers.layouts import layout_of

TABLES = [1000, 37, 2500]


def layout():
    return layout_of(TABLES, 8)


def pair(tmp_path, *, optimizer: str, budget_bytes: int, shard: int = 1, num_shards: int = 3):
    """A memory store and a disk store of the same shard."""
    opt = make_row_optimizer(optimizer, lr=0.1)
    kwargs = dict(layout=layout(), space=0, optimizer=opt, seed=7, shard=shard, num_shards=num_shards)
    return (RowStore(**kwargs),
            RowStore(**kwargs, storage=StorageSpec("disk", tmp_path / "storage", budget_bytes)))


def owned_keys(store: RowStore) -> np.ndarray:
    return np.arange(store.num_rows, dtype=np.int64) * store.num_shards + store.shard


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_a_disk_store_answers_as_the_memory_store_through_evictions(tmp_path, optimizer):
    record = 4 * (8 + make_row_optimizer(optimizer, lr=0.1).state_width(8) + 1)
    memory, disk = pair(tmp_path, optimizer=optimizer, budget_bytes=64 * (record + SLOT_OVERHEAD_BYTES))
    assert disk.rows.capacity == 64  # a cache far smaller than the shard: evictions on every step
    assert memory.num_rows == disk.num_rows > 4 * 64
    assert torch.equal(memory.all_weights(), disk.all_weights())
    keys = owned_keys(memory)
    rng = np.random.default_rng(0)
    width = memory.state_width
    for version in range(40):
        chosen = rng.choice(keys, size=int(rng.integers(1, 150)), replace=False)
        have_m, have_d = memory.fetch(chosen, np.full(len(chosen), -1), timeout=1), \
            disk.fetch(chosen, np.full(len(chosen), -1), timeout=1)
        assert all(torch.equal(a, b) for a, b in zip(have_m, have_d))
        rows, state = torch.randn(len(chosen), 8), torch.randn(len(chosen), width)
        for store in (memory, disk):
            store.write_back(chosen, rows, state, version=version)
    assert disk.rows.rows_written > 0 and disk.rows.rows_read > 0  # the file was used, not only the cache
    for store in (memory, disk):
        store.begin_snapshot(40, expected_rows=0, since=None)
    snaps = [list(store.snapshot_chunks(timeout=1, chunk_rows=100)) for store in (memory, disk)]
    for (lm, rm, sm), (ld, rd, sd) in zip(*snaps):
        assert np.array_equal(lm, ld) and np.array_equal(rm, rd) and np.array_equal(sm, sd)
    disk.close()


def test_a_fetch_waits_for_its_write_back_on_disk_too(tmp_path):
    _, disk = pair(tmp_path, optimizer="adagrad", budget_bytes=1 << 20)
    key = owned_keys(disk)[5:6]
    future = disk.fetch_async(key, np.array([3]))
    assert not future.done()
    disk.write_back(key, torch.full((1, 8), 2.0), torch.full((1, 1), 4.0), version=2)
    assert not future.done()  # version 2 is not the 3 it waits for
    disk.write_back(key, torch.full((1, 8), 3.0), torch.full((1, 1), 9.0), version=3)
    rows, state, versions = future.wait()
    assert rows[0, 0] == 3.0 and state[0, 0] == 9.0 and versions.tolist() == [3]
    disk.close()


def test_snapshots_keep_the_pre_boundary_rows_on_disk(tmp_path):
    memory, disk = pair(tmp_path, optimizer="sgd", budget_bytes=1 << 20)
    keys = owned_keys(memory)[:10]
    for store in (memory, disk):
        store.write_back(keys, torch.ones(10, 8), torch.zeros(10, 0), version=4)
        store.begin_snapshot(5, expected_rows=10, since=4)
        store.write_back(keys[:3], torch.full((3, 8), 7.0), torch.zeros(3, 0), version=5)  # after the boundary
    (local_m, rows_m, _), = list(memory.snapshot_chunks(timeout=1))
    (local_d, rows_d, _), = list(disk.snapshot_chunks(timeout=1))
    assert np.array_equal(local_m, local_d) and np.array_equal(rows_m, rows_d)
    assert (rows_d == 1.0).all() and len(local_d) == 10  # the delta since 4, as of the boundary
    disk.close()


def test_restore_and_close_on_disk(tmp_path):
    _, disk = pair(tmp_path, optimizer="adagrad", budget_bytes=1 << 20)
    disk.restore(np.array([0, 2]), np.full((2, 8), 5.0, dtype=np.float32), np.full((2, 1), 6.0, dtype=np.float32),
                 version=9)
    rows, state = disk.fetch(owned_keys(disk)[[0, 2]], np.array([9, 9]), timeout=1)
    assert (rows == 5.0).all() and (state == 6.0).all()
    path = disk.rows.path
    assert path.stat().st_size == disk.num_rows * disk.rows.record_bytes  # fixed-size records
    disk.close()
    assert not path.exists()


def test_the_memory_check_counts_the_servers_budgets_on_disk_and_the_disk_its_free_space(small_binary, tmp_path,
                                                                                      monkeypatch):
    """A job whose tables exceed the memory runs on the disk tier (its servers, or --mode single's one
    process, hold their budgets); the disk tier is refused when the files cannot fit in --storage-dir's free
    space."""
    import shutil as shutil_module
    from collections import namedtuple

    from bagpipe import preflight
    from bagpipe.data.binary import open_dataset

    dataset = open_dataset(small_binary)
    memory = job_config(small_binary, tmp_path / "run")
    layout = preflight.job_layout(memory, dataset)
    tables = preflight.table_bytes(memory, layout)
    planner = preflight.planner_bytes(layout, dataset, lookahead=memory.lookahead, batch_size=memory.batch_size)
    monkeypatch.setattr(preflight, "physical_memory_bytes", lambda: planner + tables // 2)
    with pytest.raises(ValueError, match=r"more than this machine's .*keep the tables on disk \(--storage disk\)"):
        preflight.check_memory(memory, dataset)
    on_disk = job_config(small_binary, tmp_path / "run", storage="disk", storage_budget_mb=tables / 8 / 2**20)
    preflight.check_memory(on_disk, dataset)  # two servers' budgets: a quarter of the tables
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"a_file is not a directory"):
        preflight.check_memory(job_config(small_binary, tmp_path / "run", storage="disk",
                                          storage_dir=str(tmp_path / "a_file" / "sub")), dataset)
    # --mode single on disk: one process holds one budget (and the planner's arrays, with lookahead)
    from dataclasses import replace
    preflight.check_memory(replace(on_disk, mode="single", storage_budget_mb=tables / 4 / 2**20), dataset)
    with pytest.raises(ValueError, match=r"the storage budgets .*; lower --storage-budget-mb"):
        preflight.check_memory(replace(on_disk, mode="single", storage_budget_mb=tables / 2**20), dataset)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: usage(10**12, 0, 1000))
    with pytest.raises(ValueError, match=r"--storage disk: the tables' files need .* which has .* free"):
        preflight.check_memory(on_disk, dataset)
