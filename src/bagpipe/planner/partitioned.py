"""The partitioned plan: each trainer holds only the rows its own slices use, and rows are exchanged only among the
trainers that use them.

Pure, as plan.py: no I/O, no clocks, no randomness. The input is, per iteration, each trainer's slice of the
global batch as flat keys. A row used at iteration ``i`` has its *users* there (the trainers whose slice uses it);
before ``i`` every user holds it, and no other trainer does. The rules that keep every copy exact:

- A trainer keeps a row after using it, in a slot of its own cache, until its capacity needs the slot or another
  trainer uses the row without it. A holder that is not a user at ``i`` either lets the row go before ``i`` or,
  when its own next use of the row is at most ``keep_within`` iterations away, *keeps* it: it receives the update
  of ``i`` as the users apply it (the users' contributions summed, its own none). So at every iteration the holders
  of a row are its users and keepers (its *holders* mask), and every holder's copy is current: all of them applied
  every update since they fetched it. (With ``keep_within`` > 0 a trainer that uses at ``i + 1`` a row others use
  at ``i`` *joins* them at ``i``: it fetches the row before ``i``'s update and keeps it through ``i``; its fetch is
  *late*, needed only at the next boundary, when it applies ``i``'s update.)
- A row is *dirty* when it was updated since the servers last got it. Before a trainer fetches a dirty row, a
  holder writes it back (a *hand-off*), so the fetch reads the current version; the servers already park a fetch
  until the version it asks for arrives. The last holder of a dirty row to let it go writes it back. Hand-offs go
  as early as the plan can tell: at the boundary after the row's last update when a non-holder uses it before any
  holder does again, else at the boundary before the fetch's; so a fetch that waits for a hand-off finds it on its
  server an iteration before it is due, instead of waiting at its own boundary for another trainer's.
- At ``i`` a row's users sum their contributions and every holder applies the same update (a row of one user that
  no other trainer keeps needs no exchange: ``own``; the others are ``shared``, each with an *owner* among its
  users, balanced by key); every holder's copy stays equal to the others'.

Eviction for capacity (per trainer, never a row of its current slice, and a row it keeps now only when nothing else
will do): rows another trainer will use before this one first, then rows not used within the lookahead, then the
rows whose next use by this trainer is furthest away (``_evicted``). Versions are iterations, as in plan.py: a
write-back before ``i`` carries the iteration of the row's last update, and a fetch asks for the version of the
row's last update (-1: never). (The runtime labels a write-back with its boundary, ``i - 1``, instead: every update
it holds is from before ``i``, and no later one is.)

Owners (``shared_owners``) are planned for the record and the tests: the runtime has every holder sum the users'
contributions in trainer order itself, so it needs none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from bagpipe.planner.keys import KeyIndex, grown
from bagpipe.planner.keys import unique_inverse
from bagpipe.planner.evict import highest
from bagpipe.planner.plan import _NEXT_USE_BLOCK, NEVER, Numbered, PlannerConfig, _Stream, distinct, per_space, plans_ahead


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
    fetch_late: np.ndarray  # bool per fetch: a row it joins as a keeper now and uses next, needed only at the next
    # boundary (its update of this iteration is received there): the fetch can wait an iteration longer. Nothing
    # writes such a row back at that next boundary (every trainer using it then joins or holds it), so the version
    # the fetch asks for is on its server by the boundary the fetch is made at.
    batch_keys: np.ndarray  # its slice's distinct rows, sorted
    batch_slots: np.ndarray  # and their slots
    own_keys: np.ndarray  # rows of its slice no other trainer uses or keeps now: updated here, no exchange
    shared_keys: np.ndarray  # rows of its slice other trainers use or keep too: contributions summed among users
    shared_owners: np.ndarray  # each shared row's owner (one of its users)
    shared_users: np.ndarray  # each shared row's users, a bit per trainer (bit t: trainer t uses it now)
    shared_holders: np.ndarray  # and its holders (its users and keepers), who all apply the update
    kept_keys: np.ndarray  # rows it keeps though its slice does not use them now: it receives their update
    kept_slots: np.ndarray
    kept_users: np.ndarray  # each kept row's users (bit t: trainer t), whose contributions it receives
    kept_holders: np.ndarray  # and its holders
    resident_rows: int  # rows held after this boundary
    # each id of its slice (in the order given) as its index in batch_keys, int32; only where asked for
    # (``plan_partitioned(..., inverse=True)``: the oracle's messages place the slice's ids with it, no search)
    batch_inverse: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))


@dataclass(frozen=True)
class PartitionedStep:
    iteration: int
    trainers: tuple[TrainerStep, ...]
    lookups: int  # ids in the global batch, repeats included


@dataclass
class _Cache:
    """One trainer's residency: which row each slot holds, each row's slot, the next use by this trainer. Rows are
    their numbers in the plan's KeyIndex (the order first seen)."""

    slot_of: np.ndarray  # per row number: its slot here, -1 if not held
    slot_row: np.ndarray  # per slot: its row's number, -1 if free
    slot_next: np.ndarray  # per slot: the next use of its row by this trainer, as known
    # per slot: its row's next use by any trainer (the plan's ``next_any``, kept here by slot: an eviction compares
    # it with ``slot_next`` over the whole cache, which a gather from per-row arrays made slow)
    slot_any: np.ndarray
    free: np.ndarray  # a stack of free slots: free[:num_free]
    num_free: int

    @classmethod
    def empty(cls, capacity: int) -> "_Cache":
        return cls(np.zeros(0, dtype=np.int32), np.full(capacity, -1, dtype=np.int64),
                   np.full(capacity, NEVER, dtype=np.int64), np.full(capacity, NEVER, dtype=np.int64),
                   np.arange(capacity - 1, -1, -1, dtype=np.int64), capacity)

    def let_go(self, rows: np.ndarray) -> np.ndarray:
        """Free the slots of ``rows``; the slots."""
        slots = self.slot_of[rows].astype(np.int64)
        self.free[self.num_free:self.num_free + len(slots)] = slots
        self.num_free += len(slots)
        self.slot_row[slots] = -1
        self.slot_next[slots] = NEVER
        self.slot_of[rows] = -1
        return slots

    def take(self, rows: np.ndarray, next_any: np.ndarray) -> None:
        slots = self.free[self.num_free - len(rows):self.num_free][::-1].copy()
        self.num_free -= len(rows)
        self.slot_of[rows] = slots
        self.slot_row[slots] = rows
        self.slot_any[slots] = next_any[rows]

    def any_changed(self, rows: np.ndarray, next_any: np.ndarray) -> None:
        """``next_any`` of ``rows`` changed: the slots holding any of them follow."""
        slots = self.slot_of[rows]
        held = np.flatnonzero(slots >= 0)
        self.slot_any[slots[held]] = next_any[rows[held]]


def _in(keys: np.ndarray, sorted_keys: np.ndarray) -> np.ndarray:
    """Whether each of ``keys`` is in ``sorted_keys`` (sorted, distinct)."""
    if not len(sorted_keys):
        return np.zeros(len(keys), dtype=bool)
    at = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    return sorted_keys[at] == keys


def _number_slices(slices: Iterable[list[np.ndarray]], trainers: int, *, num_rows: int, index: KeyIndex,
                   inverse: bool) -> Iterator[list[Numbered]]:
    """Per iteration, each trainer's slice numbered (its distinct keys, sorted; with ``inverse``, each id's index
    among them), then the global batch's: the union of the slices' distinct keys, with each slice's places among
    them (``Numbered.places``: which trainers use each row, no search). The union is numbered first, in key order,
    as a sort of the whole batch would be: the same numbers."""
    for position, parts in enumerate(slices):
        parts = [np.asarray(part, dtype=np.int64).ravel() for part in parts]
        if len(parts) != trainers:
            raise ValueError(f"an iteration has {len(parts)} slices for {trainers} trainers")
        mine = [distinct(part, num_rows=num_rows, inverse=inverse) for part in parts]
        union, where = unique_inverse(np.concatenate([keys for keys, _ in mine]))
        if len(union) and (union[0] < 0 or union[-1] >= num_rows):
            raise ValueError(f"batch {position} has a row outside [0, {num_rows})")
        numbers = index.numbers(union)
        bounds = np.cumsum([0] + [len(keys) for keys, _ in mine])
        places = tuple(where[start:stop] for start, stop in zip(bounds[:-1], bounds[1:]))
        yield [*(Numbered(keys, numbers[place], len(part), index.count, ids)
                 for (keys, ids), place, part in zip(mine, places, parts)),
               Numbered(union, numbers, sum(len(part) for part in parts), index.count, places=places)]


def plan_partitioned(slices: Iterable[list[np.ndarray]], config: PlannerConfig, *,
                     inverse: bool = False) -> Iterator[PartitionedStep]:
    """One PartitionedStep per iteration (``slices``: per iteration, each trainer's keys, repeats allowed), then a
    final step that writes back every dirty row and lets every row go. ``config.cache_rows`` is each trainer's
    capacity; ``config.num_trainers`` the trainers. ``inverse``: each trainer's step also places every id of its
    slice among its distinct keys (``TrainerStep.batch_inverse``)."""
    trainers, capacity = config.num_trainers, config.cache_rows
    if trainers > 63:
        raise ValueError(f"the partitioned plan names a row's users in 63 bits: {trainers} trainers are too many")
    if not plans_ahead(config.policy):
        raise ValueError(f"the partitioned plan evicts by lookahead only, not {config.policy!r}")
    # Rows are numbered in the order first seen (one KeyIndex for every stream), and the state below is over those
    # numbers: it grows with the rows the plan sees, not with the key space. Keys appear in the steps, and decide
    # wherever order or balance is by key (sorting, owners, writers).
    index = KeyIndex(key_bound=config.num_rows)
    streams = per_space(_number_slices(slices, trainers, num_rows=config.num_rows, index=index, inverse=inverse),
                        trainers + 1)
    own = [_Stream(streams[t], lookahead=config.lookahead) for t in range(trainers)]
    everyone = _Stream(streams[trainers], lookahead=config.lookahead)
    caches = [_Cache.empty(capacity) for _ in range(trainers)]
    latest = np.zeros(0, dtype=np.int64)  # per row number: the iteration of its last update (-1: none)
    server = np.zeros(0, dtype=np.int64)  # the version the servers hold (-1: the initial row)
    next_any = np.zeros(0, dtype=np.int64)  # its next use by any trainer, as known
    holders = np.zeros(0, dtype=np.int16)  # how many trainers hold it
    empty = np.zeros(0, dtype=np.int64)
    keys_of = index.keys_of

    ahead: list = [[] for _ in range(trainers)]  # per trainer, rows it hands off ahead at the next boundary
    i = 0
    while (global_batch := everyone.batch(i)) is not None:
        batch, lookups = global_batch
        rows = everyone.numbers(i)  # the global batch's rows, by number, in key order as ``batch``
        mine = [own[t].batch(i)[0] for t in range(trainers)]
        mine_rows = [own[t].numbers(i) for t in range(trainers)]
        if index.count > len(latest):  # (every stream has numbered the rows of i + 1 by now: peeked below)
            latest, server = grown(latest, index.count, -1), grown(server, index.count, -1)
            next_any, holders = grown(next_any, index.count, NEVER), grown(holders, index.count, 0)
            for cache in caches:
                cache.slot_of = grown(cache.slot_of, index.count, -1)
        for t, keys in enumerate(mine):
            if len(keys) > capacity:
                raise ValueError(f"trainer {t}'s slice of batch {i} touches {len(keys)} distinct rows, more than its "
                                 f"cache's {capacity}: raise cache_rows or lower the batch size")
        if i % _NEXT_USE_BLOCK == 0:  # a new block brings further uses of idle rows in sight
            for t, cache in enumerate(caches):
                unknown = np.flatnonzero((cache.slot_row >= 0) & (cache.slot_next == NEVER))
                cache.slot_next[unknown] = own[t].first_uses_of(cache.slot_row[unknown])
            held = np.flatnonzero((holders > 0) & (next_any == NEVER))
            next_any[held] = everyone.first_uses_of(held)
            for cache in caches:
                cache.any_changed(held, next_any)
        users = np.zeros((trainers, len(batch)), dtype=bool)  # [trainer, row of the batch]: it uses the row now
        for t, place in enumerate(everyone.places(i)):
            users[t, place] = True
        writes, write_slots = _ahead(ahead, caches)
        drops: list[list] = [[] for _ in range(trainers)]
        drop_slots: list[list] = [[] for _ in range(trainers)]
        # 1. Holders that do not use a row now keep it (its next use by them is near) or let it go; a dirty row
        # some user lacks is handed off first.
        held_by = [caches[t].slot_of[rows] >= 0 for t in range(trainers)]
        keeping = [np.zeros(len(batch), dtype=bool) for _ in range(trainers)]
        joining = [np.zeros(len(batch), dtype=bool) for _ in range(trainers)]
        if config.keep_within:
            for t, cache in enumerate(caches):
                stale = np.flatnonzero(held_by[t] & ~users[t])
                if len(stale):
                    keeping[t][stale] = cache.slot_next[cache.slot_of[rows[stale]]] - i <= config.keep_within
                # A row others use now and this trainer next: it joins them as a keeper now, so that the fetch
                # (of the version before this iteration's update) has an iteration to arrive.
                following = own[t].peek(i + 1)
                if following is not None:
                    joining[t] = ~users[t] & ~held_by[t] & _in(batch, following)
                    room = capacity - len(mine[t])  # (a join is optional: without it the row is fetched at i + 1)
                    joining[t][np.flatnonzero(joining[t])[room:]] = False
                    keeping[t] |= joining[t]
        _hand_off_before(i + 1, everyone, own, batch, caches, latest, server, writes, write_slots)
        fetching = np.zeros(len(batch), dtype=bool)
        for t in range(trainers):
            fetching |= (users[t] | joining[t]) & ~held_by[t]
        handoff = fetching & (latest[rows] > server[rows])
        if handoff.any():
            handed = rows[handoff]
            _write(batch[handoff], handed, [held[handoff] for held in held_by], caches, writes, write_slots)
            server[handed] = latest[handed]
        for t in range(trainers):
            stale = held_by[t] & ~users[t] & ~keeping[t]
            if stale.any():
                gone = rows[stale]
                drop_slots[t].append(caches[t].let_go(gone))
                holders[gone] -= 1
                drops[t].append(gone)
        # 2. Room for the fetches: each trainer evicts for its own capacity (never a row of its slice).
        fetches = []
        for t, cache in enumerate(caches):
            slice_rows = mine_rows[t]
            missing = slice_rows[cache.slot_of[slice_rows] < 0]
            overflow = len(missing) + int(joining[t].sum()) - cache.num_free
            if overflow > 0:
                resident = cache.slot_of[slice_rows]
                in_slice = np.zeros(capacity, dtype=bool)
                in_slice[resident[resident >= 0]] = True
                kept = np.zeros(capacity, dtype=bool)  # rows it keeps now: let go only if nothing else will do
                kept[cache.slot_of[rows[keeping[t] & held_by[t]]]] = True
                others = (cache.slot_row >= 0) & ~in_slice & ~kept
                chosen = _evicted(cache, others, min(int(others.sum()), overflow + int(config.cleanup_fraction
                                                                                        * capacity)),
                                  beyond=i + config.lookahead)
                if len(chosen) < overflow:  # (never for the cleanup's sake)
                    chosen = np.concatenate([chosen, _evicted(cache, kept, overflow - len(chosen),
                                                              beyond=i + config.lookahead, others_first=False)])
                chosen = index.in_key_order(cache.slot_row[chosen])[1]
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
        for t, cache in enumerate(caches):  # (a kept row its capacity needed is let go after all)
            keeping[t] &= (cache.slot_of[rows] >= 0) | joining[t]
        bits = (np.int64(1) << np.arange(trainers, dtype=np.int64))[:, None]
        users_of, holders_of = (users * bits).sum(axis=0), ((users | np.stack(keeping)) * bits).sum(axis=0)
        # 3. The fetches, at the version of each row's last update (the servers have it now).
        steps = []
        for t, cache in enumerate(caches):
            joined = rows[joining[t]]
            missing = np.concatenate([fetches[t], joined])
            late = np.arange(len(missing)) >= len(fetches[t])
            cache.take(missing, next_any)
            holders[missing] += 1
            cache.slot_next[cache.slot_of[joined]] = i + 1
            keys = mine[t]
            cache.slot_next[cache.slot_of[mine_rows[t]]] = own[t].next_uses[i]
            shared = holders_of[users[t]] != bits[t, 0]
            shared_keys = keys[shared]
            owners = _owners(shared_keys, users[:, users[t]][:, shared])
            written = np.concatenate(writes[t]) if writes[t] else empty
            dropped = np.concatenate(drops[t]) if drops[t] else empty
            steps.append(TrainerStep(
                write_keys=keys_of(written), write_versions=latest[written],
                write_slots=np.concatenate(write_slots[t]) if write_slots[t] else empty,
                drop_keys=keys_of(dropped),
                drop_slots=np.concatenate(drop_slots[t]) if drop_slots[t] else empty,
                fetch_keys=keys_of(missing), fetch_versions=latest[missing],
                fetch_slots=cache.slot_of[missing].astype(np.int64), fetch_late=late,
                batch_keys=keys, batch_slots=cache.slot_of[mine_rows[t]].astype(np.int64),
                own_keys=keys[~shared], shared_keys=shared_keys, shared_owners=owners,
                shared_users=users_of[users[t]][shared], shared_holders=holders_of[users[t]][shared],
                kept_keys=batch[keeping[t]], kept_slots=cache.slot_of[rows[keeping[t]]].astype(np.int64),
                kept_users=users_of[keeping[t]], kept_holders=holders_of[keeping[t]],
                resident_rows=capacity - cache.num_free,
                **({"batch_inverse": own[t].inverse(i)} if inverse else {})))
        # 4. The iteration: every row of the batch is updated by its holders.
        latest[rows] = i
        next_any[rows] = coming = everyone.next_uses[i]
        for cache in caches:
            cache.any_changed(rows, next_any)
        # 5. Hand-offs ahead: a row that a trainer not holding it uses before any holder does again is written back
        # at the next boundary (by a holder, balanced by key), so the fetch that needs it can be issued ahead.
        first_again = np.full(len(batch), NEVER, dtype=np.int64)
        for t, cache in enumerate(caches):
            here = np.flatnonzero((holders_of >> t) & 1)
            first_again[here] = np.minimum(first_again[here], cache.slot_next[cache.slot_of[rows[here]]])
        soon = np.flatnonzero((coming != NEVER) & (coming < first_again))
        ahead = [[] for _ in range(trainers)]
        if len(soon):
            who = holders_of[soon]
            ahead = [rows[soon][write] for write in _writers(batch[soon], [((who >> t) & 1).astype(bool)
                                                                           for t in range(trainers)])]
            server[rows[soon]] = i
        yield PartitionedStep(iteration=i, trainers=tuple(steps), lookups=lookups)
        i += 1
    # The final flush: every dirty row written back by one of its holders (or ahead), every row let go.
    steps = []
    writes, write_slots = _ahead(ahead, caches)
    for t, cache in enumerate(caches):
        keys, held = index.in_key_order(cache.slot_row[cache.slot_row >= 0])
        early = np.concatenate(writes[t]) if writes[t] else empty
        early_slots = np.concatenate(write_slots[t]) if write_slots[t] else empty
        slots = cache.let_go(held)
        holders[held] -= 1
        last = (holders[held] == 0) & (latest[held] > server[held])
        server[held[last]] = latest[held[last]]
        written = np.concatenate([early, held[last]])
        steps.append(TrainerStep(write_keys=keys_of(written), write_versions=latest[written],
                                 write_slots=np.concatenate([early_slots, slots[last]]),
                                 drop_keys=keys, drop_slots=slots, fetch_keys=empty, fetch_versions=empty,
                                 fetch_slots=empty, fetch_late=np.zeros(0, dtype=bool), batch_keys=empty,
                                 batch_slots=empty, own_keys=empty,
                                 shared_keys=empty, shared_owners=empty, shared_users=empty, shared_holders=empty,
                                 kept_keys=empty, kept_slots=empty, kept_users=empty, kept_holders=empty,
                                 resident_rows=0))
    yield PartitionedStep(iteration=i, trainers=tuple(steps), lookups=0)


def _evicted(cache: _Cache, candidates: np.ndarray, count: int, *, beyond: int, others_first: bool = True
             ) -> np.ndarray:
    """``count`` of a trainer's slots where ``candidates`` (a mask over its slots) to let go: rows another trainer
    uses first (unless not ``others_first``: kept rows, which others use now), then rows not used within the window
    (next use at ``beyond`` or later), then the furthest next uses. Each class is taken whole before the next (in
    slot order within the first two), so the costly partial sort runs only over the rows in the window, and only
    when the first two classes do not suffice. Masks over the cache's per-slot arrays, no gather per row."""
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    first = np.zeros(0, dtype=np.int64)
    rest = candidates
    if others_first:
        given_up = candidates & (cache.slot_any < cache.slot_next)
        first = np.flatnonzero(given_up)
        if len(first) >= count:
            return first[:count]
        rest = candidates & ~given_up
    far = np.flatnonzero(rest & (cache.slot_next >= beyond))
    if len(first) + len(far) >= count:
        return np.concatenate([first, far[:count - len(first)]])
    near = np.flatnonzero(rest & (cache.slot_next < beyond))
    need = count - len(first) - len(far)
    return np.concatenate([first, far, near[highest(cache.slot_next[near], need)]])


def _hand_off_before(n: int, everyone: _Stream, own: list[_Stream], batch: np.ndarray, caches: list[_Cache],
                     latest: np.ndarray, server: np.ndarray, writes: list[list], write_slots: list[list]) -> None:
    """Hand-offs an iteration early: a dirty row that a trainer not holding it uses at ``n`` and that nobody
    updates before (it is not in the current ``batch``) is written back now, by one of its holders (balanced by
    key), so that the fetch at ``n`` finds it on its server (rather than wait for a hand-off at ``n``'s boundary)."""
    coming = everyone.peek_numbered(n)
    if coming is None:
        return
    new = np.flatnonzero(~_in(coming.keys, batch))
    keys, rows = coming.keys[new], coming.numbers[new]
    dirty = latest[rows] > server[rows]
    keys, rows = keys[dirty], rows[dirty]
    if not len(rows):
        return
    lacking = np.zeros(len(rows), dtype=bool)
    for t, cache in enumerate(caches):
        lacking |= _in(keys, own[t].peek(n)) & (cache.slot_of[rows] < 0)
    keys, rows = keys[lacking], rows[lacking]
    if not len(rows):
        return
    _write(keys, rows, [cache.slot_of[rows] >= 0 for cache in caches], caches, writes, write_slots)  # (held: dirty)
    server[rows] = latest[rows]


def _writers(rows: np.ndarray, holding: list[np.ndarray]) -> list[np.ndarray]:
    """The one trainer that writes back each of ``rows`` (``holding[t]``: whether trainer t holds each): of its
    holders in trainer order, the (key mod their number)-th, so that write-backs are balanced among the trainers.
    Per trainer, which of the rows it writes."""
    turn = rows % np.maximum(np.sum(holding, axis=0), 1)
    seen = np.zeros(len(rows), dtype=np.int64)
    chosen = []
    for here in holding:
        chosen.append(here & (seen == turn))
        seen += here
    return chosen


def _write(keys: np.ndarray, rows: np.ndarray, holding: list[np.ndarray], caches: list[_Cache], writes: list[list],
           write_slots: list[list]) -> None:
    """``_writers``' write-backs of ``keys`` (``rows``: their numbers) added to each trainer's, read from its
    slots."""
    for t, write in enumerate(_writers(keys, holding)):
        if write.any():
            writes[t].append(rows[write])
            write_slots[t].append(caches[t].slot_of[rows[write]].astype(np.int64))


def _ahead(ahead: list, caches: list[_Cache]) -> tuple[list[list], list[list]]:
    """Each trainer's write-backs (row numbers) and their slots, begun with the rows it hands off ahead at this
    boundary."""
    writes = [[rows] if len(rows) else [] for rows in ahead]
    slots = [[cache.slot_of[rows].astype(np.int64)] if len(rows) else [] for rows, cache in zip(ahead, caches)]
    return writes, slots


def _owners(shared: np.ndarray, uses: np.ndarray) -> np.ndarray:
    """Each shared row's owner (one of its users, chosen by key so that ownership is balanced); ``uses``: [trainer,
    row], whether the trainer uses the row now."""
    if not len(shared):
        return np.zeros(0, dtype=np.int64)
    turn = shared % uses.sum(axis=0)
    seen = np.cumsum(uses, axis=0) - uses  # users before each trainer
    return np.argmax(uses & (seen == turn), axis=0).astype(np.int64)


def plan_partitioned_spaces(slices: Iterable[list[list[np.ndarray]]], configs: list[PlannerConfig], *,
                            inverse: bool = False) -> Iterator[tuple[PartitionedStep, ...]]:
    """``plan_partitioned`` for several embedding spaces: each iteration gives, per space, each trainer's keys, and
    each step is one PartitionedStep per space."""
    yield from zip(*(plan_partitioned(stream, config, inverse=inverse)
                     for stream, config in zip(per_space(slices, len(configs)), configs)))
