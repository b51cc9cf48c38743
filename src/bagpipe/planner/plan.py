"""The oracle's planner: from the batch stream, every iteration's fetches, evictions and syncs.

Pure: no I/O, no clocks, no randomness. Rows are keys in one flat space (table offset + id).
Before iteration ``i`` every row of batch ``i`` is resident; when the cache would overflow,
rows are evicted after iteration ``i - 1`` by the policy's score (highest first), never rows of
batch ``i``. An evicted row is always dirty (it was used since its fetch), so each eviction is a
write-back, given to one trainer in turn. Its version is the iteration after which it was
written; a later fetch must observe that version.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

POLICIES = ("lookahead", "lru", "lfu", "none")
ONLINE_POLICIES = ("lru", "lfu")  # scored by online_scores: bagpipe.nn's slot caches use these alone
NEVER = np.iinfo(np.int64).max // 4  # "no known next use"
_NOT_IN_WINDOW = 1 << 50
_NEXT_USE_BLOCK = 64  # iterations whose next uses are computed in one vectorised pass
# The least memory every row of the flat key space costs the oracle, however small the cache: the
# planner's slot_of, freq, version and the stream's earliest (int64 each), plus cache.BatchRows'
# scratch (int32). A data set whose tables need more than the machine has cannot be planned.
PLANNER_BYTES_PER_ROW = 4 * 8 + 4


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    num_rows: int  # rows of all tables together (the flat key space)
    cache_rows: int
    lookahead: int = 200  # batches the oracle sees ahead, the current one included
    num_trainers: int = 1
    policy: str = "lookahead"
    cleanup_fraction: float = 0.0  # when evicting, also free this share of the cache (fewer, larger rounds)
    # the partitioned plan: a trainer holding a row another trainer updates keeps it, receiving the update, if its
    # own next use of the row is at most this many iterations away (0: it lets the row go)
    keep_within: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.cleanup_fraction < 1.0:
            raise ValueError(f"cleanup_fraction must be in [0, 1), got {self.cleanup_fraction}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("num_rows", "cache_rows", "lookahead", "num_trainers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.keep_within < 0:
            raise ValueError(f"keep_within must not be negative, got {self.keep_within}")


def _no_keys() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class PlanStep:
    """What happens around iteration ``iteration`` (the last step, with no batch, flushes)."""

    iteration: int
    fetch_keys: np.ndarray  # rows to make resident before `iteration` (its deadline)
    fetch_versions: np.ndarray  # the write-back version each fetch must observe (-1: initial)
    evict_keys: np.ndarray  # rows written back after `iteration - 1`, freeing their slots
    evict_writers: np.ndarray  # the trainer that writes each evicted row back
    sync_now_keys: np.ndarray  # rows of this batch used again at `iteration + 1`
    sync_later_keys: np.ndarray  # rows of this batch whose next use is later (or unknown)
    sync_later_deadlines: np.ndarray  # their next use, NEVER if none is in sight
    resident_rows: int  # residency after this step's evictions and fetches
    lookups: int  # ids in the batch, repeats included
    # Where rows live: the planner assigns cache slots, so every trainer's cache (which carries out
    # the same steps) holds a row in the slot named here, and needs no key -> slot index of its own.
    fetch_slots: np.ndarray = field(default_factory=_no_keys)  # the slot each fetched row goes to
    evict_slots: np.ndarray = field(default_factory=_no_keys)  # the slot each evicted row leaves
    batch_keys: np.ndarray = field(default_factory=_no_keys)  # the batch's distinct rows, sorted
    batch_slots: np.ndarray = field(default_factory=_no_keys)  # and their slots


class _Stream:
    """The batch stream seen through a window: unique keys of batches, and their true next uses.

    Next uses are computed for a block of batches at a time by one backward scan over the block
    plus the lookahead beyond it, through a dense array of each row's earliest use seen so far
    (O(rows), like the planner's other per-row arrays): two vectorised gathers per batch, no sort.
    Uses further away are NEVER until a later block brings them in sight.
    """

    def __init__(self, batches: Iterator[np.ndarray], *, lookahead: int, num_rows: int) -> None:
        self.batches = batches
        self.lookahead = lookahead
        self.window: deque[tuple[np.ndarray, int]] = deque()  # (unique keys, lookups) from `first`
        self.first = 0
        self.exhausted = False
        self.next_uses: dict[int, np.ndarray] = {}
        self.earliest = np.full(num_rows, NEVER, dtype=np.int64)  # first use in the current block's range

    def _fill(self, upto: int) -> None:
        while not self.exhausted and self.first + len(self.window) < upto:
            batch = next(self.batches, None)
            if batch is None:
                self.exhausted = True
            else:
                batch = np.asarray(batch, dtype=np.int64).ravel()
                unique = _sorted_unique(batch)
                if len(unique) and (unique[0] < 0 or unique[-1] >= len(self.earliest)):
                    raise ValueError(f"batch {self.first + len(self.window)} has a row outside "
                                     f"[0, {len(self.earliest)})")
                self.window.append((unique, batch.size))

    def batch(self, i: int) -> tuple[np.ndarray, int] | None:
        """Unique keys and lookup count of batch i; starts a new block of next uses when due."""
        self._fill(i + 1)
        while self.first < i and self.window:
            self.window.popleft()
            self.next_uses.pop(self.first, None)
            self.first += 1
        if not self.window:
            return None
        if i not in self.next_uses:
            self._compute_block(i)
        return self.window[0]

    def peek(self, j: int) -> np.ndarray | None:
        """Unique keys of batch ``j`` (at or after the current one) without moving on; None past the end."""
        self._fill(j + 1)
        at = j - self.first
        return self.window[at][0] if 0 <= at < len(self.window) else None

    def _compute_block(self, start: int) -> None:
        stop = start + _NEXT_USE_BLOCK
        self._fill(stop + self.lookahead)
        last = self.first + len(self.window)
        earliest = self.earliest
        earliest.fill(NEVER)
        for j in range(last - 1, start - 1, -1):  # backwards: earliest[k] is k's first use after j
            keys = self.window[j - self.first][0]
            if j < stop:
                self.next_uses[j] = earliest[keys]
            earliest[keys] = j

    def first_uses(self, keys: np.ndarray) -> np.ndarray:
        """First use of each key in the current block's range, NEVER if none."""
        return self.earliest[keys]


def plan(batches: Iterable[np.ndarray], config: PlannerConfig) -> Iterator[PlanStep]:
    """Yield one PlanStep per batch, then a final flush step that writes every resident row back.

    Each batch is an array of keys (repeats allowed), in training order.
    """
    stream = _Stream(iter(batches), lookahead=config.lookahead, num_rows=config.num_rows)
    capacity = config.cache_rows
    slot_of = np.full(config.num_rows, -1, dtype=np.int64)
    slot_key = np.full(capacity, -1, dtype=np.int64)
    slot_next = np.full(capacity, NEVER, dtype=np.int64)  # next use of the slot's row, as known
    slot_last = np.full(capacity, -1, dtype=np.int64)
    freq = np.zeros(config.num_rows, dtype=np.int64)
    version = np.full(config.num_rows, -1, dtype=np.int64)
    free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack: free[:num_free]
    num_free = capacity
    writes = 0  # write-backs handed out so far, to share them evenly among trainers
    empty = np.zeros(0, dtype=np.int64)
    previous_batch = empty  # policy "none" evicts the last batch's rows

    def evict(keys: np.ndarray, *, after: int) -> tuple[np.ndarray, np.ndarray]:
        nonlocal writes, num_free
        slots = slot_of[keys]
        free[num_free:num_free + len(slots)] = slots
        num_free += len(slots)
        slot_key[slots] = -1
        slot_of[keys] = -1
        version[keys] = after
        writers = (writes + np.arange(len(keys))) % config.num_trainers
        writes += len(keys)
        return writers, slots

    i = 0
    while (current := stream.batch(i)) is not None:
        keys, lookups = current
        if len(keys) > capacity:
            raise ValueError(f"batch {i} touches {len(keys)} distinct rows, more than the cache's "
                             f"{capacity}: raise cache_rows or lower the batch size")
        if i % _NEXT_USE_BLOCK == 0:  # a new block brings further uses of idle rows in sight
            unknown = np.flatnonzero((slot_key >= 0) & (slot_next == NEVER))
            slot_next[unknown] = stream.first_uses(slot_key[unknown])
        evict_keys, writers, evict_slots = empty, empty, empty
        if config.policy == "none" and len(previous_batch):
            evict_keys = previous_batch
            writers, evict_slots = evict(previous_batch, after=i - 1)
        missing = keys[slot_of[keys] < 0]
        overflow = len(missing) - num_free
        if overflow > 0:
            in_batch = np.zeros(capacity, dtype=bool)  # slots of batch i's resident rows: not evictable
            batch_slots = slot_of[keys]
            in_batch[batch_slots[batch_slots >= 0]] = True
            candidates = np.flatnonzero((slot_key >= 0) & ~in_batch)
            overflow = min(len(candidates), overflow + int(config.cleanup_fraction * capacity))
            score = _scores(config.policy, candidates, slot_next=slot_next, slot_last=slot_last,
                            freq=freq[slot_key[candidates]], i=i, lookahead=config.lookahead)
            chosen = candidates[np.argpartition(-score, overflow - 1)[:overflow]]
            evict_keys = np.sort(slot_key[chosen])
            writers, evict_slots = evict(evict_keys, after=i - 1)
        fetch_versions = version[missing]
        slots = free[num_free - len(missing):num_free][::-1].copy()
        num_free -= len(missing)
        slot_of[missing] = slots
        slot_key[slots] = missing
        next_use = stream.next_uses[i]
        batch_slots = slot_of[keys]
        slot_next[batch_slots] = next_use
        slot_last[batch_slots] = i
        freq[keys] += 1
        previous_batch = keys
        soon = next_use == i + 1
        visible = next_use - i <= config.lookahead
        yield PlanStep(
            iteration=i,
            fetch_keys=missing,
            fetch_versions=fetch_versions,
            evict_keys=evict_keys,
            evict_writers=writers,
            sync_now_keys=keys[soon],
            sync_later_keys=keys[~soon],
            sync_later_deadlines=np.where(visible, next_use, NEVER)[~soon],
            resident_rows=capacity - num_free,
            lookups=lookups,
            fetch_slots=slots,
            evict_slots=evict_slots,
            batch_keys=keys,
            batch_slots=batch_slots,
        )
        i += 1
    remaining = np.sort(slot_key[slot_key >= 0])
    writers, evict_slots = evict(remaining, after=i - 1) if len(remaining) else (empty, empty)
    yield PlanStep(iteration=i, fetch_keys=empty, fetch_versions=empty, evict_keys=remaining,
                   evict_writers=writers, sync_now_keys=empty, sync_later_keys=empty,
                   sync_later_deadlines=empty, resident_rows=0, lookups=0, evict_slots=evict_slots)


def plan_spaces(batches: Iterable[list[np.ndarray]], configs: list[PlannerConfig]) -> Iterator[tuple[PlanStep, ...]]:
    """``plan`` for several embedding spaces at once: each batch gives one key array per space, and
    each step is one PlanStep per space (every space's planner sees the same batches)."""
    yield from zip(*(plan(stream, config) for stream, config in zip(per_space(batches, len(configs)), configs)))


def per_space(items: Iterable[list], count: int) -> list[Iterator]:
    """``count`` iterators, the s-th yielding each item's s-th part (an item: one part per embedding space), each
    reading ``items`` only as far as it needs."""
    source = iter(items)
    waiting: list[deque] = [deque() for _ in range(count)]

    def stream(space: int) -> Iterator:
        while True:
            if not waiting[space]:
                parts = next(source, None)
                if parts is None:
                    return
                for queue, part in zip(waiting, parts, strict=True):
                    queue.append(part)
            yield waiting[space].popleft()

    return [stream(space) for space in range(count)]


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    # Sort-based: several times faster than np.unique's hash path on int64 batches.
    ordered = np.sort(values)
    return ordered[np.r_[True, ordered[1:] != ordered[:-1]]] if len(ordered) else ordered


def online_scores(policy: str, age: np.ndarray, uses: np.ndarray) -> np.ndarray:
    """Eviction priority under an online policy, highest first: ``lru`` the longest unused (``age``: iterations
    since the last use); ``lfu`` the least used (``uses``), and among equals the longest unused. The planner's
    baselines and bagpipe.nn's online caches (nn/slots.py) both score by this."""
    if policy == "lru":
        return age
    if policy == "lfu":
        return -uses * (1 << 32) + age
    raise ValueError(f"{policy!r} is not an online policy ({', '.join(ONLINE_POLICIES)})")


def _scores(policy: str, slots: np.ndarray, *, slot_next, slot_last, freq, i: int, lookahead: int) -> np.ndarray:
    """Eviction priority of resident slots (``freq`` is their rows' use counts): highest goes first."""
    age = i - slot_last[slots]
    if policy in ONLINE_POLICIES:
        return online_scores(policy, age, freq)
    # lookahead: rows with no use in the window first (least frequent of those first), then the
    # row whose next use is furthest away.
    nxt = slot_next[slots]
    return np.where(nxt - i >= lookahead, _NOT_IN_WINDOW - freq, nxt)
