"""Server-side row storage: one shard of an embedding space, with optimizer state and row versions.

A shard owns the flat keys ``k`` with ``k % num_shards == shard``. A fetch names the version it
must observe (the iteration after which the row was last written back) and waits, up to a
timeout, until that write-back has arrived: the ordering invariant, enforced where rows live.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import torch

from bagpipe.embeddings import EmbeddingLayout, init_rows
from bagpipe.optim import RowOptimizer


class RowStore:
    """One shard of one embedding space (the tables of one width), initialised as the reference's."""

    def __init__(self, *, layout: EmbeddingLayout, space: int, optimizer: RowOptimizer, seed: int,
                 shard: int = 0, num_shards: int = 1) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is outside [0, {num_shards})")
        members = layout.spaces[space]
        self.shard, self.num_shards, self.dim = shard, num_shards, members.dim
        parts = []
        for table, offset in zip(members.tables, members.offsets.tolist()):
            first = (shard - offset) % num_shards  # first id of this table that the shard owns
            parts.append(init_rows(table, layout.tables[table], seed=seed, first=first, step=num_shards))
        self.weights = torch.cat(parts)
        self.state = torch.zeros(self.weights.shape[0], optimizer.state_width(self.dim))
        self.versions = np.full(self.weights.shape[0], -1, dtype=np.int64)
        self.received: Counter = Counter()  # rows written back, by version
        self._snapshot: _Snapshot | None = None
        self._changed = threading.Condition()
        self.fetches_waited = 0  # fetches that arrived before the write-back they must observe
        # parked fetches: (local rows, versions wanted, future, when parked)
        self._waiting: list[tuple[torch.Tensor, np.ndarray, torch.futures.Future, float]] = []

    def _local(self, keys: np.ndarray) -> torch.Tensor:
        keys = np.asarray(keys, dtype=np.int64)
        if len(keys) and (keys % self.num_shards != self.shard).any():
            raise ValueError(f"shard {self.shard} of {self.num_shards} was asked for rows it does not hold")
        return torch.from_numpy(keys // self.num_shards)

    def fetch(self, keys: np.ndarray, versions: np.ndarray, *, timeout: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows and optimizer state of ``keys``, once each has reached its requested version."""
        local = self._local(keys)
        wanted = np.asarray(versions, dtype=np.int64)
        with self._changed:
            ready = self._changed.wait_for(lambda: (self.versions[local.numpy()] >= wanted).all(), timeout)
            if not ready:
                behind = np.flatnonzero(self.versions[local.numpy()] < wanted)
                raise TimeoutError(f"shard {self.shard}: {len(behind)} rows still lack their write-back after "
                                   f"{timeout} s (first: key {int(keys[behind[0]])} wants version "
                                   f"{int(wanted[behind[0]])}, has {int(self.versions[local[behind[0]]])})")
            return self._read(local)

    def fetch_async(self, keys: np.ndarray, versions: np.ndarray) -> torch.futures.Future:
        """Like ``fetch``, without blocking a thread: the future completes when the rows are ready.

        The waiting side owns the timeout (an RPC's own deadline, for a remote fetch).
        """
        local = self._local(keys)
        wanted = np.asarray(versions, dtype=np.int64)
        future: torch.futures.Future = torch.futures.Future()
        with self._changed:
            if (self.versions[local.numpy()] >= wanted).all():
                future.set_result(self._read(local))
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
        for local, wanted, future, _ in expired:
            behind = int(np.flatnonzero(self.versions[local.numpy()] < wanted)[0])
            future.set_exception(TimeoutError(
                f"shard {self.shard}: key {int(local[behind]) * self.num_shards + self.shard} still lacks write-back "
                f"version {int(wanted[behind])} after {timeout:.0f} s (has {int(self.versions[local[behind]])})"))
        return len(expired)

    def _read(self, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weights.index_select(0, local), self.state.index_select(0, local)

    def write_back(self, keys: np.ndarray, rows: torch.Tensor, state: torch.Tensor, *, version: int) -> None:
        local = self._local(keys)
        ready = []
        with self._changed:
            if self._snapshot is not None and version >= self._snapshot.boundary:
                self._snapshot.save(self, local.numpy())
            self.received[version] += len(local)
            self.weights.index_copy_(0, local, rows)
            if state.shape[1]:
                self.state.index_copy_(0, local, state)
            self.versions[local.numpy()] = version
            self._changed.notify_all()
            still = []
            for waiting in self._waiting:
                if (self.versions[waiting[0].numpy()] >= waiting[1]).all():
                    ready.append((waiting[2], self._read(waiting[0])))
                else:
                    still.append(waiting)
            self._waiting = still
        for future, result in ready:  # outside the lock: completing runs the RPC's reply callbacks
            future.set_result(result)


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
            for start in range(0, self.weights.shape[0], chunk_rows):
                with self._changed:
                    stop = min(start + chunk_rows, self.weights.shape[0])
                    rows = self.weights[start:stop].numpy().copy()
                    state = self.state[start:stop].numpy().copy()
                    versions = self.versions[start:stop].copy()
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
        index = torch.from_numpy(np.asarray(local, dtype=np.int64))
        with self._changed:
            self.weights.index_copy_(0, index, torch.from_numpy(np.ascontiguousarray(rows)))
            if self.state.shape[1]:
                self.state.index_copy_(0, index, torch.from_numpy(np.ascontiguousarray(state)))
            self.versions[:] = version


class _Snapshot:
    """Copies of the rows a shard overwrote after a boundary, before its snapshot had read them."""

    def __init__(self, *, boundary: int, expected_rows: int, since: int | None) -> None:
        self.boundary, self.expected_rows, self.since = boundary, expected_rows, since
        self.saved: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
        self.done_upto = 0  # rows below this have been read: no copy needed any more

    def save(self, store: RowStore, local: np.ndarray) -> None:
        for row in local[local >= self.done_upto].tolist():
            if row not in self.saved and store.versions[row] < self.boundary:
                self.saved[row] = (store.weights[row].numpy().copy(), store.state[row].numpy().copy(),
                                   int(store.versions[row]))

    def saved_in(self, start: int, stop: int):
        return [(row, value) for row, value in self.saved.items() if start <= row < stop]


def gather_flat(shard_weights: list[torch.Tensor], num_rows: int) -> torch.Tensor:
    """Reassemble the flat key space from every shard's rows (shard s holds keys s, s + S, ...)."""
    num_shards = len(shard_weights)
    flat = torch.empty(num_rows, shard_weights[0].shape[1])
    for shard, weights in enumerate(shard_weights):
        flat[shard::num_shards] = weights
    return flat
