"""The partitioned plan: each trainer holds only the rows its own slices use, and rows are exchanged only among the
trainers that use them.

Pure, as plan.py: no I/O, no clocks, no randomness. The input is, per iteration, each trainer's slice of the
global batch as flat keys. A row used at iteration ``i`` has its *users* there (the trainers whose slice uses it);
before ``i`` every user holds it, and no other trainer does. The rules that keep every copy exact:

- A trainer keeps a row after using it, in a slot of its own cache, until its capacity needs the slot or another
  trainer uses the row without it: a holder that is not a user at ``i`` lets the row go before ``i`` (its copy
  would miss that update). So at every iteration the holders of a row are among its users, and every holder's copy
  is current: all of them applied every update since they fetched it.
- A row is *dirty* when it was updated since the servers last got it. Before a trainer fetches a dirty row, a
  holder writes it back (a *hand-off*), so the fetch reads the current version; the servers already park a fetch
  until the version it asks for arrives. The last holder of a dirty row to let it go writes it back.
- At ``i`` a row's users sum their contributions and each applies the same update (rows of one user need no
  exchange: ``own``; the others are ``shared``, each with an *owner* among its users, balanced by key); every
  holder's copy stays equal to the others'.

Eviction for capacity (per trainer, never a row of its current slice): rows another trainer will use before this
one first (their copies would be let go anyway), then rows not used within the lookahead, then the row whose next
use by this trainer is furthest away. Versions are iterations, as in plan.py: a write-back before ``i`` carries
the iteration of the row's last update, and a fetch asks for the version of the row's last update (-1: never).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from bagpipe.planner.plan import _NEXT_USE_BLOCK, _NOT_IN_WINDOW, NEVER, PlannerConfig, _Stream, per_space

_GIVEN_UP = _NOT_IN_WINDOW * 2  # a row another trainer uses first: its copy here would be let go anyway


@dataclass(frozen=True)
class TrainerStep:
    """One trainer's part of the boundary before an iteration, and of the iteration."""

    write_keys: np.ndarray  # rows this trainer writes back first (hand-offs, and dirty rows it is the last to hold)
    write_versions: np.ndarray  # the version each carries (the iteration of the row's last update)
    write_slots: np.ndarray  # the slot each is read from
    drop_keys: np.ndarray  # rows it lets go (another trainer updates them without it, or its capacity needs them)
    drop_slots: np.ndarray  # the slots they leave
    fetch_keys: np.ndarray  # rows it fetches
    fetch_versions: np.ndarray  # the version each fetch must observe (-1: the initial row)
    fetch_slots: np.ndarray  # the slot each goes to
    batch_keys: np.ndarray  # its slice's distinct rows, sorted
    batch_slots: np.ndarray  # and their slots
    own_keys: np.ndarray  # rows of its slice no other trainer uses now: updated here, no exchange
    shared_keys: np.ndarray  # rows of its slice other trainers use too: their contributions summed among the users
    shared_owners: np.ndarray  # each shared row's owner (one of its users)
    shared_users: np.ndarray  # each shared row's users, a bit per trainer (bit t: trainer t uses it now)
    resident_rows: int  # rows held after this boundary


@dataclass(frozen=True)
class PartitionedStep:
    iteration: int
    trainers: tuple[TrainerStep, ...]
    lookups: int  # ids in the global batch, repeats included


@dataclass
class _Cache:
    """One trainer's residency: which row each slot holds, each row's slot, the next use by this trainer."""

    slot_of: np.ndarray  # per row: its slot here, -1 if not held
    slot_key: np.ndarray  # per slot: its row, -1 if free
    slot_next: np.ndarray  # per slot: the next use of its row by this trainer, as known
    free: np.ndarray  # a stack of free slots: free[:num_free]
    num_free: int

    @classmethod
    def empty(cls, num_rows: int, capacity: int) -> "_Cache":
        return cls(np.full(num_rows, -1, dtype=np.int32), np.full(capacity, -1, dtype=np.int64),
                   np.full(capacity, NEVER, dtype=np.int64), np.arange(capacity - 1, -1, -1, dtype=np.int64), capacity)

    def let_go(self, keys: np.ndarray) -> np.ndarray:
        """Free the slots of ``keys``; the slots."""
        slots = self.slot_of[keys].astype(np.int64)
        self.free[self.num_free:self.num_free + len(slots)] = slots
        self.num_free += len(slots)
        self.slot_key[slots] = -1
        self.slot_next[slots] = NEVER
        self.slot_of[keys] = -1
        return slots

    def take(self, keys: np.ndarray) -> None:
        slots = self.free[self.num_free - len(keys):self.num_free][::-1].copy()
        self.num_free -= len(keys)
        self.slot_of[keys] = slots
        self.slot_key[slots] = keys


def _in(keys: np.ndarray, sorted_keys: np.ndarray) -> np.ndarray:
    """Whether each of ``keys`` is in ``sorted_keys`` (sorted, distinct)."""
    if not len(sorted_keys):
        return np.zeros(len(keys), dtype=bool)
    at = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    return sorted_keys[at] == keys


def plan_partitioned(slices: Iterable[list[np.ndarray]], config: PlannerConfig) -> Iterator[PartitionedStep]:
    """One PartitionedStep per iteration (``slices``: per iteration, each trainer's keys, repeats allowed), then a
    final step that writes back every dirty row and lets every row go. ``config.cache_rows`` is each trainer's
    capacity; ``config.num_trainers`` the trainers."""
    trainers, capacity = config.num_trainers, config.cache_rows
    if trainers > 63:
        raise ValueError(f"the partitioned plan names a row's users in 63 bits: {trainers} trainers are too many")
    if config.policy != "lookahead":
        raise ValueError(f"the partitioned plan evicts by lookahead only, not {config.policy!r}")
    def with_batch(parts: list) -> list[np.ndarray]:  # each trainer's keys, then the global batch's
        parts = [np.asarray(part, dtype=np.int64).ravel() for part in parts]
        if len(parts) != trainers:
            raise ValueError(f"an iteration has {len(parts)} slices for {trainers} trainers")
        return [*parts, np.concatenate(parts)]

    streams = per_space((with_batch(parts) for parts in slices), trainers + 1)
    own = [_Stream(streams[t], lookahead=config.lookahead, num_rows=config.num_rows) for t in range(trainers)]
    everyone = _Stream(streams[trainers], lookahead=config.lookahead, num_rows=config.num_rows)
    caches = [_Cache.empty(config.num_rows, capacity) for _ in range(trainers)]
    latest = np.full(config.num_rows, -1, dtype=np.int64)  # the iteration of each row's last update
    server = np.full(config.num_rows, -1, dtype=np.int64)  # the version the servers hold
    next_any = np.full(config.num_rows, NEVER, dtype=np.int64)  # each row's next use by any trainer, as known
    holders = np.zeros(config.num_rows, dtype=np.int16)  # how many trainers hold each row
    empty = np.zeros(0, dtype=np.int64)

    i = 0
    while (global_batch := everyone.batch(i)) is not None:
        batch, lookups = global_batch
        mine = [own[t].batch(i)[0] for t in range(trainers)]
        for t, keys in enumerate(mine):
            if len(keys) > capacity:
                raise ValueError(f"trainer {t}'s slice of batch {i} touches {len(keys)} distinct rows, more than its "
                                 f"cache's {capacity}: raise cache_rows or lower the batch size")
        if i % _NEXT_USE_BLOCK == 0:  # a new block brings further uses of idle rows in sight
            for t, cache in enumerate(caches):
                unknown = np.flatnonzero((cache.slot_key >= 0) & (cache.slot_next == NEVER))
                cache.slot_next[unknown] = own[t].first_uses(cache.slot_key[unknown])
            held = np.flatnonzero((holders > 0) & (next_any == NEVER))
            next_any[held] = everyone.first_uses(held)
        users = np.stack([_in(batch, keys) for keys in mine])  # [trainer, row of the batch]: it uses the row now
        count = users.sum(axis=0)
        writes: list[list] = [[] for _ in range(trainers)]
        write_slots: list[list] = [[] for _ in range(trainers)]
        drops: list[list] = [[] for _ in range(trainers)]
        drop_slots: list[list] = [[] for _ in range(trainers)]
        # 1. Holders that do not use a row now let it go; a dirty row some user lacks is handed off first.
        held_by = [caches[t].slot_of[batch] >= 0 for t in range(trainers)]
        fetching = np.zeros(len(batch), dtype=bool)
        for t in range(trainers):
            fetching |= users[t] & ~held_by[t]
        handoff = fetching & (latest[batch] > server[batch])
        if handoff.any():
            rows = batch[handoff]
            turn = rows % np.maximum(holders[rows], 1)  # the writer: a holder, balanced by key
            seen = np.zeros(len(rows), dtype=np.int64)
            for t in range(trainers):
                here = held_by[t][handoff]
                write = here & (seen == turn)
                if write.any():
                    writes[t].append(rows[write])
                    write_slots[t].append(caches[t].slot_of[rows[write]].astype(np.int64))
                seen += here
            server[rows] = latest[rows]
        for t in range(trainers):
            stale = held_by[t] & ~users[t]
            if stale.any():
                keys = batch[stale]
                drop_slots[t].append(caches[t].let_go(keys))
                holders[keys] -= 1
                drops[t].append(keys)
        # 2. Room for the fetches: each trainer evicts for its own capacity (never a row of its slice).
        fetches = []
        for t, cache in enumerate(caches):
            keys = mine[t]
            missing = keys[cache.slot_of[keys] < 0]
            overflow = len(missing) - cache.num_free
            if overflow > 0:
                resident = cache.slot_of[keys]
                in_slice = np.zeros(capacity, dtype=bool)
                in_slice[resident[resident >= 0]] = True
                candidates = np.flatnonzero((cache.slot_key >= 0) & ~in_slice)
                overflow = min(len(candidates), overflow + int(config.cleanup_fraction * capacity))
                rows = cache.slot_key[candidates]
                nxt = cache.slot_next[candidates]
                score = np.where(next_any[rows] < nxt, _GIVEN_UP,
                                 np.where(nxt - i >= config.lookahead, _NOT_IN_WINDOW, nxt))
                chosen = np.sort(rows[np.argpartition(-score, overflow - 1)[:overflow]])
                slots = cache.let_go(chosen)
                holders[chosen] -= 1
                drops[t].append(chosen)
                drop_slots[t].append(slots)
                last = (holders[chosen] == 0) & (latest[chosen] > server[chosen])
                if last.any():  # the last holder of a dirty row writes it back
                    writes[t].append(chosen[last])
                    write_slots[t].append(slots[last])
                    server[chosen[last]] = latest[chosen[last]]
            fetches.append(missing)
        # 3. The fetches, at the version of each row's last update (the servers have it now).
        steps = []
        for t, cache in enumerate(caches):
            missing = fetches[t]
            cache.take(missing)
            holders[missing] += 1
            keys = mine[t]
            cache.slot_next[cache.slot_of[keys]] = own[t].next_uses[i]
            shared = count[users[t]] > 1
            shared_keys = keys[shared]
            owners, users_of = _owners(shared_keys, users[:, users[t] & (count > 1)])
            write_keys = np.concatenate(writes[t]) if writes[t] else empty
            steps.append(TrainerStep(
                write_keys=write_keys, write_versions=latest[write_keys],
                write_slots=np.concatenate(write_slots[t]) if write_slots[t] else empty,
                drop_keys=np.concatenate(drops[t]) if drops[t] else empty,
                drop_slots=np.concatenate(drop_slots[t]) if drop_slots[t] else empty,
                fetch_keys=missing, fetch_versions=latest[missing],
                fetch_slots=cache.slot_of[missing].astype(np.int64),
                batch_keys=keys, batch_slots=cache.slot_of[keys].astype(np.int64),
                own_keys=keys[~shared], shared_keys=shared_keys, shared_owners=owners, shared_users=users_of,
                resident_rows=capacity - cache.num_free))
        # 4. The iteration: every row of the batch is updated by its users.
        latest[batch] = i
        next_any[batch] = everyone.next_uses[i]
        yield PartitionedStep(iteration=i, trainers=tuple(steps), lookups=lookups)
        i += 1
    # The final flush: every dirty row written back by one of its holders, every row let go.
    steps = []
    for t, cache in enumerate(caches):
        keys = np.sort(cache.slot_key[cache.slot_key >= 0])
        slots = cache.let_go(keys)
        holders[keys] -= 1
        last = (holders[keys] == 0) & (latest[keys] > server[keys])
        server[keys[last]] = latest[keys[last]]
        steps.append(TrainerStep(write_keys=keys[last], write_versions=latest[keys[last]], write_slots=slots[last],
                                 drop_keys=keys, drop_slots=slots, fetch_keys=empty, fetch_versions=empty,
                                 fetch_slots=empty, batch_keys=empty, batch_slots=empty, own_keys=empty,
                                 shared_keys=empty, shared_owners=empty, shared_users=empty, resident_rows=0))
    yield PartitionedStep(iteration=i, trainers=tuple(steps), lookups=0)


def _owners(shared: np.ndarray, uses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each shared row's owner (one of its users, chosen by key so that ownership is balanced) and its users as a
    bitmask (bit t: trainer t); ``uses``: [trainer, row], whether the trainer uses the row now."""
    if not len(shared):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    turn = shared % uses.sum(axis=0)
    seen = np.cumsum(uses, axis=0) - uses  # users before each trainer
    owners = np.argmax(uses & (seen == turn), axis=0).astype(np.int64)
    return owners, (uses.astype(np.int64) << np.arange(len(uses), dtype=np.int64)[:, None]).sum(axis=0)


def plan_partitioned_spaces(slices: Iterable[list[list[np.ndarray]]],
                            configs: list[PlannerConfig]) -> Iterator[tuple[PartitionedStep, ...]]:
    """``plan_partitioned`` for several embedding spaces: each iteration gives, per space, each trainer's keys, and
    each step is one PartitionedStep per space."""
    yield from zip(*(plan_partitioned(stream, config)
                     for stream, config in zip(per_space(slices, len(configs)), configs)))
