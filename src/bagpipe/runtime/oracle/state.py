"""What the oracle's threads share and wait on: the servers ready, the trainers' reports, the job's first failure."""

from __future__ import annotations

import threading
import time

from bagpipe.runtime.protocol import TrainerStats
from bagpipe.runtime.world import World


class JobState:
    """Shared by the oracle's threads (the planner, RPC handlers, replacements awaited), under ``changed``: the
    servers ready to serve, the trainers' reports (``done``), the job's first failure (planning's, or a
    replacement's that cannot be made: the trainers' next pull says it) and ``stop`` (the job is over: threads end
    within a poll of it)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.changed = threading.Condition()
        self.failure: BaseException | None = None
        self.stop = threading.Event()
        self.servers_ready: set[str] = set()
        self.done: dict[int, tuple[TrainerStats, dict | None]] = {}

    def fail(self, err: BaseException) -> None:
        """The job cannot go on (the first failure is kept)."""
        with self.changed:
            self.failure = self.failure or err
            self.changed.notify_all()

    def await_servers(self, within: float | None = None) -> bool:
        """Until every server is ready (or the job failed): a TimeoutError after the world's timeout; or, given
        ``within`` seconds, whether they are ready by then (no error: the caller asks again)."""
        deadline = time.monotonic() + (self.world.timeout if within is None else within)
        with self.changed:
            while len(self.servers_ready) < self.world.num_servers and self.failure is None:
                if not self.changed.wait(timeout=max(deadline - time.monotonic(), 0.0)):
                    if within is not None:
                        return False
                    raise TimeoutError(f"servers ready after {self.world.timeout:.0f} s: "
                                       f"{sorted(self.servers_ready)} of {self.world.num_servers}")
        return True

    def wait_for_trainers(self) -> None:
        """Until every trainer reported done, or the job failed (a lost trainer is the heartbeats' to tell)."""
        with self.changed:
            while len(self.done) < self.world.num_trainers:
                if self.failure is not None:
                    raise RuntimeError(f"planning failed: {self.failure}") from self.failure
                self.changed.wait(timeout=0.5)
