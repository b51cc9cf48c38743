"""The oracle role: read the data in order, plan, and hand every trainer its slice and its plan.

A producer thread runs the planner over the global batches and fills one bounded queue per
trainer; trainers pull from their queue (flow control: the oracle never runs further ahead than
the queues hold). When every trainer has reported done, each server writes its shard to disk (no
process ever holds every table); the oracle evaluates the model from there, reading only each test
batch's rows, and streams it table by table into the run dir's ``model/`` (``--eval-every``: also
from checkpoints during training, in the background).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import queue
import shutil
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

from bagpipe.cache import BatchRows, batch_view
from bagpipe.config import EXTERNAL, ModelConfig, TrainConfig, complete_model, config_to_dict
from bagpipe.data.batches import batch_rows, batches_per_epoch, read_batch
from bagpipe.data.binary import BinaryDataset
from bagpipe.data.schema import original_table_sizes, with_table_sizes
from bagpipe.embeddings import valid_keys
from bagpipe.faults import inject_fault
from bagpipe.checkpoint import ChainRows, checkpoints_dir, discard_after, valid_checkpoints
from bagpipe.evaluation import BackgroundEvaluations, no_evaluation
from bagpipe.model_dir import MODEL_DIR, write_model_dir
from bagpipe.planner import PlannerConfig, plan_spaces
from bagpipe.planner.plan import PlanStep
from bagpipe.preflight import cache_rows_of, check_job, claim, job_layout, prepare_data
from bagpipe.reference import best_metrics, build_model, deterministic
from bagpipe.rundir import RunDir
from bagpipe.runlock import lock_run_dir
from bagpipe.runtime import transport
from bagpipe.runtime.agree import Given, agree, agree_table_sizes
from bagpipe.runtime.checkpointing import JobCheckpoints
from bagpipe.runtime.endpoints import SERVER, TRAINER
from bagpipe.runtime.keys import (EPOCH_KEY, JOB_KEY, JOINING_PREFIX, LOST_AT_PREFIX, ORACLE_REPLACED,
                                  REPLACE_PREFIX, SERVER_BACK, SERVER_LOST, STOP_KEY, TRAINED, TRAINER_DONE, TRAINER_LOST)
from bagpipe.runtime.liveness import Liveness
from bagpipe.runtime.protocol import PULL_MAX_STEPS, JobInfo, Pulled, TrainerStats, schema_dict, slice_messages
from bagpipe.runtime.redo import REDO_DEPTH
from bagpipe.runtime.succession import Failure, JobRecord, NotReplaceable, RecordKeeper, load_record, replayed_from
from bagpipe.runtime.world import (Epochs, NoEpochs, Routes, World, host_store, init_rpc, job_world, publish_status,
                                   read_hellos, refuse_job, store_served_apart, wait_for_ranks)
from bagpipe.timing import cpu_seconds, peak_rss_bytes

log = logging.getLogger(__name__)

PULL_WAIT_S = 1.0  # how long a pull waits for a plan message before answering with none
# what a lost server adds to the run's figures (its own were lost with it)
LOST_SERVER_DUMP = {"bytes_sent": 0, "fetches": 0, "fetches_waited": 0, "rows_written": 0, "storage": {},
                    "peak_rss_bytes": 0, "cpu_s": 0.0, "lost": True}
FINAL_ROWS = "final-rows.tmp"  # the servers' shards after the last iteration, until model/ holds them


class Oracle:
    def __init__(self, config: TrainConfig, world: World, dataset: BinaryDataset, *,
                 resume: tuple[str, int] | None = None, takes_over: bool = False) -> None:
        """``resume``: (checkpoint name, its boundary) the job continues from; ``takes_over``: this process replaces
        the job's lost oracle (``take_over_job``)."""
        self.config, self.world, self.dataset = config, world, dataset
        self.start = resume[1] if resume else 0
        split = self.dataset.train
        self.iterations = config.iterations or batches_per_epoch(split, config.batch_size)
        if config.batch_size % world.num_trainers:
            raise ValueError(f"batch_size {config.batch_size} is not a multiple of the "
                             f"{world.num_trainers} trainers")
        self.layout = job_layout(config, dataset)
        shares = cache_rows_of(config, self.layout)
        self.job = JobInfo(config=config, schema=schema_dict(dataset.schema),
                           tables=[t.to_dict() for t in self.layout.tables], iterations=self.iterations,
                           cache_rows=shares, slice_size=config.batch_size // world.num_trainers,
                           resume=resume[0] if resume else None, start=self.start,
                           replace_trainers=config.replace_trainers and world.num_trainers >= 2,
                           replace_oracle=store_served_apart() and config.replace_oracle)
        # Evaluations (of checkpoints during training with --eval-every, of the final state) run in the
        # background once ``evaluations`` is set (run_oracle: the run dir they log to is open by then).
        self.evaluates = (config.model.name != EXTERNAL and dataset.test is not None and dataset.test.rows > 0)
        self.evaluations: BackgroundEvaluations | None = None
        self.run: RunDir | None = None  # the run dir events are logged to (run_oracle sets it once open)
        self.routes = Routes(world)
        self.keeper = RecordKeeper(JobRecord(started_at=time.time()))  # what a replacement of this oracle reads
        self.failures: list[Failure] = self.keeper.record.failures  # lost roles the job went on without
        self.planned = self.start  # the last iteration planned
        self.checkpoints = JobCheckpoints(config, world, num_spaces=len(self.layout.spaces),
                                          resumed_at=resume[1] if resume else None, routes=self.routes,
                                          on_evaluable=self._evaluable if self.evaluates else None,
                                          keep_staged=takes_over)
        # A lost oracle's replacement plans again from the start: the messages of iterations before
        # ``first_message`` are not made again, those up to ``sent_before[trainer]`` reach that trainer's kept ones only
        # (it has them), and ``sent_checkpoints`` says which of those carried a checkpoint.
        self.first_message = self.start
        self.sent_before = [self.start - 1] * world.num_trainers
        self.sent_checkpoints: set[int] = set()
        self.takeover: Failure | None = None  # this replacement's failure record, until it serves new plans
        self.planner_configs = [PlannerConfig(num_rows=space.num_rows, cache_rows=share, lookahead=config.lookahead,
                                              num_trainers=world.num_trainers, policy=config.policy,
                                              cleanup_fraction=config.cleanup_fraction)
                                for space, share in zip(self.layout.spaces, shares)]
        depth = max(2 * config.prefetch_depth, 2 * PULL_MAX_STEPS)
        self.queues = [queue.Queue(maxsize=depth) for _ in range(world.num_trainers)]
        # per trainer, the plan messages sent from REDO_DEPTH before the last iteration it stepped on (a pull's
        # answer lost to a re-formation of the RPC world is pulled again; see ``pull``)
        self.sent: list[deque] = [deque() for _ in range(world.num_trainers)]
        self.finished = [self.start - 1] * world.num_trainers  # per trainer, the last iteration it said it stepped
        self.written = [self.start - 1] * world.num_trainers  # and the version its write-backs are acknowledged to
        self.epochs = NoEpochs()  # run_oracle's Epochs once the oracle is in the RPC world
        self.store = None  # the job's store (run_oracle)
        self.replacing: dict[int, Failure] = {}  # rank -> the failure record of a lost process being replaced
        self.liveness: Liveness | None = None
        self.servers_ready: set[str] = set()
        self.done: dict[int, tuple[TrainerStats, dict | None]] = {}
        self.changed = threading.Condition()
        self.failure: BaseException | None = None
        self.bytes_sent = 0
        self.stop = threading.Event()
        self.helpers: list[threading.Thread] = []  # replacements awaited, shards taken over (``_helper``)
        self.reformed_before: list[dict] = []  # the RPC world's re-formations before this oracle's Epochs

    def save_record(self) -> None:
        """Write the job's record (``succession.JobRecord``) as it stands now, for a replacement of this oracle."""
        with self.changed:
            self.keeper.save(servers_ready=sorted(self.servers_ready), replacing=sorted(self.replacing),
                             done=sorted(self.done), reformed=self.reformed())

    def reformed(self) -> list[dict]:
        """Every re-formation of the job's RPC world: (epoch, seconds) each."""
        return self.reformed_before + self.epochs.reformed

    # -- the producer ------------------------------------------------------------------------
    def produce(self) -> None:
        try:
            self._produce()
        except BaseException as err:  # handed to the trainers' next pull and to the main thread
            with self.changed:
                self.failure = err
                self.changed.notify_all()

    def _produce(self) -> None:
        config, split, layout = self.config, self.dataset.train, self.layout
        pending: deque = deque()

        def key_stream():
            for rows in batch_rows(split, batch_size=config.batch_size, iterations=self.iterations,
                                   shuffle=config.shuffle, shuffle_seed=config.shuffle_seed):
                batch = read_batch(split, rows)
                pending.append(batch)
                yield [valid_keys(keys) for keys in layout.keys(batch.ids.numpy())]

        rows = [BatchRows(space.num_rows) for space in layout.spaces]
        started = time.perf_counter()
        resident = [np.full(c.cache_rows, -1, dtype=np.int64) for c in self.planner_configs] if self.start else None
        for steps in plan_spaces(key_stream(), self.planner_configs):
            iteration = self.planned = steps[0].iteration
            batch = pending.popleft() if iteration < self.iterations else None
            if iteration <= self.start and resident is not None:  # replaying the plan up to the checkpoint
                for slot_key, step in zip(resident, steps):
                    slot_key[step.evict_slots] = -1
                    slot_key[step.fetch_slots] = step.fetch_keys
                if iteration < self.start:
                    continue
                steps = tuple(_refill(step, slot_key) for step, slot_key in zip(steps, resident))
            checkpoint = False
            for space, step in enumerate(steps):  # what a snapshot at a later boundary waits for
                self.checkpoints.count_evictions(space, step.evict_keys)
            sent = iteration <= max(self.sent_before)  # by a lost oracle this one replaces: planned again
            if sent and iteration < self.first_message:
                continue
            if self.takeover is not None and not sent:
                self._resumed(replay_s=time.perf_counter() - started)
            if sent:
                checkpoint = iteration in self.sent_checkpoints
            elif self.checkpoints.periodic and self.start < iteration < self.iterations:
                self._await_servers()  # a checkpoint asks every server for its part
                checkpoint = self.checkpoints.maybe_begin(iteration)
            views = [batch_view(step) for step in steps]
            for space_rows, view in zip(rows, views):
                space_rows.load(view)
            inject_fault(f"planned {iteration}")
            messages = slice_messages(iteration, steps, views, rows, batch, layout, len(self.queues),
                                      checkpoint=checkpoint)
            for out, message in zip(self.queues, messages):
                self.bytes_sent += message.nbytes()
                while not self.stop.is_set():
                    try:
                        out.put(message, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if self.stop.is_set():
                    return
        if self.takeover is not None:  # the lost oracle had sent every plan: none is new
            self._resumed(replay_s=time.perf_counter() - started)

    # -- RPC handlers ------------------------------------------------------------------------
    def _await_servers(self) -> None:
        deadline = time.monotonic() + self.world.timeout
        with self.changed:
            while len(self.servers_ready) < self.world.num_servers and self.failure is None:
                if not self.changed.wait(timeout=max(deadline - time.monotonic(), 0.0)):
                    raise TimeoutError(f"servers ready after {self.world.timeout:.0f} s: "
                                       f"{sorted(self.servers_ready)} of {self.world.num_servers}")

    def pull(self, trainer: int, after: int, max_steps: int, finished: int | None = None,
             written: int | None = None) -> Pulled:
        """The next plan messages of ``trainer``, which has those up to iteration ``after``: the ones it was sent
        and did not get (the answer lost to a re-formation of the RPC world) again, else new ones; none after
        PULL_WAIT_S without any (the trainer asks again: an RPC thread is not held for long).

        ``finished``: the last iteration the trainer has stepped; its messages are kept from REDO_DEPTH before it
        on (a replacement for it may compute those iterations' shares again, runtime/redo.py). ``written``: the
        last version all its write-backs up to are acknowledged; the answer says the lowest of all the trainers'
        (every trainer keeps the rows others write back until then)."""
        self._await_servers()
        kept = self.sent[trainer]
        with self.changed:
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
            if self.failure is not None:
                raise RuntimeError(f"the oracle failed: {self.failure}")
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

    def _evaluable(self, boundary: int, dense: dict, rows: ChainRows) -> None:
        self.evaluations.submit(boundary, dense, rows)

    def checkpoint_cache(self, boundary: int, dense: dict, dense_optimizer: dict, parts: list, extra: dict) -> None:
        self.checkpoints.receive_cache(boundary, dense, dense_optimizer, parts, extra)

    def lose_peer(self, rank: int, *, store) -> bool:
        """A lost peer (``rank``); True if the job goes on without it: a trainer that has reported done (every
        row it wrote is back on the servers) is no longer needed; a data server may be covered by parity."""
        role, index = self.world.role_of(rank)
        if role == "trainer":
            with self.changed:
                reported = index in self.done
            if reported:
                log.warning("trainer %d ended after reporting done: the job no longer needs it", index)
                return True
            return self.job.replace_trainers and self._replace_trainer(rank, index)
        return self.lose_server(rank, store=store)

    def _replace_trainer(self, rank: int, index: int) -> bool:
        """A lost trainer: have a replacement made, which adds its shares to the sums that failed with it and takes a
        survivor's state (runtime/trainer.py ``replace_lost``) while the survivors wait in their sums. False when
        the RPC world cannot be re-formed (the job then restarts from its newest checkpoint)."""
        if self.replacing:
            return False  # another replacement is under way: the survivors' sums could not be done again
        failure = Failure(role=f"trainer {index}", trainer=index, rank=rank, planned_iteration=self.planned,
                          at=time.time())
        if not self._ask_for_replacement(rank, failure):
            return False
        self.failures.append(failure)
        self.save_record()
        self.run.log_metrics(event=TRAINER_LOST, trainer=index, rank=rank, replaced=True, epoch=failure.epoch)
        log.warning("trainer %d lost: the other trainers wait in their gradient sums for its replacement", index)
        return True

    def lose_server(self, rank: int, *, store) -> bool:
        """A lost server (``rank``), with parity: a data server's shard moves to its group's parity server, which
        serves it while a replacement process is made (when the RPC world can be re-formed around one) that then
        takes the shard back; a parity server is replaced. True if so; False when parity does not cover the loss
        (the job ends as without parity)."""
        role, shard = self.world.role_of(rank)
        if not self.world.parity or role != "server":
            return False
        if shard >= self.world.num_shards:
            return self._replace_parity_server(rank, shard)
        parity_server = self.world.parity_server(shard)
        with self.changed:
            earlier = self.replacing.get(rank)
        failure = Failure(role=f"server {shard}", server=shard, rank=rank, parity_server=parity_server,
                          planned_iteration=self.planned, at=time.time())
        if earlier is None:
            if any(f.parity_server == parity_server and not f.replaced for f in self.failures):
                group = ", ".join(str(s) for s in self.world.parity_group(shard))
                raise RuntimeError(f"server {shard} is the second server lost in its parity group (servers {group}): "
                                   f"parity covers one loss per group; resume from the newest checkpoint (--resume)")
            if self.replacing:
                raise RuntimeError(f"server {shard} lost while a replacement for a lost process is made: the job's "
                                   f"RPC world cannot be re-formed without it; resume from the newest checkpoint "
                                   f"(--resume)")
            started = time.perf_counter()
            self.epochs.call(World.server_name(parity_server), SERVER.stand_in, (shard,))
            self.routes.move(store, shard, parity_server)
            failure.moved_in_s = round(time.perf_counter() - started, 3)
        # else its replacement was lost before it took the shard back: the stand-in serves on
        replaced = self.config.replace_data_servers and self._ask_for_replacement(rank, failure)
        # recorded once the epoch is decided: a record saved meanwhile (another thread's) would otherwise show a
        # moved shard with no replacement asked for, which the launcher takes as served for good
        self.failures.append(failure)
        self.save_record()
        self.run.log_metrics(event=SERVER_LOST, server=shard, rank=rank, served_by=parity_server, replaced=replaced,
                             **({"epoch": failure.epoch} if replaced else {}))
        log.warning("server %d%s lost: its shard is served by server %d (its parity server) %s", shard,
                    "'s replacement" if earlier is not None else "", parity_server,
                    "until a replacement takes it back" if replaced else "from now on")
        return True

    def _replace_parity_server(self, rank: int, index: int) -> bool:
        """A lost parity server (no rows are lost: its group's data servers hold them and acknowledge their
        write-backs without it meanwhile): have a replacement made that makes the parity from its group's rows
        while training goes on. True if that can be done; False when the RPC world cannot be re-formed (see
        ``_ask_for_replacement``): the job then fails as without parity (the launcher restarts it from its newest
        checkpoint)."""
        group = self.world.parity_group((index - self.world.num_shards) * self.world.parity)
        failure = Failure(role=f"server {index}", server=index, rank=rank, parity_of=group,
                          planned_iteration=self.planned, at=time.time())
        # (a replacement for this rank lost before it was whole is replaced in turn: its group's rows are all there)
        if not self._ask_for_replacement(rank, failure):
            return False
        self.failures.append(failure)
        self.save_record()
        self.run.log_metrics(event=SERVER_LOST, server=index, rank=rank, replaced=True, epoch=failure.epoch)
        log.warning("server %d (the parity server of servers %s) lost: its group goes on without parity until a "
                    "replacement has made it again", index, ", ".join(map(str, group)))
        return True

    def _ask_for_replacement(self, rank: int, failure: Failure) -> bool:
        """Have a replacement for lost ``rank`` started (the local launcher starts one once ``REPLACE_PREFIX`` names
        a new epoch for the rank; on several machines, the same command started again joins as it) and re-form the
        RPC world around it once it is ready (``_await_replacement``). False, with a warning, when the RPC world
        cannot be re-formed: a process of it is gone for good, or some trainer has left the job."""
        gone = [f.rank for f in self.failures if not f.replaced and f.rank != rank]
        with self.changed:
            reported = bool(self.done)
        if gone or reported or self.store is None:
            why = (f"{', '.join(self.world.label(r) for r in gone)} gone for good" if gone
                   else "a trainer has left the job" if reported else "the job is not under way")
            log.warning("%s lost: no replacement, since the RPC world cannot be re-formed (%s)",
                        self.world.label(rank), why)
            return False
        failure.epoch = epoch = self.epochs.announced() + 1
        earlier = self.replacing.pop(rank, None)
        if earlier is not None:
            earlier.replaced = False  # its replacement was lost too, before it was whole: this one takes over
        self.replacing[rank] = failure
        self.save_record()
        self.store.delete_key(f"{JOINING_PREFIX}{rank}")
        self.store.set(f"{REPLACE_PREFIX}{rank}", str(epoch))
        self._helper(self._await_replacement, (rank, epoch), name="replacement")
        return True

    def _await_replacement(self, rank: int, epoch: int) -> None:
        """Once the replacement for ``rank`` is ready, announce the RPC world of ``epoch`` it joins."""
        failure, started = self.replacing[rank], time.perf_counter()
        key = f"{JOINING_PREFIX}{rank}"
        deadline = time.monotonic() + self.world.timeout
        try:
            while not self.store.check([key]):
                if self.replacing.get(rank) is not failure or self.stop.is_set():  # lost too (a later one is
                    return  # awaited), or the job has ended
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no replacement for {self.world.label(rank)} (rank {rank}) joined within "
                                       f"{self.world.timeout:.0f} s: start the same command again")
                time.sleep(0.05)
            role, shard = self.world.role_of(rank)
            if role == "server" and shard < self.world.num_shards:
                # A data server's replacement (forked, it is ready within a fraction of a second) joins once its
                # stand-in has rebuilt the shard: the re-formation fails the requests in flight, and the rebuild's
                # must not be among them (with a replacement that took seconds to start, they never were).
                self.epochs.call(World.server_name(self.world.parity_server(shard)), SERVER.stand_in_rebuilt,
                                 (shard,), timeout=10 * self.world.timeout)
            failure.joined_in_s = round(time.time() - failure.at, 3)
            if self.liveness is not None:
                self.liveness.readmit(rank)
            with self.changed:  # a trainer that has reported leaves the RPC world: announced before, it takes part
                if self.replacing.get(rank) is not failure:
                    return
                if self.done:
                    log.warning("the replacement for %s is ready after training ended: the job does not need it",
                                self.world.label(rank))
                    return
                self.store.set(EPOCH_KEY, str(epoch))
            log.info("a replacement for %s (rank %d) is ready after %.2f s: the RPC world is re-formed around it "
                     "(epoch %d)", self.world.label(rank), rank, time.perf_counter() - started, epoch)
        except BaseException as err:  # noqa: BLE001 - the job cannot go on: its trainers' next pull says why
            with self.changed:
                self.failure = self.failure or err
                self.changed.notify_all()

    def ready_to_take_over(self, rank: int) -> None:
        """A lost data server's replacement has copied its shard from the stand-in (an RPC handler): have the
        stand-in hand it over (``_take_over``, on a thread of its own)."""
        self._helper(self._take_over, (rank, self.replacing.get(rank)), name="take-over")

    def _helper(self, target, args: tuple, *, name: str) -> None:
        """Run ``target(*args)`` on a thread of its own, joined before the oracle leaves (``join_helpers``): one
        still in a store call when the process exits aborts it (seen: "terminate called without an active
        exception" after a replacement that never joined)."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self.helpers.append(thread)
        thread.start()

    def join_helpers(self, timeout: float) -> None:
        """Once ``stop`` is set: wait for the helper threads (they end within a poll of it)."""
        for thread in self.helpers:
            thread.join(timeout=timeout)

    def _take_over(self, rank: int, failure: Failure | None) -> None:
        """Between checkpoints (a stand-in's snapshot must not be cut short): freeze the stand-in, let the
        replacement catch up with it, route the shard to the replacement, and have the stand-in let go."""
        shard = self.world.role_of(rank)[1]
        parity = World.server_name(self.world.parity_server(shard))
        try:
            with self.checkpoints.paused() as open_:
                if failure is None or self.replacing.get(rank) is not failure:
                    return  # that replacement was lost: a later one is awaited
                if not open_:
                    log.warning("training ended before server %d's replacement took its shard back: its parity "
                                "server served it to the end", shard)
                    return
                started = time.perf_counter()
                versions, received = self.epochs.call(parity, SERVER.hand_over, (shard,))
                try:  # not sent again after a re-formation: that would be to another replacement
                    figures = SERVER.take_over.call(World.server_name(shard), (versions, received),
                                                    timeout=self.world.timeout)
                except RuntimeError as err:
                    self.epochs.call(parity, SERVER.keep_standing_in, (shard,))
                    log.warning("server %d's replacement was lost while taking its shard back (%s): its parity server "
                                "serves it on", shard, str(err).splitlines()[0])
                    return
                with self.changed:  # at once: the replacement lost from now on is a loss of the shard again
                    self.routes.move(self.store, shard, shard)
                    self.replaced(rank, {**figures, "handover_s": time.perf_counter() - started})
                self.run.log_metrics(event=SERVER_BACK, server=shard, rank=rank)
                self.epochs.call(parity, SERVER.handed_back, (shard,))
        except BaseException as err:  # noqa: BLE001 - the job cannot go on: its trainers' next pull says why
            with self.changed:
                self.failure = self.failure or err
                self.changed.notify_all()

    def replaced(self, rank: int, info: dict) -> None:
        """The replacement for ``rank`` has made what it holds (an RPC handler)."""
        failure = self.replacing.pop(rank)
        failure.replaced, failure.recovered_in_s = True, round(time.time() - failure.at, 3)
        # (a new dict, not updated in place: another thread's save_record may be serialising the old one)
        failure.figures = {**failure.figures, **{key: round(value, 3) for key, value in info.items()}}
        self.save_record()
        if self.world.role_of(rank) == ("trainer", 0):  # its checkpoint parts sent before its loss may be lost
            self.checkpoints.cache_parts_lost(before=info["at_iteration"])
        log.info("%s (rank %d) is replaced and whole again, %.2f s after it was lost", self.world.label(rank), rank,
                 failure.recovered_in_s)

    def server_ready(self, name: str) -> None:
        with self.changed:
            self.servers_ready.add(name)
            self.save_record()
            self.changed.notify_all()

    def trainer_done(self, trainer: int, stats: TrainerStats, dense_state: dict | None) -> None:
        with self.changed:
            self.done[trainer] = (stats, dense_state)
            self.written[trainer] = self.iterations  # the final flush's write-backs are acknowledged
            self.save_record()  # (a replacement of this oracle cannot take over once a trainer has left)
            # Recorded before the trainer has its answer (so before it can end): the launcher reads the record's
            # "done" as the trainer's part of the job done, whatever becomes of its process after. Recorded before
            # the main thread is woken too: an oracle lost past wait_for_trainers has every report in its record,
            # so the launcher restarts the job rather than start a replacement that cannot take it over. (The
            # event is for the run's readers, logged at the last iteration: a resumed run forgets it with the
            # iterations it trains again.)
            self.run.log_metrics(event=TRAINER_DONE, trainer=trainer, iteration=self.iterations)
            self.changed.notify_all()

    def _resumed(self, replay_s: float) -> None:
        """This replacement has planned again what its trainers had (in ``replay_s``): its next plans are new."""
        with self.changed:
            failure, self.takeover = self.takeover, None
            failure.replay_s = round(replay_s, 3)
            failure.resumed_in_s = failure.recovered_in_s = round(time.time() - failure.at, 3)
            self.save_record()
        self.run.log_metrics(event=ORACLE_REPLACED, rank=0, epoch=failure.epoch, joined_in_s=failure.joined_in_s,
                             resumed_in_s=failure.resumed_in_s, replayed_iterations=failure.replayed_iterations)
        log.warning("the lost oracle is replaced: plans served again %.2f s after it was lost (%d iterations planned "
                    "again in %.2f s)", failure.resumed_in_s, failure.replayed_iterations, failure.replay_s)

    # -- the main thread ---------------------------------------------------------------------
    def wait_for_trainers(self) -> None:
        """Until every trainer reported done, or planning failed (a lost trainer is the heartbeats' to tell)."""
        with self.changed:
            while len(self.done) < self.world.num_trainers:
                if self.failure is not None:
                    raise RuntimeError(f"planning failed: {self.failure}") from self.failure
                self.changed.wait(timeout=0.5)


def _per_role(key: str, oracle_value, shards: list[dict], stats: dict[int, TrainerStats]) -> dict:
    """One process figure (``key``) for every role: the oracle's own, each server's, each trainer's."""
    return {"oracle": oracle_value, **{f"server{i}": s.get(key, 0) for i, s in enumerate(shards)},
            **{f"trainer{t}": s.extra.get(key, 0) for t, s in sorted(stats.items())}}


def _mean_breakdown(breakdowns: list[dict]) -> dict:
    """Milliseconds per iteration by phase, averaged over the trainers that reported one."""
    breakdowns = [b for b in breakdowns if b]
    phases = list(dict.fromkeys(p for b in breakdowns for p in b))
    return {p: float(np.mean([b.get(p, 0.0) for b in breakdowns])) for p in phases}


def _refill(step: PlanStep, slot_key: np.ndarray) -> PlanStep:
    """The plan step a resumed job starts with: its trainers' caches are empty, so every row resident
    after it (``slot_key``: the replayed plan's slots) is fetched into its slot; the servers hold the
    checkpoint's rows, at its boundary's version."""
    slots = np.flatnonzero(slot_key >= 0)
    empty = np.zeros(0, dtype=np.int64)
    return dataclasses.replace(step, fetch_keys=slot_key[slots], fetch_slots=slots,
                               fetch_versions=np.full(len(slots), -1, dtype=np.int64), evict_keys=empty,
                               evict_writers=empty, evict_slots=empty)


def run_oracle(config: TrainConfig, world: World, *, overwrite: bool = False, prepared: bool = False,
               given: dict | None = None, resume: bool = False) -> dict:
    """Plan and feed the whole job; return the summary it writes to the run dir.

    ``prepared``: the local launcher has converted the data, checked the job and claimed the run dir.
    ``given``: the settings the oracle's command line gave (runtime.agree), agreed with every other
    role's at check-in; the job then runs with the agreed ones. A process started while the local launcher
    awaits a replacement for the job's lost oracle takes the job over instead (``take_over_job``).
    """
    started_at = time.time()
    deterministic()
    # The run dir is this job's while the oracle lives (a local launcher holds the lock for all its roles).
    with contextlib.nullcontext() if prepared else lock_run_dir(config.run_dir):
        # The store first: the other roles check in, and wait while the data is converted and checked.
        store, world = host_store(world)
        if world.epoch:
            oracle = take_over_job(world, store)
        else:
            oracle = start_job(config, world, store, overwrite=overwrite, prepared=prepared, given=given,
                               resume=resume)
            oracle.keeper.save(started_at=started_at)
        transport.serve("oracle", oracle)  # (requests that came sooner waited for it)
        return run_job(oracle)


def start_job(config: TrainConfig, world: World, store, *, overwrite: bool, prepared: bool, given: dict | None,
              resume: bool) -> Oracle:
    """The job's first oracle: every role checked in, their settings agreed, the data checked and the job published;
    in the RPC world."""
    liveness = Liveness(world, watch=list(range(1, world.world_size)))
    publish_status(store, f"preparing the data in {config.data}")
    dataset = prepare_data(config)
    inject_fault("data ready")
    publish_status(store, "waiting for every role to check in")
    wait_for_ranks(world, store)
    hellos = read_hellos(world, store)
    try:
        config, dataset = settle(config, dataset, world, given or {}, hellos)
        if resume:
            checkpoint = resume_point(config, world)
            for warning in check_job(config, dataset):
                log.warning("%s", warning)
        elif not prepared:
            claim(config, dataset, overwrite=overwrite)
    except ValueError as err:
        refuse_job(store, str(err))
        raise
    world = job_world(world, config)
    oracle = Oracle(config, world, dataset, resume=checkpoint if resume else None)
    if any(hello["given"].get("kind") == "script" for hello in hellos.values()):  # a script's model is its own:
        oracle.job = dataclasses.replace(oracle.job, replace_trainers=False)  # no share of it can be computed again
    oracle.run = run = RunDir(config.run_dir, append=resume)
    if resume:
        discard_after(config.run_dir, oracle.start)
        run.forget_metrics_after(oracle.start)
        log.info("resuming %s from its checkpoint at iteration %d", config.run_dir, oracle.start)
    run.write_json("config.json", config_to_dict(config))
    log.info("bagpipe job: %s, %d iterations of %d samples over %d trainers, %d servers; cache %d of %d rows, "
             "lookahead %d, policy %s", config.model.name, oracle.iterations, config.batch_size, world.num_trainers,
             world.num_servers, sum(oracle.job.cache_rows), oracle.layout.num_rows, config.lookahead, config.policy)
    oracle.keeper.store = store
    oracle.save_record()
    store.set(JOB_KEY, oracle.job.to_json())
    init_rpc(world, store)
    _join(oracle, store, liveness, Epochs(world, store))
    return oracle


def take_over_job(world: World, store) -> Oracle:
    """A replacement for the job's lost oracle (the local launcher's store outlived it): read the job and its record,
    re-form the RPC world around this process, ask every trainer how far it is and take over the checkpoints the
    lost oracle had begun; the producer then plans again from the start (a pure function of the data and the
    configuration), sending each trainer only what it does not have. NotReplaceable if the job cannot be taken
    over (the launcher then restarts it from its newest checkpoint)."""
    epoch = world.epoch
    lost_at = float(store.get(f"{LOST_AT_PREFIX}0")) if store.check([f"{LOST_AT_PREFIX}0"]) else time.time()
    record = load_record(store) if store.check([JOB_KEY]) else None
    if record is None:
        raise NotReplaceable("the lost oracle had not started the job yet")
    why = record.why_not_replaceable(world) or ("training had ended" if store.check([STOP_KEY]) else None)
    if why:
        raise NotReplaceable(f"the lost oracle cannot be replaced: {why}")
    job = JobInfo.from_json(store.get(JOB_KEY).decode())
    config = job.config
    world = job_world(world, config)
    liveness = Liveness(world, watch=list(range(1, world.world_size)))
    dataset = prepare_data(config, show_progress=False)
    if dataset.schema != job.layout.schema:  # the table sizes the roles agreed on
        dataset = dataset.with_schema(job.layout.schema)
    oracle = Oracle(config, world, dataset, resume=(job.resume, job.start) if job.resume else None, takes_over=True)
    oracle.job = job
    record.failures.append(failure := Failure(role="oracle", rank=0, at=lost_at, epoch=epoch, replaced=True))
    oracle.keeper.record = record
    oracle.failures, oracle.servers_ready = record.failures, set(record.servers_ready)
    oracle.reformed_before = list(record.reformed)
    oracle.routes.load(store)
    oracle.run = RunDir(config.run_dir, append=True)
    oracle.keeper.store = store
    started = time.perf_counter()
    store.set(f"{JOINING_PREFIX}0", str(epoch))
    store.set(EPOCH_KEY, str(epoch))  # every other process leaves its RPC world for this one
    init_rpc(world, store, epoch=epoch)
    oracle.reformed_before.append({"epoch": epoch, "seconds": round(time.perf_counter() - started, 3)})
    failure.joined_in_s = round(time.time() - lost_at, 3)
    epochs = Epochs(world, store)
    progress = [epochs.call(World.trainer_name(t), TRAINER.progress) for t in range(world.num_trainers)]
    oracle.sent_before = [p["after"] for p in progress]
    oracle.finished = [p["finished"] for p in progress]
    oracle.written = [p["written"] for p in progress]
    oracle.first_message = replayed_from(progress, start=oracle.start, redo_depth=REDO_DEPTH)
    oracle.checkpoints.epochs = epochs
    oracle.sent_checkpoints = oracle.checkpoints.take_over(sent_through=max(oracle.sent_before))
    failure.planned_iteration = max(oracle.sent_before)  # (at least: what the lost oracle had sent)
    failure.replayed_iterations = max(oracle.sent_before) + 1 - oracle.start
    oracle.takeover = failure
    oracle.save_record()
    log.warning("the job's lost oracle is replaced (RPC world %d, %.2f s after the loss): trainers have plans up to "
                "iterations %s; planning again from iteration %d", epoch, failure.joined_in_s,
                ", ".join(map(str, oracle.sent_before)), oracle.start)
    _join(oracle, store, liveness, epochs)
    return oracle


def _join(oracle: Oracle, store, liveness: Liveness, epochs: Epochs) -> None:
    """Hand ``oracle`` what it runs with once in the RPC world: the store, its heartbeat watch (which hands it the
    peers it loses) and its background evaluations."""
    config, dataset, run = oracle.config, oracle.dataset, oracle.run
    oracle.epochs = oracle.checkpoints.epochs = epochs
    oracle.store, oracle.liveness = store, liveness
    liveness.recover = functools.partial(oracle.lose_peer, store=store)
    if oracle.evaluates:
        oracle.evaluations = BackgroundEvaluations(
            build_model(config, dataset.schema), oracle.layout, dataset.test, batch_size=config.eval_batch_size,
            max_rows=config.max_eval_rows,
            on_result=lambda iteration, metrics: run.log_metrics(event="eval", iteration=iteration,
                                                                 samples=iteration * config.batch_size, **metrics))
        if oracle.takeover is not None:
            oracle.checkpoints.evaluate_missing(evaluated=run.evaluated_iterations())


def run_job(oracle: Oracle) -> dict:
    """Feed the trainers to the end, gather the final rows (the servers write them) and write the run's results;
    the summary."""
    config, world, run, store = oracle.config, oracle.world, oracle.run, oracle.store
    epochs, liveness = oracle.epochs, oracle.liveness
    producer = threading.Thread(target=oracle.produce, name="planner", daemon=True)
    producer.start()
    final_dir = run.path / FINAL_ROWS
    try:
        oracle.wait_for_trainers()
        inject_fault("trainers reported")
        final_rows = oracle.checkpoints.write_final(oracle.iterations, final_dir)
        for failure in oracle.replacing.values():  # its rows are on its group's servers: the run does not need it
            log.warning("training ended before %s's replacement was whole: the run goes without it", failure.role)
        latest = {f.server: f for f in oracle.failures if f.server is not None}  # a server's last loss: is it back?
        lost = {server for server, f in latest.items() if not f.replaced}
        if config.parity and config.check_parity:
            check_parity(world, epochs, skip=lost)
        shards = [LOST_SERVER_DUMP if s in lost else epochs.call(World.server_name(s), SERVER.dump)
                  for s in range(world.num_servers)]
    finally:
        oracle.stop.set()
        oracle.join_helpers(timeout=world.timeout)
    # Everything the run needs is here now: a role lost from here on costs nothing (the launcher reads STOP_KEY).
    run.log_metrics(event=TRAINED, iteration=oracle.iterations)
    liveness.fatal = False
    store.set(STOP_KEY, "1")
    others = list(range(1, world.world_size))
    staying = liveness.wait_until_gone(others, timeout=world.timeout)
    if staying:
        log.warning("%s still there %.0f s after the end", ", ".join(world.label(r) for r in staying), world.timeout)
    epochs.stop()
    liveness.stop()
    transport.shutdown_rpc()  # every role has left: no request is in flight
    return finish(oracle, run, shards, final_rows, final_dir)


def check_parity(world: World, epochs: Epochs, *, skip: set[int] = frozenset()) -> None:
    """Have every parity server (but those ``skip``ped: lost) compare its parity with its group's rows (every
    write-back has landed): a mismatch fails the run, naming the server and the rows."""
    for index in range(world.num_shards, world.num_servers):
        if index in skip:
            continue
        checked = epochs.call(World.server_name(index), SERVER.check_parity, timeout=4 * world.timeout)
        if any(checked["mismatched_rows"]):
            raise RuntimeError(f"the parity on server {index} differs from its group's rows at "
                               f"{sum(checked['mismatched_rows'])} of {sum(checked['rows'])} positions")
        log.info("parity on server %d matches its group's rows (%d positions)", index, sum(checked["rows"]))


def resume_point(config: TrainConfig, world: World) -> tuple[str, int]:
    """The newest valid checkpoint of the run (name, boundary); a ValueError if it cannot be continued."""
    found = valid_checkpoints(config.run_dir, newest_only=True)
    if not found:
        raise ValueError(f"--resume: {config.run_dir} has no valid checkpoint to resume from (a run checkpoints with "
                         f"--checkpoint-every N or --checkpoint-every-s S)")
    directory, chain = found[0]
    trainers = chain[-1]["extra"].get("trainers")
    if trainers != world.num_trainers:
        raise ValueError(f"--resume: the checkpoint {directory} was taken with {trainers} trainers, this job has "
                         f"{world.num_trainers}: the gradients' sums, and so the result, depend on it")
    return directory.name, chain[-1]["iteration"]


def settle(config: TrainConfig, dataset: BinaryDataset, world: World, given: dict,
           hellos: dict[int, dict]) -> tuple[TrainConfig, BinaryDataset]:
    """The job as every role's settings agree on it: ``config`` with the agreed values, and the data
    under the agreed table sizes."""
    givens = [Given("the oracle (rank 0)", given)]
    givens += [Given(f"{world.label(rank)} (rank {rank})", hello["given"]) for rank, hello in sorted(hellos.items())]
    agreed = agree(givens)
    if agreed.get("kind") == "script" and (config.checkpoints or config.eval_every):
        raise ValueError("checkpoints during training (and --eval-every, which evaluates them) need bagpipe's "
                         "trainers: these trainers are scripts (init_cache), which send no part of a checkpoint")
    inferred = dataset.meta.get("made_from", {}).get("table_sizes_from") == "inferred"
    sizes = agree_table_sizes(agreed.get("table_sizes"), original_table_sizes(dataset.schema), inferred=inferred,
                              where=next(g.label for g in givens if "table_sizes" in g.settings)
                              if "table_sizes" in agreed else "the oracle")
    if sizes != original_table_sizes(dataset.schema):
        dataset = dataset.with_schema(with_table_sizes(dataset.schema, sizes))
    model = {name.removeprefix("model."): value for name, value in agreed.items() if name.startswith("model.")}
    if "emb_dim" in agreed:
        model["emb_dim"] = agreed["emb_dim"]
    model = {**{f.name: getattr(config.model, f.name) for f in dataclasses.fields(ModelConfig)
                if f.name not in ("emb_dim", "arch_mlp_bot")}, **complete_model(model)}
    train = {name: agreed[name] for name in ("cache_rows", "lookahead", "optimizer", "lr") if name in agreed}
    return dataclasses.replace(config, model=ModelConfig(**model), **train), dataset


def finish(oracle: Oracle, run: RunDir, shards: list[dict], final_rows: ChainRows, final_dir: Path) -> dict:
    """Evaluate the trained model from the servers' shards on disk, write it as ``model/`` table by table,
    then the summary (the reference's run-dir layout)."""
    config, dataset, layout = oracle.config, oracle.dataset, oracle.layout
    started_at = oracle.keeper.record.started_at  # the job's first oracle's start (a replacement's record has it)
    train_s = time.time() - started_at
    train_cpu_s = cpu_seconds()
    stats = {t: s for t, (s, _) in oracle.done.items()}
    dense_state = oracle.done[0][1] or {}
    eval_started = time.perf_counter()
    metrics = {}
    model = None if config.model.name == EXTERNAL else build_model(config, dataset.schema)
    if model is None:
        log.info("the trainers' model is their own: model/ holds trainer 0's weights as it reported them "
                 "(%s), and the oracle does not evaluate it", "none" if not dense_state else f"{len(dense_state)} tensors")
    else:
        try:
            model.load_state_dict(dense_state)
        except RuntimeError as err:  # a script that named our model but trained another
            log.warning("trainer 0's weights are not the job's %s (%s): they go to model/ as reported, "
                        "unevaluated", config.model.name, str(err).splitlines()[0])
            model = None
    if model is not None:
        dense_state = model.state_dict()
        metrics = no_evaluation(model)
        if oracle.evaluations is not None:
            oracle.evaluations.submit(oracle.iterations, dense_state, final_rows)
    if oracle.evaluations is not None:
        metrics.update(oracle.evaluations.close().get(oracle.iterations, {}))
    eval_s = time.perf_counter() - eval_started
    write_model_dir(run.path / MODEL_DIR, dense=dense_state, layout=layout, source=final_rows,
                    info={"iteration": oracle.iterations, "mode": "bagpipe", "model": config.model.name})
    shutil.rmtree(final_dir)
    if not config.checkpoints:  # those taken to evaluate from (--eval-every) served their purpose
        shutil.rmtree(checkpoints_dir(config.run_dir), ignore_errors=True)
    all_stats = list(stats.values())
    batch_rows = sum(s.batch_rows for s in all_stats)
    summary = {
        "mode": "bagpipe",
        "iterations": oracle.iterations,
        "samples": oracle.iterations * config.batch_size,
        "samples_per_s": stats[0].samples_per_s,
        "final_train_loss": (stats[0].extra.get("final_train_loss") if oracle.iterations > oracle.start
                             else run.last_train_loss()),  # (a resumed run with nothing left to train)
        **metrics,
        **best_metrics(dataset.meta),
        **({"resumed_at": oracle.start} if oracle.start else {}),
        "trainers": oracle.world.num_trainers,
        "servers": oracle.world.num_servers,
        **({"parity": [s["parity"] for s in shards if "parity" in s]} if oracle.world.parity else {}),
        "failures": [failure.to_dict() for failure in oracle.failures],
        **({"epochs": oracle.reformed(),  # each re-formation of the RPC world (a replacement joined)
            # write-backs the data servers acknowledged while their parity server was lost
            "unprotected_write_backs": sum(s.get("unprotected_write_backs", 0) for s in shards)}
           if oracle.reformed() else {}),
        "model": config.model.name,
        "cache_rows": sum(oracle.job.cache_rows),
        "total_rows": layout.num_rows,
        "lookahead": config.lookahead,
        "policy": config.policy,
        "rows_fetched": sum(s.rows_fetched for s in all_stats),
        "rows_written_back": sum(s.rows_written_back for s in all_stats),
        "rows_moved_per_iteration": sum(s.rows_fetched + s.rows_written_back for s in all_stats)
        / max(oracle.iterations, 1),
        # the most rows a trainer held at once that other trainers write back (until acknowledged by all)
        "others_evicted_peak_rows": max(s.extra.get("others_evicted_peak_rows", 0) for s in all_stats),
        "cache_hit_rate": sum(s.batch_hits for s in all_stats) / batch_rows if batch_rows else float("nan"),
        "embedding_stall_fraction": float(np.mean([s.stall_s / s.loop_s if s.loop_s else 0.0
                                                   for s in all_stats])),
        **{f"{kind}_fraction": float(np.mean([getattr(s, f"{kind}_s") / s.loop_s if s.loop_s else 0.0
                                               for s in all_stats]))
           for kind in ("plan_wait", "fetch_wait", "lazy_sync_wait", "sync")},
        "bytes_sent": oracle.bytes_sent + sum(s.bytes_sent for s in all_stats)
        + sum(s["bytes_sent"] for s in shards),
        # what one trainer puts through gradient all-reduces per iteration (dense + rows)
        "allreduce_bytes_per_iteration": float(np.mean([s.allreduce_bytes for s in all_stats]))
        / max(oracle.iterations, 1),
        "server_fetches": sum(s["fetches"] for s in shards),
        "server_fetches_waited": sum(s["fetches_waited"] for s in shards),
        # the disk tier's rows read from and written to the servers' files, and its cache's hits and rows
        "storage": dict(sum((collections.Counter(s.get("storage", {})) for s in shards), collections.Counter())),
        "train_s": train_s,
        "eval_s": eval_s,
        "wall_s": time.time() - started_at,
        "warmup_iterations": config.warmup_iterations,
        # from the oracle's start to the end of trainer 0's first iteration
        "startup_s": stats[0].extra.get("first_iteration_at", float("nan")) - started_at,
        "time_breakdown_ms": _mean_breakdown([s.extra.get("time_breakdown_ms", {}) for s in all_stats]),
        "peak_rss_bytes": _per_role("peak_rss_bytes", peak_rss_bytes(), shards, stats),
        # CPU seconds per role up to the end of training (the oracle's: before evaluation)
        "cpu_s": _per_role("cpu_s", train_cpu_s, shards, stats),
    }
    run.finish(summary)
    return summary
