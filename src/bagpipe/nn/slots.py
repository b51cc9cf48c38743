"""Which row each slot of a single-process cache holds, and which rows to evict for an unknown future.

O(cache rows) throughout, and O(batch rows) per batch: a slot -> key array, a key -> slot hash table (open
addressing in numpy arrays of twice the cache's size; never a table-sized array), a stack of free slots,
and the slots' use history, in the online policies' one engine (planner/evict.py's ``OnlineHistory``, which the
planner's LRU and LFU use too; here a use count counts the uses since the row came in). When a batch does not fit,
it evicts ``cleanup_fraction`` of the cache more than the batch needs, so that choosing victims (a pass over
every slot) is paid once every many batches. Pure numpy, no torch and no device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bagpipe.planner.evict import ONLINE_POLICIES, OnlineHistory, evictions_needed
from bagpipe.planner.keys import KeyTable

CLEANUP_FRACTION = 0.05  # the default share of the cache freed beyond what a batch that does not fit needs

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

    def __init__(self, capacity: int, *, policy: str = "lru", cleanup_fraction: float = CLEANUP_FRACTION) -> None:
        if capacity <= 0:
            raise ValueError(f"cache_rows must be positive, got {capacity}")
        if not 0.0 <= cleanup_fraction < 1.0:
            raise ValueError(f"cleanup_fraction must be in [0, 1), got {cleanup_fraction}")
        self.capacity, self.policy, self.cleanup_fraction = capacity, policy, cleanup_fraction
        self.slot_key = np.full(capacity, -1, dtype=np.int64)
        self.history = OnlineHistory(capacity, policy)
        self.table = KeyTable(capacity)
        self.free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack: free[:num_free], lowest on top
        self.num_free = capacity
        self._free_stale = False  # rows were moved by a plan: the stack no longer lists the free slots
        self.tick = 0  # batches admitted
        self.version = 0  # changes of which row a slot holds: slots found at one version hold their rows while it lasts

    @property
    def resident_rows(self) -> int:
        return self.table.live

    def locate(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each key, -1 where it is not resident."""
        return self.table.get(np.asarray(keys, dtype=np.int64))

    def resident(self) -> tuple[np.ndarray, np.ndarray]:
        """Every resident key, sorted, and its slot."""
        slots = np.flatnonzero(self.slot_key >= 0)
        order = np.argsort(self.slot_key[slots])
        return self.slot_key[slots[order]], slots[order]

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
        self._restack()
        overflow = len(fetch_keys) - self.num_free
        evict_keys = evict_slots = np.zeros(0, dtype=np.int64)
        if overflow > 0:
            count = evictions_needed(overflow, candidates=self.resident_rows - int((~missing).sum()),
                                     capacity=self.capacity, cleanup_fraction=self.cleanup_fraction)
            chosen = self.history.victims(count, tick=self.tick, keep=[self.slot_key < 0, slots[~missing]])
            evict_slots = chosen[np.argsort(self.slot_key[chosen])]
            evict_keys = self.slot_key[evict_slots]
            self._forget(evict_keys, evict_slots)
        fetch_slots = self._take(len(fetch_keys))
        self._place(fetch_keys, fetch_slots)
        slots[missing] = fetch_slots
        self.history.used(slots, self.tick)
        self.tick += 1
        return Admission(evict_keys, evict_slots, fetch_keys, fetch_slots, slots)

    def preload(self, keys: np.ndarray, uses: np.ndarray) -> np.ndarray:
        """Place the distinct, not resident ``keys`` in free slots with ``uses`` as their counts (a
        frequency-aware warm-up); their slots."""
        self._restack()
        if len(keys) > self.num_free:
            raise ValueError(f"preloading {len(keys)} rows into {self.num_free} free slots")
        slots = self._take(len(keys))
        self._place(keys, slots)
        self.history.uses[slots] = uses  # (no use yet: LRU takes them first, LFU by these counts)
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
        self._free_stale = True  # the plan picks its own slots; an online admission finds the free ones again

    def clear(self) -> None:
        """Every slot free (the rows' owner has written them back or dropped them)."""
        self._forget(*self.resident())

    def _restack(self) -> None:
        if self._free_stale:
            free = np.flatnonzero(self.slot_key < 0)
            self.num_free = len(free)
            self.free[:self.num_free] = free[::-1]
            self._free_stale = False

    def _take(self, count: int) -> np.ndarray:
        slots = self.free[self.num_free - count:self.num_free][::-1].copy()
        self.num_free -= count
        return slots

    def _forget(self, keys: np.ndarray, slots: np.ndarray) -> None:
        self.version += bool(len(keys))
        self.table.remove(keys)
        self.slot_key[slots] = -1
        self.history.freed(slots)
        if not self._free_stale:
            # pushed as the planner pushes them (a plan's online policy and this index fill slots alike)
            self.free[self.num_free:self.num_free + len(slots)] = slots
            self.num_free += len(slots)

    def _place(self, keys: np.ndarray, slots: np.ndarray) -> None:
        self.version += bool(len(keys))
        self.table.insert(keys, slots)
        self.slot_key[slots] = keys
