"""The memory tier: rows, optimizer state and (if versioned) row versions as tensors and arrays in memory."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from bagpipe.embeddings import Lookup, update_rows
from bagpipe.optim import RowOptimizer
from bagpipe.storage.tiers import tier


@tier("memory")
class MemoryRows:
    """Rows ``weights`` ``[num_rows, dim]`` (shared with the caller), optimizer state ``[num_rows, state_width]``
    (``state``, shared, or zeros) and, if ``versioned``, each row's version, in memory."""

    files = False  # whole, in memory
    max_chunk_rows = 1 << 30  # a snapshot's chunk as its writer asks
    views = True  # ``rows`` gives views: the table itself
    needs_lock = False  # a read changes nothing

    @staticmethod
    def stored_bytes(num_rows: int, dim: int, state_width: int) -> int:
        """What ``num_rows`` rows and their state take (no versions: a table, not a shard)."""
        return num_rows * (dim + state_width) * 4

    def __init__(self, weights: torch.Tensor, *, state_width: int, state: torch.Tensor | None = None,
                 versioned: bool = True) -> None:
        self.weights = weights
        self.state = state if state is not None else torch.zeros(weights.shape[0], state_width)
        self._versions = np.full(weights.shape[0], -1, dtype=np.int64) if versioned else None
        self.num_rows, self.dim, self.state_width = weights.shape[0], weights.shape[1], state_width

    @classmethod
    def open(cls, spec, *, name: str, num_rows: int, dim: int, state_width: int, blocks: Iterable[torch.Tensor],
             versioned: bool = True, state: torch.Tensor | None = None) -> "MemoryRows":
        blocks = list(blocks)
        weights = blocks[0] if len(blocks) == 1 else torch.cat(blocks) if blocks else torch.zeros(0, dim)
        if weights.shape != (num_rows, dim):
            raise ValueError(f"the initial blocks hold {tuple(weights.shape)} rows, the table ({num_rows}, {dim})")
        return cls(weights, state_width=state_width, state=state, versioned=versioned)

    def read(self, local: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Copies of rows ``local`` and their state. Safe beside a ``write`` of other rows on another thread."""
        index = torch.from_numpy(np.asarray(local, dtype=np.int64))
        return self.weights.index_select(0, index), self.state.index_select(0, index), self.versions(local)

    def versions(self, local: np.ndarray) -> np.ndarray:
        """Rows ``local``'s versions (-1 each where the tier keeps none: never written back, for all it knows)."""
        return self._versions[local] if self._versions is not None else np.full(len(local), -1, dtype=np.int64)

    def write(self, local: np.ndarray, rows: torch.Tensor, state: torch.Tensor, *,
              version: int | np.ndarray) -> None:
        index = torch.from_numpy(np.asarray(local, dtype=np.int64))
        self.weights.index_copy_(0, index, rows)
        if self.state_width:
            self.state.index_copy_(0, index, state)
        if self._versions is not None:
            self._versions[local] = version

    def read_range(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of rows ``start:stop``, their state and versions."""
        return (self.weights[start:stop].numpy().copy(), self.state[start:stop].numpy().copy(),
                self._versions[start:stop].copy() if self._versions is not None
                else np.full(len(self.weights[start:stop]), -1, dtype=np.int64))

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``start:stop`` and their state: views of the table, which its users keep updating."""
        return self.weights[start:stop], self.state[start:stop]

    def set_rows(self, start: int, rows: torch.Tensor) -> None:
        """Rows from ``start`` on replaced by ``rows``; their optimizer state kept."""
        self.weights[start:start + len(rows)].copy_(rows)

    def step(self, optimizer: RowOptimizer, local: np.ndarray, grads: torch.Tensor) -> None:
        """Row-optimizer step on rows ``local`` (distinct), in place."""
        index = torch.from_numpy(np.asarray(local, dtype=np.int64))
        update_rows(optimizer, self.weights, self.state, Lookup(index, self.weights.index_select(0, index)), grads)

    def grow(self, rows: torch.Tensor) -> None:
        """Rows ``rows`` appended (their optimizer state zeros, no version yet): a table that grows with the data
        (bagpipe.nn.DynamicEmbeddingBag). The tensors keep room to double, so growing row by row costs amortised
        O(1) a row; ``weights`` and ``state`` stay views of the rows held (earlier views see no new rows)."""
        count = self.num_rows + len(rows)
        buffers = getattr(self, "_room", None)
        if buffers is None or len(buffers[0]) < count:
            capacity = max(count, 2 * (len(buffers[0]) if buffers else self.num_rows), 16)
            weights = torch.empty(capacity, self.dim)
            state = torch.zeros(capacity, self.state_width)
            weights[:self.num_rows] = self.weights
            state[:self.num_rows] = self.state
            buffers = self._room = (weights, state)
        buffers[0][self.num_rows:count] = rows
        buffers[1][self.num_rows:count] = 0.0
        self.weights, self.state = buffers[0][:count], buffers[1][:count]
        if self._versions is not None:
            self._versions = np.concatenate([self._versions, np.full(len(rows), -1, dtype=np.int64)])
        self.num_rows = count

    def set_versions(self, version: int) -> None:
        if self._versions is None:
            raise ValueError("this memory tier keeps no versions (it was opened unversioned)")
        self._versions[:] = version

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {}
