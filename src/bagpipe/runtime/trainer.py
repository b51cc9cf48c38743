"""The trainer side: a row cache kept in step with the oracle's plan, ahead of compute.

A prefetcher thread pulls plan messages from the oracle and issues each iteration's fetches as
soon as it sees them (servers park a fetch until the write-back it must observe has arrived);
a writer thread sends write-backs. The compute thread, at each iteration boundary, applies the
gradient updates that were synced lazily, evicts, installs the fetched rows and hands out the
batch. Every trainer holds the same rows (the plan is global); gradients of the batch's rows are
summed over trainers with gloo: rows used again next iteration at once, the others in the
background, applied before their next use or eviction. Each iteration's update is applied on its
own, in order, so the result equals synchronous training on the global batch.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from bagpipe.cache import BatchView, RowCache, StepTables
from bagpipe.checkpoint import RowPart, cloned_state, load_dense, resume_chain
from bagpipe.config import TrainConfig
from bagpipe.embeddings import Embeddings, Lookup
from bagpipe.faults import inject_fault
from bagpipe.metrics import CounterWindow, share
from bagpipe.optim import make_row_optimizer
from bagpipe.reference import Timer, build_model, check_loss, deterministic
from bagpipe.rundir import RunDir
from bagpipe.runtime.keys import REPLACE_PREFIX, RESUMED, STOP_KEY, SUMS_PREFIX
from bagpipe.timing import PhaseClock, cpu_seconds, peak_rss_bytes
from bagpipe.runtime import transport
from bagpipe.runtime.endpoints import ORACLE, SERVER, TRAINER
from bagpipe.runtime.protocol import (DAMAGED_RESENDS, PULL_MAX_STEPS, JobInfo, SpaceStep, StepMessage, TrainerStats,
                                      answer_digest)
from bagpipe.runtime.exit_status import PeerLost
from bagpipe.runtime.liveness import Liveness, exit_on_lost
from bagpipe.runtime.reduce import Mean
from bagpipe.runtime.redo import (REDO_DEPTH, Recomputer, RedoLog, Shares, agree_on_sums, backward_slice, dense_share,
                                  main_share, row_shares, sum_order)
from bagpipe.runtime.transport import Endpoint, unwrap
from bagpipe.runtime.world import (Epochs, Routes, ShardMoved, World, await_reformation, check_in, init_rpc, job_world,
                                   trainer_group, wait_for_job)

log = logging.getLogger(__name__)

_END = object()
WRITE_POLL_S = 0.05  # how often the writer looks at its write-backs in flight while none is queued


class TrainerRuntime:
    """One trainer's caches (one per embedding space), prefetcher, writer and gradient sync (no model knowledge)."""

    def __init__(self, world: World, store, *, job: JobInfo, liveness: Liveness, device: str = "cpu",
                 writeback_delay: float = 0.0, prefetch_depth: int | None = None, replacing: bool = False) -> None:
        """``replacing``: this process replaces a lost trainer (``replace_lost``, before any step)."""
        self.world = world
        self.store = store
        self.liveness = liveness
        self.index = world.role[1]
        self.job = job
        self.layout = job.layout
        config = job.config
        self.row_optimizer = make_row_optimizer(config.optimizer, lr=config.lr)
        self.caches = [RowCache(capacity=share, dim=space.dim, optimizer=self.row_optimizer, device=device)
                       for space, share in zip(self.layout.spaces, job.cache_rows)]
        # a replacement forms the group of its epoch once it has what to add to the sums that failed (replace_lost)
        self.group = None if replacing else trainer_group(world, store, self.index)
        self._old_groups: list = []  # groups a lost trainer broke: kept, not destroyed (their work may hang)
        self.epochs = Epochs(world, store)  # requests that fail to a re-formation of the RPC world are sent again
        if job.replace_oracle:  # requests to a lost oracle wait for its replacement
            self.epochs.await_peer("oracle")
        self.routes = Routes(world)  # a lost server's shard moves to its parity server (--parity)
        self.stats = TrainerStats()
        self.step: StepMessage | None = None
        self.writeback_delay = writeback_delay  # tests only: delays every write-back on purpose
        self._ready: queue.Queue = queue.Queue(maxsize=prefetch_depth or config.prefetch_depth)
        self._writes: queue.Queue = queue.Queue()
        # per space, lazily synced updates: (iteration, slots, grads, mean)
        self._pending: list[deque] = [deque() for _ in self.layout.spaces]
        self._failure: BaseException | None = None
        self._checkpoint_sends: list[threading.Thread] = []  # trainer 0's parts of checkpoints, on their way
        self._tags = 0  # fetches sent: each carries its number, which its answer echoes (check_fetched)
        self.redo: RedoLog | None = None  # the last iterations' inputs (train_loop's, which has the model)
        self.recompute = None  # (kept inputs, message) -> this trainer's Shares again (train_loop's)
        self.dense_state = None  # iteration -> the dense state a replacement takes at that boundary (train_loop's)
        self.replaceable = job.replace_trainers
        self.sums: list[Mean] = []  # the sums over trainers started and not yet waited for, in the order started
        self.recent: deque = deque(maxlen=REDO_DEPTH + 1)  # this trainer's last plan messages, by the compute thread
        self.recovery: Recovery | None = None  # what a lost trainer's replacement is given (by the lowest survivor)
        self._first: StepMessage | None = None  # a replacement's: the step it starts with, its boundary done
        self.kept_before: list = []  # a replacement's: its survivor's inputs of the iterations before its first
        self.finished = job.start - 1  # the last iteration stepped (the oracle keeps the messages from before it)
        self.written = WrittenBack(job.start)  # how far this trainer's write-backs are acknowledged
        # Rows evicted that other trainers write back, by version, until every trainer's write-backs up to it are
        # acknowledged (``written_by_all``, from the oracle): those of a lost trainer are sent again from here.
        self.others_evicted: deque = deque()
        self.written_by_all = job.start - 1
        self.received = -1  # the last plan message received (``begin``)
        self._stopping = threading.Event()
        self._started = None
        self._prefetcher = threading.Thread(target=self._guard, args=(self._prefetch,), name="prefetch", daemon=True)
        self._writer = threading.Thread(target=self._guard, args=(self._write,), name="write-back", daemon=True)
        if not replacing:
            self.begin(after=-1)

    def begin(self, *, after: int) -> None:
        """Start pulling plan messages after iteration ``after`` and writing back."""
        self.received = after  # the last plan message received: the oracle sends the ones after it
        self._prefetcher.start()
        self._writer.start()

    # -- background threads ------------------------------------------------------------------
    def _guard(self, body) -> None:
        try:
            body()
        except BaseException as err:
            self._failure = self._failure or err
            self._stopping.set()

    def _prefetch(self) -> None:
        while not self._stopping.is_set():
            pulled = self.epochs.call("oracle", ORACLE.pull, (self.index, self.received, PULL_MAX_STEPS, self.finished,
                                                             self.written.through()))
            self.written_by_all = pulled.written_by_all
            for message in pulled.messages:
                self.received = message.iteration
                fetches = self._issue_fetches(message)
                while not self._stopping.is_set():
                    try:
                        self._ready.put((message, fetches), timeout=0.2)
                        break
                    except queue.Full:
                        continue
                if message.final:
                    return

    def _issue_fetches(self, message: StepMessage) -> list[list]:
        """Each space's fetches, sent to the shards that hold them: (shard, index, future) per request."""
        fetches = []
        for space, step in enumerate(message.spaces):
            keys, versions = step.fetch_keys, step.fetch_versions
            shards = keys % self.world.num_shards
            requests = []
            for shard in range(self.world.num_shards):
                index = torch.nonzero(shards == shard).flatten()
                if len(index):
                    self._tags += 1
                    requests.append((shard, index, self._send(SERVER.fetch, shard,
                                                              (space, keys[index], versions[index], self._tags))))
            fetches.append(requests)
        return fetches

    def _send(self, endpoint: Endpoint, shard: int, args: tuple) -> "_Request":
        sent_to, epoch = self.routes.server(shard), self.epochs.epoch
        future = endpoint.call_async(World.server_name(sent_to), args, timeout=self.world.timeout)
        return _Request(endpoint, shard, args, sent_to, future, epoch)

    def _answer(self, request: "_Request", *, what: str):
        """The answer to ``request``; a request that failed to a re-formation of the RPC world is sent again
        once it is re-formed, and one to a server that was lost to the server its shard has moved to
        (``--parity``), which answers it as the lost one would have (a write-back it has already is a no-op
        there); one that a stand-in answered with ``ShardMoved`` goes where the shard went (its replacement); a
        fetch whose rows arrived other than the server sent them (their digest differs) is sent again at once."""
        handed_on_since, damaged = None, 0
        while True:
            try:
                answer = unwrap(request.future.wait())
            except ShardMoved as err:  # its stand-in hands the shard back to a replacement: sent where it goes
                handed_on_since = handed_on_since or time.monotonic()
                if time.monotonic() - handed_on_since > self.world.timeout:
                    raise RuntimeError(f"{what} at server {request.sent_to}: shard {request.shard} was not handed "
                                       f"on within {self.world.timeout:.0f} s ({err})") from err
                self.routes.follow(request.shard, request.sent_to, err)
                request = self._send(request.endpoint, request.shard, request.args)
                continue
            except RuntimeError as err:
                # (one to a server whose shard has moved since goes where it is now at once: the prefetches sent
                # to a lost server each waiting out the re-formation grace cost a second per iteration)
                if self.routes.server(request.shard) == request.sent_to and not self.epochs.resend_after(request.epoch):
                    self.routes.failover(request.shard, request.sent_to,
                                         RuntimeError(f"{what} at server {request.sent_to} failed: {err}"))
                request = self._send(request.endpoint, request.shard, request.args)
                continue
            if request.endpoint is not SERVER.fetch:
                return answer
            *parts, digest = answer  # rows, state, versions, tag; the digest of the first three
            if answer_digest(*parts[:3]) == digest:
                return tuple(parts)
            damaged += 1
            self.stats.extra["damaged_answers"] = self.stats.extra.get("damaged_answers", 0) + 1
            if damaged > DAMAGED_RESENDS:
                raise RuntimeError(f"{what} at server {request.sent_to}: {damaged} answers in a row arrived damaged "
                                   f"(their rows differ from what the server sent)")
            log.warning("trainer %d: a fetch's answer from server %d arrived damaged (its rows differ from what the "
                        "server sent): sent again", self.index, request.sent_to)
            request = self._send(request.endpoint, request.shard, request.args)

    def _write(self) -> None:
        in_flight: list[_Request] = []
        while True:
            try:  # with write-backs in flight, look at them now and then: a failed one is sent again at once,
                # since a fetch (and so the compute thread, and the next write-back) may be waiting for it
                item = self._writes.get(timeout=WRITE_POLL_S if in_flight else None)
            except queue.Empty:
                item = None
            if item is _END:
                break
            if item is not None:
                if self.writeback_delay:
                    time.sleep(self.writeback_delay)
                shard, args = item
                in_flight.append(self._send(SERVER.write_back, shard, args))
            done = [request.future.done() for request in in_flight]  # once: one may finish meanwhile
            answered = [request for request, finished in zip(in_flight, done) if finished]
            in_flight = [request for request, finished in zip(in_flight, done) if not finished]
            for request in answered:
                self._answer(request, what="write-back")
                self.written.acknowledged(request.args[-1])
        for request in in_flight:
            self._answer(request, what="write-back")
            self.written.acknowledged(request.args[-1])

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"trainer {self.index}: {self._failure}") from self._failure

    # -- the compute thread ------------------------------------------------------------------
    def advance(self) -> StepMessage | None:
        """Carry out the next plan step and return its message; None after the final flush."""
        if self._started is None:
            self._started = time.perf_counter()
        if self._first is not None:  # a replacement's first step: its boundary is in the state it was given
            message, self._first = self._first, None
            self.step = message
            self.recent.append(message)
            if message.final:
                self._flush()
                return None
            self.stats.iterations += 1
            return message
        waited = since = time.perf_counter()
        while True:
            self._raise_if_failed()
            try:
                message, fetches = self._ready.get(timeout=0.2)
                break
            except queue.Empty:
                if self.epochs.awaiting:  # a lost oracle's replacement, awaited within its own deadline
                    since = time.perf_counter()
                elif time.perf_counter() - since > self.world.timeout:
                    raise TimeoutError(f"trainer {self.index}: no plan from the oracle for "
                                       f"{self.world.timeout:.0f} s") from None
        self._stalled("plan_wait_s", waited)
        if self.step is not None and not self.step.final:
            self.finished = self.step.iteration
        while self.others_evicted and self.others_evicted[0][0] <= self.written_by_all:
            self.others_evicted.popleft()
        for space, (step, requests) in enumerate(zip(message.spaces, fetches)):
            self._boundary(space, message.iteration, step, requests)
            if not message.final:
                self.stats.batch_rows += len(step.batch_keys)
                self.stats.batch_hits += len(step.batch_keys) - len(step.fetch_keys)
        self.written.boundary(message.iteration - 1)  # every write-back of this boundary is counted by now
        self.recent.append(message)
        self.step = message
        self.hand_over()  # to a lost trainer's replacement, if one awaits this trainer's state
        kept = sum(len(entry[2]) for entry in self.others_evicted)
        self.stats.extra["others_evicted_peak_rows"] = max(self.stats.extra.get("others_evicted_peak_rows", 0), kept)
        if message.final:
            self._flush()
            return None
        self.stats.iterations += 1
        return message

    def _boundary(self, space: int, iteration: int, step: SpaceStep, requests: list) -> None:
        """One space's part of the boundary before ``iteration``: due updates, evictions, fetched rows."""
        cache, dim = self.caches[space], self.layout.spaces[space].dim
        evict_slots = step.evict_slots.numpy()
        self._apply_pending(space, upto=iteration - 2, evicting=evict_slots)
        if len(evict_slots):
            rows, state = cache.evict(evict_slots, step.evict_keys.numpy())
            mine = step.write_mask
            if mine.any():
                self._send_write_backs(space, step.evict_keys[mine], rows[mine], state[mine], version=iteration - 1)
            others = ~mine
            if self.group is not None and others.any():
                self.others_evicted.append((iteration - 1, space, step.evict_keys[others], rows[others], state[others]))
        fetch_keys = step.fetch_keys.numpy()
        if len(fetch_keys):
            rows = torch.empty(len(fetch_keys), dim)
            state = torch.empty(len(fetch_keys), self.row_optimizer.state_width(dim))
            waited = time.perf_counter()
            for _, index, request in requests:
                rows[index], state[index], have, tag = self._answer(request, what="fetch")
                check_fetched(*request.args, have, tag, server=request.sent_to, iteration=iteration)
            self._stalled("fetch_wait_s", waited)
            cache.install(step.fetch_slots.numpy(), fetch_keys, rows, state)
            self.stats.rows_fetched += len(fetch_keys)

    def _stalled(self, kind: str, since: float) -> None:
        waited = time.perf_counter() - since
        setattr(self.stats, kind, getattr(self.stats, kind) + waited)
        self.stats.stall_s += waited

    def _send_write_backs(self, space: int, keys: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, *,
                          version: int) -> None:
        shards = keys % self.world.num_shards
        for shard in range(self.world.num_shards):
            index = torch.nonzero(shards == shard).flatten()
            if len(index):
                self.written.sending(version)
                self._writes.put((shard, (space, keys[index], rows[index], state[index], version)))
        self.stats.rows_written_back += len(keys)
        self.stats.bytes_sent += rows.numel() * 4 + state.numel() * 4 + keys.numel() * 8

    def lookup(self) -> tuple[Embeddings, list[Lookup]]:
        """This iteration's slice's embeddings, and each space's Lookup.

        The oracle sent each id's row (``positions``) and each row's slot: no search here.
        """
        message = self.step
        views = [BatchView(step.batch_keys.numpy(), step.batch_slots.numpy(), step.num_now, step.positions)
                 for step in message.spaces]
        return StepTables(self.caches, views, self.layout).lookup(message.ids)

    def allreduce_start(self, buffer: torch.Tensor, what: tuple | None = None) -> Mean:
        """Start averaging ``buffer`` over trainers in the background (e.g. gradients ready early). ``what``: which
        share it is, (kind, iteration, space) with kind early, main or later (runtime/redo.py), so that it can be
        computed again should a trainer be lost before the sum is done."""
        if self.group is not None:
            self.stats.bytes_sent += buffer.numel() * 4
            self.stats.allreduce_bytes += buffer.numel() * 4
        mean = Mean(self.group, buffer, timeout=self.world.timeout, what=what)
        if self.group is not None:
            self.sums.append(mean)
        return mean

    def allreduce_finish(self, mean: Mean) -> torch.Tensor:
        """Wait for ``allreduce_start``'s mean over trainers, left in its buffer."""
        waited = time.perf_counter()
        buffer = self._wait(mean)
        self.stats.sync_s += time.perf_counter() - waited
        return buffer

    def _wait(self, mean: Mean) -> torch.Tensor:
        """A sum's mean; one that failed because a trainer was lost is done again with its replacement."""
        while True:
            try:
                buffer = mean.wait()
            except RuntimeError as err:
                if not self._recover(err):
                    raise
                continue
            if mean in self.sums:
                self.sums.remove(mean)
            return buffer

    def _recover(self, err: BaseException) -> bool:
        """A sum over trainers failed (``err``): if the job replaces a lost trainer, wait for the RPC world to be
        re-formed around its replacement, send again the rows the lost trainer may not have written back, agree
        with the other survivors on the sums to do again (``agree_on_sums``: with three or more trainers one may
        have finished a sum another has not), tell the replacement which sums to add its shares to (``recovery``,
        if this survivor is the donor), re-form the trainers' group and start those sums again in the order every
        trainer started them, with this trainer's shares computed again (a failed reduction may have left its buffer
        part-summed; one this trainer finished already is done again for the others, its result dropped; those of
        an iteration it has not reached yet it starts when it gets there). False if the job cannot go on so."""
        if not self.replaceable or self.recompute is None:
            return False
        failed_in, started = self.epochs.epoch, time.perf_counter()
        log.warning("trainer %d: a gradient sum failed (%s): waiting for a lost trainer's replacement", self.index,
                    str(err).splitlines()[0])
        deadline = time.monotonic() + 2 * self.world.timeout  # the loss's detection, then the replacement's start
        while self.epochs.epoch <= failed_in:
            if time.monotonic() > deadline or self.store.check([STOP_KEY]) or self._stopping.is_set():
                return False
            time.sleep(0.05)
        epoch = self.epochs.epoch
        lost = [t for t in range(self.world.num_trainers) if t != self.index
                and self.store.check([f"{REPLACE_PREFIX}{self.world.trainer_rank(t)}"])
                and int(self.store.get(f"{REPLACE_PREFIX}{self.world.trainer_rank(t)}")) == epoch]
        if not lost:  # the world was re-formed for a server: the sum failed for a reason of its own
            return False
        for version, space, keys, rows, state in list(self.others_evicted):  # a repeat is a no-op where it arrived
            self._send_write_backs(space, keys, rows, state, version=version)
        step = self.step
        own = {mean.what: mean for mean in self.sums}
        mine = list(own)
        natural = set()  # the rows not used at once are summed after the main sum, which starts them
        if ("main", step.iteration, None) in own:
            natural = {("later", step.iteration, space) for space, part in enumerate(step.spaces)
                       if part.num_now < len(part.batch_slots)}
            mine += sorted(natural, key=sum_order)
        key = f"{SUMS_PREFIX}{epoch}/"
        self.store.set(f"{key}{self.index}", json.dumps({"sums": mine, "reached": step.iteration}))
        todo, donor = agree_on_sums(read_sums(self.store, key, [t for t in range(self.world.num_trainers)
                                                                 if t not in lost], timeout=self.world.timeout))
        held = self.redo.iterations()
        if any(what[1] < min(held) for what in todo):
            log.error("trainer %d: the sums to do again reach back to iteration %d, before the inputs it keeps "
                      "(%s)", self.index, min(what[1] for what in todo), held)
            return False
        here = [what for what in todo if what[1] in held and what not in natural]
        iterations = sorted({what[1] for what in here})
        if donor == self.index:
            self.recovery = Recovery(trainer=lost[0], epoch=epoch, sums=todo,
                                     kept={iteration: self.redo.kept(iteration)
                                           for iteration in sorted({what[1] for what in todo})})
        self._old_groups.append(self.group)
        self.group = trainer_group(self.world, self.store, self.index, epoch=epoch)
        shares = {iteration: self.recompute(self.redo.kept(iteration), self._message(iteration))
                  for iteration in iterations}
        finished_here = []
        for what in here:
            operand = shares_part(shares[what[1]], what)
            if what in own:
                own[what].buffer.view(-1).copy_(operand.view(-1))
                own[what].restart(self.group)
            else:  # finished here already: its share goes in again for the others, its result is dropped
                finished_here.append(Mean(self.group, operand.clone(), timeout=self.world.timeout, what=what))
        for mean in finished_here:
            mean.wait()
        self.stats.extra.setdefault("recoveries", []).append(
            {"trainer": lost[0], "epoch": epoch, "sums_again": len(todo), "at_iteration": step.iteration,
             "seconds": round(time.perf_counter() - started, 3)})
        log.warning("trainer %d: the trainers' group is re-formed with trainer %d's replacement (epoch %d); %d sums "
                    "done again", self.index, lost[0], epoch, len(todo))
        return True

    def _message(self, iteration: int) -> StepMessage:
        for message in self.recent:
            if message.iteration == iteration:
                return message
        raise KeyError(f"trainer {self.index} no longer has its plan message of iteration {iteration}")

    def hand_over(self) -> None:
        """At an iteration boundary (its write-backs sent): if a lost trainer's replacement awaits this trainer's
        state, complete every sum in flight (the replacement took part in them) and give it the caches, the updates
        waiting to be applied and ``dense_state(iteration)`` (train_loop's: the model, its optimizer and the losses
        since the last log)."""
        recovery = self.recovery
        if recovery is None or recovery.state is not None or self.dense_state is None:
            return
        for pending in self._pending:
            for _, _, _, mean in pending:
                self._wait(mean)
        # The replacement keeps the rows this trainer writes back only from the next boundary on: those sent so far
        # are acknowledged first, so that this trainer too can be lost from then on.
        boundary, deadline = self.step.iteration, time.monotonic() + self.world.timeout
        while self.written.through() < boundary - 1:
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer {self.index}: its write-backs up to iteration {boundary - 1} were not "
                                   f"acknowledged within {self.world.timeout:.0f} s")
            time.sleep(0.005)
        kept = [dataclasses.replace(self.redo.kept(i), params=[p.clone() for p in self.redo.kept(i).params])
                for i in self.redo.iterations() if i >= boundary - REDO_DEPTH + 1]  # (the log reuses its copies)
        recovery.state = {
            "iteration": self.step.iteration, "kept": kept,
            "caches": [(cache.slot_key.copy(), cache.weights.cpu().clone(), cache.state.cpu().clone(),
                        cache.resident_rows) for cache in self.caches],
            "pending": [[(iteration, slots.copy(), grads.clone()) for iteration, slots, grads, _ in pending]
                        for pending in self._pending],
            "others_evicted": list(self.others_evicted), "written_by_all": self.written_by_all,
            **self.dense_state(self.step.iteration)}
        recovery.handed.set()
        log.info("trainer %d: its state at iteration %d is ready for trainer %d's replacement", self.index,
                 self.step.iteration, recovery.trainer)

    def replace_lost(self, make_model, layout) -> dict:
        """This process replaces a lost trainer: add its shares to the sums that failed with it (computed again from
        what the lowest survivor kept), then take that survivor's state at its next boundary; returns the state
        (its dense part is the caller's to load)."""
        started = time.perf_counter()
        survivors = [t for t in range(self.world.num_trainers) if t != self.index]
        _, donor = agree_on_sums(read_sums(self.store, f"{SUMS_PREFIX}{self.world.epoch}/", survivors,
                                           timeout=2 * self.world.timeout))
        donor = World.trainer_name(donor)
        plan = self.epochs.call(donor, TRAINER.recovery, (self.index,), timeout=2 * self.world.timeout)
        self.group = trainer_group(self.world, self.store, self.index, epoch=self.world.epoch)
        iterations = sorted(plan.kept)
        messages = self._pull_messages(iterations[0] - 1 if iterations else None)
        recompute = Recomputer(make_model, layout, seed=self.job.config.seed, part=self.index)
        shares = {iteration: recompute(plan.kept[iteration], messages[iteration]) for iteration in iterations}
        means = [Mean(self.group, shares_part(shares[what[1]], what).clone(), timeout=self.world.timeout, what=what)
                 for what in plan.sums]
        for mean in means:
            mean.wait()
        state = self.epochs.call(donor, TRAINER.handed_over, (self.index,), timeout=2 * self.world.timeout)
        n = state["iteration"]
        messages.update(self._pull_messages(n - REDO_DEPTH, upto=n))
        # the survivor's inputs of the iterations before: this process can give them to a replacement of its own
        self.kept_before = state["kept"]
        self.recent.extend(messages[kept.iteration] for kept in self.kept_before)
        for cache, (slot_key, weights, cache_state, resident) in zip(self.caches, state["caches"]):
            cache.slot_key[:] = slot_key
            cache.weights.copy_(weights)
            cache.state.copy_(cache_state)
            cache.resident_rows = resident
        for pending, entries in zip(self._pending, state["pending"]):
            pending.extend((iteration, slots, grads, Mean(None, grads, timeout=self.world.timeout))
                           for iteration, slots, grads in entries)
        self.others_evicted.extend(state["others_evicted"])
        self.written_by_all = state["written_by_all"]
        self.finished = n - 1
        self.written = WrittenBack(n)
        self._first = messages[n]
        self.begin(after=n)
        # the lost trainer's write-backs, up to the boundary taken over, may be missing: all of them sent again
        for version, space, keys, rows, state_rows in self.others_evicted:
            self._send_write_backs(space, keys, rows, state_rows, version=version)
        seconds = time.perf_counter() - started
        self.stats.extra["replaced_at_iteration"] = n
        self.epochs.call("oracle", ORACLE.replaced, (self.world.rank, {"sums_again": len(plan.sums),
                                                                           "caught_up_in_s": seconds,
                                                                           "at_iteration": n}))
        log.warning("trainer %d's replacement: %d sums done again, state of iteration %d taken over in %.2f s",
                    self.index, len(plan.sums), n, seconds)
        return state

    def _pull_messages(self, after: int | None, *, upto: int | None = None) -> dict[int, StepMessage]:
        """This trainer's plan messages after iteration ``after`` (the oracle keeps a lost trainer's), up to ``upto``
        at least if given."""
        if after is None:
            return {}
        found: dict[int, StepMessage] = {}
        deadline = time.monotonic() + self.world.timeout
        while True:
            pulled = self.epochs.call("oracle", ORACLE.pull, (self.index, after, PULL_MAX_STEPS))
            for message in pulled.messages:
                found[message.iteration] = message
            if upto is None or upto in found or any(m.final for m in pulled.messages):
                return found
            if pulled.messages:
                after = pulled.messages[-1].iteration
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer {self.index}'s replacement: no plan message of iteration {upto}")

    def sync(self, lookups: list[Lookup], extra: torch.Tensor | None = None) -> torch.Tensor | None:
        """Average the rows' gradients over trainers and update the cached rows, space by space.

        ``extra`` (e.g. the flattened dense gradients) rides along in the blocking all-reduce and
        comes back averaged. Rows used next iteration (the first ``num_now`` of each space's batch)
        are updated now; the rest when their sync completes, before their next use or eviction.
        """
        message = self.step
        if all(lookup.rows.grad is None for lookup in lookups):
            raise RuntimeError("backward() did not reach the embeddings of this batch")
        now_grads, later_grads = row_shares(lookups, message)
        dense = 0 if extra is None else extra.numel()
        buffer = self.allreduce_finish(self.allreduce_start(main_share(extra, now_grads),
                                                            what=("main", message.iteration, None)))
        offset = dense
        for space, (grads, step) in enumerate(zip(later_grads, message.spaces)):
            now, dim = step.num_now, self.layout.spaces[space].dim
            self.caches[space].apply(step.batch_slots[:now], buffer[offset:offset + now * dim].view(-1, dim))
            offset += now * dim
            if now < len(step.batch_slots):
                mean = self.allreduce_start(grads, what=("later", message.iteration, space))
                self._pending[space].append((message.iteration, step.batch_slots[now:].numpy(), grads, mean))
        return None if extra is None else buffer[:dense]

    def _apply_pending(self, space: int, *, upto: int, evicting: np.ndarray) -> None:
        """Apply a space's lazily synced updates from iterations <= upto, and any whose rows are evicted now."""
        pending, cache = self._pending[space], self.caches[space]
        evicted = None
        while pending:
            iteration, slots, grads, mean = pending[0]
            if iteration > upto:
                if not len(evicting):
                    break
                if evicted is None:
                    evicted = np.zeros(cache.capacity, dtype=bool)
                    evicted[evicting] = True
                if not evicted[slots].any():
                    break
            pending.popleft()
            waited = time.perf_counter()
            self._wait(mean)
            self._stalled("lazy_sync_wait_s", waited)
            cache.apply(slots, grads)

    def _flush(self) -> None:
        self._writes.put(_END)
        self._writer.join()
        self._raise_if_failed()
        self.stats.loop_s = time.perf_counter() - self._started

    def send_checkpoint(self, iteration: int, *, dense: dict, dense_optimizer: dict, extra: dict) -> None:
        """Trainer 0's part of the checkpoint at boundary ``iteration`` (runtime.checkpointing): every cached
        row, with every update of the iterations before applied (their background syncs are waited for),
        and the dense state given, sent to the oracle in the background."""
        no_evictions = np.zeros(0, dtype=np.int64)
        parts = []
        for space, cache in enumerate(self.caches):
            self._apply_pending(space, upto=iteration - 1, evicting=no_evictions)
            slots = np.flatnonzero(cache.slot_key >= 0)
            index = torch.from_numpy(slots).to(cache.weights.device)
            parts.append(RowPart(space=space, keys=cache.slot_key[slots].copy(),
                                 rows=cache.weights.index_select(0, index).cpu().numpy(),
                                 state=cache.state.index_select(0, index).cpu().numpy()))
        args = (iteration, dense, dense_optimizer, parts, extra)
        self._checkpoint_sends = [sending for sending in self._checkpoint_sends if sending.is_alive()]
        def send() -> None:
            inject_fault(f"sending checkpoint {iteration}")
            self.epochs.call("oracle", ORACLE.checkpoint_cache, args)

        sending = threading.Thread(target=self._guard, args=(send,), name="checkpoint", daemon=True)
        sending.start()  # (sent again after a re-formation: the oracle keeps the last one it gets)
        self._checkpoint_sends.append(sending)

    def progress(self) -> dict:
        """How far this trainer is (for a lost oracle's replacement): the last plan message received, the last
        iteration stepped, and the version its write-backs are acknowledged to."""
        return {"after": self.received, "finished": self.finished, "written": self.written.through()}

    def close(self, *, dense_state: dict | None = None) -> None:
        """Report to the oracle (after the final flush) and leave the job."""
        for sending in self._checkpoint_sends:
            sending.join()
        self._raise_if_failed()
        self._stopping.set()
        self.epochs.call("oracle", ORACLE.trainer_done, (self.index, self.stats, dense_state))
        inject_fault("done")
        self.epochs.stop()
        self.liveness.stop()
        transport.shutdown_rpc()  # the oracle has this trainer's report: nothing is in flight

    def abort(self) -> None:
        self._stopping.set()
        self._writes.put(_END)
        self.epochs.stop()

    def fail(self, lost: PeerLost) -> None:
        """A peer this trainer needs is lost: the compute thread's next step raises it."""
        log.error("%s", lost.message)
        self._failure = self._failure or RuntimeError(lost.message)
        self._stopping.set()




def read_sums(store, key: str, trainers: list[int], *, timeout: float) -> dict[int, dict]:
    """What each of ``trainers`` (survivors of a lost trainer) said under ``key``: its sums not finished and the
    iteration it is in (``agree_on_sums``), once all have said it."""
    deadline = time.monotonic() + timeout
    while not all(store.check([f"{key}{t}"]) for t in trainers):
        if time.monotonic() > deadline:
            missing = [t for t in trainers if not store.check([f"{key}{t}"])]
            raise TimeoutError(f"trainers {missing} did not say which gradient sums they have not finished within "
                               f"{timeout:.0f} s")
        time.sleep(0.02)
    return {t: json.loads(store.get(f"{key}{t}")) for t in trainers}


def shares_part(shares: Shares, what: tuple) -> torch.Tensor:
    """The operand of sum ``what`` (kind, iteration, space) among an iteration's ``shares``."""
    kind, _, space = what
    return shares.early if kind == "early" else shares.main if kind == "main" else shares.later[space]


class Recovery:
    """What the lowest surviving trainer gives a lost trainer's replacement: the sums to add its shares to (in the
    order started) and the inputs of their iterations, then its state at its next iteration boundary."""

    def __init__(self, *, trainer: int, epoch: int, sums: list[tuple], kept: dict) -> None:
        self.trainer, self.epoch, self.sums, self.kept = trainer, epoch, sums, kept
        self.state: dict | None = None
        self.handed = threading.Event()


class TrainerHandlers:
    """What this trainer process answers (runtime/endpoints.py's TrainerEndpoints), for its ``runtime``."""

    def __init__(self, runtime: TrainerRuntime) -> None:
        self.runtime = runtime

    def _recovery_for(self, trainer: int) -> Recovery:
        runtime = self.runtime
        deadline = time.monotonic() + 2 * runtime.world.timeout
        while True:
            recovery = runtime.recovery
            if recovery is not None and recovery.trainer == trainer:
                return recovery
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer {runtime.index} has no recovery for trainer {trainer}'s replacement")
            time.sleep(0.05)

    def recovery(self, trainer: int) -> Recovery:
        """The sums a replacement for ``trainer`` adds its shares to, and their iterations' inputs (without the
        state)."""
        recovery = self._recovery_for(trainer)
        plan = Recovery(trainer=trainer, epoch=recovery.epoch, sums=recovery.sums, kept=recovery.kept)
        plan.handed = None
        return plan

    def progress(self) -> dict:
        """How far this trainer is, for a lost oracle's replacement (``TrainerRuntime.progress``)."""
        return self.runtime.progress()

    def handed_over(self, trainer: int) -> dict:
        """This trainer's state for ``trainer``'s replacement, once at an iteration boundary."""
        recovery = self._recovery_for(trainer)
        if not recovery.handed.wait(timeout=2 * self.runtime.world.timeout):
            raise TimeoutError(f"trainer {self.runtime.index} did not reach an iteration boundary to hand over its "
                               f"state")
        return recovery.state



class WrittenBack:
    """The version up to which every write-back a trainer sent is acknowledged: the write-backs in flight, counted
    by version (the compute thread sends them, the writer thread sees them answered)."""

    def __init__(self, start: int) -> None:
        self._in_flight: collections.Counter = collections.Counter()
        self._last = start - 1  # the version of the last boundary whose write-backs were all sent
        self._lock = threading.Lock()

    def sending(self, version: int) -> None:
        with self._lock:
            self._in_flight[version] += 1

    def boundary(self, version: int) -> None:
        """Every write-back of ``version`` is sent (or counted by ``sending``)."""
        with self._lock:
            self._last = max(self._last, version)

    def acknowledged(self, version: int) -> None:
        with self._lock:
            self._in_flight[version] -= 1
            if not self._in_flight[version]:
                del self._in_flight[version]

    def through(self) -> int:
        with self._lock:
            return min(self._in_flight) - 1 if self._in_flight else self._last


def check_fetched(space: int, keys: torch.Tensor, wanted: torch.Tensor, tag: int, have: torch.Tensor,
                  answered: int, *, server: int, iteration: int) -> None:
    """A fetch's answer is its request's (the tag it was sent with comes back) and holds every row at (or, after a
    resume, past) the version the plan asked for; anything else is a fault of the servers or the RPC layer, and
    training on it would silently leave the reference's path: raised."""
    if answered != tag:
        raise RuntimeError(f"iteration {iteration}: server {server} answered fetch {tag} of space {space} with the "
                           f"answer to fetch {answered}")
    behind = torch.nonzero(have < wanted).flatten()
    if len(behind):
        first = int(behind[0])
        raise RuntimeError(f"iteration {iteration}: server {server} answered a fetch of space {space} with "
                           f"{len(behind)} rows older than asked for (first: key {int(keys[first])} at version "
                           f"{int(have[first])}, asked for {int(wanted[first])})")


@dataclass(frozen=True)
class _Request:
    """An RPC to the server of a data shard, kept until answered so that it can be sent again elsewhere."""

    endpoint: Endpoint
    shard: int
    args: tuple
    sent_to: int  # the server it went to
    future: torch.futures.Future
    epoch: int  # the RPC world it was sent in


def train_loop(runtime: TrainerRuntime, config: TrainConfig) -> None:
    """The training loop of ``--mode bagpipe``, for any model: the reference step, with synced gradients."""
    deterministic()
    job = runtime.job
    model = build_model(config, runtime.layout.schema)
    dense_optimizer = runtime.row_optimizer.dense_optimizer(model.parameters())
    start, losses = job.start, []

    def make_model():
        return build_model(config, runtime.layout.schema)

    if runtime.group is None and runtime.replaceable:  # a lost trainer's replacement: a survivor's state
        handed = runtime.replace_lost(make_model, runtime.layout)
        model.load_state_dict(handed["dense"])
        dense_optimizer.load_state_dict(handed["dense_optimizer"])
        start, losses = handed["iteration"], list(handed["losses"])
    elif job.resume:  # the dense state of the checkpoint; the rows come from the servers through the plan
        directory, chain = resume_chain(config.run_dir, job.resume)
        saved = load_dense(directory, chain[-1])
        model.load_state_dict(saved["dense"])
        dense_optimizer.load_state_dict(saved["dense_optimizer"])
        losses = list(chain[-1]["extra"].get("recent_losses", []))
    params = list(model.parameters())
    runtime.redo = RedoLog(params)
    for kept in runtime.kept_before:  # a replacement's: what its survivor had kept
        runtime.redo.adopt(kept)
    runtime.recompute = Recomputer(make_model, runtime.layout, seed=config.seed, part=runtime.index)

    def dense_state(boundary: int) -> dict:
        since_log = boundary % config.log_every  # the losses a replacement for trainer 0 logs with
        return {"dense": cloned_state(model.state_dict()), "dense_optimizer": cloned_state(dense_optimizer.state_dict()),
                "losses": losses[len(losses) - since_log:] if since_log else []}

    runtime.dense_state = dense_state
    # The parameters the model names as complete first in the backward (DLRM: the top MLP): their
    # all-reduce starts then and runs while the rest of the backward computes (as DDP's buckets do).
    early = _EarlyBucket(runtime, model.early_params())
    late_params = [p for p in params if all(p is not q for q in early.params)]
    leader = runtime.index == 0
    run = RunDir(config.run_dir, append=True) if leader else None
    timer = Timer(warmup=min(config.warmup_iterations, max(job.iterations - start - 1, 0)))
    clock = PhaseClock(warmup=timer.warmup)
    stats = runtime.stats
    loss = float("nan")
    tick = window_start = time.perf_counter()
    started = tick
    cache_figures = cache_window(stats)
    clock.restart()
    while True:
        waits = (stats.plan_wait_s, stats.fetch_wait_s, stats.lazy_sync_wait_s)
        message = runtime.advance()
        clock.lap("cache")
        for kind, before in zip(("plan_wait", "fetch_wait", "lazy_sync_wait"), waits):
            clock.carve("cache", kind, getattr(stats, f"{kind}_s") - before)
        if message is None:
            break
        if message.checkpoint and leader:
            runtime.send_checkpoint(message.iteration, dense=cloned_state(model.state_dict()),
                                    dense_optimizer=cloned_state(dense_optimizer.state_dict()),
                                    extra={"recent_losses": list(losses)})
            inject_fault(f"checkpoint sent {message.iteration}")
        embeddings, lookups = runtime.lookup()
        clock.lap("lookup")
        early.reset()
        local_loss = backward_slice(model, message, embeddings, seed=config.seed, part=runtime.index, lap=clock.lap)
        runtime.redo.keep(message.iteration, lookups)  # before the step: a replacement may need this slice again
        inject_fault(f"backward {message.iteration}")
        flat = dense_share(late_params, local_loss)
        sync_before = stats.sync_s
        flat = runtime.sync(lookups, flat)
        early_flat = early.finish()
        clock.lap("sync")
        clock.carve("sync", "sync_wait", stats.sync_s - sync_before)
        for group, values in ((late_params, flat), (early.params, early_flat)):
            offset = 0
            for p in group:
                p.grad.copy_(values[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        dense_optimizer.step()
        loss = float(flat[-1])
        clock.lap("optimizer")
        iteration = message.iteration
        check_loss(loss, iteration, config)
        inject_fault(f"iteration {iteration}")
        now = time.perf_counter()
        if iteration == start:
            stats.extra["first_iteration_at"] = time.time()
            if leader and start:  # a resumed job trains again: when, the launcher reports (its restarts)
                run.log_metrics(event=RESUMED, iteration=iteration + 1)
        timer.record(iteration - start, config.batch_size, now - tick)
        tick = now
        losses.append(loss)
        if leader and ((iteration + 1) % config.log_every == 0 or iteration + 1 == job.iterations):
            run.log_metrics(iteration=iteration + 1, samples=(iteration + 1) * config.batch_size,
                            train_loss=float(np.mean(losses)), elapsed_s=now - started,
                            samples_per_s=timer.samples_per_s,
                            window_samples_per_s=len(losses) * config.batch_size / (now - window_start),
                            stall_fraction=stats.stall_s / max(now - runtime._started, 1e-9),
                            time_ms=clock.window(), **cache_figures())
            losses.clear()
            window_start = now
        clock.lap("other")
        clock.end_iteration()
    stats.extra["time_breakdown_ms"] = clock.steady_ms()
    stats.extra["peak_rss_bytes"] = peak_rss_bytes()
    stats.extra["cpu_s"] = cpu_seconds()
    runtime.stats.samples_per_s = timer.samples_per_s
    runtime.stats.extra["final_train_loss"] = loss
    if run is not None:
        run.close()
    runtime.close(dense_state=model.state_dict() if leader else None)


class _EarlyBucket:
    """Parameters whose gradients are summed over trainers as soon as the backward completes them."""

    def __init__(self, runtime: TrainerRuntime, params: list[torch.nn.Parameter]) -> None:
        self.runtime = runtime
        self.params = params if runtime.group is not None else []
        self.ready = 0
        self.work = self.buffer = None
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_ready)

    def reset(self) -> None:
        self.ready, self.work, self.buffer = 0, None, None

    def _on_ready(self, _param) -> None:
        self.ready += 1
        if self.ready == len(self.params):
            self.buffer = torch.cat([p.grad.reshape(-1) for p in self.params])
            self.work = self.runtime.allreduce_start(self.buffer, what=("early", self.runtime.step.iteration, None))

    def finish(self) -> torch.Tensor:
        if not self.params:
            return torch.zeros(0)
        if self.buffer is None:
            raise RuntimeError("the backward did not reach every one of the model's early parameters")
        return self.runtime.allreduce_finish(self.work)


def cache_window(stats: TrainerStats) -> Callable[[], dict]:
    """The cache figures of each metrics window: its hit rate, rows fetched and (this trainer's share of, as
    evicted rows are written back by one trainer each) rows written back per iteration."""
    fields = ("iterations", "rows_fetched", "rows_written_back", "batch_rows", "batch_hits")
    window = CounterWindow(lambda: {name: getattr(stats, name) for name in fields})

    def take() -> dict:
        grown = window.take()
        iterations = max(grown["iterations"], 1)
        return {"cache_hit_rate": share(grown["batch_hits"], grown["batch_rows"]),
                "rows_fetched_per_iteration": grown["rows_fetched"] / iterations,
                "rows_written_back_per_iteration": grown["rows_written_back"] / iterations}
    return take


def join_as_trainer(world: World, *, given: dict, on_lost=exit_on_lost) -> tuple:
    """Check in (stating the settings this trainer was ``given``), start the heartbeat (watching the
    oracle and the other trainers) and wait for the job as every role agreed on it."""
    store, world = check_in(world, "trainer", given=given)
    liveness = Liveness(world, watch=[0, *(world.trainer_rank(t) for t in range(world.num_trainers))],
                        on_lost=on_lost)
    job = JobInfo.from_json(wait_for_job(world, store))
    world = job_world(world, job.config)
    if world.epoch:  # a lost trainer's replacement: in the RPC world the oracle re-forms around it
        if not await_reformation(world, store):
            raise RuntimeError("training ended before this trainer's replacement joined")
    init_rpc(world, store, epoch=world.epoch)
    return world, store, liveness, job


def run_trainer(world: World, *, given: dict | None = None, device: str = "cpu", writeback_delay: float = 0.0) -> None:
    if device != "cpu":
        log.warning("--device %s: this trainer's model and cache run on the CPU (the GPU path of the bagpipe "
                    "trainer is not built yet)", device)
    world, store, liveness, job = join_as_trainer(world, given={"kind": "model", **(given or {})})
    runtime = TrainerRuntime(world, store, job=job, liveness=liveness, writeback_delay=writeback_delay,
                             replacing=bool(world.epoch))
    transport.serve("trainer", TrainerHandlers(runtime))
    liveness.recover = functools.partial(liveness.goes_on_without, replace_oracle=job.replace_oracle,
                                         replace_trainers=job.replace_trainers)
    try:
        train_loop(runtime, job.config)
    except BaseException as err:
        runtime.abort()
        if transport.peer_gone(err):  # the peer that ended is the failure: name it, not this trainer
            liveness.await_verdict(err)
        raise


def cache_device(device: str) -> str:
    """The device asked for, or the CPU (with a warning) when it is a GPU this machine lacks."""
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        log.warning("device %s requested but CUDA is not available: caching on the CPU", device)
        return "cpu"
    return device
