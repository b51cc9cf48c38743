"""Server-side row storage: one shard of an embedding space, with optimizer state and row versions.

A shard owns the flat keys ``k`` with ``k % num_shards == shard``. A fetch names the version it
must observe (the iteration after which the row was last written back) and waits, up to a
timeout, until that write-back has arrived: the ordering invariant, enforced where rows live.
Where the rows live is the tier's (storage.memory, storage.disk): this class holds the ordering,
the parked fetches and the snapshots, the same over either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bagpipe.config import STORAGE_KINDS
from bagpipe.embeddings import EmbeddingLayout, init_row_blocks
from bagpipe.embeddings.dynamic import keyed_blocks
from bagpipe.optim import RowOptimizer
from bagpipe.storage.bits import row_bits
from bagpipe.storage.tiers import open_tier, tier_class

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StorageSpec:
    """Where a store keeps its rows: the tier ``kind`` (storage.tiers), and for a tier that keeps files, the
    ``directory`` they go to and the ``budget_bytes`` of DRAM it may hold of them."""

    kind: str = "memory"
    directory: Path | None = None
    budget_bytes: int = 0

    def __post_init__(self) -> None:
        if self.kind not in STORAGE_KINDS:
            raise ValueError(f"storage must be one of {', '.join(STORAGE_KINDS)}, got {self.kind!r}")
        if self.files and self.directory is None:
            raise ValueError(f"the {self.kind} tier keeps files: it needs a directory")

    @classmethod
    def of(cls, kind: str, directory: str | Path, budget_bytes: float) -> "StorageSpec":
        """The storage ``kind`` names: in ``directory`` with ``budget_bytes`` of DRAM if its tier keeps files."""
        return cls(kind, Path(directory), int(budget_bytes)) if tier_class(kind).files else cls(kind)

    @property
    def files(self) -> bool:
        """Whether its tier keeps the rows in files (a block at a time, never whole in memory)."""
        return tier_class(self.kind).files

    def stored_bytes(self, num_rows: int, dim: int, state_width: int) -> int:
        """What ``num_rows`` rows of ``dim`` floats and their state take in this tier."""
        return tier_class(self.kind).stored_bytes(num_rows, dim, state_width)

    def split(self, weights: list[int]) -> list["StorageSpec"]:
        """One storage per part, the DRAM budget shared among them in proportion to ``weights`` (their bytes)."""
        total = max(sum(weights), 1)
        return [dataclasses.replace(self, budget_bytes=self.budget_bytes * weight // total) for weight in weights]


def shard_tables(layout: EmbeddingLayout, space: int, shard: int, num_shards: int) -> list[tuple[int, int]]:
    """The tables of ``space`` in the order a shard lays them out, each with the first of its rows the shard owns
    (then every ``num_shards``-th): the shard owns flat keys ``k`` with ``k % num_shards == shard``."""
    members = layout.spaces[space]
    return [(table, (shard - offset) % num_shards) for table, offset in zip(members.tables, members.offsets.tolist())]


def shard_num_rows(layout: EmbeddingLayout, space: int, shard: int, num_shards: int) -> int:
    return sum(max(0, -(-(layout.tables[table].num_rows - first) // num_shards))
               for table, first in shard_tables(layout, space, shard, num_shards))


def shard_keys(layout: EmbeddingLayout, table_keys: list[np.ndarray], space: int, shard: int,
               num_shards: int) -> list[np.ndarray]:
    """Raw-id tables (``table_keys``: each model table's key of each row, embeddings.dynamic): the keys of the
    rows a shard of ``space`` holds, per table in the shard's order (``shard_tables``)."""
    return [np.ascontiguousarray(table_keys[table][first::num_shards])
            for table, first in shard_tables(layout, space, shard, num_shards)]


def initial_blocks(layout: EmbeddingLayout, space: int, shard: int, num_shards: int, *, seed: int,
                   keys: list[np.ndarray] | None = None):
    """A shard's initial rows in its local order, one initialisation block at a time: from the seed, or for
    raw-id tables from each row's key (``keys``: the shard's, ``shard_keys``)."""
    for place, (table, first) in enumerate(shard_tables(layout, space, shard, num_shards)):
        if keys is not None:
            yield from keyed_blocks(keys[place], table_index=table, table=layout.tables[table], seed=seed)
        else:
            yield from init_row_blocks(table, layout.tables[table], seed=seed, first=first, step=num_shards)


class RowStore:
    """One shard of one embedding space (the tables of one width), initialised as the reference's (raw-id tables:
    from its rows' ``keys``, ``shard_keys``)."""

    def __init__(self, *, layout: EmbeddingLayout, space: int, optimizer: RowOptimizer, seed: int,
                 shard: int = 0, num_shards: int = 1, storage: StorageSpec | None = None,
                 keys: list[np.ndarray] | None = None) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is outside [0, {num_shards})")
        members = layout.spaces[space]
        self.shard, self.num_shards, self.dim = shard, num_shards, members.dim
        self.state_width = optimizer.state_width(self.dim)
        self.rows = open_tier(storage or StorageSpec(), name=f"shard{shard}.space{space}",
                              num_rows=shard_num_rows(layout, space, shard, num_shards), dim=self.dim,
                              state_width=self.state_width,
                              blocks=initial_blocks(layout, space, shard, num_shards, seed=seed, keys=keys))
        self.num_rows = self.rows.num_rows
        self.received: Counter = Counter()  # rows written back, by version
        self.counts_write_backs = True  # False: someone else counts them into ``received`` (a parity's stand-in)
        self._snapshot: _Snapshot | None = None
        self._changed = threading.Condition()
        self.fetches_waited = 0  # fetches that arrived before the write-back they must observe
        # erasure coding (storage.parity): called with (local rows, old ^ new bits, old versions, version) on
        # every write-back, under the lock, so that one row's deltas leave in the order they were made
        self.parity_sink: Callable[[np.ndarray, np.ndarray, np.ndarray, int], object] | None = None
        # parked fetches: (local rows, versions wanted, future, when parked)
        self._waiting: list[tuple[np.ndarray, np.ndarray, torch.futures.Future, float]] = []

    def close(self) -> None:
        """Let go of the rows (the disk tier deletes its working file)."""
        with self._changed:
            self.rows.close()

    def all_weights(self) -> torch.Tensor:
        """Every row of the shard, in local order (for tests and small exports)."""
        with self._changed:
            return torch.from_numpy(self.rows.read_range(0, self.num_rows)[0])

    def _local(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.int64)
        if len(keys) and (keys % self.num_shards != self.shard).any():
            raise ValueError(f"shard {self.shard} of {self.num_shards} was asked for rows it does not hold")
        return keys // self.num_shards

    def fetch(self, keys: np.ndarray, versions: np.ndarray, *, timeout: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows and optimizer state of ``keys``, once each has reached its requested version."""
        local = self._local(keys)
        wanted = np.asarray(versions, dtype=np.int64)
        with self._changed:
            ready = self._changed.wait_for(lambda: (self.rows.versions(local) >= wanted).all(), timeout)
            if not ready:
                have = self.rows.versions(local)
                behind = np.flatnonzero(have < wanted)
                raise TimeoutError(f"shard {self.shard}: {len(behind)} rows still lack their write-back after "
                                   f"{timeout} s (first: key {int(keys[behind[0]])} wants version "
                                   f"{int(wanted[behind[0]])}, has {int(have[behind[0]])})")
            return self.rows.read(local)[:2]

    def fetch_async(self, keys: np.ndarray, versions: np.ndarray) -> torch.futures.Future:
        """Like ``fetch``, without blocking a thread: the future completes with the rows, their state and
        their versions (what the caller checks) once each row has reached its requested version.

        The waiting side owns the timeout (an RPC's own deadline, for a remote fetch).
        """
        local = self._local(keys)
        wanted = np.array(versions, dtype=np.int64)  # a copy: ``versions`` may be a view of an RPC's buffer
        future: torch.futures.Future = torch.futures.Future()
        with self._changed:
            if (self.rows.versions(local) >= wanted).all():  # (a parked fetch reads its rows once, when ready)
                rows, state, have = self.rows.read(local)
                future.set_result((rows, state, torch.from_numpy(have)))
            else:
                self.fetches_waited += 1
                self._waiting.append((local, wanted, future, time.monotonic()))
        return future

    def expire_waiting(self, *, timeout: float) -> int:
        """Fail the fetches parked for longer than ``timeout`` (their callers have given up); return how many."""
        now = time.monotonic()
        with self._changed:
            expired = [w for w in self._waiting if now - w[3] > timeout]
            self._waiting = [w for w in self._waiting if now - w[3] <= timeout]
            have = [self.rows.versions(local) for local, *_ in expired]
        for (local, wanted, future, _), versions in zip(expired, have):
            if future.done():
                continue
            behind = int(np.flatnonzero(versions < wanted)[0])
            future.set_exception(TimeoutError(
                f"shard {self.shard}: key {int(local[behind]) * self.num_shards + self.shard} still lacks write-back "
                f"version {int(wanted[behind])} after {timeout:.0f} s (has {int(versions[behind])})"))
        return len(expired)

    def fail_waiting(self, err: BaseException) -> int:
        """Fail every parked fetch with ``err`` (a shard handed on: they are to be sent where it went)."""
        with self._changed:
            waiting, self._waiting = self._waiting, []
        for _, _, future, _ in waiting:
            if not future.done():
                future.set_exception(err)
        return len(waiting)

    def write_back(self, keys: np.ndarray, rows: torch.Tensor, state: torch.Tensor, *, version: int):
        """Store a write-back; return what the parity sink returned (a future, over RPC), else None. Rows at
        ``version`` already are left alone (a write-back sent again: its answer was lost to a re-formation of the
        RPC world, or it was handed on by a stand-in that had it), so a repeat is neither counted nor folded."""
        local = self._local(keys)
        with self._changed:
            fresh = self.rows.versions(local) < version
            if not fresh.all():
                chosen = torch.from_numpy(np.flatnonzero(fresh))
                local, rows, state = local[fresh], rows.index_select(0, chosen), state.index_select(0, chosen)
                if not len(local):
                    return None
            if self._snapshot is not None and version >= self._snapshot.boundary:
                self._snapshot.save(self.rows, local)
            if self.counts_write_backs:
                self.received[version] += len(local)
            if self.parity_sink is not None:
                old_rows, old_state, before = self.rows.read(local)
                delta = row_bits(old_rows, old_state) ^ row_bits(rows, state)
            self.rows.write(local, rows, state, version=version)
            folded = None if self.parity_sink is None else self.parity_sink(local, delta, before, version)
            ready = self._ready_fetches()
        _complete(ready)  # outside the lock: completing runs the RPC's reply callbacks
        return folded

    def put(self, local: np.ndarray, rows: torch.Tensor, state: torch.Tensor, *, version: int | np.ndarray) -> None:
        """Rows placed as they stood at ``version`` (one, or one per row: a rebuilt or copied shard's): not a
        write-back, so neither counted nor folded into a parity, which holds them already."""
        with self._changed:
            self.rows.write(np.asarray(local, dtype=np.int64), rows, state, version=version)
            ready = self._ready_fetches()
        _complete(ready)

    def read(self, local: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Rows, state and versions of ``local`` as they stand."""
        with self._changed:
            return self.rows.read(np.asarray(local, dtype=np.int64))

    def read_range(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of local rows ``start:stop`` (cut at the shard's end), their state and versions, as they stand."""
        with self._changed:
            return self.rows.read_range(min(start, self.num_rows), min(stop, self.num_rows))

    def _ready_fetches(self) -> list:
        """Under the lock: wake the waits, and take the parked fetches whose versions have arrived."""
        self._changed.notify_all()
        ready, still = [], []
        for waiting in self._waiting:
            if (self.rows.versions(waiting[0]) >= waiting[1]).all():
                rows, state, have = self.rows.read(waiting[0])
                ready.append((waiting[2], (rows, state, torch.from_numpy(have))))
            else:
                still.append(waiting)
        self._waiting = still
        return ready

    # -- snapshots: the shard as it stood at an iteration boundary, while training goes on --------------
    def begin_snapshot(self, boundary: int, *, expected_rows: int, since: int | None) -> None:
        """Start keeping the shard as of ``boundary``: the write-backs of versions < ``boundary`` (of which
        ``expected_rows`` rows are still to count, from the oracle's plan) and none later. A row about to
        be overwritten by a later version is copied first (copy-on-write). ``since``: only rows written
        back from version ``since`` on (a delta), else every row."""
        with self._changed:
            assert self._snapshot is None, "one snapshot at a time"
            self._snapshot = _Snapshot(boundary=boundary, expected_rows=expected_rows, since=since)

    def snapshot_chunks(self, *, timeout: float, chunk_rows: int = 1 << 16):
        """The snapshot's rows, chunk by chunk: (local rows, rows, state) numpy arrays; waits (up to
        ``timeout``) for every write-back before the boundary first. Ends the snapshot."""
        snapshot = self._snapshot
        assert snapshot is not None, "begin_snapshot first"
        with self._changed:
            arrived = self._changed.wait_for(lambda: self._rows_before(snapshot.boundary) >= snapshot.expected_rows,
                                             timeout)
            if not arrived:
                self._snapshot = None
                raise TimeoutError(f"shard {self.shard}: {snapshot.expected_rows - self._rows_before(snapshot.boundary)}"
                                   f" rows written back before iteration {snapshot.boundary} had not arrived after "
                                   f"{timeout:.0f} s")
        try:
            chunk_rows = min(chunk_rows, self.rows.max_chunk_rows)
            for start in range(0, self.num_rows, chunk_rows):
                with self._changed:
                    stop = min(start + chunk_rows, self.num_rows)
                    rows, state, versions = self.rows.read_range(start, stop)
                    for local, (row, row_state, version) in snapshot.saved_in(start, stop):
                        rows[local - start], state[local - start], versions[local - start] = row, row_state, version
                    snapshot.done_upto = stop
                chosen = np.arange(start, stop, dtype=np.int64)
                if snapshot.since is not None:
                    keep = versions >= snapshot.since
                    chosen, rows, state = chosen[keep], rows[keep], state[keep]
                yield chosen, rows, state
        finally:
            with self._changed:
                self._snapshot = None

    def _rows_before(self, boundary: int) -> int:
        return sum(count for version, count in self.received.items() if version < boundary)

    def restore(self, local: np.ndarray, rows: np.ndarray, state: np.ndarray, *, version: int) -> None:
        """Rows of a checkpoint (by local index), at ``version``: what fetches after it may ask for at most."""
        with self._changed:
            self.rows.write(np.asarray(local, dtype=np.int64), torch.from_numpy(np.ascontiguousarray(rows)),
                            torch.from_numpy(np.ascontiguousarray(state)), version=version)
            self.rows.set_versions(version)


class _Snapshot:
    """Copies of the rows a shard overwrote after a boundary, before its snapshot had read them."""

    def __init__(self, *, boundary: int, expected_rows: int, since: int | None) -> None:
        self.boundary, self.expected_rows, self.since = boundary, expected_rows, since
        self.saved: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
        self.done_upto = 0  # rows below this have been read: no copy needed any more

    def save(self, rows, local: np.ndarray) -> None:
        """Keep the pre-boundary version of each of ``local`` that is about to be overwritten."""
        unread = np.array([row for row in local[local >= self.done_upto].tolist() if row not in self.saved],
                          dtype=np.int64)
        if not len(unread):
            return
        weights, state, versions = rows.read(unread)
        for i in np.flatnonzero(versions < self.boundary).tolist():
            self.saved[int(unread[i])] = (weights[i].numpy().copy(), state[i].numpy().copy(), int(versions[i]))

    def saved_in(self, start: int, stop: int):
        return [(row, value) for row, value in self.saved.items() if start <= row < stop]


def gather_flat(shard_weights: list[torch.Tensor], num_rows: int) -> torch.Tensor:
    """Reassemble the flat key space from every shard's rows (shard s holds keys s, s + S, ...)."""
    num_shards = len(shard_weights)
    flat = torch.empty(num_rows, shard_weights[0].shape[1])
    for shard, weights in enumerate(shard_weights):
        flat[shard::num_shards] = weights
    return flat


def _complete(ready: list) -> None:
    """Complete parked fetches with their rows. One completed already is skipped, with a warning (it happened when
    futures outlived the RPC agent that waited on them across re-formations, before runtime.world.Epochs.answer;
    a guard, not expected)."""
    for future, result in ready:
        if future.done():
            log.warning("a parked fetch was answered already; skipped")
            continue
        future.set_result(result)
