"""The embedding server role: one shard of every embedding space (a RowStore each) behind RPC.

Fetches that ask for a version not yet written back are parked (``async_execution``) rather
than holding an RPC thread, so a server can never deadlock on its own write-back traffic; a
parked fetch fails after the timeout, as its caller's RPC deadline does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.distributed.rpc as rpc

from bagpipe.checkpoint import background_priority, chain_parts, resume_chain, write_snapshot
from bagpipe.faults import inject_fault
from bagpipe.heap import bounded_heap
from bagpipe.optim import make_row_optimizer
from bagpipe.runtime import oracle
from bagpipe.runtime.liveness import Liveness
from bagpipe.runtime.protocol import JobInfo
from bagpipe.runtime.world import STOP_KEY, World, check_in, init_rpc, wait_for_job
from bagpipe.timing import cpu_seconds, peak_rss_bytes
from bagpipe.storage import RowStore, StorageSpec
from bagpipe.storage.disk import record_bytes, storage_path

log = logging.getLogger(__name__)


class Server:
    """One shard of every embedding space (a RowStore each), behind the RPC handlers below."""

    def __init__(self, stores: list[RowStore]) -> None:
        self.stores = stores
        self.bytes_sent = 0
        self.fetches = 0
        self.rows_written = 0
        self.checkpoints: dict[int, torch.futures.Future] = {}  # boundary -> its part's manifest entries, once written
        self._lock = threading.Lock()

    def fetch(self, space: int, keys: torch.Tensor, versions: torch.Tensor) -> torch.futures.Future:
        store = self.stores[space]
        future = store.fetch_async(keys.numpy(), versions.numpy())
        with self._lock:
            self.fetches += 1
            self.bytes_sent += len(keys) * 4 * (store.dim + store.state_width)
        return future

    def write_back(self, space: int, keys: torch.Tensor, rows: torch.Tensor, state: torch.Tensor,
                   version: int) -> None:
        self.stores[space].write_back(keys.numpy(), rows, state, version=version)
        with self._lock:
            self.rows_written += len(keys)

    def begin_checkpoint(self, boundary: int, expected_rows: list[int], since: int | None, directory: str, *,
                         shard: int, num_shards: int, timeout: float) -> None:
        """Start the shard's part of the checkpoint at ``boundary`` (see RowStore.begin_snapshot): kept as of
        now, written to ``directory`` in the background while training goes on."""
        for store, rows in zip(self.stores, expected_rows):
            store.begin_snapshot(boundary, expected_rows=rows, since=since)
        future: torch.futures.Future = torch.futures.Future()
        self.checkpoints[boundary] = future

        def write() -> None:
            background_priority()
            try:
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

    def restore(self, directory: Path, chain: list[dict], *, shard: int, num_shards: int) -> None:
        """This shard's rows of a checkpoint's chain (base first, later parts override), at its boundary."""
        boundary = chain[-1]["iteration"]
        for space, keys, rows, state in chain_parts(directory, chain):
            mine = np.flatnonzero(keys % num_shards == shard)
            if len(mine):
                self.stores[space].restore(keys[mine] // num_shards, rows[mine], state[mine], version=boundary - 1)

    def dump(self) -> dict:
        """The shard's figures for the run's summary (its rows reach the run dir as snapshots, never by RPC)."""
        return {"bytes_sent": self.bytes_sent,
                "fetches": self.fetches, "fetches_waited": sum(store.fetches_waited for store in self.stores),
                "rows_written": self.rows_written, "peak_rss_bytes": peak_rss_bytes(), "cpu_s": cpu_seconds(),
                "storage": dict(sum((Counter(store.rows.stats()) for store in self.stores), Counter()))}


def storage_specs(config: dict, layout, *, num_shards: int, state_width) -> list[StorageSpec]:
    """Each space's storage on this server: the budget of ``--storage-budget-mb`` split among the spaces
    in proportion to the bytes of their shards."""
    if config.get("storage", "memory") == "memory":
        return [StorageSpec() for _ in layout.spaces]
    bounded_heap()  # transient buffers go back to the system: the budget holds
    directory = storage_path(config.get("storage_dir", ""), config["run_dir"])
    shard_bytes = [(space.num_rows // num_shards + 1) * record_bytes(space.dim, state_width(space.dim))
                   for space in layout.spaces]
    budget = int(config["storage_budget_mb"] * 2**20)
    return [StorageSpec("disk", directory, budget * part // max(sum(shard_bytes), 1)) for part in shard_bytes]


_SERVER: Server | None = None
_WORLD: World | None = None


@rpc.functions.async_execution
def rpc_fetch(space: int, keys: torch.Tensor, versions: torch.Tensor) -> torch.futures.Future:
    return _SERVER.fetch(space, keys, versions)


def rpc_write_back(space: int, keys: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, version: int) -> None:
    _SERVER.write_back(space, keys, rows, state, version)


def rpc_dump() -> dict:
    return _SERVER.dump()


def rpc_begin_checkpoint(boundary: int, expected_rows: list[int], since: int | None, directory: str) -> None:
    _SERVER.begin_checkpoint(boundary, expected_rows, since, directory, shard=_WORLD.role[1],
                             num_shards=_WORLD.num_servers, timeout=_WORLD.timeout)


@rpc.functions.async_execution
def rpc_checkpoint_written(boundary: int) -> torch.futures.Future:
    return _SERVER.checkpoints.pop(boundary)


def run_server(world: World, *, given: dict | None = None) -> None:
    """Serve one shard until the oracle says training has ended (a lost oracle is the heartbeats' to tell).

    ``given``: the settings this server's command line gave (an embedding size, table sizes), which
    the oracle agrees with every other role's at check-in.
    """
    global _SERVER, _WORLD
    store, world = check_in(world, "server", given=given)
    _WORLD = world
    role, index = world.role
    liveness = Liveness(world, watch=[0])
    job = JobInfo.from_json(wait_for_job(world, store))
    init_rpc(world, store)
    config, layout = job.config, job.layout
    row_optimizer = make_row_optimizer(config["optimizer"], lr=config["lr"])
    started = time.perf_counter()
    specs = storage_specs(config, layout, num_shards=world.num_servers, state_width=row_optimizer.state_width)
    _SERVER = Server([RowStore(layout=layout, space=s, optimizer=row_optimizer, seed=config["seed"], shard=index,
                               num_shards=world.num_servers, storage=spec) for s, spec in enumerate(specs)])
    if job.resume:
        directory, chain = resume_chain(config["run_dir"], job.resume)
        _SERVER.restore(directory, chain, shard=index, num_shards=world.num_servers)
    where = "in memory" if specs[0].kind == "memory" else (f"on disk in {specs[0].directory}, "
                                                           f"{config['storage_budget_mb']:g} MiB of it in memory")
    log.info("server %d holds %d rows (of %d) %s; ready in %.1f s", index, sum(st.num_rows for st in _SERVER.stores),
             layout.num_rows, where, time.perf_counter() - started)
    rpc.rpc_sync("oracle", oracle.rpc_ready, args=(world.name,), timeout=world.timeout)
    while not store.check([STOP_KEY]):
        time.sleep(0.2)
        for row_store in _SERVER.stores:
            row_store.expire_waiting(timeout=world.timeout)
    liveness.stop()
    rpc.shutdown(graceful=False)  # the oracle has all it needs: no request is in flight
    for row_store in _SERVER.stores:
        row_store.close()
