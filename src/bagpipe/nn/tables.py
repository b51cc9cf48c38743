"""``CachedTables``: the model's tables as the reference trainer uses them (``lookup``, ``apply_gradients``), kept
in host memory behind one cache per embedding width: what ``bagpipe train --mode single`` trains through.

The host tables are the reference's own ``EmbeddingTables`` (same initial rows, same optimizer state), each
space behind a CachedRows as in CachedEmbeddingBagCollection; a lookup gathers the batch's rows from the
cache with the reference's own code, so training equals ``--mode reference`` bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from bagpipe.cache import BatchRows, BatchView
from bagpipe.embeddings import EmbeddingTables, Embeddings, Lookup, distinct_positions, gather, valid_keys
from bagpipe.nn.host import MemoryTable
from bagpipe.nn.rows import CachedRows, hit_rate, total_stats
from bagpipe.nn.slots import CLEANUP_FRACTION


class CachedTables:
    """``tables``' rows behind a cache of ``cache_rows[s]`` rows for each space s (a trainer's shares:
    ``EmbeddingLayout.split_cache``); ``policy`` "lru" or "lfu" evicts for an unknown future (with
    ``bagpipe.nn.Lookahead`` the planner decides instead)."""

    def __init__(self, tables: EmbeddingTables, *, cache_rows: list[int], policy: str = "lru",
                 cleanup_fraction: float = CLEANUP_FRACTION, device: torch.device | str | None = None) -> None:
        self.host, self.layout, self.optimizer = tables, tables.layout, tables.optimizer
        if len(cache_rows) != len(self.layout.spaces):
            raise ValueError(f"{len(cache_rows)} cache sizes for {len(self.layout.spaces)} embedding spaces")
        self.spaces = [CachedRows(MemoryTable(weights, state), cache_rows=share, optimizer=tables.optimizer,
                                  policy=policy, cleanup_fraction=cleanup_fraction, device=device)
                       for weights, state, share in zip(tables.weights, tables.state, cache_rows)]
        self._keys: list[np.ndarray] = []  # the rows of the last lookup, per space (what a step changes)
        # with a plan: each id's row in the planned batch, through a per-row scratch (as a trainer's)
        self._rows_of: list[BatchRows | None] = [None] * len(self.spaces)

    # -- EmbeddingTables' interface -------------------------------------------------------------------------

    def distinct_keys(self, ids: torch.Tensor) -> list[torch.Tensor]:
        return self.host.distinct_keys(ids)

    def lookup(self, ids: torch.Tensor, *, keys: list[torch.Tensor] | None = None) -> tuple[Embeddings, list[Lookup]]:
        blocks, lookups, self._keys = [], [], []
        for s, (space, flat) in enumerate(zip(self.layout.spaces, self.host.space_keys(ids))):
            planned = self._planned(s, flat.numpy()) if keys is None else None
            distinct, positions = planned or distinct_positions(flat, padded=space.padded,
                                                                keys=None if keys is None else keys[s])
            rows = self.spaces[s]
            slots = torch.from_numpy(rows.make_resident(distinct.numpy())).to(rows.cache_weight.device)
            block, lookup = gather(rows.cache_weight, slots, positions.to(rows.cache_weight.device),
                                   padded=space.padded)
            blocks.append(block)
            lookups.append(lookup)
            self._keys.append(distinct.numpy())
        return Embeddings(blocks, self.layout, ids), lookups

    def apply_gradients(self, lookups: list[Lookup], grads: list[torch.Tensor] | None = None) -> None:
        for s, lookup in enumerate(lookups):
            self.spaces[s].apply(lookup.index, lookup.rows, None if grads is None else grads[s])
            if self.host.changed:
                self.host.changed[s][torch.from_numpy(self._keys[s])] = True

    def _planned(self, s: int, flat: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The planned batch's distinct keys (the planner sorted them) and each id's place in them, if ``flat``
        is that batch: the values ``distinct_positions`` computes, without sorting the batch again."""
        planned = self.spaces[s].planned
        if planned is None or not len(planned[0]):
            return None
        if self._rows_of[s] is None:
            self._rows_of[s] = BatchRows(self.spaces[s].num_rows)
        keys = planned[0]
        self._rows_of[s].load(BatchView(keys, planned[1], 0, np.zeros(0, dtype=np.int32)))
        positions = self._rows_of[s].at(flat).positions.astype(np.int64)
        valid = flat >= 0
        used = positions[valid]
        if not (np.array_equal(keys[np.minimum(used, len(keys) - 1)], flat[valid])
                and np.bincount(used, minlength=len(keys)).all()):
            return None  # not the planned batch (other keys, or only some of its keys)
        return torch.from_numpy(keys), torch.from_numpy(positions)

    @property
    def weights(self) -> list[torch.Tensor]:
        """Each space's full table, the cached rows written in."""
        self.flush()
        return self.host.weights

    @property
    def state(self) -> list[torch.Tensor]:
        self.flush()
        return self.host.state

    @property
    def changed(self) -> list[torch.Tensor]:
        return self.host.changed

    def track_changes(self) -> None:
        self.host.track_changes()

    def table(self, index: int) -> torch.Tensor:
        self.flush()
        return self.host.table(index)

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
