"""A lost data server's replacement taking its shard back from the stand-in on its group's parity server."""

from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np
import torch

from bagpipe.runtime.endpoints import SERVER
from bagpipe.runtime.server.data_server import CHUNK_ROWS, Server
from bagpipe.runtime.world import Epochs

log = logging.getLogger(__name__)

class ShardTakeOver:
    """A lost data server's replacement taking its shard back from the stand-in on its group's parity server,
    while training goes on there. ``copy``: once the stand-in has rebuilt the shard, every row is read from it in
    chunks (rows, state and versions, each chunk as it stands) into ``server``'s stores. ``take_over`` (once the
    stand-in is frozen: see StandInServer.freeze): the rows whose version moved since their chunk was read are
    read again (versions only grow: they are exactly the rows written meanwhile) and the write-back counts are
    taken over; from then on ``server`` is the shard's. ``source`` reads the stand-in: ``rebuilt()``,
    ``read_range(space, start, stop)`` and ``read_rows(space, local)`` (RemoteStandIn: by RPC)."""

    def __init__(self, server: Server, source, *, shard: int) -> None:
        self.server, self.source, self.shard = server, source, shard
        self.copied: list[np.ndarray] = [np.full(store.num_rows, -1, dtype=np.int64) for store in server.stores]
        self.copied_in_s: float | None = None

    def copy(self, *, chunk_rows: int = CHUNK_ROWS) -> None:
        started = time.perf_counter()
        self.source.rebuilt()  # (it may be rebuilding still: the replacement started as soon as the loss was known)
        for space, store in enumerate(self.server.stores):
            for start in range(0, store.num_rows, chunk_rows):
                rows, state, versions = self.source.read_range(space, start, start + chunk_rows)
                local = np.arange(start, start + len(rows), dtype=np.int64)
                store.put(local, rows, state, version=versions)
                self.copied[space][local] = versions
        self.copied_in_s = time.perf_counter() - started
        log.info("server %d's shard copied from its stand-in in %.2f s (%d rows)", self.shard, self.copied_in_s,
                 sum(store.num_rows for store in self.server.stores))

    def take_over(self, versions: list[np.ndarray], received: list[dict]) -> dict:
        """The frozen stand-in's row versions and counts of write-backs by version, per space: catch up."""
        started = time.perf_counter()
        again = 0
        for space, store in enumerate(self.server.stores):
            moved = np.flatnonzero(versions[space] != self.copied[space])
            for start in range(0, len(moved), CHUNK_ROWS):
                local = moved[start:start + CHUNK_ROWS]
                rows, state, have = self.source.read_rows(space, local)
                store.put(local, rows, state, version=have)
            again += len(moved)
            store.received = Counter({int(version): count for version, count in received[space].items()})
        log.info("server %d's shard taken back from its stand-in (%d rows written meanwhile read again in %.2f s)",
                 self.shard, again, time.perf_counter() - started)
        return {"copied_in_s": round(self.copied_in_s, 3), "rows_copied": sum(len(c) for c in self.copied),
                "rows_copied_again": again}


class RemoteStandIn:
    """The stand-in for ``shard`` on parity server ``name``, as ShardTakeOver reads it: by RPC."""

    def __init__(self, name: str, shard: int, *, epochs: Epochs, timeout: float) -> None:
        self.name, self.shard, self.epochs, self.timeout = name, shard, epochs, timeout

    def rebuilt(self) -> None:
        self.epochs.call(self.name, SERVER.stand_in_rebuilt, (self.shard,), timeout=10 * self.timeout)

    def read_range(self, space: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        rows, state, versions = self.epochs.call(self.name, SERVER.read_range, (space, start, stop))
        return rows, state, versions.numpy()

    def read_rows(self, space: int, local: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        # not sent again after a re-formation: the take-over is the oracle's to give up then
        rows, state, versions = SERVER.read_rows.call(self.name, (space, torch.from_numpy(local)), timeout=self.timeout)
        return rows, state, versions.numpy()
