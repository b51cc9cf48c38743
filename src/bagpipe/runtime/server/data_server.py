"""A data server: one shard of every embedding space (a RowStore each).

Fetches that ask for a version not yet written back are parked (the RowStore's futures) rather than holding an
RPC thread, so a server can never deadlock on its own write-back traffic; a parked fetch fails after the timeout,
as its caller's RPC deadline does. With ``--parity`` every write-back's delta goes to its group's parity server
(server/deltas.py) before it is acknowledged.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bagpipe.train.checkpoints import background_priority, chain_parts, write_snapshot
from bagpipe.config import TrainConfig
from bagpipe.faults import inject_fault
from bagpipe.heap import bounded_heap
from bagpipe.runtime.endpoints import ORACLE
from bagpipe.runtime.protocol import JobInfo
from bagpipe.runtime.server.deltas import DeltaSender
from bagpipe.runtime.world import Epochs, World
from bagpipe.timing import cpu_seconds, peak_rss_bytes
from bagpipe.storage import RowStore, StorageSpec
from bagpipe.storage.tiers import storage_path


CHUNK_ROWS = 1 << 14  # rows a replacement reads at a time from the members of its group or from a stand-in


class Server:
    """One shard of every embedding space (a RowStore each), behind the RPC handlers of server/handlers.py."""

    def __init__(self, stores: list[RowStore]) -> None:
        self.stores = stores
        self.bytes_sent = 0
        self.fetches = 0
        self.rows_fetched = 0  # rows served by fetches
        self.rows_written = 0
        self._cpu_ready: float | None = None  # the process's CPU when it began serving (``ready``)
        self.checkpoints: dict[int, torch.futures.Future] = {}  # boundary -> its part's manifest entries, once written
        self.deltas: DeltaSender | None = None  # with --parity: where its write-backs' deltas go
        self._lock = threading.Lock()

    def fetch(self, space: int, keys: torch.Tensor, versions: torch.Tensor) -> torch.futures.Future:
        store = self.stores[space]
        future = store.fetch_async(keys.numpy(), versions.numpy())
        with self._lock:
            self.fetches += 1
            self.rows_fetched += len(keys)
            self.bytes_sent += len(keys) * 4 * (store.dim + store.state_width)
        return future

    def write_back(self, space: int, keys: torch.Tensor, rows: torch.Tensor, state: torch.Tensor,
                   version: int) -> torch.futures.Future:
        """Store a write-back; the future completes once it is safe: at once, or with parity once the group's
        parity server has folded its delta in (so no write-back acknowledged is lost with this server)."""
        inject_fault(f"write-back {version}")  # received, not stored
        folded = self.stores[space].write_back(keys.numpy(), rows, state, version=version)
        inject_fault(f"delta sent {version}")  # stored and its delta on its way, not acknowledged
        with self._lock:
            self.rows_written += len(keys)
        if folded is not None:
            return folded
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def send_deltas_to(self, parity_name: str, *, member: int, epochs: Epochs, timeout: float) -> None:
        """Erasure coding: every write-back's old ^ new bits go to ``parity_name`` (this shard is ``member``
        of its group there)."""
        self.deltas = DeltaSender(parity_name, member=member, epochs=epochs, timeout=timeout)
        for space, store in enumerate(self.stores):
            store.parity_sink = functools.partial(self.deltas.send, space)

    def read_range(self, space: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, state, versions = self.stores[space].read_range(start, stop)
        return torch.from_numpy(rows), torch.from_numpy(state), torch.from_numpy(versions)

    def read_rows(self, space: int, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, state, versions = self.stores[space].read(local.numpy())
        return rows, state, torch.from_numpy(versions)


    def begin_checkpoint(self, boundary: int, expected_rows: list[int], since: int | None, directory: str, *,
                         shard: int, num_shards: int, timeout: float) -> None:
        """Start the shard's part of the checkpoint at ``boundary`` (see RowStore.begin_snapshot): kept as of
        now, written to ``directory`` in the background while training goes on."""
        if boundary in self.checkpoints:  # asked again after a re-formation of the RPC world: begun already
            return
        for older in [b for b in self.checkpoints if b < boundary]:  # the oracle has committed or abandoned them
            del self.checkpoints[older]
        for store, rows in zip(self.stores, expected_rows):
            store.begin_snapshot(boundary, expected_rows=rows, since=since)
        future: torch.futures.Future = torch.futures.Future()
        self.checkpoints[boundary] = future

        def write() -> None:
            background_priority()
            try:
                self.before_snapshot()
                entries = [write_snapshot(Path(directory), name=f"server{shard}.space{space}", space=space,
                                          chunks=store.snapshot_chunks(timeout=timeout), num_rows=store.num_rows,
                                          dim=store.dim, state_width=store.state_width, start=shard,
                                          step=num_shards, full=since is None)
                           for space, store in enumerate(self.stores)]
                inject_fault(f"checkpoint {boundary} written")
                future.set_result(entries)
            except BaseException as err:  # noqa: BLE001 - the oracle's wait reports it
                future.set_exception(err)

        threading.Thread(target=write, name="checkpoint", daemon=True).start()

    def before_snapshot(self) -> None:
        """Called on a snapshot's writer thread before it reads the rows (its copy-on-write has begun)."""

    def restore(self, directory: Path, chain: list[dict], *, shard: int, num_shards: int) -> None:
        """This shard's rows of a checkpoint's chain (base first, later parts override), at its boundary."""
        boundary = chain[-1]["iteration"]
        for space, keys, rows, state in chain_parts(directory, chain):
            mine = np.flatnonzero(keys % num_shards == shard)
            if len(mine):
                self.stores[space].restore(keys[mine] // num_shards, rows[mine], state[mine], version=boundary - 1)

    def ready(self) -> None:
        """The shard is built (its rows initialised or restored): its CPU from now on is serving's."""
        self._cpu_ready = cpu_seconds()

    def dump(self) -> dict:
        """The shard's figures for the run's summary (its rows reach the run dir as snapshots, never by RPC)."""
        cpu_s = cpu_seconds()
        return {"bytes_sent": self.bytes_sent,
                "fetches": self.fetches, "fetches_waited": sum(store.fetches_waited for store in self.stores),
                "rows_fetched": self.rows_fetched, "rows_written": self.rows_written,
                "peak_rss_bytes": peak_rss_bytes(), "cpu_s": cpu_s,
                **({"serving_cpu_s": cpu_s - self._cpu_ready} if self._cpu_ready is not None else {}),
                **({"unprotected_write_backs": self.deltas.unprotected} if self.deltas is not None else {}),
                "storage": dict(sum((Counter(store.rows.stats()) for store in self.stores), Counter()))}


def storage_specs(config: TrainConfig, layout, *, num_shards: int, state_width) -> list[StorageSpec]:
    """Each space's storage on this server: the budget of ``--storage-budget-mb`` split among the spaces
    in proportion to the bytes of their shards."""
    spec = StorageSpec.of(config.storage, storage_path(config.storage_dir, config.run_dir),
                          config.storage_budget_mb * 2**20)
    if not spec.files:
        return [spec for _ in layout.spaces]
    bounded_heap()  # transient buffers go back to the system: the budget holds
    return spec.split([spec.stored_bytes(space.num_rows // num_shards + 1, space.dim, state_width(space.dim))
                       for space in layout.spaces])


def shard_stores(world: World, job: JobInfo, row_optimizer, specs: list[StorageSpec],
                 keys_of: Callable[[int, int], list[np.ndarray] | None] | None = None) -> list[RowStore]:
    """This data server's shard of every space, initialised from the seed (raw ids: from each row's key,
    ``keys_of(space, shard)``), where ``specs`` say."""
    shard = world.role[1]
    return [RowStore(layout=job.layout, space=s, optimizer=row_optimizer, seed=job.config.seed, shard=shard,
                     num_shards=world.num_shards, storage=spec, keys=keys_of(s, shard) if keys_of else None)
            for s, spec in enumerate(specs)]


def shard_keys_of(job: JobInfo, epochs: Epochs) -> Callable[[int, int], list[np.ndarray] | None] | None:
    """Raw-id data: (space, shard) -> the keys of that shard's rows, per table, asked of the oracle (which
    numbered the rows: embeddings.dynamic); None for tables of a fixed size."""
    if not job.raw_ids:
        return None
    return lambda space, shard: epochs.call("oracle", ORACLE.row_keys, (space, shard))


def send_deltas(server: Server, world: World, epochs: Epochs) -> None:
    """Erasure coding: ``server``'s write-backs' deltas go to its group's parity server."""
    index = world.role[1]
    server.send_deltas_to(World.server_name(world.parity_server(index)), member=index % world.parity, epochs=epochs,
                          timeout=world.timeout)
