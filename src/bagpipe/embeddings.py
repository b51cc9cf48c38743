"""All embedding tables in memory as one flat tensor, with row-wise optimizer state.

Used by the reference trainer. Tables are concatenated: global row = table offset + id, so a
batch touching 26 tables is one unique, one gather and one optimizer step, not 26 of each.
Initial values are a function of (seed, table, row block) alone, so any shard of a table can be
initialised on its own and still equal the reference.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from bagpipe.optim import RowOptimizer

INIT_BLOCK_ROWS = 65_536


def table_offsets(table_sizes: list[int]) -> np.ndarray:
    """First flat key of each table: key = offset of its table + id."""
    return np.concatenate([[0], np.cumsum(table_sizes)[:-1]]).astype(np.int64)


def init_block(*, seed: int, table: int, block: int, num_rows: int, dim: int) -> torch.Tensor:
    """Rows [block * INIT_BLOCK_ROWS, ...) of a table: uniform in +-1/sqrt(num_rows), as DLRM does."""
    start = block * INIT_BLOCK_ROWS
    count = min(INIT_BLOCK_ROWS, num_rows - start)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + table) * 1_000_003 + block)
    bound = math.sqrt(1.0 / num_rows)
    return (torch.rand(count, dim, generator=generator) * 2.0 - 1.0) * bound


def init_table(*, seed: int, table: int, num_rows: int, dim: int) -> torch.Tensor:
    blocks = range(math.ceil(num_rows / INIT_BLOCK_ROWS))
    return torch.cat([init_block(seed=seed, table=table, block=b, num_rows=num_rows, dim=dim) for b in blocks])


class EmbeddingTables:
    """Every table's rows and optimizer state; lookups return tensors that autograd flows through."""

    def __init__(self, *, table_sizes: list[int], dim: int, optimizer: RowOptimizer, seed: int) -> None:
        self.table_sizes = list(table_sizes)
        self.dim = dim
        self.optimizer = optimizer
        self.offsets = torch.from_numpy(table_offsets(table_sizes))
        self.weights = torch.cat([
            init_table(seed=seed, table=t, num_rows=n, dim=dim) for t, n in enumerate(table_sizes)
        ])
        self.state = torch.zeros(self.weights.shape[0], optimizer.state_width(dim))

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, "Lookup"]:
        """Embeddings [B, T, D] of ids [B, T] (one id per sample and table)."""
        global_ids = ids.to(torch.int64) + self.offsets
        unique_ids, inverse = torch.unique(global_ids, return_inverse=True)
        rows = self.weights.index_select(0, unique_ids).requires_grad_(True)
        # index_select's backward is an index_add, much cheaper than embedding's sort-based one.
        embeddings = rows.index_select(0, inverse.reshape(-1)).view(*inverse.shape, self.dim)
        return embeddings, Lookup(unique_ids, rows)

    @torch.no_grad()
    def apply_gradients(self, lookup: "Lookup") -> None:
        rows = lookup.rows.detach().clone()
        grads = lookup.rows.grad
        assert grads is not None, "backward() must run before apply_gradients()"
        state = self.state.index_select(0, lookup.unique_ids)
        self.optimizer.step(rows, state, grads)
        self.weights.index_copy_(0, lookup.unique_ids, rows)
        if state.shape[1]:
            self.state.index_copy_(0, lookup.unique_ids, state)

    def table(self, index: int) -> torch.Tensor:
        start = int(self.offsets[index])
        return self.weights[start:start + self.table_sizes[index]]


class Lookup:
    """The rows one batch gathered (a leaf that receives their summed gradients)."""

    __slots__ = ("unique_ids", "rows")

    def __init__(self, unique_ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.unique_ids = unique_ids
        self.rows = rows
