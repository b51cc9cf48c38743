"""A trainer's row caches kept in step with the oracle's plan, ahead of compute.

A prefetcher thread pulls plan messages from the oracle and issues each iteration's fetches as soon as it sees them
(servers park a fetch until the write-back it must observe has arrived); a writer thread sends write-backs. The
compute thread, at each iteration boundary, applies the gradient updates that were synced lazily, evicts, installs
the fetched rows and hands out the batch. Every trainer holds the same rows (the plan is global). ``TrainerRuntime``
holds the trainer's components: this cache sync, its gradient sync (trainer/grad_sync.py) and its side of replacing
a lost trainer (trainer/recovery.py); it knows nothing of the model but the hooks recovery needs.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from bagpipe.cache import RowCache, StepTables
from bagpipe.train.checkpoints import RowPart
from bagpipe.embeddings import Embeddings, Lookup
from bagpipe.embeddings.dynamic import remade_weights
from bagpipe.faults import inject_fault
from bagpipe.optim import make_row_optimizer
from bagpipe.runtime import transport
from bagpipe.runtime.endpoints import ORACLE, SERVER
from bagpipe.runtime.exit_status import PeerLost
from bagpipe.runtime.liveness import Liveness
from bagpipe.runtime.protocol import (DAMAGED_RESENDS, PULL_MAX_STEPS, JobInfo, SpaceStep, StepMessage, TrainerStats,
                                      answer_digest)
from bagpipe.runtime.reduce import Mean
from bagpipe.runtime.redo import REDO_DEPTH
from bagpipe.runtime.trainer.grad_sync import GradientSync, stalled
from bagpipe.runtime.trainer.partitioned import SharedRows, write_and_drop
from bagpipe.runtime.trainer.recovery import HandedOver, LostTrainers, ModelHooks
from bagpipe.runtime.transport import Endpoint, unwrap
from bagpipe.runtime.world import Epochs, Routes, ShardMoved, World, trainer_group

log = logging.getLogger(__name__)

_END = object()
WRITE_POLL_S = 0.05  # how often the writer looks at its write-backs in flight while none is queued


class TrainerRuntime:
    """One trainer's caches (one per embedding space), prefetcher, writer, gradient sync (``grads``) and recovery
    (``lost``), whole once constructed. ``model``: the hooks into the model trained that recovery needs (None where
    the model is the user's, as in ``init_cache``: a lost trainer then ends the job)."""

    def __init__(self, world: World, store, *, job: JobInfo, liveness: Liveness, model: ModelHooks | None = None,
                 device: str = "cpu", writeback_delay: float = 0.0, prefetch_depth: int | None = None,
                 replacing: bool = False) -> None:
        """``replacing``: this process replaces a lost trainer (``lost.replace_lost``, before any step)."""
        self.world = world
        self.store = store
        self.liveness = liveness
        self.index = world.role[1]
        self.job = job
        self.layout = job.layout
        self.replacing = replacing
        config = job.config
        self.row_optimizer = make_row_optimizer(config.optimizer, lr=config.lr)
        self.caches = [RowCache(capacity=share, dim=space.dim, optimizer=self.row_optimizer, device=device)
                       for space, share in zip(self.layout.spaces, job.cache_rows)]
        self.stats = TrainerStats()
        self.lost = LostTrainers(self, model, replaceable=job.replace_trainers)
        # the trainers' group first (before this process follows re-formations of the RPC world); a replacement
        # forms the group of its epoch once it has what to add to the sums that failed (replace_lost)
        self.grads = GradientSync(None if replacing else trainer_group(world, store, self.index), caches=self.caches,
                                  stats=self.stats, timeout=world.timeout, recover=self.lost.recover)
        # the partitioned cache (planner/partitioned.py): this trainer's own rows, shared ones summed among users
        self.shared = SharedRows(self.grads, caches=self.caches, stats=self.stats, index=self.index,
                                 trainers=world.num_trainers, timeout=world.timeout
                                 ) if config.partitioned else None
        self.epochs = Epochs(world, store)  # requests that fail to a re-formation of the RPC world are sent again
        if job.replace_oracle:  # requests to a lost oracle wait for its replacement
            self.epochs.await_peer("oracle")
        self.routes = Routes(world)  # a lost server's shard moves to its parity server (--parity)
        self.step: StepMessage | None = None
        self.writeback_delay = writeback_delay  # tests only: delays every write-back on purpose
        self._ready: queue.Queue = queue.Queue(maxsize=prefetch_depth or config.prefetch_depth)
        self._writes: queue.Queue = queue.Queue()
        self._failure: BaseException | None = None
        self._late: list[tuple] = []  # partitioned: the last boundary's fetches due at the next one
        self._remade_at = -1  # raw ids, rows retired: the iteration whose rows made again this trainer has made
        self._checkpoint_sends: list[threading.Thread] = []  # trainer 0's parts of checkpoints, on their way
        self._tags = 0  # fetches sent: each carries its number, which its answer echoes (check_fetched)
        self.recent: deque = deque(maxlen=REDO_DEPTH + 1)  # this trainer's last plan messages, by the compute thread
        self._first: StepMessage | None = None  # a replacement's: the step it starts with, its boundary done
        self.finished = job.start - 1  # the last iteration stepped (the oracle keeps the messages from before it)
        self.written = WrittenBack(job.start)  # how far this trainer's write-backs are acknowledged
        # Rows evicted that other trainers write back, by version, until every trainer's write-backs up to it are
        # acknowledged (``written_by_all``, from the oracle): those of a lost trainer are sent again from here.
        self.others_evicted: deque = deque()
        self.written_by_all = job.start - 1
        self.servers_pending = False  # the oracle's last answer: a server is still filling its tables
        self.received = -1  # the last plan message received (``begin``)
        self.stopping = threading.Event()
        self.started: float | None = None  # when the first step was asked for
        self._prefetcher = threading.Thread(target=self._guard, args=(self._prefetch,), name="prefetch", daemon=True)
        self._writer = threading.Thread(target=self._guard, args=(self._write,), name="write-back", daemon=True)
        if not replacing:
            self.begin(after=-1)

    def begin(self, *, after: int) -> None:
        """Start pulling plan messages after iteration ``after`` and writing back."""
        self.received = after  # the last plan message received: the oracle sends the ones after it
        self._prefetcher.start()
        self._writer.start()

    def _guard(self, body) -> None:
        try:
            body()
        except BaseException as err:
            self._failure = self._failure or err
            self.stopping.set()

    def _prefetch(self) -> None:
        while not self.stopping.is_set():
            pulled = self.epochs.call("oracle", ORACLE.pull, (self.index, self.received, PULL_MAX_STEPS, self.finished,
                                                             self.written.through()))
            self.written_by_all = pulled.written_by_all
            self.servers_pending = not pulled.servers_ready
            for message in pulled.messages:
                self.received = message.iteration
                fetches = self._issue_fetches(message)
                while not self.stopping.is_set():
                    try:
                        self._ready.put((message, fetches), timeout=0.2)
                        break
                    except queue.Full:
                        continue
                if message.final:
                    return

    def _issue_fetches(self, message: StepMessage) -> list:
        """Each space's fetches, sent to the shards that hold them: (shard, index, future) per request; with the
        partitioned cache, two such lists per space: the fetches due at this boundary, and those due at the next
        one (``fetch_late``), asked for apart so that the first answers do not wait for the second."""
        fetches = []
        for space, step in enumerate(message.spaces):
            if self.shared is None:
                fetches.append(self._fetch_requests(space, step, torch.ones(len(step.fetch_keys), dtype=torch.bool)))
            else:
                fetches.append(tuple(self._fetch_requests(space, step, due)
                                     for due in (~step.fetch_late, step.fetch_late)))
        return fetches

    def _fetch_requests(self, space: int, step, chosen: torch.Tensor) -> list:
        """Requests for the ``chosen`` (a mask) of a step's fetches, one per shard: (shard, index, future)."""
        keys, versions = step.fetch_keys, step.fetch_versions
        shards = keys % self.world.num_shards
        requests = []
        for shard in range(self.world.num_shards):
            index = torch.nonzero((shards == shard) & chosen).flatten()
            if len(index):
                self._tags += 1
                requests.append((shard, index, self._send(SERVER.fetch, shard,
                                                          (space, keys[index], versions[index], self._tags))))
        return requests

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

    def advance(self) -> StepMessage | None:
        """Carry out the next plan step and return its message; None after the final flush."""
        if self.started is None:
            self.started = time.perf_counter()
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
                if self.epochs.awaiting or self.servers_pending:  # a lost oracle's replacement, awaited within
                    since = time.perf_counter()  # its own deadline; servers filling their tables (the oracle says)
                elif time.perf_counter() - since > self.world.timeout:
                    raise TimeoutError(f"trainer {self.index}: no plan from the oracle for "
                                       f"{self.world.timeout:.0f} s") from None
        stalled(self.stats, "plan_wait_s", waited)
        if self.step is not None and not self.step.final:
            self.finished = self.step.iteration
        while self.others_evicted and self.others_evicted[0][0] <= self.written_by_all:
            self.others_evicted.popleft()
        if self.shared is not None:
            self._part_boundary(message, fetches)
        else:
            for space, (step, requests) in enumerate(zip(message.spaces, fetches)):
                self._boundary(space, message.iteration, step, requests)
        if not message.final:
            for step in message.spaces:
                self.stats.batch_rows += len(step.batch_keys)
                self.stats.batch_hits += len(step.batch_keys) - step.due_fetches
        self.written.boundary(message.iteration - 1)  # every write-back of this boundary is counted by now
        self.recent.append(message)
        self.step = message
        self.lost.hand_over()  # to a lost trainer's replacement, if one awaits this trainer's state
        kept = sum(len(entry[2]) for entry in self.others_evicted)
        self.stats.extra["others_evicted_peak_rows"] = max(self.stats.extra.get("others_evicted_peak_rows", 0), kept)
        if message.final:
            self._flush()
            return None
        self.stats.iterations += 1
        return message

    def _boundary(self, space: int, iteration: int, step: SpaceStep, requests: list) -> None:
        """One space's part of the boundary before ``iteration``: due updates, evictions, fetched rows."""
        cache = self.caches[space]
        evict_slots = step.evict_slots.numpy()
        self.grads.apply_pending(space, upto=iteration - 2, evicting=evict_slots)
        if len(evict_slots):
            rows, state = cache.evict(evict_slots, step.evict_keys.numpy())
            mine = step.write_mask
            writes = mine.numpy()  # (asked of the host array: a tensor's .any() is a value read back, counted)
            if writes.any():
                self._send_write_backs(space, step.evict_keys[mine], rows[mine], state[mine], version=iteration - 1)
            others = ~mine
            if self.grads.group is not None and not writes.all():
                self.others_evicted.append((iteration - 1, space, step.evict_keys[others], rows[others], state[others]))
        self._install_fetched(space, iteration, step, requests)

    def _remake(self, remade: list, *, spaces: list[int] | None = None,
                held: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Raw ids with rows retired: the rows whose numbers are reused at this iteration made again for their new
        keys (each from its key, its optimizer state zero) in the slots that hold them, as every trainer holding
        one does (its server's copy is stale until the row is written back, as any cached row's is). A row's last
        use before it was retired is two boundaries back at least, so its lazily synced update is in by now.
        A row made again is looked up at its iteration, so this trainer holds it only among the step's rows (its
        batch's, and with the partitioned cache those it keeps): found there, not by a scan of the cache.
        ``spaces`` and ``held``: those spaces' rows among ``held`` (keys and slots: a keeper's late fetches)."""
        for space, (keys, raw, tables) in enumerate(remade):
            if not len(keys) or (spaces is not None and space not in spaces):
                continue
            if held is not None:
                have_keys, have_slots = held
            else:
                step = self.step.spaces[space]
                have_keys, have_slots = step.batch_keys.numpy(), step.batch_slots.numpy()
                kept = getattr(step, "kept_keys", None)
                if kept is not None and len(kept):
                    have_keys = np.concatenate([have_keys, kept.numpy()])
                    have_slots = np.concatenate([have_slots, step.kept_slots.numpy()])
            cache = self.caches[space]
            hit = np.isin(have_keys, keys.numpy())
            hit[hit] = cache.slot_key[have_slots[hit]] == have_keys[hit]  # (a keeper's late fetch: at its install)
            if not hit.any():
                continue
            slots, found = have_slots[hit], have_keys[hit]
            order = np.argsort(keys.numpy(), kind="stable")
            mine = order[np.searchsorted(keys.numpy(), found, sorter=order)]
            weights = remade_weights(self.layout, tables.numpy()[mine], raw.numpy()[mine], seed=self.job.config.seed)
            cache.install(slots, found, weights, torch.zeros(len(slots), cache.state.shape[1]), refill=True)

    def _part_boundary(self, message: StepMessage, fetches: list) -> None:
        """This trainer's part of a partitioned plan's boundary (trainer/partitioned.py): the last boundary's late
        fetches, the last iteration's shared rows' updates, then every space's write-backs and rows let go, then
        every space's fetches due now (the late ones are kept for the next boundary)."""
        for space, iteration, step, requests, remade in self._late:  # the last boundary's fetches due now
            installed = self._install_fetched(space, iteration, step, requests)
            if remade is not None and installed is not None:  # (a row made again at that iteration reaches this
                self._remake(remade, spaces=[space], held=installed)  # keeper as its server had it)
        self._late = []
        self.shared.apply()
        for space, step in enumerate(message.spaces):
            rows, state = write_and_drop(step, self.caches[space])
            if len(rows):
                self._send_write_backs(space, step.write_keys, rows, state, version=message.iteration - 1)
        for space, (step, (due, late)) in enumerate(zip(message.spaces, fetches)):
            self._install_fetched(space, message.iteration, step, due)
            if late:
                self._late.append((space, message.iteration, step, late, message.remade))

    def _install_fetched(self, space: int, iteration: int, step, requests: list
                         ) -> tuple[np.ndarray, np.ndarray] | None:
        """A space's fetches of the boundary before ``iteration`` that ``requests`` ask for, waited for and
        installed in their slots; their keys and slots."""
        if not requests:
            return None
        dim = self.layout.spaces[space].dim
        index = torch.cat([index for _, index, _ in requests])
        rows = torch.empty(len(step.fetch_keys), dim)
        state = torch.empty(len(step.fetch_keys), self.row_optimizer.state_width(dim))
        waited = time.perf_counter()
        for _, part, request in requests:
            rows[part], state[part], have, tag = self._answer(request, what="fetch")
            check_fetched(*request.args, have, tag, server=request.sent_to, iteration=iteration)
        stalled(self.stats, "fetch_wait_s", waited)
        keys, slots = step.fetch_keys[index].numpy(), step.fetch_slots[index].numpy()
        self.caches[space].install(slots, keys, rows[index], state[index])
        self.stats.rows_fetched += len(index)
        return keys, slots

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

    def resend_others_evicted(self) -> None:
        """Send again the rows evicted that other trainers write back (a lost trainer's may be missing; a repeat
        is a no-op where it arrived)."""
        for version, space, keys, rows, state in list(self.others_evicted):
            self._send_write_backs(space, keys, rows, state, version=version)

    def await_written(self, version: int) -> None:
        """Wait until this trainer's write-backs up to ``version`` are acknowledged."""
        deadline = time.monotonic() + self.world.timeout
        while self.written.through() < version:
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer {self.index}: its write-backs up to iteration {version} were not "
                                   f"acknowledged within {self.world.timeout:.0f} s")
            time.sleep(0.005)

    def take_over(self, state: HandedOver, *, first: StepMessage, recent: list[StepMessage]) -> None:
        """A replacement's: a survivor's cache-side state at ``state.iteration`` (``first``'s, whose boundary it has
        done), with its plan messages of the iterations before (``recent``); then start pulling after it, and send
        again the lost trainer's write-backs up to it (any may be missing)."""
        n = state.iteration
        self.recent.extend(recent)
        for cache, pending, taken in zip(self.caches, self.grads.pending, state.caches):
            cache.load_state_dict(taken.slots)
            pending.extend((iteration, slots, grads, Mean(None, grads, timeout=self.world.timeout))
                           for iteration, slots, grads in taken.pending)
        self.others_evicted.extend(state.others_evicted)
        self.written_by_all = state.written_by_all
        self.finished = n - 1
        self.written = WrittenBack(n)
        self._first = first
        self.begin(after=n)
        self.resend_others_evicted()

    @property
    def alone(self) -> bool:
        """Whether this is a job's only trainer, with a replicated cache: it sums with no one, so its gradients
        stay on its device (``GradientSync.apply_alone``; the dense ones in the parameters' ``grad``)."""
        return self.world.num_trainers == 1 and self.shared is None

    def sync(self, lookups: list[Lookup], extra: torch.Tensor | None = None) -> torch.Tensor | None:
        """This iteration's gradient sync (``GradientSync.sync``; with the partitioned cache ``SharedRows.sync``)."""
        if self.shared is not None:
            return self.shared.sync(self.step, lookups, extra)
        return self.grads.sync(self.step, lookups, extra)

    def lookup(self) -> tuple[Embeddings, list[Lookup]]:
        """This iteration's slice's embeddings, and each space's Lookup.

        The oracle sent each id's row (``positions``) and each row's slot: no search here. Raw ids with rows retired:
        the rows made again at this iteration are, first (after the boundary's checkpoint part, which holds the
        state after the iterations before: ``_remake``).
        """
        message = self.step
        if message.remade is not None and self._remade_at != message.iteration:
            self._remake(message.remade)
            self._remade_at = message.iteration
        return StepTables(self.caches, [step.view() for step in message.spaces], self.layout).lookup(message.ids)

    def _flush(self) -> None:
        self._writes.put(_END)
        self._writer.join()
        self._raise_if_failed()
        self.stats.loop_s = time.perf_counter() - self.started

    def send_checkpoint(self, iteration: int, *, dense: dict | None, dense_optimizer: dict | None,
                        extra: dict) -> None:
        """This trainer's part of the checkpoint at boundary ``iteration`` (runtime.oracle.checkpointing; trainer 0's,
        and with the partitioned cache every trainer's): every cached row, with every update of the iterations
        before applied (their background syncs are waited for), and the dense state given (trainer 0), sent to the
        oracle in the background."""
        no_evictions = np.zeros(0, dtype=np.int64)
        parts = []
        for space, cache in enumerate(self.caches):
            self.grads.apply_pending(space, upto=iteration - 1, evicting=no_evictions)
            slots = np.flatnonzero(cache.slot_key >= 0)
            index = torch.from_numpy(slots).to(cache.weights.device)
            parts.append(RowPart(space=space, keys=cache.slot_key[slots].copy(),
                                 rows=cache.weights.index_select(0, index).cpu().numpy(),
                                 state=cache.state.index_select(0, index).cpu().numpy()))
        args = (iteration, self.index, dense, dense_optimizer, parts, extra)
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
        self.stopping.set()
        self.epochs.call("oracle", ORACLE.trainer_done, (self.index, self.stats, dense_state))
        inject_fault("done")
        self.epochs.stop()
        self.liveness.stop()
        transport.shutdown_rpc()  # the oracle has this trainer's report: nothing is in flight

    def abort(self) -> None:
        self.stopping.set()
        self._writes.put(_END)
        self.epochs.stop()

    def fail(self, lost: PeerLost) -> None:
        """A peer this trainer needs is lost: the compute thread's next step raises it."""
        log.error("%s", lost.message)
        self._failure = self._failure or RuntimeError(lost.message)
        self.stopping.set()


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
