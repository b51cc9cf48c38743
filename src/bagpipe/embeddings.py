"""All embedding tables in memory as one flat tensor, with row-wise optimizer state.

Used by the reference trainer. Tables are concatenated: global row = table offset + id, so a
batch touching 26 tables is one unique, one gather and one optimizer step, not 26 of each.
Initial values are a function of (seed, table, row block) alone, so any shard of a table can be
initialised on its own and still equal the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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

    def lookup(self, ids: "torch.Tensor | Bags", *, keys: torch.Tensor | None = None) -> tuple[torch.Tensor, "Lookup"]:
        """Embeddings [B, T, D] of ids [B, T] (one id per sample and table), or of pooled bags.

        The Lookup's leaf holds the distinct rows of ``ids``, or the sorted flat ``keys`` given
        (e.g. a whole global batch's, of which ``ids`` is one trainer's slice).
        """
        flat = flat_keys(ids, self.offsets)
        if keys is None:
            keys, inverse = torch.unique(flat, return_inverse=True)
        else:
            inverse = torch.searchsorted(keys, flat)
        if isinstance(ids, Bags):
            return gather_bags(self.weights, keys, inverse, ids)
        return gather_rows(self.weights, keys, inverse)

    def distinct_keys(self, ids: "torch.Tensor | Bags") -> torch.Tensor:
        """The sorted flat keys of the rows ``ids`` touch."""
        return torch.unique(flat_keys(ids, self.offsets))

    def apply_gradients(self, lookup: "Lookup", grads: torch.Tensor | None = None) -> None:
        update_rows(self.optimizer, self.weights, self.state, lookup, grads)

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


POOLING = ("sum", "mean")


@dataclass(frozen=True)
class Bags:
    """A variable-length bag of ids per sample and table, pooled as ``nn.EmbeddingBag`` does.

    ``values`` holds the ids (within their tables) sample-major, then table by table;
    ``lengths[b, t]`` how many belong to sample b's bag for table t (0: an empty bag, pooled to 0).
    One-hot batches are plain [B, T] id tensors; everything downstream of the ids (planner keys,
    cache lookups, gradient sync) works on flat keys and so takes either.
    """

    values: torch.Tensor  # int64 [N]
    lengths: torch.Tensor  # int64 [B, T]
    mode: str = "sum"

    def __post_init__(self) -> None:
        if self.mode not in POOLING:
            raise ValueError(f"pooling must be one of {', '.join(POOLING)}, got {self.mode!r}")
        if self.lengths.dim() != 2 or (self.lengths < 0).any():
            raise ValueError("bag lengths must be a [batch, tables] tensor of non-negative counts")
        if int(self.lengths.sum()) != self.values.numel():
            raise ValueError(f"bag lengths add up to {int(self.lengths.sum())}, but there are "
                             f"{self.values.numel()} ids")

    def __len__(self) -> int:
        return self.lengths.shape[0]

    def keys(self, offsets: torch.Tensor) -> torch.Tensor:
        """Flat keys [N] (table offset + id) of every id, in order."""
        tables = torch.arange(self.lengths.shape[1]).repeat(len(self))
        return self.values.to(torch.int64) + offsets[tables].repeat_interleave(self.lengths.flatten())

    def slice(self, samples: slice) -> "Bags":
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), self.lengths.sum(1).cumsum(0)])
        first, last = int(starts[samples.start]), int(starts[samples.stop])
        return Bags(self.values[first:last], self.lengths[samples], self.mode)


def flat_keys(ids: "torch.Tensor | Bags", offsets: torch.Tensor) -> torch.Tensor:
    """Flat keys of a batch's ids: [B, T] for one-hot ids, [N] for bags (what the planner plans)."""
    if isinstance(ids, Bags):
        return ids.keys(offsets)
    return ids.to(torch.int64) + offsets


def gather_bags(weights: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor,
                bags: Bags) -> tuple[torch.Tensor, Lookup]:
    """Pooled embeddings [B, T, D] of ``bags``, built from the distinct rows ``weights[index]``."""
    batch, tables = bags.lengths.shape
    rows = weights.index_select(0, index).requires_grad_(True)
    per_id = rows.index_select(0, inverse.reshape(-1))
    lengths = bags.lengths.flatten().to(weights.device)
    segments = torch.arange(batch * tables, device=weights.device).repeat_interleave(lengths)
    pooled = torch.zeros(batch * tables, weights.shape[1], device=weights.device).index_add(0, segments, per_id)
    if bags.mode == "mean":
        pooled = pooled / lengths.clamp(min=1).unsqueeze(1).to(pooled.dtype)
    return pooled.view(batch, tables, weights.shape[1]), Lookup(index, rows)


@torch.no_grad()
def update_rows(optimizer: RowOptimizer, weights: torch.Tensor, state: torch.Tensor, lookup: Lookup,
                grads: torch.Tensor | None = None) -> None:
    """Row-optimizer step on the looked-up rows, in place (``grads``: default, the leaf's own)."""
    grads = lookup.rows.grad if grads is None else grads
    assert grads is not None, "backward() must run before the row update"
    if optimizer.name == "sgd":  # fused: one scatter-add into the weights (the rows are distinct)
        # grads * -lr first: index_add_ with alpha= takes a slow path (2.3 ms against 0.28 ms for
        # 12k rows of 16 into 130k, 1 thread).
        weights.index_add_(0, lookup.index, grads.mul(-optimizer.lr))
        return
    rows, row_state = lookup.rows.detach().clone(), state.index_select(0, lookup.index)
    optimizer.step(rows, row_state, grads)
    weights.index_copy_(0, lookup.index, rows)
    if row_state.shape[1]:
        state.index_copy_(0, lookup.index, row_state)
