"""The trainer role's process (``bagpipe trainer``): join the job, build the model and the runtime around it,
answer what other roles ask, train."""

from __future__ import annotations

import functools
import logging


from bagpipe.device import resolve_device
from bagpipe.runtime import transport
from bagpipe.runtime.liveness import Liveness, exit_on_lost
from bagpipe.runtime.protocol import JobInfo
from bagpipe.runtime.trainer.handlers import TrainerHandlers
from bagpipe.runtime.trainer.loop import DenseModel, train_loop
from bagpipe.runtime.trainer.runtime import TrainerRuntime
from bagpipe.runtime.world import World, await_reformation, check_in, init_rpc, job_world, wait_for_job

log = logging.getLogger(__name__)


def join_as_trainer(world: World, *, given: dict, on_lost=exit_on_lost) -> tuple:
    """Check in (stating the settings this trainer was ``given``), start the heartbeat (watching the
    oracle and the other trainers) and wait for the job as every role agreed on it."""
    store, world = check_in(world, "trainer", given=given)
    liveness = Liveness(world, watch=[0, *(world.trainer_rank(t) for t in range(world.num_trainers))],
                        on_lost=on_lost)
    job = JobInfo.from_json(wait_for_job(world, store))
    world = job_world(world, job.config)
    liveness.adopt(world)
    if world.epoch:  # a lost trainer's replacement: in the RPC world the oracle re-forms around it
        if not await_reformation(world, store):
            raise RuntimeError("training ended before this trainer's replacement joined")
    init_rpc(world, store, epoch=world.epoch)
    return world, store, liveness, job


def run_trainer(world: World, *, given: dict | None = None, device: str | None = None,
                writeback_delay: float = 0.0) -> None:
    """``device``: this trainer's (cpu, auto, cuda, cuda:N: the original's trainer flag, a GPU falling back to the
    CPU where there is none); None: the job's ``--device``."""
    # 1. the job, as every role agreed on it, in the RPC world (a replacement's: re-formed around it)
    world, store, liveness, job = join_as_trainer(world, given={"kind": "model", **(given or {})})
    # 2. the model, then the runtime around it (caches, prefetch and write-back, gradient sync, recovery), on the
    # device: the dense model and the row caches there; plans, fetched rows, write-backs and sums in host memory
    device = resolve_device(device, fallback=True) if device else resolve_device(job.config.device)
    dense = DenseModel(job.config, job.layout, part=world.role[1], device=device)
    runtime = TrainerRuntime(world, store, job=job, liveness=liveness, model=dense.hooks(), device=device,
                             writeback_delay=writeback_delay, replacing=bool(world.epoch))
    runtime.stats.extra["device"] = str(device)
    # 3. answer the other roles; a lost peer this job goes on without is the heartbeats' to judge
    transport.serve("trainer", TrainerHandlers(runtime))
    liveness.recover = functools.partial(liveness.goes_on_without, replace_oracle=job.replace_oracle,
                                         replace_trainers=job.replace_trainers)
    # 4. train
    try:
        train_loop(runtime, dense)
    except BaseException as err:
        runtime.abort()
        if transport.peer_gone(err):  # the peer that ended is the failure: name it, not this trainer
            liveness.await_verdict(err)
        raise

