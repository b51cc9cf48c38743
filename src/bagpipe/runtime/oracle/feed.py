"""The oracle's feed: the planner run over the global batches, and each trainer's plan messages, pulled.

A producer thread runs the planner over the global batches in order and fills one bounded queue per trainer;
trainers pull from their queue (flow control: the oracle never runs further ahead than the queues hold). Every
trainer's messages are kept from REDO_DEPTH before the last iteration it stepped (a pull's answer lost to a
re-formation of the RPC world is pulled again; a lost trainer's replacement computes those iterations again). A
lost oracle's replacement plans again from the start (a pure function of the data and the configuration) and
sends each trainer only what it does not have (``Sent``).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import deque
from typing import Callable

import numpy as np
import torch

from bagpipe.cache import batch_view
from bagpipe.config import TrainConfig
from bagpipe.data.batches import epoch_rows, fresh_negatives, read_batch
from bagpipe.data.binary import BinaryDataset
from bagpipe.embeddings import valid_keys
from bagpipe.embeddings.dynamic import remade
from bagpipe.faults import inject_fault
from bagpipe.planner import PlannerConfig, plan_spaces
from bagpipe.planner.ahead import NumberingLost, plan_spaces_ahead
from bagpipe.planner.partitioned import TrainerStep, plan_partitioned_spaces
from bagpipe.planner.plan import PlanStep
from bagpipe.runtime.liveness import end_as_lost
from bagpipe.runtime.oracle.checkpointing import JobCheckpoints
from bagpipe.runtime.oracle.state import JobState
from bagpipe.runtime.protocol import PULL_MAX_STEPS, JobInfo, Pulled, part_messages, slice_messages
from bagpipe.runtime.redo import REDO_DEPTH
from bagpipe.timing import cpu_seconds, peak_rss_bytes

PULL_WAIT_S = 1.0  # how long a pull waits for a plan message before answering with none


@dataclasses.dataclass
class Sent:
    """What the trainers had from a lost oracle when its replacement took over (their ``progress``): per trainer
    the last plan message it has (``before``), the last iteration it stepped and the version its write-backs are
    acknowledged to; the first message made again (``first``: those before it no trainer may pull again), and which
    of the messages made again carried a checkpoint."""

    before: list[int]
    finished: list[int]
    written: list[int]
    first: int
    checkpoints: set[int] = dataclasses.field(default_factory=set)


class Feed:
    """The plan of ``job`` over ``dataset``'s training split, fed to its trainers. ``checkpoints``: which
    boundaries carry one (and what each snapshot waits for); ``state``: the servers a checkpoint waits for, the
    job's failure, ``stop``. A replacement oracle's feed is given what its trainers have (``sent``) and calls
    ``on_resumed(replay_s)`` once its plans are new."""

    def __init__(self, config: TrainConfig, dataset: BinaryDataset, job: JobInfo, *, checkpoints: JobCheckpoints,
                 state: JobState, sent: Sent | None = None, on_resumed: Callable[[float], None] | None = None) -> None:
        self.config, self.dataset, self.checkpoints, self.state = config, dataset, checkpoints, state
        self.layout, self.iterations, self.start = job.layout, job.iterations, job.start
        num_trainers = state.world.num_trainers
        self.partitioned = config.partitioned
        self.planned = self.start  # the last iteration planned
        self.planner_configs = [PlannerConfig(num_rows=space.num_rows, cache_rows=share, lookahead=config.lookahead,
                                              num_trainers=num_trainers, policy=config.policy,
                                              cleanup_fraction=config.cleanup_fraction,
                                              keep_within=config.keep_within)
                                for space, share in zip(self.layout.spaces, job.cache_rows)]
        depth = max(2 * config.prefetch_depth, 2 * PULL_MAX_STEPS)
        self.queues = [queue.Queue(maxsize=depth) for _ in range(num_trainers)]
        # per trainer, the plan messages sent from REDO_DEPTH before the last iteration it stepped on
        self.sent: list[deque] = [deque() for _ in range(num_trainers)]
        sent = sent or Sent(before=[self.start - 1] * num_trainers, finished=[self.start - 1] * num_trainers,
                            written=[self.start - 1] * num_trainers, first=self.start)
        self.sent_before, self.first_message, self.sent_checkpoints = sent.before, sent.first, sent.checkpoints
        self.finished = list(sent.finished)  # per trainer, the last iteration it said it stepped
        self.written = list(sent.written)  # and the version its write-backs are acknowledged to
        self.on_resumed = on_resumed
        self.bytes_sent = 0
        self.figures = PlanningFigures()
        self.figures.processes = config.planner_processes

    def produce(self) -> None:
        """The producer thread's: plan to the end of the job (a failure is the job's: the trainers' next pull
        says it)."""
        try:
            self._produce()
        except NumberingLost as err:  # a part of the oracle killed: the oracle is lost as a killed one is, replaced
            end_as_lost(f"the oracle's numbering process was lost ({err}): the oracle ends as a lost one, for its "
                        f"replacement to take the job over")
        except BaseException as err:  # noqa: BLE001 - handed to the trainers' next pull and to the main thread
            self.state.fail(err)
        finally:
            self.figures.finish_thread()

    def _produce(self) -> None:
        config, split, layout, stop = self.config, self.dataset.train, self.layout, self.state.stop
        pending: deque = deque()
        figures = self.figures
        trainers = len(self.queues)

        negatives = fresh_negatives(config, split)

        numbering = self.dataset.numbering  # raw ids: a key not admitted yet looks its table's default row up
        retiring = numbering is not None and numbering.retires

        def key_stream():  # per iteration, each space's keys (replicated), or each space's keys per trainer
            for iteration, (epoch, rows) in enumerate(epoch_rows(
                    split, batch_size=config.batch_size, iterations=self.iterations, shuffle=config.shuffle,
                    shuffle_seed=config.shuffle_seed)):
                reading = time.thread_time()
                batch = read_batch(split, rows, epoch=epoch, negatives=negatives)
                if numbering is not None:
                    batch = numbering.batch_as_made(batch, iteration)
                if self.partitioned:  # (each slice's key matrices kept, as the whole batch's below)
                    parts = [layout.keys(part.ids.numpy()) for part in batch.slices(trainers)]
                    pending.append((batch, parts))
                    keys = [[valid_keys(part[s]) for part in parts] for s in range(len(layout.spaces))]
                else:  # (each space's key matrix kept: the messages place its ids where the planner put them)
                    matrices = layout.keys(batch.ids.numpy())
                    pending.append((batch, matrices))
                    keys = [valid_keys(keys) for keys in matrices]
                figures.read(time.thread_time() - reading)
                yield keys

        started = time.perf_counter()
        figures.begin()
        plans = self._partitioned(key_stream()) if self.partitioned else self._replicated(key_stream())
        for iteration, messages_of in plans:
            self.planned = iteration
            batch, batch_keys = pending.popleft() if iteration < self.iterations else (None, None)
            if messages_of is None:  # replayed up to the checkpoint resumed from
                continue
            checkpoint = False
            sent = iteration <= max(self.sent_before)  # by a lost oracle this one replaces: planned again
            if sent and iteration < self.first_message:
                continue
            if not sent:
                self._resumed(started)
            if sent:
                checkpoint = iteration in self.sent_checkpoints
            elif self.checkpoints.periodic and self.start < iteration < self.iterations:
                self.state.await_servers()  # a checkpoint asks every server for its part
                checkpoint = self.checkpoints.maybe_begin(iteration)
            inject_fault(f"planned {iteration}")
            messages = messages_of(batch, batch_keys, checkpoint)
            if retiring and iteration < self.iterations:  # (rows made again now: each trainer holding one)
                made_again = [tuple(torch.from_numpy(part) for part in space)
                              for space in remade(numbering, layout, iteration)]
                for message in messages:
                    message.remade = made_again
            for out, message in zip(self.queues, messages):
                self.bytes_sent += message.nbytes()
                while not stop.is_set():
                    try:
                        out.put(message, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        self._resumed(started)  # (the lost oracle had sent every plan: none is new)

    def _replicated(self, keys):
        """The replicated plan over ``keys`` (each iteration's keys per space): per iteration, its number and how to
        make the trainers' messages (of its batch, with or without a checkpoint; None before the start)."""
        trainers = len(self.queues)
        resident = [np.full(c.cache_rows, -1, dtype=np.int64) for c in self.planner_configs] if self.start else None
        # (with each id's place among its batch's rows: the messages cut every trainer's from it, no search)
        planning = plan_spaces_ahead if self.config.planner_processes == 2 else plan_spaces
        for steps in self.figures.timed(planning(keys, self.planner_configs, inverse=True)):
            iteration = steps[0].iteration
            if iteration <= self.start and resident is not None:  # replaying the plan up to the checkpoint
                for slot_key, step in zip(resident, steps):
                    slot_key[step.evict_slots] = -1
                    slot_key[step.fetch_slots] = step.fetch_keys
                if iteration < self.start:
                    yield iteration, None
                    continue
                steps = tuple(_refill(step, slot_key) for step, slot_key in zip(steps, resident))
            for space, step in enumerate(steps):  # what a snapshot at a later boundary waits for
                self.checkpoints.count_evictions(space, step.evict_keys)

            def messages_of(batch, batch_keys, checkpoint: bool, steps=steps, iteration=iteration):
                views = [batch_view(step, keys) for step, keys in zip(steps, batch_keys or [None] * len(steps))]
                return slice_messages(iteration, steps, views, batch, trainers, checkpoint=checkpoint)
            yield iteration, messages_of

    def _partitioned(self, keys):
        """``_replicated`` for the partitioned plan (``keys``: each iteration's keys per space per trainer)."""
        # per space and trainer, the row in each slot, while the plan is replayed up to the checkpoint resumed from
        resident = [[np.full(c.cache_rows, -1, dtype=np.int64) for _ in self.queues]
                    for c in self.planner_configs] if self.start else None
        for steps in self.figures.timed(plan_partitioned_spaces(keys, self.planner_configs, inverse=True)):
            iteration = steps[0].iteration
            if iteration <= self.start and resident is not None:
                for slot_keys, step in zip(resident, steps):
                    for slot_key, part in zip(slot_keys, step.trainers):
                        slot_key[part.drop_slots] = -1
                        slot_key[part.fetch_slots] = part.fetch_keys
                if iteration < self.start:
                    yield iteration, None
                    continue
                steps = tuple(dataclasses.replace(step, trainers=tuple(_refill_part(part, slot_key) for part, slot_key
                                                                      in zip(step.trainers, slot_keys)))
                              for step, slot_keys in zip(steps, resident))
            for space, step in enumerate(steps):  # what a snapshot at a later boundary waits for
                self.checkpoints.count_evictions(space, np.concatenate([part.write_keys for part in step.trainers]))
            yield iteration, (lambda batch, slice_keys, checkpoint, steps=steps, iteration=iteration:
                              part_messages(iteration, steps, batch, slice_keys, checkpoint=checkpoint))

    def _resumed(self, started: float) -> None:
        if self.on_resumed is not None:
            on_resumed, self.on_resumed = self.on_resumed, None
            on_resumed(time.perf_counter() - started)

    def pull(self, trainer: int, after: int, max_steps: int, finished: int | None = None,
             written: int | None = None) -> Pulled:
        """The next plan messages of ``trainer``, which has those up to iteration ``after``: the ones it was sent
        and did not get (the answer lost to a re-formation of the RPC world) again, else new ones; none after
        PULL_WAIT_S without any (the trainer asks again: an RPC thread is not held for long).

        ``finished``: the last iteration the trainer has stepped; its messages are kept from REDO_DEPTH before it
        on (a replacement for it may compute those iterations' shares again, runtime/redo.py). ``written``: the
        last version all its write-backs up to are acknowledged; the answer says the lowest of all the trainers'
        (every trainer keeps the rows others write back until then)."""
        state = self.state
        if not state.await_servers(within=PULL_WAIT_S):  # a server still filling its tables (on disk: minutes, for
            with state.changed:                            # hundreds of millions of rows): the trainer asks again
                return Pulled([], min(self.written), servers_ready=False)
        kept = self.sent[trainer]
        with state.changed:
            if finished is not None:
                self.finished[trainer] = max(self.finished[trainer], finished)
            if written is not None:
                self.written[trainer] = max(self.written[trainer], written)
            written_by_all = min(self.written)
        while kept and kept[0].iteration <= self.finished[trainer] - REDO_DEPTH:
            kept.popleft()
        if kept and after + 1 < kept[0].iteration:
            raise RuntimeError(f"trainer {trainer}'s plan messages from iteration {after + 1} are no longer kept "
                               f"(from {kept[0].iteration} on)")
        again = [message for message in kept if message.iteration > after]
        if again:
            return Pulled(again, written_by_all)
        if kept and after > kept[-1].iteration and after > self.sent_before[trainer]:
            raise RuntimeError(f"trainer {trainer} pulled after iteration {after}, past the {kept[-1].iteration} "
                               f"it was sent")
        out = self.queues[trainer]
        deadline = time.monotonic() + PULL_WAIT_S
        messages = []
        while not messages:
            if state.failure is not None:
                raise RuntimeError(f"the oracle failed: {state.failure}")
            try:
                message = out.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    return Pulled([], written_by_all)
                continue
            kept.append(message)
            if message.iteration > after:  # (one a lost oracle had sent, planned again, is kept only)
                messages.append(message)
        while len(messages) < max_steps and not messages[-1].final:
            try:
                messages.append(out.get_nowait())
            except queue.Empty:
                break
            kept.append(messages[-1])
        return Pulled(messages, written_by_all)

    def trainer_done(self, trainer: int) -> None:
        """``trainer``'s final flush's write-backs are acknowledged (under ``state.changed``)."""
        self.written[trainer] = self.iterations


class PlanningFigures:
    """Where the producer thread's time goes, in its own CPU time (``time.thread_time``): planning (the planner's
    steps, the data it reads excluded), reading the batches and mapping their ids to keys, and the rest of the
    feed (each trainer's messages made and queued); the ids planned and the process's CPU while it fed the trainers
    (``cpu_s``: every thread, the RPC answers to pulls included)."""

    def __init__(self) -> None:
        self.planner_cpu_s = self.read_cpu_s = self.thread_cpu_s = 0.0
        self._read_here_s = 0.0  # of the reading, what the producer thread did (with --planner-processes 2: none)
        self.processes = 1
        self._producer: int | None = None
        self.ids = self.iterations = 0
        self._thread_start = self._cpu_start = None
        self.cpu_s = 0.0
        self.peak_rss_fed = 0  # the oracle's peak memory once the trainers are fed (before evaluation and the model)

    def begin(self) -> None:
        self._thread_start, self._cpu_start = time.thread_time(), cpu_seconds()
        self._producer = threading.get_ident()

    def read(self, seconds: float) -> None:
        """``seconds`` of CPU reading a batch and mapping its ids to keys, on the thread that did it (the producer,
        or with --planner-processes 2 a numbering process's feeder)."""
        self.read_cpu_s += seconds
        if threading.get_ident() == self._producer:
            self._read_here_s += seconds

    def timed(self, steps):
        """``steps`` (the planner's), each one's CPU time counted, less the reading it did for it."""
        steps = iter(steps)
        while True:
            started, read_before = time.thread_time(), self._read_here_s
            try:
                planned = next(steps)
            except StopIteration:
                return
            self.planner_cpu_s += time.thread_time() - started - (self._read_here_s - read_before)
            self.ids += sum(step.lookups for step in planned)
            self.iterations += 1
            yield planned

    def end(self) -> None:
        """The trainers are fed (every one has reported): the producer's and the process's CPU so far."""
        if self._cpu_start is not None:
            self.cpu_s = cpu_seconds() - self._cpu_start
        self.peak_rss_fed = peak_rss_bytes()

    def finish_thread(self) -> None:
        if self._thread_start is not None:
            self.thread_cpu_s = time.thread_time() - self._thread_start

    def summary(self) -> dict:
        """Per iteration planned, in milliseconds: the oracle's CPU while feeding (every thread), the producer
        thread's, and of that the planner's and the reading's; the oracle's CPU per 1,000 ids planned, and ids
        planned per second of the planner's CPU."""
        per = 1e3 / max(self.iterations, 1)
        return {"oracle_ms_per_iteration": {"cpu": round(self.cpu_s * per, 3),
                                            "producer": round(self.thread_cpu_s * per, 3),
                                            "planner": round(self.planner_cpu_s * per, 3),
                                            "reading": round(self.read_cpu_s * per, 3)},
                "oracle_cpu_per_planner": (round(self.cpu_s / self.planner_cpu_s, 3) if self.planner_cpu_s
                                           else float("nan")),
                "oracle_ms_per_1k_ids": round(self.cpu_s * 1e6 / self.ids, 4) if self.ids else float("nan"),
                "planned_ids_per_planner_s": round(self.ids / self.planner_cpu_s) if self.planner_cpu_s else 0,
                # 2: the batches numbered in a process per embedding space (their CPU is theirs, not in ``cpu`` or
                # ``planner``, which are then the decisions')
                "planner_processes": self.processes,
                # its peak memory while it planned and fed the trainers (peak_rss_bytes: the whole run's, the final
                # evaluation and model written included)
                "oracle_peak_rss_while_feeding_bytes": self.peak_rss_fed}


def _refill(step: PlanStep, slot_key: np.ndarray) -> PlanStep:
    """The plan step a resumed job starts with: its trainers' caches are empty, so every row resident
    after it (``slot_key``: the replayed plan's slots) is fetched into its slot; the servers hold the
    checkpoint's rows, at its boundary's version."""
    slots = np.flatnonzero(slot_key >= 0)
    empty = np.zeros(0, dtype=np.int64)
    return dataclasses.replace(step, fetch_keys=slot_key[slots], fetch_slots=slots,
                               fetch_versions=np.full(len(slots), -1, dtype=np.int64), evict_keys=empty,
                               evict_writers=empty, evict_slots=empty)


def _refill_part(part: TrainerStep, slot_key: np.ndarray) -> TrainerStep:
    """``_refill`` for one trainer's part of a partitioned plan step: every row it holds after the step is fetched
    into its slot (the servers hold the checkpoint's rows), nothing is written back or let go."""
    slots = np.flatnonzero(slot_key >= 0)
    empty = np.zeros(0, dtype=np.int64)
    return dataclasses.replace(part, write_keys=empty, write_versions=empty, write_slots=empty, drop_keys=empty,
                               drop_slots=empty, fetch_keys=slot_key[slots], fetch_slots=slots,
                               fetch_versions=np.full(len(slots), -1, dtype=np.int64),
                               fetch_late=np.zeros(len(slots), dtype=bool))
