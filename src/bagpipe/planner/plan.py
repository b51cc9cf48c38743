"""The oracle's planner: from the batch stream, every iteration's fetches, evictions and syncs.

Pure: no I/O, no clocks, no randomness. Rows are keys in one flat space (table offset + id).
Before iteration ``i`` every row of batch ``i`` is resident; when the cache would overflow,
rows are evicted after iteration ``i - 1`` by the policy's score (highest first), never rows of
batch ``i``. An evicted row is always dirty (it was used since its fetch), so each eviction is a
write-back, given to one trainer in turn. Its version is the iteration after which it was
written; a later fetch must observe that version.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator, NamedTuple

import numpy as np

from bagpipe.planner.evict import LOWEST, ONLINE_POLICIES, OnlineHistory, evictions_needed, highest
from bagpipe.planner.keys import KeyIndex, grown, in_key_order, sorted_distinct, unique_inverse

POLICIES = ("lookahead", *ONLINE_POLICIES, "none")  # the online ones chosen by evict.OnlineHistory, as bagpipe.nn's
NEVER = np.iinfo(np.int64).max // 4  # "no known next use"
_NOT_IN_WINDOW = 1 << 50
_INT32_KEYS = np.iinfo(np.int32).max  # a key space this small sorts its batches as int32
_FREED = -1  # a free slot's next use: below every iteration, so never idle (never evicted by _idle_evictions)
_INT32_LIMIT = 2**31 - 1  # per-row slots, use counts and versions below this are kept as int32
_NEXT_USE_BLOCK = 64  # iterations whose next uses are computed in one vectorised pass
# What a row the planner has seen costs it, at most: its number in the KeyIndex's hash table (key and value, int64
# each, in a table at most 4 times the rows it holds; the old table too while it is rebuilt) and keys array, its
# slot, use count, version (int32 each) and earliest next use (int64), every array grown by doubling (so up to
# twice the rows). Rows never seen cost nothing: a job's planner needs at most this times the distinct rows its
# data uses (preflight).
PLANNER_BYTES_PER_SEEN_ROW = 256
# And what its window of batches costs it, per id of a batch in the window (the lookahead and the next-use block
# being scanned: at most lookahead + _NEXT_USE_BLOCK batches), at most: the batch's distinct keys, their numbers and
# next uses (int64 each, at most one per id) and each id's place among them (int32, where asked for): a cost of the
# batches planned ahead, independent of the tables
PLANNER_BYTES_PER_WINDOW_ID = 28
# The partitioned plan's more, per trainer: each trainer's slot, its own stream's next uses (and the rows' holders,
# versions and next use by anyone, shared)
PARTITIONED_BYTES_PER_SEEN_ROW_PER_TRAINER = 32


def plans_ahead(policy: str) -> bool:
    """Whether ``policy`` needs the future (the lookahead plan), not only the past (an online policy, or none)."""
    return policy == "lookahead"


def index_policy(policy: str) -> str:
    """The online policy a single process's cache index (nn.SlotIndex) runs for ``policy``: its own where it is
    online, else LRU (under the lookahead policy the plan decides the evictions: bagpipe.nn.Lookahead)."""
    return policy if policy in ONLINE_POLICIES else ONLINE_POLICIES[0]


def planner_window_bytes(*, lookahead: int, batch_ids: int, partitioned: bool = False) -> int:
    """The most a planner's window of batches holds (``batch_ids``: ids in a global batch, repeats included); the
    partitioned plan streams each id twice (its trainer's slice, and the whole batch)."""
    return (lookahead + _NEXT_USE_BLOCK) * batch_ids * PLANNER_BYTES_PER_WINDOW_ID * (2 if partitioned else 1)


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
    # each id of the batch (in the order given) as its index in batch_keys, int32; only where asked for
    # (``plan(..., inverse=True)``: the oracle's messages place each trainer's ids with it, no search)
    batch_inverse: np.ndarray = field(default_factory=_no_keys)


class Numbered(NamedTuple):
    """A batch as the planner's decisions take it: its distinct keys (sorted), their numbers in the plan's KeyIndex
    (rows numbered in the order first seen), its ids counted with repeats, the rows numbered so far, and (where
    asked for) each id's index among the distinct keys; for the union of several slices' keys (the partitioned plan's
    global batch), each slice's distinct keys' indices among these (``places``)."""

    keys: np.ndarray
    numbers: np.ndarray
    lookups: int
    count: int
    inverse: np.ndarray | None = None
    places: tuple[np.ndarray, ...] | None = None


def number_batches(batches: Iterable[np.ndarray], *, num_rows: int, index: KeyIndex | None = None,
                   inverse: bool = False) -> Iterator[Numbered]:
    """Each batch of keys (repeats allowed) sorted, deduplicated and numbered (``index``: shared by several streams
    of one plan, or a new one): the stream's half of planning, independent of every decision (so it may run ahead,
    in another process: planner/ahead.py). ``inverse``: with each id's index among the distinct keys (from the
    same sort: about half a millisecond more for 53k ids)."""
    index = KeyIndex(key_bound=num_rows) if index is None else index
    for position, batch in enumerate(batches):
        batch = np.asarray(batch).ravel()
        if batch.dtype != np.int32 or num_rows > _INT32_KEYS:  # (int32 batches of a small key space stay int32)
            batch = batch.astype(np.int64, copy=False)
        if len(batch) and (batch.min() < 0 or batch.max() >= num_rows):
            raise ValueError(f"batch {position} has a row outside [0, {num_rows})")
        unique, where = distinct(batch, num_rows=num_rows, inverse=inverse)
        yield Numbered(unique, index.numbers(unique), batch.size, index.count, where)


def distinct(batch: np.ndarray, *, num_rows: int, inverse: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """A batch's distinct keys (int64, sorted) and, where asked for, each id's index among them (int32)."""
    if inverse:
        return unique_inverse(batch)
    # keys below 2^31 sort as int32 (numpy sorts them with SIMD instructions where the CPU has them: 0.5 ms for
    # 106k ids here, against 1.0 as int64 and 4.3 by a 16-bit radix)
    return (sorted_distinct(batch.astype(np.int32, copy=False)).astype(np.int64) if num_rows <= _INT32_KEYS
            else sorted_distinct(batch)), None


class _Stream:
    """The batch stream seen through a window: unique keys of batches, and their true next uses.

    Batches come numbered (``number_batches``: keys numbered in the order first seen, by a KeyIndex that several
    streams of one plan may share), and all per-row state here is over those numbers, so it grows with the rows the
    stream brings, not with the key space. Next uses are computed for a block of batches at a time by one backward
    scan over the block plus the lookahead beyond it, through an array of each row's earliest use seen so far (two
    vectorised gathers per batch, no sort); only the entries a scan set are reset before the next. Uses further
    away are NEVER until a later block brings them in sight.
    """

    def __init__(self, numbered: Iterator[Numbered], *, lookahead: int, ramp: bool = False) -> None:
        self.numbered = numbered
        self.lookahead = lookahead
        # ``ramp``: blocks of 1, 1, 2, 4, ... 64 iterations from the start, so that the first step waits for
        # 1 + lookahead batches, not 64 + lookahead (the plan is the same: see plan_numbered)
        self.ramp = ramp
        self.new_block = False  # whether the last ``batch(i)`` started a block (its rows' first uses are known)
        self.window: deque[Numbered] = deque()
        self.first = 0
        self.exhausted = False
        self.count = 0  # rows numbered so far (by the batches read into the window)
        self.next_uses: dict[int, np.ndarray] = {}
        self.earliest = np.zeros(0, dtype=np.int64)  # by number: first use in the current block's range
        self._set: list[np.ndarray] = []  # the numbers whose earliest the last scan set

    def _fill(self, upto: int) -> None:
        while not self.exhausted and self.first + len(self.window) < upto:
            numbered = next(self.numbered, None)
            if numbered is None:
                self.exhausted = True
            else:
                self.window.append(numbered)
                self.count = numbered.count

    def batch(self, i: int) -> tuple[np.ndarray, int] | None:
        """Unique keys and lookup count of batch i; starts a new block of next uses when due."""
        self._fill(i + 1)
        while self.first < i and self.window:
            self.window.popleft()
            self.next_uses.pop(self.first, None)
            self.first += 1
        if not self.window:
            return None
        self.new_block = i not in self.next_uses
        if self.new_block:
            self._compute_block(i)
        keys, lookups = self.window[0].keys, self.window[0].lookups
        return keys, lookups

    def numbers(self, i: int) -> np.ndarray:
        """The numbers of batch ``i``'s unique keys (in the same order); ``batch(i)`` first."""
        return self.window[i - self.first][1]

    def inverse(self, i: int) -> np.ndarray | None:
        """Each id of batch ``i`` as its index among the unique keys, if numbered with it; ``batch(i)`` first."""
        return self.window[i - self.first].inverse

    def places(self, i: int) -> tuple[np.ndarray, ...] | None:
        """Batch ``i``'s ``Numbered.places`` (a union of slices); ``batch(i)`` first."""
        return self.window[i - self.first].places

    def peek(self, j: int) -> np.ndarray | None:
        """Unique keys of batch ``j`` (at or after the current one) without moving on; None past the end."""
        numbered = self.peek_numbered(j)
        return None if numbered is None else numbered.keys

    def peek_numbered(self, j: int) -> Numbered | None:
        """Batch ``j`` (at or after the current one) as numbered, without moving on; None past the end."""
        self._fill(j + 1)
        at = j - self.first
        return self.window[at] if 0 <= at < len(self.window) else None

    def _compute_block(self, start: int) -> None:
        stop = start + (max(1, min(start, _NEXT_USE_BLOCK)) if self.ramp else _NEXT_USE_BLOCK)
        self._fill(stop + self.lookahead)
        last = self.first + len(self.window)
        self.earliest = grown(self.earliest, self.count, NEVER)
        earliest = self.earliest
        for numbers in self._set:
            earliest[numbers] = NEVER
        self._set = []
        for j in range(last - 1, start - 1, -1):  # backwards: earliest[k] is k's first use after j
            numbers = self.window[j - self.first][1]
            if j < stop:
                self.next_uses[j] = earliest[numbers]
            earliest[numbers] = j
            self._set.append(numbers)

    def first_uses_of(self, numbers: np.ndarray) -> np.ndarray:
        """First use of each row (by number) in the current block's range, NEVER if none."""
        return self.earliest[numbers]


def plan(batches: Iterable[np.ndarray], config: PlannerConfig, *, inverse: bool = False) -> Iterator[PlanStep]:
    """Yield one PlanStep per batch, then a final flush step that writes every resident row back.

    Each batch is an array of keys (repeats allowed), in training order. ``inverse``: each step also places every
    id of its batch among its distinct keys (``PlanStep.batch_inverse``).
    """
    return plan_numbered(number_batches(batches, num_rows=config.num_rows, inverse=inverse), config)


def plan_numbered(numbered: Iterable[Numbered], config: PlannerConfig) -> Iterator[PlanStep]:
    """``plan`` of batches already numbered (``number_batches``, here or in another process: planner/ahead.py)."""
    # rows by number (in the order first seen): the state below grows with the rows seen
    # (Blocks ramp up from the start: a block's size changes no decision. Its scan reaches ``lookahead`` past its
    # last iteration, so a row's next use is known exactly wherever it is within the window (where a score or a
    # deadline depends on it), and NEVER only where it is further: the same scores, evictions and deadlines.)
    stream = _Stream(iter(numbered), lookahead=config.lookahead, ramp=True)
    capacity = config.cache_rows
    # per row number, int32 where values allow (half the memory to grow and to gather from: these grow to the
    # rows seen, 9M and more at 26 x 40M, where the per-slot arrays stay at the cache's size)
    slot_of = np.zeros(0, dtype=np.int32 if capacity < _INT32_LIMIT else np.int64)  # its slot, -1 if not resident
    slot_row = np.full(capacity, -1, dtype=np.int64)  # the number of the slot's row, -1 if free
    slot_key = np.full(capacity, -1, dtype=np.int64)  # the key of the slot's row
    # next use of the slot's row, as known (exact within the window); _FREED where the slot is free
    slot_next = np.full(capacity, _FREED, dtype=np.int64)
    # the slot's row's last use and its uses so far (as ``freq``, by slot): what the online policies choose by, in
    # the engine they share with bagpipe.nn's caches; the lookahead policy reads the uses too
    history = OnlineHistory(capacity, config.policy if config.policy in ONLINE_POLICIES else "lru")
    slot_freq = history.uses
    slot_far = np.full(capacity, _NOT_IN_WINDOW, dtype=np.int64)  # its lookahead score with no use in the window
    freq = np.zeros(0, dtype=np.int32)  # by row number: its uses so far (int64 from iteration _INT32_LIMIT on)
    version = np.zeros(0, dtype=np.int32)  # by row number: the iteration after which it was last written back
    free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack: free[:num_free]
    num_free = capacity
    writes = 0  # write-backs handed out so far, to share them evenly among trainers
    empty = np.zeros(0, dtype=np.int64)
    previous_keys = previous_rows = empty  # policy "none" evicts the last batch's rows
    scanned = True  # whether the last eviction's rows were used once (then the next looks for those first)
    once = _OnceScan(capacity)  # where those can be

    def evict(rows: np.ndarray, *, after: int) -> tuple[np.ndarray, np.ndarray]:
        nonlocal writes, num_free
        slots = slot_of[rows].astype(np.int64)
        free[num_free:num_free + len(slots)] = slots
        num_free += len(slots)
        slot_row[slots] = -1
        slot_next[slots] = _FREED
        history.freed(slots)
        slot_of[rows] = -1
        version[rows] = after
        writers = (writes + np.arange(len(rows))) % config.num_trainers
        writes += len(rows)
        return writers, slots

    i = 0
    while (current := stream.batch(i)) is not None:
        keys, lookups = current
        rows = stream.numbers(i)
        if len(keys) > capacity:
            raise ValueError(f"batch {i} touches {len(keys)} distinct rows, more than the cache's "
                             f"{capacity}: raise cache_rows or lower the batch size")
        if i == _INT32_LIMIT - 1:  # use counts and versions reach int32's end
            freq, version = freq.astype(np.int64), version.astype(np.int64)
        if stream.count > len(slot_of):
            slot_of, freq, version = (grown(slot_of, stream.count, -1), grown(freq, stream.count, 0),
                                      grown(version, stream.count, -1))
        if stream.new_block:  # a new block brings further uses of idle rows in sight
            unknown = np.flatnonzero(slot_next == NEVER)  # (free slots are _FREED)
            slot_next[unknown] = stream.first_uses_of(slot_row[unknown])
        evict_keys, writers, evict_slots = empty, empty, empty
        if config.policy == "none" and len(previous_rows):
            evict_keys = previous_keys
            writers, evict_slots = evict(previous_rows, after=i - 1)
        held = slot_of[rows].astype(np.int64)
        absent = np.flatnonzero(held < 0)  # (positions, not a mask: a random mask's compress is several times slower)
        missing, missing_rows = keys[absent], rows[absent]
        overflow = len(missing) - num_free
        if overflow > 0:
            # every slot scored at once (contiguous arrays, no gathers); free slots and those of batch i's resident
            # rows, which may not go, score lowest
            resident = held[held >= 0]
            candidates = capacity - num_free - len(resident)
            overflow = evictions_needed(overflow, candidates=candidates, capacity=capacity,
                                        cleanup_fraction=config.cleanup_fraction)
            chosen = None
            if config.policy in ONLINE_POLICIES:
                chosen = history.victims(overflow, tick=i, keep=[resident, free[:num_free]])
            elif config.policy == "lookahead":
                chosen = _idle_evictions(overflow, slot_next=slot_next, slot_freq=slot_freq, i=i,
                                         lookahead=config.lookahead, scan=scanned, once=once)
                scanned = chosen is not None and bool((slot_freq[chosen] == 1).all())  # (so the scan finds them)
            if chosen is None:
                score = _scores(slot_next=slot_next, slot_far=slot_far, i=i, lookahead=config.lookahead)
                score[resident] = LOWEST
                score[free[:num_free]] = LOWEST
                chosen = highest(score, overflow)  # slots, in increasing order
            evict_keys, evicted = in_key_order(slot_key[chosen], slot_row[chosen])
            writers, evict_slots = evict(evicted, after=i - 1)
        fetch_versions = version[missing_rows].astype(np.int64)
        slots = free[num_free - len(missing):num_free][::-1].copy()
        num_free -= len(missing)
        slot_of[missing_rows] = slots
        slot_row[slots] = missing_rows
        slot_key[slots] = missing
        once.filled(slots)
        next_use = stream.next_uses[i]
        batch_slots = held  # (evictions took none of batch i's rows: its resident rows' slots held, the rest new)
        batch_slots[absent] = slots
        slot_next[batch_slots] = next_use
        uses = freq[rows] + 1
        freq[rows] = uses
        uses = uses.astype(np.int64)
        history.used(batch_slots, i, uses=uses)
        slot_far[batch_slots] = _NOT_IN_WINDOW - uses
        previous_keys, previous_rows = keys, rows
        inverse = stream.inverse(i)
        now = np.flatnonzero(next_use == i + 1)
        later = np.flatnonzero(next_use != i + 1)
        deadlines = next_use[later]
        deadlines[deadlines > i + config.lookahead] = NEVER  # (a deadline only where the next use is in sight)
        yield PlanStep(
            iteration=i,
            fetch_keys=missing,
            fetch_versions=fetch_versions,
            evict_keys=evict_keys,
            evict_writers=writers,
            sync_now_keys=keys[now],
            sync_later_keys=keys[later],
            sync_later_deadlines=deadlines,
            resident_rows=capacity - num_free,
            lookups=lookups,
            fetch_slots=slots,
            evict_slots=evict_slots,
            batch_keys=keys,
            batch_slots=batch_slots,
            batch_inverse=empty if inverse is None else inverse,
        )
        i += 1
    held = slot_row >= 0
    remaining, remaining_rows = in_key_order(slot_key[held], slot_row[held])
    writers, evict_slots = evict(remaining_rows, after=i - 1) if len(remaining) else (empty, empty)
    yield PlanStep(iteration=i, fetch_keys=empty, fetch_versions=empty, evict_keys=remaining,
                   evict_writers=writers, sync_now_keys=empty, sync_later_keys=empty,
                   sync_later_deadlines=empty, resident_rows=0, lookups=0, evict_slots=evict_slots)


def plan_spaces(batches: Iterable[list[np.ndarray]], configs: list[PlannerConfig], *, inverse: bool = False
                ) -> Iterator[tuple[PlanStep, ...]]:
    """``plan`` for several embedding spaces at once: each batch gives one key array per space, and
    each step is one PlanStep per space (every space's planner sees the same batches). (planner/ahead.py's
    ``plan_spaces_ahead``: the same, each space's batches numbered in a process of its own.)"""
    yield from zip(*(plan(stream, config, inverse=inverse)
                     for stream, config in zip(per_space(batches, len(configs)), configs)))


def per_space(items: Iterable[list], count: int) -> list[Iterator]:
    """``count`` iterators, the s-th yielding each item's s-th part (an item: one part per embedding space), each
    reading ``items`` only as far as it needs."""
    source = iter(items)
    waiting: list[deque] = [deque() for _ in range(count)]
    reading = threading.Lock()  # (the streams may be read on threads of their own: planner/ahead.py's feeders)

    def stream(space: int) -> Iterator:
        while True:
            with reading:
                if not waiting[space]:
                    parts = next(source, None)
                    if parts is None:
                        return
                    for queue, part in zip(waiting, parts, strict=True):
                        queue.append(part)
                part = waiting[space].popleft()
            yield part

    return [stream(space) for space in range(count)]


_SCAN_CHUNK = 1 << 14  # slots looked at first by _lowest_hits (then twice as many, and so on)


class _OnceScan:
    """Where ``_idle_evictions``' scan looks for idle rows used once, the highest scores there are.

    Such a row is idle (no use within the window) and used once. Neither can start while a row stays: its next use
    as known only comes nearer the window's end as iterations pass (or is learnt, nearer still, where it was NEVER),
    and its uses only grow; a row fetched anew is the one way (a row fetched again was used before). So after a scan
    took every such row below ``start``, there are none there but in slots filled since (``fresh``): the next scan
    looks at those, then on from ``start``, not from slot 0 again."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.start = 0  # below it, rows idle and used once are only in ``fresh`` slots
        self.fresh: list[np.ndarray] = []
        self.fresh_count = 0

    def filled(self, slots: np.ndarray) -> None:
        """Rows were fetched into ``slots``."""
        if self.start:
            self.fresh.append(slots)
            self.fresh_count += len(slots)
            if self.fresh_count > self.capacity:  # (long without a scan: start over from slot 0)
                self.start, self.fresh, self.fresh_count = 0, [], 0

    def lowest(self, count: int, *, slot_next, slot_freq, end: int) -> np.ndarray:
        """The ``count`` lowest slots holding rows with no use before ``end`` and used once (fewer where there are
        not that many), in increasing order; the caller evicts them all."""
        def hits(start: int, stop: int) -> np.ndarray:
            return np.flatnonzero((slot_next[start:stop] >= end) & (slot_freq[start:stop] == 1))

        low = np.zeros(0, dtype=np.int64)
        if self.fresh:
            fresh = sorted_distinct(np.concatenate(self.fresh))  # (a slot may be filled twice)
            fresh = fresh[fresh < self.start]
            low = fresh[(slot_next[fresh] >= end) & (slot_freq[fresh] == 1)]
        if len(low) >= count:
            found = low[:count]
        else:
            start = self.start
            found = np.concatenate([low, start + _lowest_hits(count - len(low), self.capacity - start,
                                                              lambda a, b: hits(start + a, start + b))])
        # every such row up to the last found is found (and goes); where too few were, the caller takes another way
        self.start = int(found[-1]) + 1 if count and len(found) == count else 0
        self.fresh, self.fresh_count = [], 0
        return found


def _idle_evictions(count: int, *, slot_next, slot_freq, i: int, lookahead: int, scan: bool = True,
                    once: _OnceScan | None = None) -> np.ndarray | None:
    """The lookahead policy's ``count`` evictions where the cache holds at least that many rows with no use within
    the window (``idle``), found without scoring every slot; None where it does not (the caller scores them all).

    An idle row scores _NOT_IN_WINDOW less its use count, above every row used within the window (a row of batch
    ``i`` scores lowest), so ``highest``'s choice (the ``count`` highest scores, equal ones to the earlier slot) is
    the idle rows by increasing use count, and among the last count taken, the lowest slots. Every resident row has
    been used, so rows used once score highest of all: with ``scan``, the lowest slots holding those are looked for
    first (``once``: the plan's _OnceScan, which knows where they can be; a new one looks from slot 0 in growing
    chunks); where there are not enough, one pass finds the idle rows and the use count up to which they go.
    Idle is ``slot_next`` at or past the window's end alone: a free slot's is _FREED, and a row of batch ``i``'s is
    ``i`` (a next use within the window is known exactly), both below it."""
    end = i + lookahead
    if scan:
        found = (_OnceScan(len(slot_next)) if once is None else once).lowest(count, slot_next=slot_next,
                                                                             slot_freq=slot_freq, end=end)
        if len(found) == count:
            return found
    idle = np.flatnonzero(slot_next >= end)
    if len(idle) < count:
        return None
    uses = slot_freq[idle]
    taken = np.cumsum(np.bincount(uses))
    last = int(np.searchsorted(taken, count))  # the use count the evictions go up to
    below = idle[uses < last] if last and taken[last - 1] else idle[:0]
    # the lowest slots of use count ``last`` (there are enough: ``taken``)
    more = idle[_lowest_hits(count - len(below), len(idle),
                             lambda start, stop: np.flatnonzero(uses[start:stop] == last))]
    return np.sort(np.concatenate([below, more]))


def _lowest_hits(count: int, length: int, hits_in) -> np.ndarray:
    """The first ``count`` positions below ``length`` (fewer where there are not that many) that ``hits_in(start,
    stop)`` finds (their offsets from ``start``, increasing), looked for from 0 in chunks that double."""
    found, start, chunk = [np.zeros(0, dtype=np.int64)], 0, max(_SCAN_CHUNK, 2 * count)
    while count > 0 and start < length:
        stop = min(length, start + chunk)
        hits = hits_in(start, stop)[:count] + start
        found.append(hits)
        count -= len(hits)
        start, chunk = stop, 2 * chunk
    return np.concatenate(found)


def _scores(*, slot_next, slot_far, i: int, lookahead: int) -> np.ndarray:
    """The lookahead policy's eviction priority of every slot (meaningful for those holding a row; ``slot_far``:
    _NOT_IN_WINDOW less their rows' use counts), highest first: rows with no use in the window first (the least
    used of those first), then the row whose next use is furthest away. (Policy "none" never scores: it evicts
    the last batch's rows.)"""
    return np.where(slot_next >= i + lookahead, slot_far, slot_next)
