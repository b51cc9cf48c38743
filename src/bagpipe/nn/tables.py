"""``CachedTables``: the model's tables as the reference trainer uses them (``lookup``, ``apply_gradients``), kept
in host memory or on disk behind one cache per embedding width: what ``bagpipe train --mode single`` trains
through.

In memory the host tables are the reference's own ``EmbeddingTables`` (same initial rows, same optimizer
state); on disk each space is a file of records (the disk tier, storage.DiskRows) filled with the same initial rows,
block by block. Each space sits behind a CachedRows as in CachedEmbeddingBagCollection; a lookup gathers the batch's
rows from the cache with the reference's own code, so training equals ``--mode reference`` bit for bit.
"""

from __future__ import annotations

import itertools
import weakref

import numpy as np
import torch

from bagpipe.embeddings import (EmbeddingLayout, EmbeddingTables, Embeddings, Lookup, distinct_positions, gather,
                                id_places, init_row_blocks, valid_keys)
from bagpipe.embeddings.dynamic import keyed_blocks
from bagpipe.nn.host import HostTable, host_table
from bagpipe.nn.rows import CachedRows, hit_rate, total_stats
from bagpipe.nn.slots import CLEANUP_FRACTION
from bagpipe.optim import RowOptimizer
from bagpipe.planner.keys import unique_inverse
from bagpipe.storage import StorageSpec
from bagpipe.storage.memory import MemoryRows


LOAD_BLOCK_ROWS = 65_536  # rows written at once when a space is restored


class CachedTables:
    """The rows of ``layout``'s spaces (``hosts``: one HostTable each, in any storage tier) behind a cache of
    ``cache_rows[s]`` rows for each space s (a trainer's shares: ``EmbeddingLayout.split_cache``); ``policy``
    "lru" or "lfu" evicts for an unknown future (with ``bagpipe.nn.Lookahead`` the planner decides instead).
    ``over`` makes them over the reference's tables in memory, ``on_disk`` in files."""

    def __init__(self, layout: EmbeddingLayout, optimizer: RowOptimizer, hosts: list[HostTable], *,
                 cache_rows: list[int], policy: str = "lru", cleanup_fraction: float = CLEANUP_FRACTION,
                 device: torch.device | str | None = None) -> None:
        self.layout, self.optimizer = layout, optimizer
        if len(cache_rows) != len(self.layout.spaces):
            raise ValueError(f"{len(cache_rows)} cache sizes for {len(self.layout.spaces)} embedding spaces")
        self.spaces = [CachedRows(host, cache_rows=share, optimizer=optimizer, policy=policy,
                                  cleanup_fraction=cleanup_fraction, device=device)
                       for host, share in zip(hosts, cache_rows)]
        self.changed: list[torch.Tensor] = []  # per space, rows updated since the last checkpoint (if tracked)
        self._keys: list[np.ndarray] = []  # the rows of the last lookup, per space (what a step changes)
        # with a plan: each id's row in the planned batch, through a per-row scratch (as a trainer's)

    @classmethod
    def over(cls, tables: EmbeddingTables, **options) -> "CachedTables":
        """The reference's tables (in memory, shared) behind the caches."""
        hosts = [HostTable(MemoryRows(weights, state_width=state.shape[1], state=state, versioned=False))
                 for weights, state in zip(tables.weights, tables.state)]
        return cls(tables.layout, tables.optimizer, hosts, **options)

    @classmethod
    def on_disk(cls, layout: EmbeddingLayout, optimizer: RowOptimizer, *, seed: int, storage: StorageSpec,
                row_keys: list[np.ndarray] | None = None, **options) -> "CachedTables":
        """Tables initialised as the reference's from ``seed`` (raw-id tables: from each row's key, ``row_keys``
        per table, embeddings.dynamic), each space in a file in ``storage.directory``, ``storage.budget_bytes`` of
        DRAM shared among the spaces in proportion to their files."""
        shares = storage.split([storage.stored_bytes(space.num_rows, space.dim, optimizer.state_width(space.dim))
                                for space in layout.spaces])
        hosts = []
        try:
            for space, share in zip(layout.spaces, shares):
                blocks = itertools.chain.from_iterable(
                    init_row_blocks(t, layout.tables[t], seed=seed) if row_keys is None else
                    keyed_blocks(row_keys[t], table_index=t, table=layout.tables[t], seed=seed) for t in space.tables)
                hosts.append(host_table(share, num_rows=space.num_rows, dim=space.dim,
                                        state_width=optimizer.state_width(space.dim), blocks=blocks))
        except BaseException:
            for host in hosts:
                host.close()
            raise
        tables = cls(layout, optimizer, hosts, **options)
        for host in hosts:  # the files are working copies: gone with the tables
            weakref.finalize(tables, host.close)
        return tables

    # -- EmbeddingTables' interface -------------------------------------------------------------------------

    def space_keys(self, ids: torch.Tensor) -> list[torch.Tensor]:
        return [torch.from_numpy(keys) for keys in self.layout.keys(ids.numpy())]

    def distinct_keys(self, ids: torch.Tensor) -> list[torch.Tensor]:
        return [torch.unique(keys[keys >= 0]) for keys in self.space_keys(ids)]

    def lookup(self, ids: torch.Tensor, *, keys: list[torch.Tensor] | None = None) -> tuple[Embeddings, list[Lookup]]:
        blocks, lookups, self._keys = [], [], []
        for s, (space, flat) in enumerate(zip(self.layout.spaces, self.space_keys(ids))):
            planned = self._planned(s, flat.numpy()) if keys is None else None
            distinct, positions = planned or distinct_positions(flat, padded=space.padded,
                                                                keys=None if keys is None else keys[s])
            rows = self.spaces[s]
            slots, positions = rows.slots.to_device(rows.make_resident(distinct.numpy()), positions)
            block, lookup = gather(rows.cache_weight, slots, positions, padded=space.padded)
            blocks.append(block)
            lookups.append(lookup)
            self._keys.append(distinct.numpy())
        return Embeddings(blocks, self.layout, ids), lookups

    def apply_gradients(self, lookups: list[Lookup], grads: list[torch.Tensor] | None = None) -> None:
        for s, lookup in enumerate(lookups):
            self.spaces[s].apply(lookup.index, lookup.rows, None if grads is None else grads[s])
            if self.changed:
                self.changed[s][torch.from_numpy(self._keys[s])] = True

    def _planned(self, s: int, flat: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The planned batch's distinct keys (the planner sorted them) and each id's place in them, if ``flat``
        is that batch: the values ``distinct_positions`` computes, taken from the planner's sort where the ids are
        those the plan placed (``CachedRows.placed``: bagpipe.nn.Lookahead's), else by one sort of the batch
        (keys.unique_inverse) whose distinct keys must be exactly the planned ones."""
        planned = self.spaces[s].planned
        if planned is None or not len(planned[0]):
            return None
        keys, placed = planned[0], self.spaces[s].placed
        given = valid_keys(flat)
        if placed is not None and np.array_equal(given, placed[0]):
            inverse = placed[1]  # the ids the plan placed (its sort's places): nothing to sort here
        else:
            distinct, inverse = unique_inverse(given)
            if not np.array_equal(distinct, keys):
                return None  # not the planned batch (other keys, or only some of its keys)
        positions = id_places(flat, inverse, empty=len(keys)).astype(np.int64)  # PAD: the empty place after the rows
        return torch.from_numpy(keys), torch.from_numpy(positions)

    def track_changes(self) -> None:
        """Mark every row an update touches from now on (what an incremental checkpoint writes)."""
        self.changed = [torch.zeros(rows.num_rows, dtype=torch.bool) for rows in self.spaces]

    def read_rows(self, space: int, keys: np.ndarray | None = None, *,
                  with_state: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """Copies of a space's rows ``keys`` (default: every row), the cached rows written in, and their state."""
        rows = self.spaces[space]
        rows.flush()
        if keys is None:  # a table on disk reads a copy; one in memory gives views, copied here
            weights, state = (part.numpy().copy() if rows.host.views else part.numpy()
                              for part in rows.host.rows(0, rows.num_rows))
        else:
            weights, state = (part.numpy() for part in rows.host.read(keys))
        return weights, state if with_state else None

    def remake_rows(self, space: int, keys: np.ndarray, weights: torch.Tensor) -> None:
        """``EmbeddingTables.remake_rows``, wherever each row is: a cached one in its slot (written back when it
        leaves), any other on the host (a plan makes the rows of its step resident before the step: those are
        cached, and the read-ahead, which reads only rows not cached, never meets them)."""
        keys = np.asarray(keys, dtype=np.int64)
        self.spaces[space].remake(keys, weights)
        if self.changed:
            self.changed[space][torch.from_numpy(keys)] = True

    def load_rows(self, space: int, weights: np.ndarray, state: np.ndarray) -> None:
        """Every row of a space and its optimizer state replaced (a checkpoint restored); the cache emptied."""
        rows = self.spaces[space]
        rows.empty()
        for start in range(0, rows.num_rows, LOAD_BLOCK_ROWS):
            stop = min(start + LOAD_BLOCK_ROWS, rows.num_rows)
            rows.host.write(np.arange(start, stop, dtype=np.int64), torch.from_numpy(weights[start:stop]),
                            torch.from_numpy(state[start:stop]))

    def table(self, index: int) -> torch.Tensor:
        """Table ``index``'s rows, the cached rows written in (in memory a view; on disk a copy)."""
        space, offset = self.layout.place(index)
        rows = self.spaces[space]
        rows.flush()
        return rows.host.rows(offset, offset + self.layout.tables[index].num_rows)[0]

    def close(self) -> None:
        """Delete the tables' files, if on disk."""
        for rows in self.spaces:
            rows.host.close()

    def flush(self) -> None:
        for rows in self.spaces:
            rows.flush()

    # -- what bagpipe.nn.Lookahead plans for --------------------------------------------------------------

    def cached_spaces(self) -> list[CachedRows]:
        return self.spaces

    def plan_keys(self, ids: torch.Tensor) -> list[np.ndarray]:
        return [valid_keys(keys) for keys in self.layout.keys(ids.numpy())]

    def cache_stats(self) -> dict:
        """Rows looked up, fetched and written back over all spaces, the hit rate, and the cache's size."""
        totals = total_stats(self.spaces)
        totals["batches"] //= len(self.spaces)
        return {**totals, "hit_rate": hit_rate(totals), "cache_rows": [rows.index.capacity for rows in self.spaces]}

    def storage_stats(self) -> dict:
        """The disk tier's counters over all spaces (rows read from and written to the files, DRAM-cache hits);
        empty in memory."""
        totals: dict = {}
        for rows in self.spaces:
            for name, value in rows.host.stats().items():
                totals[name] = totals.get(name, 0) + value
        return totals
