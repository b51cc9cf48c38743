"""Server-side row storage: one shard of every table, with optimizer state and row versions.

A shard owns the flat keys ``k`` with ``k % num_shards == shard``. A fetch names the version it
must observe (the iteration after which the row was last written back) and waits, up to a
timeout, until that write-back has arrived: the ordering invariant, enforced where rows live.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from bagpipe.embeddings import init_table, table_offsets
from bagpipe.optim import RowOptimizer


class RowStore:
    def __init__(self, *, table_sizes: list[int], dim: int, optimizer: RowOptimizer, seed: int,
                 shard: int = 0, num_shards: int = 1) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is outside [0, {num_shards})")
        self.shard, self.num_shards, self.dim = shard, num_shards, dim
        offsets = table_offsets(table_sizes)
        parts = []
        for table, (offset, size) in enumerate(zip(offsets.tolist(), table_sizes)):
            first = (shard - offset) % num_shards  # first id of this table that the shard owns
            rows = init_table(seed=seed, table=table, num_rows=size, dim=dim)
            parts.append(rows[first::num_shards])
        self.weights = torch.cat(parts)
        self.state = torch.zeros(self.weights.shape[0], optimizer.state_width(dim))
        self.versions = np.full(self.weights.shape[0], -1, dtype=np.int64)
        self._changed = threading.Condition()

    def _local(self, keys: np.ndarray) -> torch.Tensor:
        keys = np.asarray(keys, dtype=np.int64)
        if len(keys) and (keys % self.num_shards != self.shard).any():
            raise ValueError(f"shard {self.shard} of {self.num_shards} was asked for rows it does not hold")
        return torch.from_numpy(keys // self.num_shards)

    def fetch(self, keys: np.ndarray, versions: np.ndarray, *, timeout: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows and optimizer state of ``keys``, once each has reached its requested version."""
        local = self._local(keys)
        wanted = np.asarray(versions, dtype=np.int64)
        with self._changed:
            ready = self._changed.wait_for(lambda: (self.versions[local.numpy()] >= wanted).all(), timeout)
            if not ready:
                behind = np.flatnonzero(self.versions[local.numpy()] < wanted)
                raise TimeoutError(f"shard {self.shard}: {len(behind)} rows still lack their write-back after "
                                   f"{timeout} s (first: key {int(keys[behind[0]])} wants version "
                                   f"{int(wanted[behind[0]])}, has {int(self.versions[local[behind[0]]])})")
            return self.weights.index_select(0, local), self.state.index_select(0, local)

    def write_back(self, keys: np.ndarray, rows: torch.Tensor, state: torch.Tensor, *, version: int) -> None:
        local = self._local(keys)
        with self._changed:
            self.weights.index_copy_(0, local, rows)
            if state.shape[1]:
                self.state.index_copy_(0, local, state)
            self.versions[local.numpy()] = version
            self._changed.notify_all()
