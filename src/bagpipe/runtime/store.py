"""The job's store as a process of its own (``bagpipe store``), for a job started role by role: it outlives the oracle.

Every role meets at it as at the oracle's store; the oracle, started with ``--store-served``, joins it as a client.
It watches the oracle's heartbeat: once that stops for the liveness window (the oracle's process ended, stopped or
hung), it has a replacement awaited, and the same ``bagpipe oracle`` command started again (on any machine) takes the
job over (runtime/succession.py) while the trainers and servers wait for it. The local launcher does the same for a
job on one machine. The process ends once every role has left, or none has beaten for the time a lost oracle's
replacement is awaited.
"""

from __future__ import annotations

import logging
import time

from bagpipe.runtime.names import BEAT_PREFIX, JOB_KEY, LEFT_PREFIX, STOP_KEY
from bagpipe.runtime.succession import OracleWatch, declare_oracle_lost, load_record
from bagpipe.runtime.world import JobStore, World

log = logging.getLogger(__name__)

POLL_S = 0.2


def serve_store(world: World) -> None:
    """Serve the job's store until the job has ended (every role left) or is gone (no role beats any more)."""
    job_store = JobStore(world)
    store = job_store.store
    watch = OracleWatch(world, store)
    log.info("serving the job's store at %s:%d for a world of %d: start the oracle with --store-served; a lost "
             "oracle is replaced by starting its command again", world.master_addr, world.master_port, world.world_size)
    ranks = range(world.world_size)
    beats = {rank: 0 for rank in ranks}
    changed = time.monotonic()
    watching = True  # the oracle's heartbeat, until a loss it cannot take over is logged
    while True:
        time.sleep(POLL_S)
        if all(store.check([f"{LEFT_PREFIX}{rank}"]) for rank in ranks):
            log.info("every role has left: the job's store closes")
            break
        now = {rank: store.add(f"{BEAT_PREFIX}{rank}", 0) for rank in ranks}
        if now != beats:
            beats, changed = now, time.monotonic()
        elif any(now.values()) and time.monotonic() - changed > world.replacement_s:
            log.error("no role of the job has beaten for %.0f s: the job is gone; the store closes",
                      time.monotonic() - changed)
            break
        silent = watch.silent_s() if watching else None
        if silent is not None:
            watching = _oracle_silent(store, silent)
    job_store.close()


def _oracle_silent(store, silent: float) -> bool:
    """The oracle has not beaten for ``silent`` seconds: have its replacement awaited, if the job can be taken over
    (True; False: it cannot be, said once)."""
    record = load_record(store) if store.check([JOB_KEY]) else None
    why = ("it had not started the job" if record is None else "training had ended" if store.check([STOP_KEY])
           else f"trainer {record.done[0]} had reported done" if record.done else None)
    if why is not None:
        log.error("the oracle has not beaten for %.0f s and cannot be replaced (%s): the job's roles end by "
                  "themselves", silent, why)
        return False
    epoch = declare_oracle_lost(store, f"no heartbeat for {silent:.0f} s", lost_at=time.time() - silent)
    log.warning("the oracle has not beaten for %.0f s: start the same `bagpipe oracle` command again (kill the old "
                "process if it is still there): it takes the job over in RPC world %d while the others wait", silent,
                epoch)
    return True
