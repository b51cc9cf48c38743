"""The disk tier: a shard in a file of fixed-size records, its hottest rows in a bounded DRAM cache.

Each record holds one row, its optimizer state and its version, as float32 words (the version as
the bits of an int32, stored plus one so that a new, zero-filled file says "never written back"):
a fixed size, so row ``i`` is at byte ``i * record_bytes``, the PMem/SSD layout of a persistent
parameter server. Records are read and written with ``preadv``/``pwritev``, one call per run of
consecutive rows, in file order: about 1.6 us a row read and 1.8 us a row written here (72-byte
records, measured alone). (A memory
map would save the calls but not the cost: the kernel maps up to 64 KiB of neighbouring pages on a
read fault and a whole page-cache folio on a write fault, so a random row costs as much, and the
pages it maps must be dropped again to stay within the budget: 2.7 us a row written at a 5 MiB
budget, measured.)

The budget is the DRAM cache: rows written back (dirty) and rows just read (a fetch is read once by
each trainer), least recently used evicted first, dirty ones written to the file in one batch.
Its index is a sorted key array, not a per-row table (that would cost 8 bytes a row of the shard).
What the process holds is then the cache and its index, whatever the shard's size; the page
cache is the kernel's, reclaimable under pressure.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from bagpipe.embeddings import Lookup, update_rows
from bagpipe.files import writing
from bagpipe.optim import RowOptimizer
from bagpipe.storage.tiers import tier

# per cached row beyond its record: its key twice (slot owner and sorted index), its slot in the index,
# its last use and whether it is dirty
SLOT_OVERHEAD_BYTES = 8 + 8 + 8 + 8 + 1
FILL_ROWS = 8192  # initial rows written per call
EVICT_FRACTION = 16
CHUNK_BYTES = 4 << 20  # the most a snapshot reads at once


def record_bytes(dim: int, state_width: int) -> int:
    """A row's record in the file: the row, its optimizer state and its version, 4 bytes each."""
    return 4 * (dim + state_width + 1)


@tier("disk")
class DiskRows:
    """``num_rows`` rows in ``path``, with at most ``budget_bytes`` of them in this process."""

    files = True  # a file of records in StorageSpec.directory, StorageSpec.budget_bytes of them in DRAM
    views = False  # ``rows`` reads copies
    needs_lock = True  # a read changes the DRAM cache

    @staticmethod
    def stored_bytes(num_rows: int, dim: int, state_width: int) -> int:
        """What the file of ``num_rows`` records takes."""
        return num_rows * record_bytes(dim, state_width)

    def __init__(self, path: Path, *, num_rows: int, dim: int, state_width: int, budget_bytes: int) -> None:
        self.path = Path(path)
        self.num_rows, self.dim, self.state_width = num_rows, dim, state_width
        self.record_bytes = record_bytes(dim, state_width)
        self.width = self.record_bytes // 4  # the version last
        self.budget_bytes = budget_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, num_rows * self.record_bytes)  # zeros: no optimizer state, never written back
        self.capacity = max(budget_bytes // (self.record_bytes + SLOT_OVERHEAD_BYTES), 0)
        self.max_chunk_rows = max(CHUNK_BYTES // self.record_bytes, 1)  # a snapshot's transient copies stay small
        self._cache = np.empty((self.capacity, self.width), dtype=np.float32)  # pages resident once used
        self._owner = np.full(self.capacity, -1, dtype=np.int64)  # the row in each slot, -1: free
        self._used_at = np.zeros(self.capacity, dtype=np.int64)
        self._dirty = np.zeros(self.capacity, dtype=bool)
        self._free = np.arange(self.capacity, dtype=np.int64)[::-1].copy()  # a stack
        self._num_free = self.capacity
        self._keys = np.empty(0, dtype=np.int64)  # the cached rows, sorted ...
        self._slots = np.empty(0, dtype=np.int64)  # ... and their slots
        self._clock = 0
        self.hits = self.rows_read = self.rows_written = 0

    @classmethod
    def open(cls, spec, *, name: str, num_rows: int, dim: int, state_width: int, blocks: Iterable[torch.Tensor],
             versioned: bool = True, state: torch.Tensor | None = None) -> "DiskRows":
        """A file ``name``.rows in ``spec.directory`` behind ``spec.budget_bytes`` of DRAM, filled with ``blocks``
        and zero optimizer state (every record holds a version: ``versioned`` changes nothing here)."""
        if state is not None:
            raise ValueError("a table on disk starts with zero optimizer state: only the memory tier shares one")
        rows = cls(Path(spec.directory) / f"{name}.rows", num_rows=num_rows, dim=dim, state_width=state_width,
                   budget_bytes=spec.budget_bytes)
        start = 0
        try:
            for block in blocks:
                rows.fill(start, block.detach().to("cpu", torch.float32).contiguous())
                start += len(block)
            if start != num_rows:
                raise ValueError(f"the initial blocks hold {start} rows, the table {num_rows}")
        except BaseException:
            rows.close()
            raise
        return rows

    # -- the tier's interface (storage/tiers.py) ------------------------------------------------
    def fill(self, start: int, rows: torch.Tensor) -> None:
        """Initial rows from ``start`` on (no state, never written back), straight to the file."""
        for first in range(0, len(rows), FILL_ROWS):
            part = rows[first:first + FILL_ROWS].numpy()
            records = np.zeros((len(part), self.width), dtype=np.float32)
            records[:, :self.dim] = part
            with writing(self.path):
                os.pwrite(self._fd, records.data, (start + first) * self.record_bytes)

    def read(self, local: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Rows, optimizer state and versions of ``local`` (the rows read from the file are cached)."""
        records = self._read_records(np.asarray(local, dtype=np.int64), cache=True)
        return self._split(records)

    def versions(self, local: np.ndarray) -> np.ndarray:
        return self._split(self._read_records(np.asarray(local, dtype=np.int64), cache=True))[2]

    def write(self, local: np.ndarray, rows: torch.Tensor, state: torch.Tensor, *,
              version: int | np.ndarray) -> None:
        """Write-backs land in the cache (dirty); the file gets them in batches, as they are evicted."""
        local = np.asarray(local, dtype=np.int64)
        records = self._records(rows, state, version)
        hit, slots = self._lookup(local)
        self._cache[slots] = records[hit]
        self._dirty[slots], self._used_at[slots] = True, self._clock
        self._insert(local[~hit], records[~hit], dirty=True)
        self._clock += 1

    def read_range(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of rows ``start:stop``, their state and versions, as they stand (cached rows included),
        without disturbing the cache (a snapshot reads every row once)."""
        block = np.empty((stop - start, self.width), dtype=np.float32)
        self._pread(block, start)
        lo, hi = np.searchsorted(self._keys, [start, stop])
        block[self._keys[lo:hi] - start] = self._cache[self._slots[lo:hi]]
        rows, state, versions = self._split(block)
        return rows.numpy(), state.numpy(), versions

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of rows ``start:stop`` and their state, read from the file (and the DRAM cache's newer rows) a
        chunk at a time."""
        parts = [self.read_range(first, min(first + FILL_ROWS, stop))[:2] for first in range(start, stop, FILL_ROWS)]
        if not parts:
            return torch.zeros(0, self.dim), torch.zeros(0, self.state_width)
        return (torch.from_numpy(np.concatenate([w for w, _ in parts])),
                torch.from_numpy(np.concatenate([s for _, s in parts])))

    def set_rows(self, start: int, rows: torch.Tensor) -> None:
        """Rows from ``start`` on replaced by ``rows``, a chunk at a time; their optimizer state and versions kept."""
        for first in range(0, len(rows), FILL_ROWS):
            part = rows[first:first + FILL_ROWS].detach().to("cpu", torch.float32).contiguous()
            local = np.arange(start + first, start + first + len(part), dtype=np.int64)
            _, state, versions = self.read_range(int(local[0]), int(local[-1]) + 1)
            self.write(local, part, torch.from_numpy(state), version=versions)

    def step(self, optimizer: RowOptimizer, local: np.ndarray, grads: torch.Tensor) -> None:
        """Row-optimizer step on rows ``local`` (distinct): read, stepped as the memory tier steps them, written
        back at the versions they had."""
        weights, state, versions = self.read(local)
        update_rows(optimizer, weights, state, Lookup(torch.arange(len(local)), weights), grads)
        self.write(local, weights, state, version=versions)

    def set_versions(self, version: int) -> None:
        """Every row at ``version`` (a restored checkpoint's boundary)."""
        for start in range(0, self.num_rows, FILL_ROWS):
            block = np.empty((min(FILL_ROWS, self.num_rows - start), self.width), dtype=np.float32)
            self._pread(block, start)
            block[:, -1:].view(np.int32)[:, 0] = version + 1
            with writing(self.path):
                os.pwrite(self._fd, block.data, start * self.record_bytes)
        self._cache[:, -1:].view(np.int32)[:, 0] = version + 1

    def close(self) -> None:
        """Close and delete the file: it is this run's working copy, not a checkpoint."""
        os.close(self._fd)
        self.path.unlink(missing_ok=True)

    def stats(self) -> dict:
        return {"disk_rows_read": self.rows_read, "disk_rows_written": self.rows_written,
                "disk_cache_hits": self.hits, "disk_cache_rows": self.capacity}

    # -- the cache -------------------------------------------------------------------------
    def _records(self, rows: torch.Tensor, state: torch.Tensor, version: int | np.ndarray) -> np.ndarray:
        records = np.empty((len(rows), self.width), dtype=np.float32)
        records[:, :self.dim] = rows.numpy()
        records[:, self.dim:self.dim + self.state_width] = state.numpy()
        records[:, -1:].view(np.int32)[:, 0] = np.asarray(version) + 1
        return records

    def _split(self, records: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        rows = torch.from_numpy(np.ascontiguousarray(records[:, :self.dim]))
        state = torch.from_numpy(np.ascontiguousarray(records[:, self.dim:self.dim + self.state_width]))
        versions = records[:, -1:].view(np.int32)[:, 0].astype(np.int64) - 1
        return rows, state, versions

    def _lookup(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which of ``local`` are cached, and the slots of those."""
        if not len(self._keys):
            return np.zeros(len(local), dtype=bool), np.empty(0, dtype=np.int64)
        at = np.minimum(np.searchsorted(self._keys, local), len(self._keys) - 1)
        hit = self._keys[at] == local
        return hit, self._slots[at[hit]]

    def _read_records(self, local: np.ndarray, *, cache: bool) -> np.ndarray:
        records = np.empty((len(local), self.width), dtype=np.float32)
        hit, slots = self._lookup(local)
        records[hit] = self._cache[slots]
        self._used_at[slots] = self._clock
        self.hits += len(slots)
        missed = np.flatnonzero(~hit)
        if len(missed):
            rows, inverse = np.unique(local[missed], return_inverse=True)  # in file order, each once
            from_file = np.empty((len(rows), self.width), dtype=np.float32)
            self._transfer(os.preadv, rows, from_file)
            self.rows_read += len(rows)
            records[missed] = from_file[inverse]
            if cache:
                self._insert(rows, from_file, dirty=False)
        self._clock += 1
        return records

    def _insert(self, local: np.ndarray, records: np.ndarray, *, dirty: bool) -> None:
        """Cache rows not cached yet; more than the cache holds go (if dirty) straight to the file."""
        if len(local) > self.capacity:
            if dirty:
                self._write_file(local[:-self.capacity or None], records[:-self.capacity or None])
            local, records = local[len(local) - self.capacity:], records[len(local) - self.capacity:]
        if not len(local):
            return
        if len(local) > self._num_free:  # evict a sixteenth of the cache at least: fewer, larger batches
            self._evict(max(len(local) - self._num_free, self.capacity // EVICT_FRACTION))
        slots = self._free[self._num_free - len(local):self._num_free][::-1].copy()
        self._num_free -= len(local)
        self._cache[slots], self._owner[slots] = records, local
        self._dirty[slots], self._used_at[slots] = dirty, self._clock
        order = np.argsort(local, kind="stable")
        at = np.searchsorted(self._keys, local[order])
        self._keys = np.insert(self._keys, at, local[order])
        self._slots = np.insert(self._slots, at, slots[order])

    def _evict(self, count: int) -> None:
        """Free the ``count`` least recently used slots, writing the dirty ones to the file in one batch."""
        used = np.flatnonzero(self._owner >= 0)
        victims = used[np.argpartition(self._used_at[used], count - 1)[:count]] if count < len(used) else used
        dirty = victims[self._dirty[victims]]
        if len(dirty):
            self._write_file(self._owner[dirty], self._cache[dirty])
        keep = np.ones(len(self._keys), dtype=bool)
        keep[np.searchsorted(self._keys, self._owner[victims])] = False
        self._keys, self._slots = self._keys[keep], self._slots[keep]
        self._owner[victims], self._dirty[victims] = -1, False
        self._free[self._num_free:self._num_free + len(victims)] = victims
        self._num_free += len(victims)

    def _write_file(self, local: np.ndarray, records: np.ndarray) -> None:
        order = np.argsort(local)
        with writing(self.path):  # a full disk named as such (the file is sparse: its rows take space as written)
            self._transfer(os.pwritev, local[order], np.ascontiguousarray(records[order]))
        self.rows_written += len(local)

    def _transfer(self, call, rows: np.ndarray, records: np.ndarray) -> None:
        """``call`` (preadv or pwritev) of ``records`` to or from ``rows`` (sorted, distinct): one call per
        run of consecutive rows."""
        if not len(rows):
            return
        view = memoryview(records).cast("B")
        size = self.record_bytes
        ends = np.append(np.flatnonzero(np.diff(rows) != 1) + 1, len(rows))
        first = 0
        for end in ends.tolist():
            want = (end - first) * size
            if call(self._fd, [view[first * size:end * size]], int(rows[first]) * size) != want:
                raise OSError(f"{self.path}: short {call.__name__} at row {int(rows[first])}")
            first = end

    def _pread(self, block: np.ndarray, start: int) -> None:
        if len(block) and os.preadv(self._fd, [memoryview(block).cast("B")], start * self.record_bytes) != block.nbytes:
            raise OSError(f"{self.path}: short read at row {start}")
