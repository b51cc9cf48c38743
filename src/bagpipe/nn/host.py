"""Where a cached module's full table lives: any storage tier (storage/tiers.py), in host memory (``MemoryRows``)
or in a file of records on local disk behind a bounded DRAM cache (``DiskRows``), the tiers the servers use.

``HostTable`` reads and writes rows by key together with their optimizer state, so a row evicted from the device
cache keeps its state wherever the table lives, and training is the same bit for bit over every tier.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from bagpipe.optim import RowOptimizer
from bagpipe.storage import StorageSpec, open_tier
from bagpipe.storage.tiers import RowTier

DISK_BUDGET_BYTES = 64 << 20  # storage="disk"'s default DRAM cache in front of the file
INIT_BLOCK_ROWS = 8192  # rows drawn at once when a table on disk is filled, or set by a load


class HostTable:
    """A table of ``num_rows x dim`` rows and their optimizer state in a storage ``tier``, as a cached module
    reads and writes it: by key, with no versions. Calls are serialised where the tier's reads change it (a disk
    tier's DRAM cache: the module's read-ahead thread reads too). A table in a file is the module's working copy:
    deleted by ``close`` (or when the module is collected, or at exit)."""

    def __init__(self, tier: RowTier) -> None:
        self._tier: RowTier | None = tier
        self.num_rows, self.dim, self.state_width = tier.num_rows, tier.dim, tier.state_width
        self.views = tier.views  # ``rows`` gives views of the table (in memory), not copies
        self._lock = threading.Lock() if tier.needs_lock else contextlib.nullcontext()

    @property
    def tier(self) -> RowTier:
        if self._tier is None:
            raise RuntimeError("this table is closed (its file deleted)")
        return self._tier

    @property
    def path(self) -> Path | None:
        """The table's file, for a tier that keeps one."""
        return getattr(self.tier, "path", None)

    def read(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of rows ``keys`` and their state."""
        with self._lock:
            weights, state, _ = self.tier.read(keys)
        return weights, state

    def write(self, keys: np.ndarray, weights: torch.Tensor, state: torch.Tensor) -> None:
        with self._lock:
            self.tier.write(keys, weights.contiguous(), state.contiguous(), version=0)

    def step(self, optimizer: RowOptimizer, keys: np.ndarray, grads: torch.Tensor) -> None:
        """Row-optimizer step on rows ``keys`` (distinct)."""
        with self._lock:
            self.tier.step(optimizer, keys, grads)

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``start:stop`` and their state: views of a table in memory (which the module keeps updating),
        copies of one on disk."""
        with self._lock:
            return self.tier.rows(start, stop)

    def set_rows(self, start: int, weights: torch.Tensor) -> None:
        """Rows from ``start`` on replaced by ``weights`` (on any device), a block at a time (a table on disk is
        never whole in this process, and a read-ahead waits for one block at most); their optimizer state kept."""
        for first in range(0, len(weights), INIT_BLOCK_ROWS):
            part = weights[first:first + INIT_BLOCK_ROWS].detach().to("cpu", torch.float32)
            with self._lock:
                self.tier.set_rows(start + first, part)

    def load(self, weights: torch.Tensor, state: torch.Tensor | None, *, start: int = 0) -> None:
        """Rows from ``start`` on (default: every row) and their optimizer state replaced (``state`` None: zeros,
        a fresh optimizer's), a block at a time."""
        for first in range(0, len(weights), INIT_BLOCK_ROWS):
            stop = min(first + INIT_BLOCK_ROWS, len(weights))
            part = weights[first:stop].detach().to("cpu", torch.float32)
            part_state = (torch.zeros(stop - first, self.state_width) if state is None
                          else state[first:stop].detach().to("cpu", torch.float32))
            self.write(np.arange(start + first, start + stop, dtype=np.int64), part, part_state)

    def grow(self, rows: torch.Tensor) -> None:
        """Rows ``rows`` appended, their optimizer state zeros (a tier that can grow: memory)."""
        with self._lock:
            self.tier.grow(rows)
            self.num_rows = self.tier.num_rows

    def stats(self) -> dict:
        return self.tier.stats()

    def close(self) -> None:
        """Let go of the table, deleting its file if it has one (idempotent; using it after is an error)."""
        with self._lock:
            if self._tier is not None:
                self._tier.close()
                self._tier = None


def storage_spec(storage: str | StorageSpec) -> StorageSpec:
    """``storage`` as a StorageSpec: "memory", "disk" (a file in the system's temporary directory behind
    DISK_BUDGET_BYTES of DRAM), or a StorageSpec naming the directory and the budget."""
    if isinstance(storage, StorageSpec):
        return storage
    return StorageSpec.of(storage, Path(tempfile.gettempdir()), DISK_BUDGET_BYTES)  # (a ValueError naming the kinds)


def host_table(storage: StorageSpec, *, num_rows: int, dim: int, state_width: int, blocks: Iterable[torch.Tensor],
               state: torch.Tensor | None = None) -> HostTable:
    """A table of the initial rows ``blocks`` (concatenated) and zero optimizer state (or ``state``, shared, in
    memory), where ``storage`` says (a file on disk gets a name of its own in its directory)."""
    if not storage.files:
        return HostTable(open_tier(storage, name="table", num_rows=num_rows, dim=dim, state_width=state_width,
                                   blocks=blocks, versioned=False, state=state))
    Path(storage.directory).mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(dir=storage.directory, prefix="bagpipe-table-", suffix=".rows", delete=False)
    handle.close()  # a unique name, whose file the tier opens again (and deletes when closed)
    try:
        return HostTable(open_tier(storage, name=Path(handle.name).name.removesuffix(".rows"), num_rows=num_rows,
                                   dim=dim, state_width=state_width, blocks=blocks, versioned=False, state=state))
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise


def initial_blocks(num_rows: int, dim: int, weight: torch.Tensor | None, *, storage: StorageSpec) -> Iterable[torch.Tensor]:
    """A table's initial rows for ``host_table``: the given ``weight`` (in memory shared, as ``nn.EmbeddingBag``
    shares its ``_weight``), or N(0, 1) as ``nn.EmbeddingBag`` draws them; on disk a block at a time."""
    on_disk = storage.files
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
