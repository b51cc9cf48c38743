"""Erasure-coded shards: groups of ``k`` data shards and one parity shard, exact to the bit.

For each row position (a shard's local row index), the parity holds the XOR of its ``k`` members' rows *and
optimizer state* as raw bit patterns, and which version of each member's row that XOR holds. A write-back to a
member folds ``old ^ new`` into the parity. XOR of bit patterns loses nothing: a member's row rebuilt as the parity
XOR the other members' rows is the lost row bit for bit, optimizer state included (ECRec's parity is a
floating-point sum, so its rebuilt rows are only near the lost ones).

A rebuild reads each survivor's row together with its version and uses it only where the parity holds that very
version of it: a write-back whose delta has not reached the parity yet (or has, while the survivor was read) is
seen as a mismatch and read again, never mixed in. Deltas of one member's row are folded in their order (a delta
arriving before its predecessor waits for it), and a delta already folded in (a retried write-back) is a no-op.

Components with no knowledge of processes (the servers' wiring puts an RPC where a call is here):

- ``ParityRows``: the parity of one group of one space.
- ``reconstruct``: a lost member's rows from a parity read and the survivors' reads.
- ``StandIn``: a lost member served from its group while it is rebuilt, then the member again.
- ``ParityGroups``: every shard of one space, data and parity, with failures: the single-process reference that
  the distributed servers must equal.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from bagpipe.planner.keys import sorted_distinct
from bagpipe.storage.bits import BITS, from_bits, row_bits
from bagpipe.storage.rowstore import RowStore, initial_blocks, shard_num_rows

REBUILD_CHUNK_ROWS = 1 << 14


class TwoLossesInAGroup(RuntimeError):
    """A second member of a parity group was lost before the first was rebuilt: parity covers one loss."""


class ParityRows:
    """The parity of one group of ``k`` data shards of one space: ``num_rows`` positions (the longest member's
    rows; a shorter member counts as zeros, never written, past its end) of ``width`` 32-bit words."""

    def __init__(self, *, num_rows: int, width: int, k: int) -> None:
        self.num_rows, self.width, self.k = num_rows, width, k
        self.bits = np.zeros((num_rows, width), dtype=BITS)
        self.versions = np.full((num_rows, k), -1, dtype=np.int64)  # [position, member]: the version held
        self.deltas_applied = 0
        self.generation = 0  # counts the applies that changed anything: what a reader waits past
        # rows written back to each member, by version (each once: a repeated delta is not counted): what a
        # stand-in's snapshot waits for, since the lost member's own count was lost with it
        self.received: list[Counter] = [Counter() for _ in range(k)]
        self._pending: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, int]] = []  # deltas ahead of their turn
        self._changed = threading.Condition()
        # a parity made while its members train (a replacement's): [position, member] whether that member's row
        # is in the bits yet; a delta waits for its row to be installed. None: every row is.
        self.installed: np.ndarray | None = None

    @classmethod
    def empty(cls, *, num_rows: int, width: int, k: int) -> "ParityRows":
        """A parity to be made from its members' rows as they stand while they train (``install``), deltas
        arriving meanwhile folded in once their row is there (or dropped if the row read already holds them)."""
        parity = cls(num_rows=num_rows, width=width, k=k)
        parity.installed = np.zeros((num_rows, k), dtype=bool)
        return parity

    def install(self, member: int, start: int, bits: np.ndarray, versions: np.ndarray) -> None:
        """``member``'s rows ``start:start + len(bits)`` as read from it (bits and versions, read together under
        its lock), XORed in; then the deltas that waited for them."""
        stop = start + len(bits)
        with self._changed:
            if self.installed[start:stop, member].any():
                raise ValueError(f"member {member}'s rows {start}:{stop} are installed already")
            self.bits[start:stop] ^= bits
            self.versions[start:stop, member] = versions
            self.installed[start:stop, member] = True
            self._fold_pending()
            self.generation += 1
            self._changed.notify_all()

    def complete(self) -> bool:
        """Whether every member's rows are in the bits."""
        with self._changed:
            return self.installed is None or bool(self.installed.all())

    @classmethod
    def of(cls, members: list[RowStore]) -> "ParityRows":
        """The parity of ``members`` as they stand (read in chunks)."""
        num_rows = max(member.num_rows for member in members)
        parity = cls(num_rows=num_rows, width=members[0].dim + members[0].state_width, k=len(members))
        for index, member in enumerate(members):
            for start in range(0, member.num_rows, REBUILD_CHUNK_ROWS):
                stop = min(start + REBUILD_CHUNK_ROWS, member.num_rows)
                rows, state, versions = member.read_range(start, stop)
                parity.bits[start:stop] ^= row_bits(rows, state)
                parity.versions[start:stop, index] = versions
        return parity

    @classmethod
    def initial(cls, layout, space: int, *, shards: list[int], num_shards: int, state_width: int,
                seed: int, keys_of: Callable[[int], list[np.ndarray] | None] | None = None) -> "ParityRows":
        """The parity of data shards ``shards`` (of ``num_shards``) as initialised, made block by block from the
        seed as each shard makes its rows: no member is ever held whole. Optimizer state starts at zero.
        ``keys_of(shard)``: raw-id tables, the shard's row keys (rowstore.shard_keys)."""
        dim = layout.spaces[space].dim
        counts = [shard_num_rows(layout, space, shard, num_shards) for shard in shards]
        parity = cls(num_rows=max(counts), width=dim + state_width, k=len(shards))
        for shard in shards:
            start = 0
            keys = keys_of(shard) if keys_of is not None else None
            for block in initial_blocks(layout, space, shard, num_shards, seed=seed, keys=keys):
                parity.bits[start:start + len(block), :dim] ^= block.numpy().view(BITS)
                start += len(block)
        return parity

    def apply(self, member: int, local: np.ndarray, delta: np.ndarray, before: np.ndarray, version: int) -> None:
        """Fold in a write-back of ``member``'s rows ``local`` at ``version``: ``delta`` = old ^ new bits, ``before``
        the versions the old rows had. A row whose parity does not hold ``before`` yet waits for its earlier delta;
        one that holds ``version`` or later already has this one."""
        local, before = np.asarray(local, dtype=np.int64), np.asarray(before, dtype=np.int64)
        with self._changed:
            self._pending.append((member, local, np.asarray(delta, dtype=BITS), before, version))
            if self._fold_pending():
                self.generation += 1
                self._changed.notify_all()

    def _fold_pending(self) -> bool:
        """Fold in what of the waiting deltas can be (under the lock); whether anything was."""
        changed, progress = False, True
        while progress:  # a row folded in may be the one another delta waits for
            progress = False
            still = []
            for entry in self._pending:
                folded, complete = self._fold(*entry)
                progress |= folded
                if not complete:
                    still.append(entry)
            self._pending = still
            changed |= progress
        return changed

    def _fold(self, member: int, local: np.ndarray, delta: np.ndarray, before: np.ndarray,
              version: int) -> tuple[bool, bool]:
        """Fold in what of one delta can be: whether any row was, and whether all of it is done."""
        held = self.versions[local, member]
        done = held >= version
        due = (held == before) & ~done
        if self.installed is not None:  # a row not read from its member yet: the delta waits for it
            there = self.installed[local, member]
            done &= there
            due &= there
        if due.any():
            rows = local[due]
            self.bits[rows] ^= delta[due]
            self.versions[rows, member] = version
            self.deltas_applied += int(due.sum())
            self.received[member][version] += int(due.sum())
        return bool(due.any()), bool((done | due).all())

    def pending_rows(self) -> int:
        """Rows of deltas waiting for an earlier delta of the same row."""
        with self._changed:
            return sum(int(np.count_nonzero(self.versions[local, member] < version))
                       for member, local, _, _, version in self._pending)

    def read(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the parity bits of ``local`` and the member versions they hold ``[len, k]``."""
        local = np.asarray(local, dtype=np.int64)
        with self._changed:
            return self.bits[local], self.versions[local]

    def wait_past(self, generation: int, timeout: float) -> bool:
        """Wait until a delta has been folded in since ``generation`` was read; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self.generation > generation, timeout)


def read_member(store: RowStore, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A member's bits and versions at ``local``, zeros and -1 past its end (as the parity counts it)."""
    local = np.asarray(local, dtype=np.int64)
    inside = local < store.num_rows
    bits = np.zeros((len(local), store.dim + store.state_width), dtype=BITS)
    versions = np.full(len(local), -1, dtype=np.int64)
    if inside.any():
        rows, state, have = store.read(local[inside])
        bits[inside], versions[inside] = row_bits(rows, state), have
    return bits, versions


def reconstruct(member: int, parity: tuple[np.ndarray, np.ndarray],
                survivors: dict[int, tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``member``'s bits and versions at the positions read, from the parity's (bits, versions ``[n, k]``) and every
    other member's (bits, versions); and which positions were read consistently (the parity holding exactly the
    survivors' versions). Inconsistent positions' results mean nothing: read them again."""
    bits, held = parity
    lost = bits.copy()
    consistent = np.ones(len(bits), dtype=bool)
    for index, (their_bits, their_versions) in survivors.items():
        lost ^= their_bits
        consistent &= held[:, index] == their_versions
    return lost, held[:, member].copy(), consistent


class StandIn:
    """A lost member served from its group while it is rebuilt into ``store`` (a fresh shard of the same place):
    a row not rebuilt yet is reconstructed when first fetched or written back, and ``rebuild`` fills the rest
    chunk by chunk. Writes go to ``store``, which folds them into the parity as any member does. Once
    ``complete``, ``store`` is the member, bit for bit as the lost shard would be."""

    def __init__(self, store: RowStore, *, member: int, parity: ParityRows,
                 survivors: dict[int, RowStore], timeout: float = 30.0) -> None:
        self.store, self.member, self.parity, self.survivors = store, member, parity, survivors
        # write-backs to this member are counted by the parity, the lost member's before the loss included
        store.received, store.counts_write_backs = parity.received[member], False
        self.timeout = timeout
        self.rebuilt = np.zeros(store.num_rows, dtype=bool)
        self.rows_rebuilt = 0  # of rebuilt, kept as a count: a rebuild asks after every chunk
        self.rows_reconstructed = 0  # by a fetch or a write-back that needed them, before the rebuild reached them
        self._next = 0  # rebuild's position
        self._lock = threading.Lock()

    @property
    def complete(self) -> bool:
        return self.rows_rebuilt == self.store.num_rows

    @property
    def rows_left(self) -> int:
        return self.store.num_rows - self.rows_rebuilt

    def ensure(self, local: np.ndarray, *, asked: bool = True) -> None:
        """Reconstruct the rows of ``local`` not rebuilt yet (``asked``: by a fetch or write-back, counted)."""
        with self._lock:
            missing = sorted_distinct(np.asarray(local, dtype=np.int64)[~self.rebuilt[local]])
            while len(missing):
                seen = self.parity.generation  # before the reads: a delta folded in after them wakes the retry
                lost, versions, consistent = reconstruct(
                    self.member, self.parity.read(missing),
                    {index: read_member(store, missing) for index, store in self.survivors.items()})
                done = missing[consistent]
                if len(done):
                    self._install(done, lost[consistent], versions[consistent])
                    self.rows_reconstructed += len(done) if asked else 0
                missing = missing[~consistent]
                if len(missing) and not self.parity.wait_past(seen, self.timeout):
                    raise TimeoutError(f"{len(missing)} rows of lost shard {self.store.shard} could not be read "
                                       f"consistently from their parity group within {self.timeout:.0f} s")

    def _install(self, local: np.ndarray, bits: np.ndarray, versions: np.ndarray) -> None:
        rows, state = from_bits(bits, self.store.dim)
        for version in np.unique(versions).tolist():
            chosen = np.flatnonzero(versions == version)
            self.store.put(local[chosen], rows[chosen], state[chosen], version=version)
        self.rebuilt[local] = True  # none of them was: ensure installs only rows missing
        self.rows_rebuilt += len(local)

    def rebuild(self, max_rows: int = REBUILD_CHUNK_ROWS) -> int:
        """Rebuild up to ``max_rows`` more rows (in position order); return how many were left to rebuild."""
        start = self._next
        stop = min(start + max_rows, self.store.num_rows)
        self.ensure(np.arange(start, stop, dtype=np.int64), asked=False)
        self._next = stop
        return self.rows_left

    def fetch(self, keys: np.ndarray, versions: np.ndarray, *, timeout: float) -> tuple[torch.Tensor, torch.Tensor]:
        self.ensure(self.store._local(keys))
        return self.store.fetch(keys, versions, timeout=timeout)

    def write_back(self, keys: np.ndarray, rows: torch.Tensor, state: torch.Tensor, *, version: int) -> None:
        """Rebuilds the rows first (the parity needs the old rows to fold the new ones in). A write-back sent again
        after its server was lost may have reached the parity before: its rows are then at ``version`` already,
        which the store leaves alone."""
        self.ensure(self.store._local(keys))
        self.store.write_back(keys, rows, state, version=version)


class ParityGroups:
    """Every shard of one space: ``num_shards`` data shards in groups of ``k`` (shard s in group s // k), each
    group with a parity; the single-process reference of erasure-coded servers. ``lose(shard)`` drops a shard's
    rows; from then on its place is a ``StandIn`` until ``rebuild`` completes it."""

    def __init__(self, make_store: Callable[[int], RowStore], *, num_shards: int, k: int) -> None:
        if k < 1 or num_shards % k:
            raise ValueError(f"{num_shards} data shards do not form groups of {k}")
        self.make_store, self.k = make_store, k
        self.members: list[RowStore | StandIn] = [make_store(shard) for shard in range(num_shards)]
        self.parities = [ParityRows.of(self.members[g * k:(g + 1) * k]) for g in range(num_shards // k)]
        for shard, store in enumerate(self.members):
            self._attach(shard, store)

    def _attach(self, shard: int, store: RowStore) -> None:
        parity, member = self.parities[shard // self.k], shard % self.k
        store.parity_sink = functools.partial(parity.apply, member)

    def lose(self, shard: int) -> None:
        """Shard ``shard`` is gone (its rows with it): serve it from its group while a fresh one is rebuilt."""
        group = shard // self.k
        standing_in = [s for s in range(group * self.k, (group + 1) * self.k) if isinstance(self.members[s], StandIn)]
        if standing_in:
            raise TwoLossesInAGroup(
                f"shard {shard} lost while shard {standing_in[0]} of the same parity group (shards "
                f"{group * self.k}..{(group + 1) * self.k - 1}) is still being rebuilt: parity covers one loss per "
                f"group; resume from the newest checkpoint")
        fresh = self.make_store(shard)
        survivors = {s % self.k: self.members[s] for s in range(group * self.k, (group + 1) * self.k) if s != shard}
        self.members[shard] = StandIn(fresh, member=shard % self.k, parity=self.parities[group], survivors=survivors)
        self._attach(shard, fresh)

    def rebuild(self, max_rows: int = REBUILD_CHUNK_ROWS) -> int:
        """Rebuild up to ``max_rows`` rows of each lost shard; a shard complete takes its place again. Returns the
        rows still to rebuild."""
        left = 0
        for shard, member in enumerate(self.members):
            if isinstance(member, StandIn):
                remaining = member.rebuild(max_rows)
                if remaining == 0:
                    self.members[shard] = member.store
                left += remaining
        return left

    def rows_to_rebuild(self) -> int:
        return sum(member.rows_left for member in self.members if isinstance(member, StandIn))

    @property
    def stores(self) -> list[RowStore]:
        """Each data shard's store (a stand-in's, rebuilt or not)."""
        return [member.store if isinstance(member, StandIn) else member for member in self.members]
