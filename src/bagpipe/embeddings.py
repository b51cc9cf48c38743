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

    def __init__(self, *, table_sizes: list[int], dim: int, optimizer: RowOptimizer, seed: int,
                 weights: torch.Tensor | None = None) -> None:
        """Initial rows from ``seed``, or the given flat ``weights`` (e.g. gathered from servers)."""
        self.table_sizes = list(table_sizes)
        self.dim = dim
        self.optimizer = optimizer
        self.offsets = torch.from_numpy(table_offsets(table_sizes))
        if weights is None:
            weights = torch.cat([init_table(seed=seed, table=t, num_rows=n, dim=dim)
                                 for t, n in enumerate(table_sizes)])
        self.weights = weights
        self.state = torch.zeros(self.weights.shape[0], optimizer.state_width(dim))

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, "Lookup"]:
        """Embeddings [B, T, D] of ids [B, T] (one id per sample and table)."""
        unique_ids, inverse = torch.unique(ids.to(torch.int64) + self.offsets, return_inverse=True)
        return gather_rows(self.weights, unique_ids, inverse)

    def apply_gradients(self, lookup: "Lookup") -> None:
        update_rows(self.optimizer, self.weights, self.state, lookup)

    def table(self, index: int) -> torch.Tensor:
        start = int(self.offsets[index])
        return self.weights[start:start + self.table_sizes[index]]


class Lookup:
    """The rows one batch gathered (a leaf that receives their summed gradients)."""

    __slots__ = ("index", "rows")

    def __init__(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        self.index = index  # where the distinct rows live in the weights tensor (ids or cache slots)
        self.rows = rows


def gather_rows(weights: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> tuple[torch.Tensor, Lookup]:
    """Embeddings [*inverse.shape, D] built from the distinct rows ``weights[index]``."""
    rows = weights.index_select(0, index).requires_grad_(True)
    # index_select's backward is an index_add, much cheaper than embedding's sort-based one.
    embeddings = rows.index_select(0, inverse.reshape(-1)).view(*inverse.shape, weights.shape[1])
    return embeddings, Lookup(index, rows)


@torch.no_grad()
def update_rows(optimizer: RowOptimizer, weights: torch.Tensor, state: torch.Tensor, lookup: Lookup,
                grads: torch.Tensor | None = None) -> None:
    """Row-optimizer step on the looked-up rows, in place (``grads``: default, the leaf's own)."""
    grads = lookup.rows.grad if grads is None else grads
    assert grads is not None, "backward() must run before the row update"
    rows, row_state = lookup.rows.detach().clone(), state.index_select(0, lookup.index)
    optimizer.step(rows, row_state, grads)
    weights.index_copy_(0, lookup.index, rows)
    if row_state.shape[1]:
        state.index_copy_(0, lookup.index, row_state)
