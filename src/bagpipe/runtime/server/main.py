"""The server role's process: check in, wait for the job, become what the world says this process is (a data
server, a parity server, or the replacement of a lost one), serve until training ends."""

from __future__ import annotations

import functools
import logging
import time

from bagpipe.train.checkpoints import resume_chain
from bagpipe.faults import inject_fault
from bagpipe.optim import make_row_optimizer
from bagpipe.runtime import transport
from bagpipe.runtime.endpoints import ORACLE
from bagpipe.runtime.names import STOP_KEY
from bagpipe.runtime.liveness import Liveness
from bagpipe.runtime.protocol import JobInfo
from bagpipe.runtime.server.data_server import Server, send_deltas, shard_keys_of, shard_stores, storage_specs
from bagpipe.runtime.server.handlers import ServerHandlers
from bagpipe.runtime.server.parity_server import replacement_parity, start_parity
from bagpipe.runtime.server.takeover import RemoteStandIn, ShardTakeOver
from bagpipe.runtime.world import (Epochs, NoEpochs, World, check_in, init_rpc, job_world, join_rpc_as_replacement,
                                   wait_for_job)
from bagpipe.storage import RowStore

log = logging.getLogger(__name__)


def run_server(world: World, *, given: dict | None = None) -> None:
    """Serve one shard until the oracle says training has ended (a lost oracle is the heartbeats' to tell).

    ``given``: the settings this server's command line gave (an embedding size, table sizes), which
    the oracle agrees with every other role's at check-in. The same command started again for a server
    whose process was lost, while the oracle awaits its replacement, joins as that replacement.
    """
    # 1. check in, watch the oracle, and wait for the job as every role agreed on it
    store, world = check_in(world, "server", given=given)
    liveness = Liveness(world, watch=[0])
    job = JobInfo.from_json(wait_for_job(world, store))
    world = job_world(world, job.config)
    liveness.adopt(world)
    liveness.recover = functools.partial(liveness.goes_on_without, replace_oracle=job.replace_oracle)
    # 2. become what this rank is: a data server or a parity server, or a lost one's replacement (which is made
    # ready before the RPC world is re-formed around it, while training goes on)
    handlers = ServerHandlers(world, job)  # served once whole (a request that comes sooner waits for it)
    data = world.role[1] < world.num_shards
    if world.epoch:
        become = _replace_data_server if data else _replace_parity_server
    else:
        become = _start_data_server if data else _start_parity_server
    # 3. serve until the oracle says training has ended
    become(handlers, store, liveness, make_row_optimizer(job.config.optimizer, lr=job.config.lr))


def _start_data_server(handlers: ServerHandlers, store, liveness: Liveness, row_optimizer) -> None:
    """A data server of the job's first RPC world: its shard from the seed or the checkpoint resumed."""
    world, job = handlers.world, handlers.job
    config, layout, index = job.config, job.layout, world.role[1]
    started = time.perf_counter()
    init_rpc(world, store)
    handlers.epochs = epochs = Epochs(world, store)
    specs = storage_specs(config, layout, num_shards=world.num_shards, state_width=row_optimizer.state_width)
    server = Server(shard_stores(world, job, row_optimizer, specs, keys_of=shard_keys_of(job, epochs)))
    inject_fault("tables filled")  # (its tables made: on disk, hundreds of millions of rows take minutes)
    if job.resume:
        directory, chain = resume_chain(config.run_dir, job.resume)
        server.restore(directory, chain, shard=index, num_shards=world.num_shards)
    if world.parity:
        send_deltas(server, world, epochs)
    handlers.server = server
    transport.serve("server", handlers)
    where = "in memory" if not specs[0].files else (f"on disk in {specs[0].directory}, "
                                                           f"{config.storage_budget_mb:g} MiB of it in memory")
    log.info("server %d holds %d rows (of %d) %s; ready in %.1f s", index, sum(st.num_rows for st in server.stores),
             layout.num_rows, where, time.perf_counter() - started)
    serve_until_stopped(handlers, store, liveness, stores=server.stores)


def _start_parity_server(handlers: ServerHandlers, store, liveness: Liveness, row_optimizer) -> None:
    """A parity server of the job's first RPC world: the parity of its group as the members start."""
    world, index = handlers.world, handlers.world.role[1]
    started = time.perf_counter()
    init_rpc(world, store)
    handlers.epochs = epochs = Epochs(world, store)
    handlers.parity = parity = start_parity(world, handlers.job, index, row_optimizer, epochs)
    transport.serve("server", handlers)
    log.info("server %d holds the parity of servers %s (%d positions); ready in %.1f s", index,
             ", ".join(map(str, parity.shards)), sum(p.num_rows for p in parity.parities),
             time.perf_counter() - started)
    serve_until_stopped(handlers, store, liveness, stores=[])


def _replace_parity_server(handlers: ServerHandlers, store, liveness: Liveness, row_optimizer) -> None:
    """A lost parity server's replacement: the parity's structure first (its members' deltas arrive as soon as the
    RPC world has this process), then the parity made from its group's rows while they train."""
    world = handlers.world
    handlers.parity = parity = replacement_parity(world, handlers.job, world.role[1], row_optimizer, NoEpochs())
    transport.serve("server", handlers)
    epochs = join_rpc_as_replacement(world, store)
    if epochs is None:  # training ended before the job needed it
        liveness.stop()
        return
    handlers.epochs = parity.epochs = epochs
    parity.make()
    inject_fault("parity made")
    epochs.call("oracle", ORACLE.replaced, (world.rank, {"made_in_s": parity.made_in_s}))
    serve_until_stopped(handlers, store, liveness, stores=[])


def _replace_data_server(handlers: ServerHandlers, store, liveness: Liveness, row_optimizer) -> None:
    """A lost data server's replacement: its stores made first (so it is ready before the RPC world is re-formed
    around it), then its shard copied from the stand-in while training goes on; the oracle then has the stand-in
    hand the shard over (``ServerHandlers.take_over``) and routes it here again."""
    world, job = handlers.world, handlers.job
    index = world.role[1]
    specs = storage_specs(job.config, job.layout, num_shards=world.num_shards, state_width=row_optimizer.state_width)
    # (raw ids: made from the seed, not from their keys, which only the oracle has and this process is not yet in its
    # RPC world to ask for; every row is copied from the stand-in before it serves any)
    stores = shard_stores(world, job, row_optimizer, specs)
    epochs = join_rpc_as_replacement(world, store)
    if epochs is None:  # training ended before the job needed it
        liveness.stop()
        for row_store in stores:
            row_store.close()
        return
    handlers.epochs = epochs
    transport.serve("server", handlers)  # (its shard's requests answered with ShardMoved until it takes it back)
    source = RemoteStandIn(World.server_name(world.parity_server(index)), index, epochs=epochs, timeout=world.timeout)
    taking_over = ShardTakeOver(Server(stores), source, shard=index)
    taking_over.copy()
    handlers.taking_over = taking_over
    inject_fault("shard copied")
    epochs.call("oracle", ORACLE.ready_to_take_over, (world.rank,))
    serve_until_stopped(handlers, store, liveness, stores=stores)


def serve_until_stopped(handlers: ServerHandlers, store, liveness: Liveness, *, stores: list[RowStore]) -> None:
    """Tell the oracle this server is ready, then serve until it says training has ended (its fetches parked for
    longer than the timeout failed meanwhile: those of ``stores``, or of the shard a parity server stands in for).
    A request to a lost oracle that the job replaces waits for its replacement."""
    world, epochs = handlers.world, handlers.epochs
    if handlers.job.replace_oracle:
        epochs.await_peer("oracle")
    if handlers.server is not None:  # a data server's CPU from here on is serving's (summary: per 1,000 rows)
        handlers.server.ready()
    epochs.call("oracle", ORACLE.server_ready, (world.name,))
    try:
        while not store.check([STOP_KEY]):
            time.sleep(0.2)
            standing_in = handlers.parity.standing_in if handlers.parity is not None else None
            for row_store in stores or (standing_in.stores if standing_in is not None else []):
                row_store.expire_waiting(timeout=world.timeout)
    except RuntimeError as err:
        if transport.peer_gone(err):  # the store's host, the oracle, has ended: the heartbeats name it
            liveness.await_verdict(err)
        raise
    epochs.stop()
    liveness.stop()
    transport.shutdown_rpc()  # the oracle has all it needs: no request is in flight
    for row_store in stores:
        row_store.close()
