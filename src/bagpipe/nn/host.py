"""Where a cached module's full table lives: tensors in host memory (``MemoryTable``), or a file of records
on local disk behind a bounded DRAM cache (``DiskTable``, the servers' disk tier ``storage.DiskRows``).

Both read and write rows by key together with their optimizer state, so a row evicted from the device
cache keeps its state wherever the table lives, and training is the same bit for bit over either.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from bagpipe.embeddings import Lookup, update_rows
from bagpipe.optim import RowOptimizer
from bagpipe.storage import DiskRows, StorageSpec

DISK_BUDGET_BYTES = 64 << 20  # storage="disk"'s default DRAM cache in front of the file
INIT_BLOCK_ROWS = 8192  # rows drawn, written or read at once when a table on disk is filled or read whole


class MemoryTable:
    """``weight`` ``[N, D]`` and ``state`` ``[N, S]`` as host tensors (``weight`` shared with the caller)."""

    def __init__(self, weight: torch.Tensor, state: torch.Tensor) -> None:
        self.weight, self.state = weight, state
        self.num_rows, self.dim = weight.shape

    def read(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of rows ``keys`` and their state. Safe beside a ``write`` of other rows on another thread."""
        index = torch.from_numpy(keys)
        return self.weight.index_select(0, index), self.state.index_select(0, index)

    def write(self, keys: np.ndarray, weights: torch.Tensor, state: torch.Tensor) -> None:
        index = torch.from_numpy(keys)
        self.weight.index_copy_(0, index, weights)
        if self.state.shape[1]:
            self.state.index_copy_(0, index, state)

    def step(self, optimizer: RowOptimizer, keys: np.ndarray, grads: torch.Tensor) -> None:
        """Row-optimizer step on rows ``keys`` (distinct), in place."""
        index = torch.from_numpy(keys)
        update_rows(optimizer, self.weight, self.state, Lookup(index, self.weight.index_select(0, index)), grads)

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``start:stop`` and their state: views of the table, which the module keeps updating."""
        return self.weight[start:stop], self.state[start:stop]

    def set_rows(self, start: int, weights: torch.Tensor) -> None:
        """Rows from ``start`` on replaced by ``weights``; their optimizer state kept."""
        self.weight[start:start + len(weights)].copy_(weights)

    def close(self) -> None:
        pass


class DiskTable:
    """A table of ``num_rows x dim`` (and its optimizer state) in a file of fixed-size records in ``directory``,
    with at most ``budget_bytes`` of it cached in this process (``storage.DiskRows``). ``blocks``: the initial
    rows, block by block, so that the table is never whole in memory. The file is this module's working copy:
    deleted by ``close`` (or when the module is collected, or at exit)."""

    def __init__(self, directory: str | Path, *, num_rows: int, dim: int, state_width: int, budget_bytes: int,
                 blocks: Iterable[torch.Tensor]) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        handle = tempfile.NamedTemporaryFile(dir=directory, prefix="bagpipe-table-", suffix=".rows", delete=False)
        handle.close()  # a unique name; DiskRows opens it again
        self.num_rows, self.dim, self.state_width = num_rows, dim, state_width
        self.disk = DiskRows(Path(handle.name), num_rows=num_rows, dim=dim, state_width=state_width,
                             budget_bytes=budget_bytes)
        self._lock = threading.Lock()  # DiskRows' DRAM cache changes on reads too (a read-ahead thread reads)
        start = 0
        for block in blocks:
            self.disk.fill(start, block.detach().to("cpu", torch.float32).contiguous())
            start += len(block)
        if start != num_rows:
            self.close()
            raise ValueError(f"the initial blocks hold {start} rows, the table {num_rows}")

    @property
    def path(self) -> Path:
        return self.disk.path

    def read(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            weights, state, _ = self.disk.read(keys)
        return weights, state

    def write(self, keys: np.ndarray, weights: torch.Tensor, state: torch.Tensor) -> None:
        with self._lock:
            self.disk.write(keys, weights.contiguous(), state.contiguous(), version=0)

    def step(self, optimizer: RowOptimizer, keys: np.ndarray, grads: torch.Tensor) -> None:
        """Row-optimizer step on rows ``keys`` (distinct): read, stepped as the memory tier steps them, written."""
        weights, state = self.read(keys)
        index = torch.arange(len(keys))
        update_rows(optimizer, weights, state, Lookup(index, weights), grads)
        self.write(keys, weights, state)

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of rows ``start:stop`` and their state, read from the file (and the DRAM cache's newer rows)."""
        parts = []
        with self._lock:
            for first in range(start, stop, INIT_BLOCK_ROWS):
                parts.append(self.disk.read_range(first, min(first + INIT_BLOCK_ROWS, stop))[:2])
        if not parts:
            return torch.zeros(0, self.dim), torch.zeros(0, self.state_width)
        return (torch.from_numpy(np.concatenate([w for w, _ in parts])),
                torch.from_numpy(np.concatenate([s for _, s in parts])))

    def set_rows(self, start: int, weights: torch.Tensor) -> None:
        """Rows from ``start`` on replaced by ``weights``, block by block; their optimizer state kept."""
        for first in range(0, len(weights), INIT_BLOCK_ROWS):
            part = weights[first:first + INIT_BLOCK_ROWS].detach().to("cpu", torch.float32)
            keys = np.arange(start + first, start + first + len(part), dtype=np.int64)
            with self._lock:
                _, state, _ = self.disk.read_range(int(keys[0]), int(keys[-1]) + 1)
                self.disk.write(keys, part.contiguous(), torch.from_numpy(state), version=0)

    def stats(self) -> dict:
        return self.disk.stats()

    def close(self) -> None:
        """Delete the file (idempotent)."""
        with self._lock:
            if self.disk is not None:
                self.disk.close()
                self.disk = None


def storage_spec(storage: str | StorageSpec) -> StorageSpec:
    """``storage`` as a StorageSpec: "memory", "disk" (a file in the system's temporary directory behind
    DISK_BUDGET_BYTES of DRAM), or a StorageSpec naming the directory and the budget."""
    if isinstance(storage, StorageSpec):
        return storage
    if storage == "disk":
        return StorageSpec("disk", Path(tempfile.gettempdir()), DISK_BUDGET_BYTES)
    return StorageSpec(storage)  # "memory", or a ValueError naming the kinds


def host_table(storage: StorageSpec, *, num_rows: int, dim: int, state_width: int,
               blocks: Iterable[torch.Tensor]) -> MemoryTable | DiskTable:
    """A table of the initial rows ``blocks`` (concatenated) and zero optimizer state, where ``storage`` says."""
    if storage.kind == "memory":
        blocks = list(blocks)
        weight = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        return MemoryTable(weight, torch.zeros(num_rows, state_width))
    return DiskTable(storage.directory, num_rows=num_rows, dim=dim, state_width=state_width,
                     budget_bytes=storage.budget_bytes, blocks=blocks)


def initial_blocks(num_rows: int, dim: int, weight: torch.Tensor | None, *, storage: StorageSpec) -> Iterable[torch.Tensor]:
    """A table's initial rows for ``host_table``: the given ``weight`` (in memory shared, as ``nn.EmbeddingBag``
    shares its ``_weight``), or N(0, 1) as ``nn.EmbeddingBag`` draws them; on disk a block at a time."""
    on_disk = storage.kind == "disk"
    if weight is not None:
        return blocks_of(weight.detach()) if on_disk else [weight.detach().to("cpu", torch.float32)]
    return normal_blocks(num_rows, dim) if on_disk else [torch.nn.init.normal_(torch.empty(num_rows, dim))]


def normal_blocks(num_rows: int, dim: int) -> Iterable[torch.Tensor]:
    """N(0, 1) rows, as ``nn.EmbeddingBag`` initialises its table (the global generator), drawn a block at a
    time (the values differ from one draw of the whole table in the last block's few rows)."""
    for start in range(0, num_rows, INIT_BLOCK_ROWS):
        yield torch.nn.init.normal_(torch.empty(min(INIT_BLOCK_ROWS, num_rows - start), dim))


def blocks_of(weight: torch.Tensor) -> Iterable[torch.Tensor]:
    """A given table, a block of rows at a time."""
    for start in range(0, len(weight), INIT_BLOCK_ROWS):
        yield weight[start:start + INIT_BLOCK_ROWS]
