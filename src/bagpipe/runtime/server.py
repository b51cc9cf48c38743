"""The embedding server role: one shard of every embedding space (a RowStore each) behind RPC.

Fetches that ask for a version not yet written back are parked (``async_execution``) rather
than holding an RPC thread, so a server can never deadlock on its own write-back traffic; a
parked fetch fails after the timeout, as its caller's RPC deadline does.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import torch.distributed.rpc as rpc

from bagpipe.optim import make_row_optimizer
from bagpipe.runtime import oracle
from bagpipe.runtime.liveness import Liveness
from bagpipe.runtime.protocol import JobInfo
from bagpipe.runtime.world import STOP_KEY, World, check_in, init_rpc, wait_for_job
from bagpipe.timing import cpu_seconds, peak_rss_bytes
from bagpipe.storage import RowStore

log = logging.getLogger(__name__)


class Server:
    """One shard of every embedding space (a RowStore each), behind the RPC handlers below."""

    def __init__(self, stores: list[RowStore]) -> None:
        self.stores = stores
        self.bytes_sent = 0
        self.fetches = 0
        self.rows_written = 0
        self._lock = threading.Lock()

    def fetch(self, space: int, keys: torch.Tensor, versions: torch.Tensor) -> torch.futures.Future:
        store = self.stores[space]
        future = store.fetch_async(keys.numpy(), versions.numpy())
        with self._lock:
            self.fetches += 1
            self.bytes_sent += len(keys) * 4 * (store.dim + store.state.shape[1])
        return future

    def write_back(self, space: int, keys: torch.Tensor, rows: torch.Tensor, state: torch.Tensor,
                   version: int) -> None:
        self.stores[space].write_back(keys.numpy(), rows, state, version=version)
        with self._lock:
            self.rows_written += len(keys)

    def dump(self) -> dict:
        return {"weights": [store.weights for store in self.stores], "bytes_sent": self.bytes_sent,
                "fetches": self.fetches, "fetches_waited": sum(store.fetches_waited for store in self.stores),
                "rows_written": self.rows_written, "peak_rss_bytes": peak_rss_bytes(), "cpu_s": cpu_seconds()}


_SERVER: Server | None = None


@rpc.functions.async_execution
def rpc_fetch(space: int, keys: torch.Tensor, versions: torch.Tensor) -> torch.futures.Future:
    return _SERVER.fetch(space, keys, versions)


def rpc_write_back(space: int, keys: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, version: int) -> None:
    _SERVER.write_back(space, keys, rows, state, version)


def rpc_dump() -> dict:
    return _SERVER.dump()


def run_server(world: World, *, given: dict | None = None) -> None:
    """Serve one shard until the oracle says training has ended (a lost oracle is the heartbeats' to tell).

    ``given``: the settings this server's command line gave (an embedding size, table sizes), which
    the oracle agrees with every other role's at check-in.
    """
    global _SERVER
    store, world = check_in(world, "server", given=given)
    role, index = world.role
    liveness = Liveness(world, watch=[0])
    job = JobInfo.from_json(wait_for_job(world, store))
    init_rpc(world, store)
    config, layout = job.config, job.layout
    row_optimizer = make_row_optimizer(config["optimizer"], lr=config["lr"])
    started = time.perf_counter()
    _SERVER = Server([RowStore(layout=layout, space=s, optimizer=row_optimizer, seed=config["seed"], shard=index,
                               num_shards=world.num_servers) for s in range(len(layout.spaces))])
    log.info("server %d holds %d rows (of %d) in %.1f s", index, sum(st.weights.shape[0] for st in _SERVER.stores),
             layout.num_rows, time.perf_counter() - started)
    rpc.rpc_sync("oracle", oracle.rpc_ready, args=(world.name,), timeout=world.timeout)
    while not store.check([STOP_KEY]):
        time.sleep(0.2)
        for row_store in _SERVER.stores:
            row_store.expire_waiting(timeout=world.timeout)
    liveness.stop()
    rpc.shutdown(graceful=False)  # the oracle has all it needs: no request is in flight
