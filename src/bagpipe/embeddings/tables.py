"""Embedding rows in memory, one flat tensor per space, with row-wise optimizer state.

The reference trainer's tables, and the lookups every mode shares: a batch's distinct rows of a
space are gathered once into a leaf tensor, whose gradient after the backward is each row's
summed gradient, and every lookup of the space is one gather from it. Initial values are a
function of (seed, table, row block) alone, so any shard of a table can be initialised on its
own and still equal the reference.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import torch

from bagpipe.data.schema import PAD
from bagpipe.embeddings.layout import EmbeddingLayout, TableConfig

if TYPE_CHECKING:  # (bagpipe.optim's RowWise applies this module's update_rows)
    from bagpipe.optim import RowOptimizer

INIT_BLOCK_ROWS = 65_536
POOLING = ("sum", "mean")


def table_offsets(table_sizes: list[int]) -> np.ndarray:
    """First flat key of each table: key = offset of its table + id."""
    return np.concatenate([[0], np.cumsum(table_sizes)[:-1]]).astype(np.int64)


def init_block(*, seed: int, table: int, block: int, num_rows: int, dim: int, init: str = "uniform") -> torch.Tensor:
    """Rows [block * INIT_BLOCK_ROWS, ...) of a table: uniform in +-1/sqrt(num_rows), as DLRM does; normal
    with standard deviation 1/dim, as Caser does; or zeros."""
    start = block * INIT_BLOCK_ROWS
    count = min(INIT_BLOCK_ROWS, num_rows - start)
    if init == "zeros":
        return torch.zeros(count, dim)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + table) * 1_000_003 + block)
    if init == "normal":
        return torch.randn(count, dim, generator=generator) / dim
    bound = math.sqrt(1.0 / num_rows)
    return torch.rand(count, dim, generator=generator).mul_(2.0).sub_(1.0).mul_(bound)  # in place: no temporaries


def init_table(*, seed: int, table: int, num_rows: int, dim: int, init: str = "uniform") -> torch.Tensor:
    blocks = range(math.ceil(num_rows / INIT_BLOCK_ROWS))
    return torch.cat([init_block(seed=seed, table=table, block=b, num_rows=num_rows, dim=dim, init=init)
                      for b in blocks])


def init_rows(table_index: int, table: TableConfig, *, seed: int, first: int = 0, step: int = 1) -> torch.Tensor:
    """The table's initial rows ``first, first + step, ...`` (a server's shard), made block by block: a
    shard never holds the whole table at once."""
    if step == 1 and first == 0:
        return init_table(seed=seed, table=table_index, num_rows=table.num_rows, dim=table.dim, init=table.init)
    parts = list(init_row_blocks(table_index, table, seed=seed, first=first, step=step))
    return torch.cat(parts) if parts else torch.zeros(0, table.dim)


def init_row_blocks(table_index: int, table: TableConfig, *, seed: int, first: int = 0,
                    step: int = 1) -> Iterator[torch.Tensor]:
    """``init_rows`` one initialisation block at a time (for a shard written straight to disk)."""
    for block in range(math.ceil(table.num_rows / INIT_BLOCK_ROWS)):
        start = block * INIT_BLOCK_ROWS
        offset = (first - start) % step  # the block's first row of the shard
        rows = init_block(seed=seed, table=table_index, block=block, num_rows=table.num_rows, dim=table.dim,
                          init=table.init)
        if step == 1:
            yield rows
        else:
            yield rows[offset::step].clone() if offset < len(rows) else rows[:0]


class Lookup:
    """The rows one batch gathered from one space (a leaf that receives their summed gradients)."""

    __slots__ = ("index", "rows")

    def __init__(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        self.index = index  # where the distinct rows live in the weights tensor (keys or cache slots)
        self.rows = rows


def gather(weights: torch.Tensor, index: torch.Tensor, positions: torch.Tensor, *,
           padded: bool) -> tuple[torch.Tensor, Lookup]:
    """Embeddings ``[*positions.shape, D]`` built from the distinct rows ``weights[index]``.

    ``positions`` index those rows; with ``padded``, position ``len(index)`` is an empty place
    (PAD in the ids) and embeds to zeros.
    """
    rows = weights.index_select(0, index).requires_grad_(True)
    source = torch.cat([rows, rows.new_zeros(1, rows.shape[1])]) if padded else rows
    # index_select's backward is an index_add, much cheaper than embedding's sort-based one.
    embeddings = source.index_select(0, positions.reshape(-1)).view(*positions.shape, weights.shape[1])
    return embeddings, Lookup(index, rows)


def positions_in(keys: torch.Tensor, distinct: torch.Tensor) -> torch.Tensor:
    """Each key's index in the sorted ``distinct`` keys; PAD maps to ``len(distinct)`` (the empty place)."""
    positions = torch.searchsorted(distinct, keys.contiguous())
    return torch.where(keys >= 0, positions, len(distinct)) if (keys < 0).any() else positions


def id_places(keys: np.ndarray, places: np.ndarray, *, empty: int) -> np.ndarray:
    """Each id's place (int32) in the shape of ``keys`` (a space's key matrix, PAD where empty): ``places`` gives
    the valid ids' in order (where the planner's sort of them put each: ``inverse=True``; one per valid id,
    checked), PAD's is ``empty`` (the empty place after the rows)."""
    valid = keys != PAD
    count = np.count_nonzero(valid)
    if len(places) != count:
        raise ValueError(f"the plan places {len(places)} ids, the keys hold {count} "
                         f"(plan with inverse=True, over these keys)")
    if count == keys.size:  # no PAD: the places are the matrix's, in order
        return places.astype(np.int32, copy=False).reshape(keys.shape)
    positions = np.full(keys.shape, empty, dtype=np.int32)
    positions[valid] = places
    return positions


def distinct_positions(flat: torch.Tensor, *, padded: bool, keys: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """A space's key matrix as its sorted distinct keys (or the ``keys`` given) and each key's index in them."""
    if keys is None and not padded:
        return torch.unique(flat, return_inverse=True)
    distinct = keys if keys is not None else torch.unique(flat[flat >= 0])
    return distinct, positions_in(flat, distinct)


class Embeddings(list):
    """One batch's embeddings as a model receives them: a list of one entry per lookup, in the layout's order.

    Entry i is ``[B, D]`` for a one-column feature, ``[B, W, D]`` for a multi-valued one (zeros
    where the ids hold PAD); ``pooled(i, mode)`` sums or averages those as ``nn.EmbeddingBag`` does.
    A list, so that a script written for the original API (``get_emb``: one tensor per table) can
    index it, unpack it or ``torch.stack`` it; the entries are views of one block per space.
    """

    def __init__(self, spaces: list[torch.Tensor], layout: EmbeddingLayout, ids: torch.Tensor) -> None:
        self.spaces, self.layout, self.ids = spaces, layout, ids
        # a space's one-column entries from one unbind (one operation, where a view each was one apiece)
        columns = {s: spaces[s].unbind(1) for s in {spec.space for spec in layout.lookups if spec.stop - spec.start == 1}}
        super().__init__(columns[spec.space][spec.start] if spec.stop - spec.start == 1
                         else spaces[spec.space][:, spec.start:spec.stop] for spec in layout.lookups)

    def stack(self, lookups: Sequence[int] | None = None) -> torch.Tensor:
        """Those lookups (default all; one-column features of one width) as ``[B, n, D]``: a view when
        they are one space's consecutive columns, as DLRM's are."""
        indices = range(len(self)) if lookups is None else lookups
        specs = [self.layout.lookups[i] for i in indices]
        first = specs[0]
        if (all(s.space == first.space and s.stop - s.start == 1 for s in specs)
                and [s.start for s in specs] == list(range(first.start, first.start + len(specs)))):
            return self.spaces[first.space][:, first.start:first.start + len(specs)]
        return torch.stack([self[i] for i in indices], dim=1)

    def pooled(self, index: int, mode: str = "sum") -> torch.Tensor:
        """Entry ``index`` pooled over its places: ``[B, D]`` (an empty bag pools to zeros)."""
        if mode not in POOLING:
            raise ValueError(f"pooling must be one of {', '.join(POOLING)}, got {mode!r}")
        entry = self[index]
        if entry.dim() == 2:
            return entry
        total = entry.sum(dim=1)
        if mode == "sum":
            return total
        start, stop = self.layout.schema.columns(self.layout.lookups[index].feature)
        counts = (self.ids[:, start:stop] >= 0).sum(dim=1, keepdim=True).clamp(min=1)
        return total / counts.to(total)  # (the ids stay on the host: counted there, moved to the block's device)


class EmbeddingTables:
    """Every table's rows and optimizer state, space by space, on one device; lookups autograd flows through.

    The ids a batch looks up stay in host memory (keys are computed there, by the layout); their keys go to
    the device, where the rows are gathered, trained and updated. Whatever the device, the initial rows are
    drawn on the CPU (``init_rows``), so every device starts from the same bits."""

    def __init__(self, *, layout: EmbeddingLayout, optimizer: RowOptimizer, seed: int,
                 weights: list[torch.Tensor] | None = None, device: torch.device | str = "cpu") -> None:
        """Initial rows from ``seed``, or the given weights of each space (e.g. gathered from servers)."""
        self.layout, self.optimizer, self.device = layout, optimizer, torch.device(device)
        if weights is None:
            weights = [torch.cat([init_rows(t, layout.tables[t], seed=seed) for t in space.tables])
                       for space in layout.spaces]
        self.weights = [w.to(self.device) for w in weights]
        self.state = [torch.zeros(w.shape[0], optimizer.state_width(space.dim), device=self.device)
                      for w, space in zip(weights, layout.spaces)]
        self.changed: list[torch.Tensor] = []  # per space, rows updated since the last checkpoint (if tracked)

    def track_changes(self) -> None:
        """Mark every row an update touches from now on (what an incremental checkpoint writes)."""
        self.changed = [torch.zeros(w.shape[0], dtype=torch.bool, device=self.device) for w in self.weights]

    def space_keys(self, ids: torch.Tensor) -> list[torch.Tensor]:
        return [torch.from_numpy(keys).to(self.device) for keys in self.layout.keys(ids.cpu().numpy())]

    def distinct_keys(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Per space, the sorted keys of the rows ``ids`` touch."""
        return [torch.unique(keys[keys >= 0]) for keys in self.space_keys(ids)]

    def lookup(self, ids: torch.Tensor, *, keys: list[torch.Tensor] | None = None) -> tuple[Embeddings, list[Lookup]]:
        """The embeddings of ids ``[B, K]``, and each space's Lookup. Each leaf holds the distinct rows of
        ``ids``, or the sorted ``keys`` given (e.g. a whole global batch's, of which ``ids`` is a slice)."""
        blocks, lookups = [], []
        for s, (space, flat) in enumerate(zip(self.layout.spaces, self.space_keys(ids))):
            distinct, positions = distinct_positions(flat, padded=space.padded, keys=None if keys is None else keys[s])
            block, lookup = gather(self.weights[s], distinct, positions, padded=space.padded)
            blocks.append(block)
            lookups.append(lookup)
        return Embeddings(blocks, self.layout, ids), lookups

    def apply_gradients(self, lookups: list[Lookup], grads: list[torch.Tensor] | None = None) -> None:
        for s, lookup in enumerate(lookups):
            update_rows(self.optimizer, self.weights[s], self.state[s], lookup, None if grads is None else grads[s])
            if self.changed:
                self.changed[s][lookup.index] = True

    def table(self, index: int) -> torch.Tensor:
        space, offset = self.layout.place(index)
        return self.weights[space][offset:offset + self.layout.tables[index].num_rows]

    def read_rows(self, space: int, keys: np.ndarray | None = None, *,
                  with_state: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """Copies of a space's rows ``keys`` (default: every row) and, ``with_state``, their optimizer state:
        what a checkpoint and an export read, whichever tables hold the rows (nn.CachedTables too)."""
        if keys is None:
            return (self.weights[space].cpu().numpy().copy(),
                    self.state[space].cpu().numpy().copy() if with_state else None)
        index = torch.from_numpy(keys).to(self.device)
        return (self.weights[space].index_select(0, index).cpu().numpy(),
                self.state[space].index_select(0, index).cpu().numpy() if with_state else None)

    def remake_rows(self, space: int, keys: np.ndarray, weights: torch.Tensor) -> None:
        """Rows ``keys`` of a space made again: ``weights``, their optimizer state zero (a raw-id row retired and its
        number reused: embeddings.dynamic.RetiringNumbering)."""
        index = torch.from_numpy(np.asarray(keys, dtype=np.int64)).to(self.device)
        self.weights[space].index_copy_(0, index, weights.to(self.device))
        self.state[space].index_fill_(0, index, 0.0)
        if self.changed:  # (an incremental checkpoint writes them)
            self.changed[space][index] = True

    def load_rows(self, space: int, rows: np.ndarray, state: np.ndarray) -> None:
        """Every row of a space and its optimizer state replaced (a checkpoint restored)."""
        self.weights[space].copy_(torch.from_numpy(rows))
        self.state[space].copy_(torch.from_numpy(state))


def row_sums(index: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each distinct ``index``'s ``values`` summed in the order they come (a left fold), the indices sorted: how
    every row gradient of bagpipe.nn and RowWise is summed from a sparse gradient's entries, one per id looked up.

    One rule for every path, so that they agree bit for bit however the lookups are grouped: a table alone, the
    tables of a space in one lookup, several backward passes accumulated. (``coalesce()`` is not such a rule:
    its sort is unstable at small sizes, so a row's sum depends on what else is in the tensor.) A stable sort and
    a segment sum: deterministic on CUDA too, where ``index_add_`` adds in no fixed order."""
    ordered, order = torch.sort(index, stable=True)
    distinct, counts = torch.unique_consecutive(ordered, return_counts=True)
    return distinct, torch.segment_reduce(values.index_select(0, order), "sum", lengths=counts)


def sparse_row_sums(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse ``[N, D]`` gradient (coalesced or not) as its rows' indices and their ``row_sums``."""
    return row_sums(grad._indices()[0], grad._values())


@torch.no_grad()
def update_rows(optimizer: RowOptimizer, weights: torch.Tensor, state: torch.Tensor, lookup: Lookup,
                grads: torch.Tensor | None = None) -> None:
    """Row-optimizer step on the looked-up rows, in place (``grads``: default, the leaf's own): the one call every
    path makes, so that they step alike (``RowOptimizer.update``)."""
    grads = lookup.rows.grad if grads is None else grads
    if grads is None:  # no lookup of this space reached the loss (e.g. all its ids were PAD)
        grads = torch.zeros_like(lookup.rows)
    optimizer.update(weights, state, lookup.index, lookup.rows, grads)


def valid_keys(keys: np.ndarray) -> np.ndarray:
    """The keys of a space's key matrix that are not PAD, flattened (what the planner plans)."""
    flat = keys.ravel()
    return flat[flat != PAD] if (flat == PAD).any() else flat
