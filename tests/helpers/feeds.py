"""An oracle's feed (runtime/oracle/feed.py) in one process, its servers taken as ready: what a test of planning
and pulling needs of an oracle, without the store, the RPC world or the run dir."""

from __future__ import annotations

from bagpipe.config import TrainConfig
from bagpipe.runtime.oracle.checkpointing import JobCheckpoints
from bagpipe.runtime.oracle.feed import Feed, Sent
from bagpipe.runtime.oracle.main import job_info
from bagpipe.runtime.oracle.state import JobState
from bagpipe.runtime.world import Routes, World


def feed_of(config: TrainConfig, world: World, dataset, *, sent: Sent | None = None) -> Feed:
    job = job_info(config, world, dataset, resume=None, scripts=False)
    state = JobState(world)
    state.servers_ready.update(World.server_name(s) for s in range(world.num_servers))
    checkpoints = JobCheckpoints(config, world, num_spaces=len(job.layout.spaces), resumed_at=None,
                                 routes=Routes(world))
    return Feed(config, dataset, job, checkpoints=checkpoints, state=state, sent=sent)
