"""Trainer-side row cache: a fixed number of slots holding rows and their optimizer state.

Memory is O(cache rows x dim): the key -> slot map is a sorted array of the resident keys, never
an array over all rows. The cache carries out a plan step (evict, then install fetched rows) and
serves lookups whose gradients the row optimizer applies to the cached rows in place.
"""

from __future__ import annotations

import numpy as np
import torch

from bagpipe.embeddings import Bags, Lookup, flat_keys, gather_bags, gather_rows, table_offsets, update_rows
from bagpipe.optim import RowOptimizer


class RowCache:
    def __init__(self, *, capacity: int, dim: int, optimizer: RowOptimizer, device: str = "cpu") -> None:
        if capacity <= 0:
            raise ValueError(f"cache capacity must be positive, got {capacity}")
        self.capacity, self.dim, self.optimizer = capacity, dim, optimizer
        self.weights = torch.zeros(capacity, dim, device=device)
        self.state = torch.zeros(capacity, optimizer.state_width(dim), device=device)
        self.slot_key = np.full(capacity, -1, dtype=np.int64)
        self._index_keys = np.zeros(0, dtype=np.int64)  # resident keys, sorted
        self._index_slots = np.zeros(0, dtype=np.int64)

    @property
    def resident_rows(self) -> int:
        return len(self._index_keys)

    def _positions(self, keys: np.ndarray) -> np.ndarray:
        """Where each (resident) key sits in the sorted index."""
        keys = np.asarray(keys, dtype=np.int64)
        pos = np.searchsorted(self._index_keys, keys)
        found = pos < len(self._index_keys)
        found[found] = self._index_keys[pos[found]] == keys[found]
        if not found.all():
            raise KeyError(f"{int((~found).sum())} rows are not resident (first: key {int(keys[~found][0])}); "
                           "the plan and the cache disagree")
        return pos

    def slots_of(self, keys: np.ndarray) -> np.ndarray:
        return self._index_slots[self._positions(keys)]

    def evict(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove ``keys``; return their rows and state for the write-back."""
        pos = self._positions(keys)
        slots = torch.from_numpy(self._index_slots[pos])
        rows, state = self.weights.index_select(0, slots), self.state.index_select(0, slots)
        self.slot_key[slots.numpy()] = -1
        keep = np.ones(len(self._index_keys), dtype=bool)
        keep[pos] = False  # the index stays sorted: no re-sort, one O(resident) pass
        self._index_keys, self._index_slots = self._index_keys[keep], self._index_slots[keep]
        return rows, state

    def install(self, keys: np.ndarray, rows: torch.Tensor, state: torch.Tensor) -> None:
        free = np.flatnonzero(self.slot_key < 0)
        if len(keys) > len(free):
            raise ValueError(f"installing {len(keys)} rows into a cache with {len(free)} free slots")
        keys = np.asarray(keys, dtype=np.int64)
        if len(self._index_keys) and len(keys):
            near = np.searchsorted(self._index_keys, keys).clip(max=len(self._index_keys) - 1)
            if (self._index_keys[near] == keys).any():
                raise ValueError("installing rows that are already resident: the plan and the cache disagree")
        slots = free[:len(keys)]
        self.slot_key[slots] = keys
        index = torch.from_numpy(slots)
        self.weights.index_copy_(0, index, rows.to(self.weights.device))
        if state.shape[1]:
            self.state.index_copy_(0, index, state.to(self.state.device))
        order = np.argsort(keys, kind="stable")  # merge the new keys into the sorted index
        at = np.searchsorted(self._index_keys, keys[order])
        self._index_keys = np.insert(self._index_keys, at, keys[order])
        self._index_slots = np.insert(self._index_slots, at, slots[order])

    def lookup(self, keys: torch.Tensor, bags: Bags | None = None) -> tuple[torch.Tensor, Lookup]:
        """Embeddings [B, T, D] of flat keys [B, T], or pooled ``bags`` whose flat keys are ``keys`` [N].

        Every key must be resident.
        """
        unique_keys, inverse = torch.unique(keys, return_inverse=True)
        slots = torch.from_numpy(self.slots_of(unique_keys.numpy())).to(self.weights.device)
        inverse = inverse.to(self.weights.device)
        if bags is not None:
            return gather_bags(self.weights, slots, inverse, bags)
        return gather_rows(self.weights, slots, inverse)

    def apply_to(self, keys: np.ndarray, grads: torch.Tensor) -> None:
        """Row-optimizer step on resident ``keys`` with the given (e.g. all-reduced) gradients."""
        slots = torch.from_numpy(self.slots_of(keys)).to(self.weights.device)
        update_rows(self.optimizer, self.weights, self.state, Lookup(slots, self.weights.index_select(0, slots)),
                    grads.to(self.weights.device))

    def apply_gradients(self, lookup: Lookup, grads: torch.Tensor | None = None) -> None:
        """Row-optimizer step on the looked-up slots (``grads``: e.g. all-reduced ones)."""
        update_rows(self.optimizer, self.weights, self.state, lookup, grads)


class CachedTables:
    """A RowCache seen through per-table ids, with the reference tables' lookup interface."""

    def __init__(self, cache: RowCache, table_sizes: list[int]) -> None:
        self.cache = cache
        self.offsets = torch.from_numpy(table_offsets(table_sizes))

    def lookup(self, ids: torch.Tensor | Bags) -> tuple[torch.Tensor, Lookup]:
        """Embeddings [B, T, D] of one-hot ids [B, T], or pooled bags."""
        return self.cache.lookup(flat_keys(ids, self.offsets), bags=ids if isinstance(ids, Bags) else None)

    def apply_gradients(self, lookup: Lookup, grads: torch.Tensor | None = None) -> None:
        self.cache.apply_gradients(lookup, grads)
