"""Which row each slot of a single-process cache holds, and which rows to evict for an unknown future.

O(cache rows) throughout: a slot -> key array, the resident keys kept sorted beside their slots (a
lookup is a binary search, never a table-sized key -> slot array), and per slot the last use and the
use count that the LRU and LFU policies score by. Pure numpy, no torch and no device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ONLINE_POLICIES = ("lru", "lfu")


@dataclass(frozen=True)
class Admission:
    """What making a batch's rows resident takes: rows to write back, rows to fetch, and where all of them are."""

    evict_keys: np.ndarray  # sorted
    evict_slots: np.ndarray
    fetch_keys: np.ndarray  # sorted
    fetch_slots: np.ndarray
    batch_slots: np.ndarray  # the slot of each of the batch's distinct keys, in their (sorted) order


class SlotIndex:
    """The cache's bookkeeping: ``capacity`` slots, the key each holds (-1: free), and their use history."""

    def __init__(self, capacity: int, *, policy: str = "lru") -> None:
        if capacity <= 0:
            raise ValueError(f"cache_rows must be positive, got {capacity}")
        if policy not in ONLINE_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(ONLINE_POLICIES)}, got {policy!r}")
        self.capacity, self.policy = capacity, policy
        self.slot_key = np.full(capacity, -1, dtype=np.int64)
        self.last_use = np.full(capacity, -1, dtype=np.int64)
        self.uses = np.zeros(capacity, dtype=np.int64)
        self._keys = np.zeros(0, dtype=np.int64)  # resident keys, sorted
        self._slots = np.zeros(0, dtype=np.int64)  # their slots
        self.tick = 0  # batches admitted

    @property
    def resident_rows(self) -> int:
        return len(self._keys)

    def locate(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each key, -1 where it is not resident."""
        keys = np.asarray(keys, dtype=np.int64)
        if not len(self._keys):
            return np.full(len(keys), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
        return np.where(self._keys[at] == keys, self._slots[at], -1)

    def resident(self) -> tuple[np.ndarray, np.ndarray]:
        """Every resident key (sorted) and its slot."""
        return self._keys, self._slots

    def admit(self, keys: np.ndarray) -> Admission:
        """Make the distinct sorted ``keys`` of one batch resident, evicting by the policy if the cache is full.

        A batch's own rows are never evicted for it; a batch with more distinct rows than the cache is an
        error (the planner's capacity check), not a partial admission.
        """
        if len(keys) > self.capacity:
            raise ValueError(f"a batch touches {len(keys)} distinct rows, more than the cache's {self.capacity}: "
                             f"raise cache_rows or lower the batch size")
        slots = self.locate(keys)
        missing = slots < 0
        fetch_keys = keys[missing]
        free = np.flatnonzero(self.slot_key < 0)
        overflow = len(fetch_keys) - len(free)
        evict_keys = evict_slots = np.zeros(0, dtype=np.int64)
        if overflow > 0:
            candidates = np.ones(self.capacity, dtype=bool)
            candidates[slots[~missing]] = False
            candidates = np.flatnonzero(candidates & (self.slot_key >= 0))
            chosen = candidates[np.argpartition(-self._scores(candidates), overflow - 1)[:overflow]]
            order = np.argsort(self.slot_key[chosen])
            evict_slots = chosen[order]
            evict_keys = self.slot_key[evict_slots]
            self._forget(evict_keys, evict_slots)
            free = np.sort(np.concatenate([free, evict_slots]))
        fetch_slots = free[:len(fetch_keys)]
        self._place(fetch_keys, fetch_slots)
        slots[missing] = fetch_slots
        self.last_use[slots] = self.tick
        self.uses[slots] += 1
        self.tick += 1
        return Admission(evict_keys, evict_slots, fetch_keys, fetch_slots, slots)

    def preload(self, keys: np.ndarray, uses: np.ndarray) -> np.ndarray:
        """Place the sorted, distinct, not resident ``keys`` in free slots with ``uses`` as their counts (a
        frequency-aware warm-up); their slots."""
        free = np.flatnonzero(self.slot_key < 0)
        if len(keys) > len(free):
            raise ValueError(f"preloading {len(keys)} rows into {len(free)} free slots")
        slots = free[:len(keys)]
        self._place(keys, slots)
        self.uses[slots] = uses
        return slots

    def move(self, *, evict_keys: np.ndarray, evict_slots: np.ndarray, fetch_keys: np.ndarray,
             fetch_slots: np.ndarray) -> None:
        """Carry out evictions and placements decided elsewhere (a lookahead plan's step), checking that the
        evicted slots hold those rows and the fetched ones are free."""
        held = self.slot_key[evict_slots]
        if not np.array_equal(held, evict_keys):
            wrong = int(np.flatnonzero(held != evict_keys)[0])
            raise ValueError(f"the plan evicts row {int(evict_keys[wrong])} from slot {int(evict_slots[wrong])}, "
                             f"which holds row {int(held[wrong])}: the cache was used outside the plan (a batch "
                             f"looked up that is not the one planned?)")
        self._forget(evict_keys, evict_slots)
        if (self.slot_key[fetch_slots] >= 0).any():
            raise ValueError("the plan fetches into a slot that is not free: the cache was used outside the plan")
        self._place(fetch_keys, fetch_slots)

    def clear(self) -> None:
        """Every slot free (the rows' owner has written them back or dropped them)."""
        self._forget(self._keys.copy(), self._slots.copy())

    def _scores(self, slots: np.ndarray) -> np.ndarray:
        """Eviction priority, highest first: least recently used, or least used and then least recently."""
        age = self.tick - self.last_use[slots]
        return age if self.policy == "lru" else -self.uses[slots] * (1 << 32) + age

    def _forget(self, keys: np.ndarray, slots: np.ndarray) -> None:
        self.slot_key[slots] = -1
        self.last_use[slots] = -1
        self.uses[slots] = 0
        keep = ~np.isin(self._keys, keys, assume_unique=True)
        self._keys, self._slots = self._keys[keep], self._slots[keep]

    def _place(self, keys: np.ndarray, slots: np.ndarray) -> None:
        self.slot_key[slots] = keys
        at = np.searchsorted(self._keys, keys)
        self._keys, self._slots = np.insert(self._keys, at, keys), np.insert(self._slots, at, slots)
