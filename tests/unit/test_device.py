"""bagpipe.device: the device specs accepted and refused, and HostStaging's reused buffers (on CPU always, on
CUDA where there is one)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from bagpipe.cache import INDEX_SLOTS, RowCache
from bagpipe.device import HostStaging, resolve_device
from bagpipe.nn import CachedEmbeddingBag, Lookahead
from bagpipe.optim import make_row_optimizer
from bagpipe.synth import zipf_bags

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cpu_and_none_resolve_to_the_cpu():
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_a_gpu_where_cuda_is_not_available_is_refused_naming_auto(spec, monkeypatch):
    """As PyTorch refuses it (issue 46's W4: it trained on the CPU, config.json saying cuda, summary.json cpu)."""
    _no_cuda(monkeypatch)
    with pytest.raises(ValueError, match=rf"--device {spec}: CUDA is not available here .*--device auto"):
        resolve_device(spec)


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_the_originals_flags_fall_back_to_the_cpu_with_a_warning_without_cuda(spec, monkeypatch, caplog):
    """The original system's trainer commands and init_cache say --device cuda:0 and ran on CPU-only machines."""
    _no_cuda(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="bagpipe.device"):
        assert resolve_device(spec, fallback=True) == torch.device("cpu")
    assert f"device {spec} requested but CUDA is not available: running on the CPU" in caplog.text


def test_auto_takes_a_gpu_where_there_is_one_and_the_cpu_elsewhere(monkeypatch, caplog):
    _no_cuda(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="bagpipe.device"):
        assert resolve_device("auto") == torch.device("cpu")
    assert caplog.text == ""  # asked for: no warning
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


@pytest.mark.parametrize("mode", ["reference", "single", "bagpipe"])
def test_train_with_a_gpu_where_there_is_none_is_refused_before_anything_runs(small_binary, tmp_path, monkeypatch,
                                                                              capsys, mode):
    from bagpipe.cli import main

    _no_cuda(monkeypatch)
    code = main(["train", "--data", str(small_binary), "--run-dir", str(tmp_path / "run"), "--mode", mode,
                 "--device", "cuda", "--no-progress"])
    assert code != 0 and "--device cuda: CUDA is not available here" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cuda:", "cuda:-1", "CUDA", "cpu:0", "", "cuda0"])
def test_unknown_specs_are_refused(spec, monkeypatch):
    _no_cuda(monkeypatch)  # refused before any fallback
    with pytest.raises(ValueError, match="expected 'cpu', 'auto', 'cuda' or 'cuda:N'"):
        resolve_device(spec)


def test_cuda_devices_resolve_when_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="cuda:2 requested but this machine has 2 CUDA device"):
        resolve_device("cuda:2")


def test_staged_views_have_the_inputs_shapes_and_contents():
    staging = HostStaging("cpu", pin=False)
    weights, state, ids, empty = torch.randn(7, 5), torch.randn(7, 2), torch.arange(9), torch.empty(7, 0)
    views = staging.stage(weights, state, ids, empty)
    for view, tensor in zip(views, (weights, state, ids, empty)):
        assert view.shape == tensor.shape and view.dtype == tensor.dtype and torch.equal(view, tensor)
        assert view.data_ptr() != tensor.data_ptr() or not tensor.numel()
    assert staging.stats() == {"allocations": 2, "bytes_allocated": (35 + 14) * 4 + 9 * 8,
                               "staged_bytes": (35 + 14) * 4 + 9 * 8}


def test_allocations_stay_bounded_and_grow_only_for_a_bigger_input():
    staging = HostStaging("cpu", pin=False, slots=2)
    generator = torch.Generator().manual_seed(0)
    staging.stage(torch.randn(100, 8), torch.randn(100, 2), torch.arange(100))
    staging.stage(torch.randn(100, 8), torch.randn(100, 2), torch.arange(100))
    assert staging.allocations == 2 * 2  # slots x dtypes
    for _ in range(100):
        rows = int(torch.randint(1, 101, (1,), generator=generator))
        weights, state, ids = torch.randn(rows, 8), torch.randn(rows, 2), torch.arange(rows)
        views = staging.stage(weights, state, ids)
        assert all(torch.equal(view, tensor) for view, tensor in zip(views, (weights, state, ids)))
    assert staging.allocations == 4
    staging.stage(torch.randn(101, 8), torch.randn(101, 2), torch.arange(100))  # more floats, as many ids
    assert staging.allocations == 5
    bytes_before = staging.bytes_allocated
    staging.stage(torch.randn(101, 8), torch.randn(101, 2), torch.arange(100))  # the other slot grows too
    assert staging.allocations == 6
    assert staging.bytes_allocated - bytes_before == 1.5 * 1000 * 4  # geometric growth, x1.5 at least


def test_a_ring_of_two_keeps_the_previous_batch_and_a_ring_of_one_reuses_it():
    first, second = torch.full((4, 3), 1.0), torch.full((4, 3), 2.0)
    ring = HostStaging("cpu", pin=False, slots=2)
    older, = ring.stage(first)
    ring.stage(second)
    assert torch.equal(older, first)
    single = HostStaging("cpu", pin=False, slots=1)
    older, = single.stage(first)
    single.stage(second)
    assert torch.equal(older, second)  # the same buffer, overwritten


def test_to_device_on_the_cpu_returns_the_inputs_without_staging():
    staging = HostStaging("cpu")
    assert not staging.pin
    weights, state = torch.randn(3, 4), torch.randn(3, 1)
    got = staging.to_device(weights, state)
    assert got[0] is weights and got[1] is state
    assert staging.stats() == {"allocations": 0, "bytes_allocated": 0, "staged_bytes": 0}


def test_slots_and_tensors_off_the_cpu_are_refused():
    with pytest.raises(ValueError, match="slots must be at least 1"):
        HostStaging("cpu", slots=0)
    with pytest.raises(ValueError, match="stages CPU tensors"):
        HostStaging("cpu", pin=False).stage(torch.empty(2, device="meta"))


@needs_cuda
def test_to_device_on_cuda_equals_the_inputs_with_bounded_allocations():
    staging = HostStaging("cuda")
    assert staging.pin
    generator = torch.Generator().manual_seed(1)
    side, staged = torch.cuda.Stream(), 0
    for step in range(200):
        rows = int(torch.randint(1, 513, (1,), generator=generator)) if step > 1 else 512  # each slot's biggest
        weights, state = torch.randn(rows, 16, generator=generator), torch.randn(rows, 2, generator=generator)
        stream = side if step % 2 else None
        got = staging.to_device(weights, state, stream=stream)
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        assert all(tensor.is_cuda for tensor in got)
        assert torch.equal(got[0].cpu(), weights) and torch.equal(got[1].cpu(), state)
        staged += rows * 18 * 4
    assert staging.allocations == 2  # slots x dtypes: no allocation per batch
    assert staging.stats() == {"allocations": 2, "bytes_allocated": 2 * 512 * 18 * 4, "staged_bytes": staged}


def _fill_and_churn(cache: RowCache, *, steps: int, seed: int) -> None:
    """Install random rows into free slots, evict some, install again: ``steps`` times."""
    generator, key = torch.Generator().manual_seed(seed), 0
    for _ in range(steps):
        free = [slot for slot in range(cache.capacity) if cache.slot_key[slot] < 0]
        count = int(torch.randint(1, len(free) + 1, (1,), generator=generator))
        slots = torch.tensor(free)[torch.randperm(len(free), generator=generator)[:count]].numpy()
        keys = torch.arange(key, key + count).numpy()
        key += count
        cache.install(slots, keys, torch.randn(count, cache.dim, generator=generator),
                      torch.rand(count, cache.state.shape[1], generator=generator))
        held = [slot for slot in range(cache.capacity) if cache.slot_key[slot] >= 0]
        gone = torch.tensor(held)[torch.randperm(len(held), generator=generator)[:len(held) // 2]].numpy()
        cache.evict(gone, cache.slot_key[gone])


def test_a_row_cache_on_the_cpu_copies_nothing():
    cache = RowCache(capacity=32, dim=4, optimizer=make_row_optimizer("adagrad", lr=0.1))
    _fill_and_churn(cache, steps=5, seed=0)
    assert cache.copy_stream is None and cache.staging is None
    assert cache.copy_stats() == {"pinned_allocations": 0, "pinned_bytes": 0, "bytes_to_device": 0}


def test_a_row_caches_index_copies_keep_their_dtypes_and_values_on_the_cpu():
    cache = RowCache(capacity=8, dim=4, optimizer=make_row_optimizer("sgd", lr=0.1))
    slots, positions = cache.to_device(np.array([3, 1, 2]), torch.tensor([0, 2, 1, 1], dtype=torch.int32))
    assert cache.indices is None  # (nothing to stage on the CPU)
    assert slots.dtype == torch.int64 and slots.tolist() == [3, 1, 2]
    assert positions.dtype == torch.int32 and positions.tolist() == [0, 2, 1, 1]


@needs_cuda
def test_a_row_caches_steps_on_cuda_never_wait_for_the_device():
    """Installs, lookups' index copies and row updates go through reused pinned buffers: under torch's sync debug
    mode set to fail, many steps run (a copy from pageable memory would wait for every queued kernel; an H200
    counted 4 such waits of a trainer's 6 an iteration before), with a bounded number of pinned allocations."""
    cache = RowCache(capacity=64, dim=8, optimizer=make_row_optimizer("adagrad", lr=0.1), device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # (an eviction's read-out to the host waits, by its nature: none here)
    try:
        for step in range(30):
            free = np.flatnonzero(cache.slot_key < 0)[:2]
            cache.install(free, np.arange(2 * step, 2 * step + len(free)), torch.randn(len(free), 8),
                          torch.randn(len(free), 8))
            slots = np.flatnonzero(cache.slot_key >= 0)[step % 4:][:16]
            index, positions = cache.to_device(slots, np.arange(len(slots), dtype=np.int32))
            cache.apply(slots, torch.ones(len(slots), 8, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert index.is_cuda and positions.dtype == torch.int32
    assert 0 < cache.indices.stats()["allocations"] <= INDEX_SLOTS * 2 * 4  # ring slots x dtypes x growth steps


@needs_cuda
def test_a_row_cache_on_cuda_installs_on_its_side_stream_what_the_cpu_cache_holds():
    """Fetched rows go in on the cache's own stream (ordered before the compute stream's writes by an event), through
    a few reused pinned buffers; the slots end up holding what a CPU cache given the same steps holds."""
    optimizer = make_row_optimizer("adam", lr=0.1)
    caches = {device: RowCache(capacity=64, dim=8, optimizer=optimizer, device=device) for device in ("cpu", "cuda")}
    for cache in caches.values():
        _fill_and_churn(cache, steps=100, seed=3)
    gpu = caches["cuda"]
    assert gpu.copy_stream is not None and gpu.copy_stream != torch.cuda.current_stream()
    assert torch.equal(gpu.weights.cpu(), caches["cpu"].weights) and torch.equal(gpu.state.cpu(), caches["cpu"].state)
    stats = gpu.copy_stats()
    assert 0 < stats["pinned_allocations"] <= 2 * 2 * 8 and stats["bytes_to_device"] >= 100 * (8 + 16) * 4


@needs_cuda
@pytest.mark.parametrize("policy", ["lru", "lookahead-prefetch"])
def test_a_cached_bag_on_cuda_trains_as_on_the_cpu(policy):
    num_rows, dim = 400, 6
    batches = zipf_bags(40, num_rows=num_rows, dim=dim, bags=16, ids_per_bag=3, seed=0, skew=1.3)
    weight = torch.randn(num_rows, dim, generator=torch.Generator().manual_seed(0))
    bags = {device: CachedEmbeddingBag(num_rows, dim, cache_rows=60, mode="sum", optimizer="adagrad", lr=0.05,
                                       _weight=weight.clone(), device=device) for device in ("cpu", "cuda")}
    for device, bag in bags.items():
        loop = Lookahead(batches, bag, lookahead=8, prefetch=True) if policy == "lookahead-prefetch" else batches
        for ids, offsets, target in loop:
            embeddings = bag(ids.to(device), offsets.to(device))
            ((embeddings - target.to(device)) ** 2).sum().backward()
    cpu, cuda = bags["cpu"], bags["cuda"]
    assert cuda.rows.stats["rows_written_back"] > cuda.rows.index.capacity  # evictions happened
    assert cuda.rows.stats["rows_fetched"] == cpu.rows.stats["rows_fetched"]
    assert torch.allclose(cuda.weight, cpu.weight, atol=1e-5, rtol=0)
    # slots x dtypes x a few growth steps (a fetch is at most a batch's 48 rows), not one per batch
    assert cuda.rows.stats["pinned_allocations"] <= 12
    assert "pinned_allocations" not in cpu.rows.stats

