"""The memory tier: a shard's rows, optimizer state and row versions as arrays in memory."""

from __future__ import annotations

import numpy as np
import torch


class MemoryRows:
    """Rows ``[num_rows, dim]``, optimizer state ``[num_rows, state_width]`` and versions in memory."""

    max_chunk_rows = 1 << 30  # a snapshot's chunk as its writer asks

    def __init__(self, weights: torch.Tensor, *, state_width: int) -> None:
        self.weights = weights
        self.state = torch.zeros(weights.shape[0], state_width)
        self._versions = np.full(weights.shape[0], -1, dtype=np.int64)
        self.num_rows, self.dim, self.state_width = weights.shape[0], weights.shape[1], state_width

    def read(self, local: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        index = torch.from_numpy(np.asarray(local, dtype=np.int64))
        return self.weights.index_select(0, index), self.state.index_select(0, index), self._versions[local]

    def versions(self, local: np.ndarray) -> np.ndarray:
        return self._versions[local]

    def write(self, local: np.ndarray, rows: torch.Tensor, state: torch.Tensor, *,
              version: int | np.ndarray) -> None:
        index = torch.from_numpy(np.asarray(local, dtype=np.int64))
        self.weights.index_copy_(0, index, rows)
        if self.state_width:
            self.state.index_copy_(0, index, state)
        self._versions[local] = version

    def read_range(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of rows ``start:stop``, their state and versions."""
        return (self.weights[start:stop].numpy().copy(), self.state[start:stop].numpy().copy(),
                self._versions[start:stop].copy())

    def set_versions(self, version: int) -> None:
        self._versions[:] = version

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {}
