"""What a server process answers: its data server, its parity server, or a replacement still taking its shard
back, behind one object of handlers (runtime/endpoints.py's ServerEndpoints)."""

from __future__ import annotations

import functools

import torch

from bagpipe.faults import inject_fault
from bagpipe.runtime.protocol import JobInfo, answer_digest
from bagpipe.runtime.server.data_server import Server, send_deltas
from bagpipe.runtime.server.parity_server import ParityServer
from bagpipe.runtime.server.takeover import ShardTakeOver
from bagpipe.runtime.world import Epochs, NoEpochs, ShardMoved, World


class ServerHandlers:
    """What this server process answers (runtime/endpoints.py's ServerEndpoints): its data server (``server``; the
    stand-in a parity server becomes for a lost data server's shard), its parity server (``parity``), or a lost data
    server's replacement still copying its shard (``taking_over``). ``epochs`` answers the futures it returns."""

    def __init__(self, world: World, job: JobInfo) -> None:
        self.world, self.job = world, job
        self.server: Server | None = None
        self.parity: ParityServer | None = None
        self.taking_over: ShardTakeOver | None = None
        self.epochs: Epochs | NoEpochs = NoEpochs()

    def fetch(self, space: int, keys: torch.Tensor, versions: torch.Tensor, tag: int) -> torch.futures.Future:
        """Rows, state and versions of ``keys`` once at ``versions``, and ``tag`` (the caller's check that the
        answer is its request's)."""
        if self.server is None:
            return self._not_yet()
        tagged: torch.futures.Future = torch.futures.Future()
        self.server.fetch(space, keys, versions).add_done_callback(functools.partial(_pass_on_tagged, tagged, tag))
        return self.epochs.answer(tagged)

    def write_back(self, space: int, keys: torch.Tensor, rows: torch.Tensor, state: torch.Tensor,
                   version: int) -> torch.futures.Future:
        if self.server is None:
            return self._not_yet()
        return self.epochs.answer(self.server.write_back(space, keys, rows, state, version))

    def _not_yet(self) -> torch.futures.Future:
        """The answer of a lost data server's replacement to a request for its shard before it has taken the shard
        back: a request sent here since a re-formation came before the sender learnt that the shard moved to
        its stand-in (a replacement joins within a second of the loss) goes where the route says."""
        moved: torch.futures.Future = torch.futures.Future()
        moved.set_exception(ShardMoved(f"{self.world.name} is a replacement that has not taken its shard back yet"))
        return self.epochs.answer(moved)

    def read_range(self, space: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.server.read_range(space, start, stop)

    def read_rows(self, space: int, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.server.read_rows(space, local)

    def parity_apply(self, space: int, member: int, local: torch.Tensor, delta: torch.Tensor, before: torch.Tensor,
                     version: int) -> None:
        inject_fault(f"delta {version}")  # a parity server given a delta, before folding it in
        self.parity.apply(space, member, local, delta, before, version)

    def check_parity(self) -> dict:
        return self.parity.check(timeout=self.world.timeout)

    def dump(self) -> dict:
        return self.parity.dump() if self.parity is not None else self.server.dump()

    def begin_checkpoint(self, boundary: int, expected_rows: list[int], since: int | None, directory: str,
                         shard: int) -> None:
        self.server.begin_checkpoint(boundary, expected_rows, since, directory, shard=shard,
                                     num_shards=self.world.num_shards, timeout=self.world.timeout)

    def checkpoint_written(self, boundary: int) -> torch.futures.Future:
        return self.epochs.answer(self.server.checkpoints[boundary])  # kept: asked again if lost to a re-formation

    def stand_in(self, shard: int) -> None:
        self.server = self.parity.stand_in(shard, job=self.job, num_shards=self.world.num_shards,
                                           timeout=self.world.timeout)

    def stand_in_rebuilt(self, shard: int) -> torch.futures.Future:
        return self.epochs.answer(self.parity.serving(shard).rebuilt)

    def hand_over(self, shard: int) -> tuple[list[torch.Tensor], list[dict]]:
        return self.parity.hand_over(shard)

    def keep_standing_in(self, shard: int) -> None:
        self.parity.keep_standing_in(shard)

    def handed_back(self, shard: int) -> None:
        self.parity.handed_back(shard)

    def take_over(self, versions: list[torch.Tensor], received: list[dict]) -> dict:
        """A replacement data server's: the frozen stand-in's state; serve the shard once caught up with it."""
        inject_fault("take over")
        figures = self.taking_over.take_over([v.numpy() for v in versions], received)
        send_deltas(self.taking_over.server, self.world, self.epochs)
        self.server, self.taking_over = self.taking_over.server, None
        return figures


def _pass_on_tagged(to: torch.futures.Future, tag: int, done: torch.futures.Future) -> None:
    """A fetch's answer: rows, state and versions, the request's ``tag`` and their digest (answer_digest)."""
    try:
        rows, state, versions = done.value()
        to.set_result((rows, state, versions, tag, answer_digest(rows, state, versions)))
    except BaseException as err:  # noqa: BLE001 - handed on (a ShardMoved included, as itself)
        to.set_exception(err)
