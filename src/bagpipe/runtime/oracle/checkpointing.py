"""The oracle's side of checkpoints during a bagpipe job: when, and gathering every role's part.

A checkpoint at boundary b holds every row as it stood after iteration b - 1: on the servers, the
rows written back before b (each server keeps them copy-on-write while later write-backs arrive,
``RowStore.begin_snapshot``), overridden by the rows trainer 0 holds in its cache at b (all
trainers hold the same), with every update of the iterations before b applied; and trainer 0's
dense weights and optimizer state. With the partitioned cache every trainer holds rows of its own, and
every trainer sends its cached rows (a row several trainers hold is current, so equal, in each). The oracle
starts the servers' snapshots while planning b, before it hands any trainer the plan of b, so no write-back of b or later can reach a server
first; it tells each server how many rows the plan writes back before b, which that server waits
for. Training goes on while the parts are written; the oracle commits them (``CheckpointWriter``).
With ``--eval-every N`` a checkpoint is taken at every multiple of N as well, and handed, once committed,
to the evaluation (read lazily: ``ChainRows``). The run's final state is written by the same servers'
snapshots (``write_final``), never gathered into one process.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from bagpipe.train.checkpoints import (ChainRows, CheckpointSchedule, CheckpointWriter, background_priority, load_dense,
                                       read_chain, save_dense, step_name, valid_checkpoints, write_parts)
from bagpipe.config import TrainConfig
from bagpipe.faults import inject_fault
from bagpipe.threads import Background
from bagpipe.runtime.endpoints import SERVER
from bagpipe.runtime.transport import unwrap
from bagpipe.runtime.world import Epochs, NoEpochs, Routes, World

log = logging.getLogger(__name__)


class JobCheckpoints:
    """Decide the boundaries, start the servers' snapshots, gather trainer 0's part (partitioned: every
    trainer's), commit."""

    def __init__(self, config: TrainConfig, world: World, *, num_spaces: int, resumed_at: int | None,
                 routes: Routes, on_evaluable: Callable[[int, dict, ChainRows], None] | None = None,
                 keep_staged: bool = False, epochs: Epochs | NoEpochs | None = None) -> None:
        """``on_evaluable(boundary, dense, rows)``: called with each checkpoint taken for ``--eval-every`` once
        committed (its rows read lazily, from files opened before any later prune). ``keep_staged``: checkpoints
        being written are left alone (a lost oracle's replacement takes them over, ``take_over``). ``epochs``: the
        oracle's, through which requests to the servers are sent again after a re-formation of the RPC world."""
        self.config, self.world, self.routes = config, world, routes
        self.on_evaluable = on_evaluable
        self.epochs = epochs if epochs is not None else NoEpochs()  # requests sent again after a re-formation
        self.writer = (CheckpointWriter(config.run_dir, keep=config.keep_checkpoints, clear_staged=not keep_staged)
                       if self.periodic else None)
        self.schedule = CheckpointSchedule(every=config.checkpoint_every, every_s=config.checkpoint_every_s)
        # rows the plan has written back since the job started, per space and server: what a snapshot awaits
        self.evicted = np.zeros((num_spaces, world.num_shards), dtype=np.int64)
        self.previous = self.resumed_at = resumed_at  # the last checkpoint's boundary: a delta holds the rows since
        self._abandoned: set[int] = set()  # checkpoints given up (a server lost while writing its part)
        self._begun: set[int] = set()  # checkpoints this oracle began (trainer 0's parts of others are not kept)
        self._again: set[int] = set()  # a lost oracle's, staged, whose plan no trainer had: begun again
        # per boundary, each trainer's part as it arrives: trainer -> (dense, dense_optimizer, parts, extra)
        self._cache_parts: dict[int, dict[int, tuple]] = {}
        # the trainers that send a part: trainer 0 (its cache is every trainer's), or all (partitioned)
        self.senders = set(range(world.num_trainers)) if config.partitioned else {0}
        # (a replaced trainer 0) its parts of the boundaries before this that have not come are lost
        self._cache_lost_before = -1
        self._arrived = threading.Condition()
        self._job: Background | None = None  # the checkpoint being committed
        self.written: list[int] = []
        self._beginning = threading.Lock()  # held while a checkpoint begins, and while ``paused``
        self.closed = False  # the final rows are being written: training has ended

    @property
    def periodic(self) -> bool:
        """Whether checkpoints are taken during training (asked for, or to evaluate from)."""
        return self.config.checkpoints or (self.on_evaluable is not None and self.config.eval_every > 0)

    def evaluates(self, boundary: int) -> bool:
        return self.on_evaluable is not None and self.config.eval_every > 0 and boundary % self.config.eval_every == 0

    def count_evictions(self, space: int, keys: np.ndarray) -> None:
        if len(keys):
            self.evicted[space] += np.bincount(keys % self.world.num_shards, minlength=self.world.num_shards)

    def maybe_begin(self, boundary: int) -> bool:
        """Called while planning ``boundary`` (its evictions counted), before any trainer gets its plan:
        start a checkpoint there if one is due. Waits for the previous one to be committed first."""
        if not (self.schedule.due(boundary) or self.evaluates(boundary) or boundary in self._again):
            return False
        with self._beginning:
            self.wait()
            full = self.writer.wants_full() or self.previous is None
            # (one a lost oracle began: its servers may be writing into its directory already)
            directory = self.writer.staged(boundary) if boundary in self._again else self.writer.stage(boundary)
            self._begun.add(boundary)
            futures = self._begin_snapshots(boundary, directory, since=None if full else self.previous)
            self._job = Background(lambda: self._finish(boundary, full, futures), name="checkpoint")
            self.previous = boundary
        return True

    @contextlib.contextmanager
    def paused(self):
        """While the body runs no checkpoint is in progress (one is committed first; none begins): a shard may
        change hands (a stand-in's snapshot is not cut short). Yields False, at once, once training has ended."""
        with self._beginning:
            if self.closed:
                yield False
                return
            self.wait()
            yield True

    def _begin_snapshots(self, boundary: int, directory: Path, *, since: int | None) -> list:
        """Ask every server to write its shard as of ``boundary`` into ``directory`` (every row, or those
        written back from iteration ``since`` on); the futures of their part entries."""
        futures = []
        for shard in range(self.world.num_shards):  # parity servers hold no rows of their own
            args = (boundary, self.evicted[:, shard].tolist(), since, str(directory), shard)
            try:
                name = self.routes.name(shard)  # a lost server's shard: its parity server, standing in
                self.epochs.call(name, SERVER.begin_checkpoint, args)  # sent again after a re-formation
            except RuntimeError:
                if not self._lost_meanwhile(shard):
                    raise
                name = self.routes.name(shard)  # none of its write-backs of this boundary has happened yet
                self.epochs.call(name, SERVER.begin_checkpoint, args)
            futures.append(self._written(name, boundary))
        return futures

    def _written(self, name: str, boundary: int) -> tuple:
        """(epoch, future) of a server's part of the checkpoint at ``boundary``, once written. (Asked while this
        process's RPC agent is shut down for a re-formation, the future fails, and ``_wait_written`` asks again:
        before Endpoint.call_async said so by a failed future, the exception it raised failed the job.)"""
        return self.epochs.epoch, SERVER.checkpoint_written.call_async(
            name, (boundary,), timeout=self.world.timeout + 3 * self.world.timeout)

    def _wait_written(self, shard: int, boundary: int, sent: tuple) -> list:
        """A server's part entries; asked again if the RPC world was re-formed meanwhile (the part is kept)."""
        while True:
            sent_in, future = sent
            try:
                return unwrap(future.wait())
            except RuntimeError:
                if not self.epochs.resend_after(sent_in):
                    raise
                sent = self._written(self.routes.name(shard), boundary)

    def write_final(self, boundary: int, directory: Path) -> ChainRows:
        """The job's rows after its last iteration ``boundary`` (when every row is back on its server: the
        last plan step writes every cached row back), each server writing its own shard into ``directory``;
        read lazily from there."""
        with self._beginning:
            self.closed = True
            self.wait()
            directory.mkdir(parents=True, exist_ok=True)
            entries = [entry for shard, sent in enumerate(self._begin_snapshots(boundary, directory, since=None))
                       for entry in self._wait_written(shard, boundary, sent)]
        return ChainRows([(directory, entries)])

    def receive_cache(self, boundary: int, trainer: int, dense: dict | None, dense_optimizer: dict | None,
                      parts: list, extra: dict) -> None:
        """A trainer's part (an RPC handler): its cached rows at ``boundary``, and trainer 0's dense weights and
        optimizer state."""
        with self._arrived:
            if boundary in self._begun and boundary not in self._abandoned and trainer in self.senders:
                self._cache_parts.setdefault(boundary, {})[trainer] = (dense, dense_optimizer, parts, extra)
            self._arrived.notify_all()

    def take_over(self, *, sent_through: int) -> set[int]:
        """A lost oracle's replacement (trainers have the plans up to iteration ``sent_through``) takes over the
        checkpoints it began and did not commit, staged in the run dir: one whose plan some trainer has is given up
        once every server has written its part into its directory (trainer 0's part went to the lost oracle); one
        whose plan none has yet is begun again when planned (a server that has begun it keeps its part). Returns
        the boundaries up to ``sent_through`` whose plans carried a checkpoint (as far as the run dir tells)."""
        if self.writer is None:
            return set()
        committed = {c[-1]["iteration"] for _, c in valid_checkpoints(self.config.run_dir)}
        staged = sorted(int(p.name.removeprefix("step-").removesuffix(".tmp"))
                        for p in self.writer.root.glob("step-*.tmp"))
        for boundary in staged:
            if boundary > sent_through:
                self._again.add(boundary)
                continue
            for shard in range(self.world.num_shards):
                try:
                    self._wait_written(shard, boundary, self._written(self.routes.name(shard), boundary))
                except RuntimeError as err:  # its part failed: nothing writes into the directory any more
                    log.warning("server %d's part of the checkpoint at iteration %d failed: %s", shard, boundary,
                                str(err).splitlines()[0])
            self._abandon(boundary, "the oracle was lost before it committed it")
        if self.writer.last is not None:  # the next one is a delta from the last one committed
            self.previous = int(self.writer.last.removeprefix("step-"))
        return {b for b in committed | set(staged) if b <= sent_through}

    def evaluate_missing(self, *, evaluated: set[int]) -> None:
        """(A lost oracle's replacement) Evaluate the committed checkpoints taken for ``--eval-every`` whose
        evaluation was lost with the oracle (none of ``evaluated`` logged)."""
        if self.on_evaluable is None or self.config.eval_every <= 0:
            return
        for directory, chain in reversed(valid_checkpoints(self.config.run_dir)):
            boundary = chain[-1]["iteration"]
            if self.evaluates(boundary) and boundary not in evaluated and (self.resumed_at or 0) < boundary:
                log.info("evaluating the checkpoint at iteration %d again (its evaluation was lost with the oracle)",
                         boundary)
                self.on_evaluable(boundary, load_dense(directory, chain[-1])["dense"],
                                  ChainRows.of_chain(directory, chain))

    def cache_parts_lost(self, *, before: int) -> None:
        """Trainer 0 was lost and its replacement started at boundary ``before``: its parts of earlier boundaries
        that have not come never will (the RPC world they were sent in is gone); those checkpoints are given up."""
        with self._arrived:
            self._cache_lost_before = max(self._cache_lost_before, before)
            self._arrived.notify_all()

    def _lost_meanwhile(self, shard: int) -> bool:
        """Whether ``shard``'s server, whose part just failed, is a loss the job goes on without (--parity):
        the oracle moves its shard within the liveness window."""
        if not self.world.parity:
            return False
        deadline = time.monotonic() + self.world.takeover_s
        while self.routes.server(shard) == shard and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.routes.server(shard) != shard

    def _finish(self, boundary: int, full: bool, futures: list) -> None:
        background_priority()
        started = time.perf_counter()
        entries = []
        for shard, sent in enumerate(futures):
            try:
                entries += self._wait_written(shard, boundary, sent)
            except RuntimeError as err:
                if not self._lost_meanwhile(shard):
                    raise
                # Its part died with it, and the rows it had kept as of the boundary may be gone: a later
                # checkpoint, taken from its stand-in, will do.
                self._abandon(boundary, f"server {shard} was lost while writing its part ({str(err).splitlines()[0]})")
                return
        def arrived() -> bool:
            return self.senders <= self._cache_parts.get(boundary, {}).keys()

        with self._arrived:
            if not self._arrived.wait_for(lambda: arrived() or boundary < self._cache_lost_before,
                                          timeout=4 * self.world.timeout):
                missing = sorted(self.senders - self._cache_parts.get(boundary, {}).keys())
                raise TimeoutError(f"trainer {', '.join(map(str, missing))} sent no part of the checkpoint at "
                                   f"iteration {boundary}")
            if not arrived():
                self._abandoned.add(boundary)
        if boundary in self._abandoned:  # a later checkpoint will do
            self._abandon(boundary, "a trainer was lost before its part arrived")
            return
        with self._arrived:
            received = self._cache_parts.pop(boundary)
        dense, dense_optimizer, _, extra = received[0]
        parts = [part for trainer in sorted(received) for part in received[trainer][2]]
        directory = self.writer.root / f"{step_name(boundary)}.tmp"
        save_dense(directory, dense, dense_optimizer)
        entries += write_parts(directory, parts, prefix="cache")  # last: the cached rows override the servers'
        extra = {**extra, "mode": "bagpipe", "trainers": self.world.num_trainers,
                 "servers": self.world.num_shards}
        inject_fault(f"committing {boundary}")
        final = self.writer.publish(boundary, full=full, parts=entries, extra=extra)
        self.written.append(boundary)
        if self.evaluates(boundary):
            self.on_evaluable(boundary, dense, ChainRows.of_chain(final, read_chain(final)))
        log.info("checkpoint at iteration %d committed in %.2f s after its parts were started", boundary,
                 time.perf_counter() - started)

    def _abandon(self, boundary: int, why: str) -> None:
        log.warning("checkpoint at iteration %d abandoned: %s", boundary, why)
        with self._arrived:
            self._abandoned.add(boundary)
            self._cache_parts.pop(boundary, None)
        shutil.rmtree(self.writer.root / f"{step_name(boundary)}.tmp", ignore_errors=True)

    def wait(self) -> None:
        """Until the checkpoint in progress is committed (or abandoned); its failure raised here."""
        job, self._job = self._job, None
        if job is not None:
            job.join(failed="a checkpoint failed")
            if self.previous in self._abandoned:  # the next delta holds what changed since the last one kept
                self.previous = self.written[-1] if self.written else self.resumed_at

