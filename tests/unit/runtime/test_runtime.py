"""The distributed runtime (oracle, servers, trainers as processes) against the reference trainer."""


import dataclasses
import time
from pathlib import Path

import pytest
import torch

from bagpipe.config import ModelConfig
from bagpipe.runtime.launch import launch_local
from bagpipe.runtime.world import free_port
from helpers.jobs import job_config, reference_of


def test_a_reference_is_trained_once_per_configuration(small_binary, tmp_path):
    """The session's cache of references: a configuration that differs only in where the job runs gets the first
    one's run dir and export; one that differs in what is trained gets its own."""
    config = job_config(small_binary, tmp_path / "job", iterations=6)
    first = reference_of(config, tmp_path / "first")
    again = reference_of(dataclasses.replace(config, servers=4, parity=3, timeout=5.0), tmp_path / "again")
    assert again is first and (tmp_path / "again" / "summary.json").read_text() == (
        tmp_path / "first" / "summary.json").read_text()
    other = reference_of(dataclasses.replace(config, lr=0.1), tmp_path / "other")
    assert other is not first and not torch.equal(other["embeddings"][0], first["embeddings"][0])


def test_cache_smaller_than_a_batch_is_refused_before_any_role_starts(small_binary, tmp_path):
    config = job_config(small_binary, tmp_path / "run", cache_rows=50)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"batch 0 touches \d+ distinct rows, more than the cache's 50"):
        launch_local(config, show_progress=False)
    assert time.monotonic() - started < 10
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, message", [
    ({"batch_size": 100_000}, "batch_size 100000 exceeds the 40000 training rows"),
    ({"model": ModelConfig(emb_dim=8, arch_mlp_bot="7-16-8", arch_mlp_top="16-1")}, "arch_mlp_bot starts with 7 inputs"),
])
def test_a_job_that_cannot_run_is_refused_before_any_role_starts(small_binary, tmp_path, overrides, message):
    config = job_config(small_binary, tmp_path / "run", **overrides)
    with pytest.raises(ValueError, match=message):
        launch_local(config, show_progress=False)
    assert not (tmp_path / "run").exists()


def test_a_partitioned_cache_smaller_than_a_slice_is_refused_naming_the_trainer(small_binary, tmp_path):
    """With the partitioned cache a trainer's cache holds its slice's rows only: a slice that does not fit is
    refused before any role starts, and one that fits is not, though the whole batch would not."""
    from bagpipe.data.binary import open_dataset
    from bagpipe.preflight import check_cache

    config = job_config(small_binary, tmp_path / "run", cache_mode="partitioned", cache_rows=350)
    with pytest.raises(ValueError, match="trainer 0's slice of batch 0 touches 486 distinct rows, more than the "
                                         "cache's 350"):
        launch_local(config, show_progress=False)
    assert not (tmp_path / "run").exists()
    fits = dataclasses.replace(config, cache_rows=560)
    check_cache(fits, open_dataset(small_binary))  # a slice's rows fit
    with pytest.raises(ValueError, match=r"^batch 0 touches \d+ distinct rows"):  # a whole batch's do not
        check_cache(dataclasses.replace(fits, cache_mode="replicated"), open_dataset(small_binary))


@pytest.mark.parametrize("cache_mode", ["replicated", "partitioned"])
def test_a_refused_cache_names_the_smallest_cache_rows_that_every_batch_fits(small_binary, tmp_path, cache_mode):
    """Not only "raise cache_rows": by how much. The value named fits every batch, and one row fewer does not."""
    import re

    from bagpipe.data.binary import open_dataset
    from bagpipe.preflight import check_cache

    dataset = open_dataset(small_binary)
    config = job_config(small_binary, tmp_path / "run", cache_mode=cache_mode, cache_rows=300, iterations=40)
    with pytest.raises(ValueError, match="the smallest --cache-rows that every batch fits is") as refused:
        check_cache(config, dataset)
    smallest = int(re.search(r"fits is ([\d,]+)", str(refused.value)).group(1).replace(",", ""))
    assert smallest > 300
    check_cache(dataclasses.replace(config, cache_rows=smallest), dataset)
    with pytest.raises(ValueError, match="more than the cache's"):
        check_cache(dataclasses.replace(config, cache_rows=smallest - 1), dataset)


def test_a_cache_that_holds_every_row_gets_a_warning(small_binary):
    from bagpipe.data.binary import open_dataset
    from bagpipe.preflight import cache_warnings

    dataset = open_dataset(small_binary)
    total = sum(dataset.table_sizes)
    assert cache_warnings(job_config(small_binary, "r", cache_rows=total), dataset)[0].startswith(
        f"--cache-rows {total} holds all {total} rows")
    assert cache_warnings(job_config(small_binary, "r", cache_rows=total - 1), dataset) == []
    # the partitioned cache without checkpoints: a lost trainer ends the job, and the user is told so at start
    partitioned = job_config(small_binary, "r", cache_mode="partitioned")
    assert cache_warnings(partitioned, dataset) == [
        "--cache-mode partitioned does not replace a lost trainer (the rows only it held are lost with it): without "
        "checkpoints and --max-restarts such a loss ends the job; --checkpoint-every N lets it restart from the "
        "newest checkpoint"]
    assert cache_warnings(dataclasses.replace(partitioned, checkpoint_every=10), dataset) == []


def test_a_loopback_master_store_listens_on_loopback_only():
    from datetime import timedelta

    from bagpipe.runtime.world import World, _host_store

    port = free_port()
    store = _host_store(World(rank=0, world_size=3, num_trainers=1, master_port=port), timedelta(seconds=5))
    hex_port = f":{port:04X}"
    listening = [line.split()[1] for name in ("/proc/net/tcp", "/proc/net/tcp6") if Path(name).exists()
                 for line in Path(name).read_text().splitlines()[1:]
                 if line.split()[3] == "0A" and line.split()[1].endswith(hex_port)]  # 0A: LISTEN
    assert listening == [f"0100007F{hex_port}"]  # 127.0.0.1, and no wildcard socket
    del store


def test_a_torch_outside_the_supported_range_is_refused_naming_it():
    from bagpipe.runtime.transport import SUPPORTED_TORCH, check_torch

    check_torch()  # this one's
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_TORCH
    check_torch(f"{high_major}.{high_minor}.1+cu130")
    for outside in (f"{low_major}.{low_minor - 1}.0", f"{high_major}.{high_minor + 1}.0a0"):
        with pytest.raises(RuntimeError, match=rf"supports torch {low_major}.{low_minor} to {high_major}.{high_minor}, "
                                               rf"this is torch {outside}: install torch>="):
            check_torch(outside)


def test_a_process_listens_where_it_reaches_the_master_from():
    from bagpipe.runtime.world import World, reach

    assert reach("127.0.0.1") == ("127.0.0.1", "lo")
    assert reach("localhost")[1] == "lo"
    assert World(rank=1, world_size=3, num_trainers=1).interface == "lo"
    assert reach("no-such-host.invalid") == (None, None)  # the libraries' own choice then


def test_a_rank_started_again_at_once_waits_for_its_loss_to_be_told_and_a_live_holders_is_refused():
    import threading

    import torch.distributed as dist

    from bagpipe.runtime.names import BEAT_PREFIX, REPLACE_PREFIX
    from bagpipe.runtime.world import World, _claim

    world = World(rank=2, world_size=4, num_trainers=2)
    store = dist.HashStore()
    assert _claim(world, store, wait_s=5.0) == 0  # the first process of rank 2
    store.add(f"{BEAT_PREFIX}2", 1)
    # started again by hand while the loss is not yet told (its heartbeat silent): waits, then joins as the replacement
    threading.Timer(0.6, lambda: store.set(f"{REPLACE_PREFIX}2", "3")).start()
    started = time.monotonic()
    assert _claim(world, store, wait_s=5.0) == 3
    assert 0.5 < time.monotonic() - started < 3.0
    store.delete_key(f"{REPLACE_PREFIX}2")
    # a second process given the same --worker-id while the first still beats: refused within a beat, not the wait
    beating = threading.Timer(0.5, lambda: store.add(f"{BEAT_PREFIX}2", 1))
    beating.start()
    started = time.monotonic()
    with pytest.raises(ValueError, match="is already taken by another process of this job"):
        _claim(world, store, wait_s=20.0)
    assert time.monotonic() - started < 3.0
    # and where nobody asks for a replacement, refused after the wait
    with pytest.raises(ValueError, match="is already taken"):
        _claim(world, store, wait_s=0.5)
