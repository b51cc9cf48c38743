"""The embedding server role: one shard of every embedding space (a RowStore each) behind RPC.

Fetches that ask for a version not yet written back are parked (``async_execution``) rather
than holding an RPC thread, so a server can never deadlock on its own write-back traffic; a
parked fetch fails after the timeout, as its caller's RPC deadline does.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from bagpipe.checkpoint import background_priority, chain_parts, resume_chain, write_snapshot
from bagpipe.config import TrainConfig
from bagpipe.faults import inject_fault
from bagpipe.heap import bounded_heap
from bagpipe.optim import make_row_optimizer
from bagpipe.runtime import transport
from bagpipe.runtime.endpoints import ORACLE, SERVER
from bagpipe.runtime.keys import STOP_KEY
from bagpipe.runtime.liveness import Liveness
from bagpipe.runtime.protocol import JobInfo, answer_digest
from bagpipe.runtime.world import (Epochs, NoEpochs, ShardMoved, World, check_in, init_rpc, job_world,
                                   join_rpc_as_replacement, wait_for_job)
from bagpipe.timing import cpu_seconds, peak_rss_bytes
from bagpipe.storage import RowStore, StorageSpec
from bagpipe.storage.bits import row_bits
from bagpipe.storage.disk import record_bytes, storage_path
from bagpipe.storage.parity import ParityRows, StandIn, TwoLossesInAGroup
from bagpipe.storage.rowstore import shard_num_rows

log = logging.getLogger(__name__)

CHUNK_ROWS = 1 << 14  # rows a replacement reads at a time from the members of its group or from a stand-in


class Server:
    """One shard of every embedding space (a RowStore each), behind the RPC handlers below."""

    def __init__(self, stores: list[RowStore]) -> None:
        self.stores = stores
        self.bytes_sent = 0
        self.fetches = 0
        self.rows_written = 0
        self.checkpoints: dict[int, torch.futures.Future] = {}  # boundary -> its part's manifest entries, once written
        self.deltas: DeltaSender | None = None  # with --parity: where its write-backs' deltas go
        self._lock = threading.Lock()

    def fetch(self, space: int, keys: torch.Tensor, versions: torch.Tensor) -> torch.futures.Future:
        store = self.stores[space]
        future = store.fetch_async(keys.numpy(), versions.numpy())
        with self._lock:
            self.fetches += 1
            self.bytes_sent += len(keys) * 4 * (store.dim + store.state_width)
        return future

    def write_back(self, space: int, keys: torch.Tensor, rows: torch.Tensor, state: torch.Tensor,
                   version: int) -> torch.futures.Future:
        """Store a write-back; the future completes once it is safe: at once, or with parity once the group's
        parity server has folded its delta in (so no write-back acknowledged is lost with this server)."""
        inject_fault(f"write-back {version}")  # received, not stored
        folded = self.stores[space].write_back(keys.numpy(), rows, state, version=version)
        inject_fault(f"delta sent {version}")  # stored and its delta on its way, not acknowledged
        with self._lock:
            self.rows_written += len(keys)
        if folded is not None:
            return folded
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def send_deltas_to(self, parity_name: str, *, member: int, epochs: Epochs, timeout: float) -> None:
        """Erasure coding: every write-back's old ^ new bits go to ``parity_name`` (this shard is ``member``
        of its group there)."""
        self.deltas = DeltaSender(parity_name, member=member, epochs=epochs, timeout=timeout)
        for space, store in enumerate(self.stores):
            store.parity_sink = functools.partial(self.deltas.send, space)

    def read_range(self, space: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, state, versions = self.stores[space].read_range(start, stop)
        return torch.from_numpy(rows), torch.from_numpy(state), torch.from_numpy(versions)

    def read_rows(self, space: int, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, state, versions = self.stores[space].read(local.numpy())
        return rows, state, torch.from_numpy(versions)


    def begin_checkpoint(self, boundary: int, expected_rows: list[int], since: int | None, directory: str, *,
                         shard: int, num_shards: int, timeout: float) -> None:
        """Start the shard's part of the checkpoint at ``boundary`` (see RowStore.begin_snapshot): kept as of
        now, written to ``directory`` in the background while training goes on."""
        if boundary in self.checkpoints:  # asked again after a re-formation of the RPC world: begun already
            return
        for older in [b for b in self.checkpoints if b < boundary]:  # the oracle has committed or abandoned them
            del self.checkpoints[older]
        for store, rows in zip(self.stores, expected_rows):
            store.begin_snapshot(boundary, expected_rows=rows, since=since)
        future: torch.futures.Future = torch.futures.Future()
        self.checkpoints[boundary] = future

        def write() -> None:
            background_priority()
            try:
                self.before_snapshot()
                entries = [write_snapshot(Path(directory), name=f"server{shard}.space{space}", space=space,
                                          chunks=store.snapshot_chunks(timeout=timeout), num_rows=store.num_rows,
                                          dim=store.dim, state_width=store.state_width, start=shard,
                                          step=num_shards, full=since is None)
                           for space, store in enumerate(self.stores)]
                inject_fault(f"checkpoint {boundary} written")
                future.set_result(entries)
            except BaseException as err:  # noqa: BLE001 - the oracle's wait reports it
                future.set_exception(err)

        threading.Thread(target=write, name="checkpoint", daemon=True).start()

    def before_snapshot(self) -> None:
        """Called on a snapshot's writer thread before it reads the rows (its copy-on-write has begun)."""

    def restore(self, directory: Path, chain: list[dict], *, shard: int, num_shards: int) -> None:
        """This shard's rows of a checkpoint's chain (base first, later parts override), at its boundary."""
        boundary = chain[-1]["iteration"]
        for space, keys, rows, state in chain_parts(directory, chain):
            mine = np.flatnonzero(keys % num_shards == shard)
            if len(mine):
                self.stores[space].restore(keys[mine] // num_shards, rows[mine], state[mine], version=boundary - 1)

    def dump(self) -> dict:
        """The shard's figures for the run's summary (its rows reach the run dir as snapshots, never by RPC)."""
        return {"bytes_sent": self.bytes_sent,
                "fetches": self.fetches, "fetches_waited": sum(store.fetches_waited for store in self.stores),
                "rows_written": self.rows_written, "peak_rss_bytes": peak_rss_bytes(), "cpu_s": cpu_seconds(),
                **({"unprotected_write_backs": self.deltas.unprotected} if self.deltas is not None else {}),
                "storage": dict(sum((Counter(store.rows.stats()) for store in self.stores), Counter()))}


class StandInServer(Server):
    """A lost data server's shard, served by its group's parity server from the moment the oracle moves it
    there (storage.parity.StandIn per space): a row not rebuilt yet is reconstructed when first asked for, and
    a background thread rebuilds the rest; then the shard stays here, whole, until a replacement process takes
    it back (``freeze``: from then on every fetch and write-back is answered ``ShardMoved``)."""

    def __init__(self, stand_ins: list[StandIn], *, shard: int) -> None:
        super().__init__([stand_in.store for stand_in in stand_ins])
        self.stand_ins, self.shard = stand_ins, shard
        self.started = time.perf_counter()
        self.rebuilt_after_s: float | None = None
        self.rebuilt: torch.futures.Future = torch.futures.Future()  # completes once the shard is whole here
        self.frozen = False  # handing the shard on: requests are refused (their senders follow the route)
        # Rebuilding a row reads the survivors by RPC and may wait for the parity to catch up: never on an RPC
        # thread, which the parity's own deltas need (a pool of them all waiting here would wait forever).
        self._work = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stand-in")
        self._rebuilder = threading.Thread(target=self._rebuild, name="rebuild", daemon=True)
        self._rebuilder.start()

    def fetch(self, space: int, keys: torch.Tensor, versions: torch.Tensor) -> torch.futures.Future:
        def fetch_rebuilt() -> torch.futures.Future:
            self._refuse_if_frozen()
            self.stand_ins[space].ensure(self.stores[space]._local(keys.numpy()))
            return super(StandInServer, self).fetch(space, keys, versions)

        return self._off_rpc_thread(fetch_rebuilt)

    def write_back(self, space: int, keys: torch.Tensor, rows: torch.Tensor, state: torch.Tensor,
                   version: int) -> torch.futures.Future:
        def write_rebuilt() -> torch.futures.Future:  # (a repeat is left alone by the store)
            self._refuse_if_frozen()
            self.stand_ins[space].ensure(self.stores[space]._local(keys.numpy()))  # the parity needs the old rows
            return super(StandInServer, self).write_back(space, keys, rows, state, version)

        return self._off_rpc_thread(write_rebuilt)

    def _off_rpc_thread(self, work) -> torch.futures.Future:
        """``work()`` (which returns a future) on the stand-in's thread; its answer, as a future now."""
        answer: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            try:
                work().add_done_callback(functools.partial(_pass_on, answer))
            except BaseException as err:  # noqa: BLE001 - the caller's RPC gets it
                answer.set_exception(err)

        self._work.submit(run)
        return answer

    def _refuse_if_frozen(self) -> None:
        if self.frozen:
            raise self._moved()

    def _moved(self) -> ShardMoved:
        return ShardMoved(f"server {self.shard}'s shard is handed back to its replacement")

    def freeze(self) -> tuple[list[torch.Tensor], list[dict]]:
        """Stop serving the shard (a replacement takes it back): once the requests queued before are done, every
        fetch and write-back is answered ``ShardMoved``, parked fetches included. Returns what the replacement
        needs to catch up: each space's row versions and count of rows written back by version (what a
        checkpoint's snapshot waits for)."""
        def freeze_now() -> tuple[list[torch.Tensor], list[dict]]:
            self.frozen = True
            for store in self.stores:
                store.fail_waiting(self._moved())
            versions = [torch.from_numpy(np.concatenate(
                [store.read_range(start, start + CHUNK_ROWS)[2] for start in range(0, store.num_rows, CHUNK_ROWS)]
                or [np.zeros(0, dtype=np.int64)])) for store in self.stores]
            return versions, [dict(store.received) for store in self.stores]

        return self._work.submit(freeze_now).result()  # after the work queued before it

    def unfreeze(self) -> None:
        """Serve the shard again (its replacement was lost while taking it back)."""
        self._work.submit(lambda: setattr(self, "frozen", False)).result()

    def before_snapshot(self) -> None:
        # A snapshot reads every row: the shard must be whole first. Its copy-on-write has begun meanwhile, and
        # a write-back here rebuilds its rows before they are overwritten, so what it keeps is right.
        self._rebuilder.join()

    def _rebuild(self) -> None:
        background_priority()
        try:
            for stand_in in self.stand_ins:
                while stand_in.rebuild():
                    pass
        except BaseException as err:  # noqa: BLE001 - a replacement waiting for the shard is told
            self.rebuilt.set_exception(err)
            raise
        self.rebuilt_after_s = time.perf_counter() - self.started
        self.rebuilt.set_result(None)
        log.info("shard %d rebuilt from its parity group in %.2f s (%d rows)", self.shard, self.rebuilt_after_s,
                 sum(stand_in.store.num_rows for stand_in in self.stand_ins))

    def dump(self) -> dict:
        return {**super().dump(), "rebuilt_after_s": self.rebuilt_after_s,
                "rows": sum(stand_in.store.num_rows for stand_in in self.stand_ins),
                "rows_reconstructed_on_demand": sum(stand_in.rows_reconstructed for stand_in in self.stand_ins)}


def _pass_on(to: torch.futures.Future, done: torch.futures.Future) -> None:
    try:
        to.set_result(done.value())
    except BaseException as err:  # noqa: BLE001 - handed on
        to.set_exception(err)


class RemoteMember:
    """A surviving member of a parity group as storage.parity.read_member reads one: by RPC."""

    def __init__(self, shard: int, space: int, *, num_rows: int, dim: int, state_width: int, epochs: Epochs) -> None:
        self.shard, self.space, self.epochs = shard, space, epochs
        self.num_rows, self.dim, self.state_width = num_rows, dim, state_width

    def read(self, local: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        rows, state, versions = self.epochs.call(World.server_name(self.shard), SERVER.read_rows,
                                                 (self.space, torch.from_numpy(np.asarray(local, dtype=np.int64))))
        return rows, state, versions.numpy()


class DeltaSender:
    """A data server's deltas to its group's parity server. A write-back is acknowledged once its delta has
    arrived there (``send``'s future). A delta that failed to a re-formation of the RPC world is sent again. If
    the parity server is lost, write-backs are acknowledged without it and their deltas dropped: the group has
    no redundancy until a replacement has made the parity again (a loss in it meanwhile is the checkpoints' to
    cover), and the replacement reads this server's rows in the new RPC world, after every such write-back, so
    its parity holds them all."""

    def __init__(self, parity_name: str, *, member: int, epochs: Epochs, timeout: float) -> None:
        self.parity_name, self.member, self.epochs, self.timeout = parity_name, member, epochs, timeout
        self.unprotected = 0  # write-backs acknowledged while the parity server was lost
        self._lost_in: int | None = None  # the epoch in which the parity server was found lost
        self._lock = threading.Lock()
        self._failed: queue.Queue = queue.Queue()
        threading.Thread(target=self._recover, name="deltas", daemon=True).start()

    def send(self, space: int, local: np.ndarray, delta: np.ndarray, before: np.ndarray,
             version: int) -> torch.futures.Future:
        """The delta of a write-back (under the store's lock: a row's deltas leave in order); a future that
        completes when the write-back may be acknowledged."""
        answer: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._lost_in is not None and self.epochs.epoch == self._lost_in:  # no parity server to send to
                self.unprotected += 1
                answer.set_result(None)
                return answer
        self._send((space, self.member, torch.from_numpy(local), torch.from_numpy(delta.view(np.int32)),
                    torch.from_numpy(before), version), answer)
        return answer

    def _send(self, entry: tuple, answer: torch.futures.Future) -> None:
        sent_in = self.epochs.epoch
        sent = SERVER.parity_apply.call_async(self.parity_name, entry, timeout=self.timeout)
        sent.add_done_callback(functools.partial(self._arrived, entry, answer, sent_in))

    def _arrived(self, entry: tuple, answer: torch.futures.Future, sent_in: int, sent: torch.futures.Future) -> None:
        try:
            sent.value()
        except BaseException as err:  # noqa: BLE001 - judged on the recovery thread (it may wait)
            self._failed.put((entry, answer, sent_in, err))
            return
        answer.set_result(None)

    def _recover(self) -> None:
        while True:
            entry, answer, sent_in, err = self._failed.get()
            if not isinstance(err, RuntimeError):  # the parity server's own error (raised there): the write-back's
                answer.set_exception(err)
                continue
            with self._lock:
                lost = self._lost_in is not None and sent_in == self._lost_in
            if not lost and self.epochs.resend_after(sent_in):
                self._send(entry, answer)
                continue
            with self._lock:
                if self._lost_in is None or self._lost_in < sent_in:
                    self._lost_in = sent_in
                    log.warning("the parity server %s is lost (%s): write-backs are acknowledged without parity "
                                "until its replacement has made it again", self.parity_name, str(err).splitlines()[0])
                self.unprotected += 1
            answer.set_result(None)


class ParityServer:
    """The parity of one group of data shards (a ParityRows per space), behind the RPC handlers below."""

    def __init__(self, parities: list[ParityRows], *, group: int, shards: list[int], epochs: Epochs) -> None:
        self.parities, self.group, self.shards, self.epochs = parities, group, shards, epochs
        self.messages = 0  # delta messages received (one per write-back of a member)
        self._counting = threading.Lock()
        self.checked: dict | None = None
        self.standing_in: StandInServer | None = None
        self.given_back: list[dict] = []  # the shards it stood in for that their replacements took back
        self.made_in_s: float | None = None  # a replacement's: how long making the parity from its group took

    def make(self, *, chunk_rows: int = CHUNK_ROWS) -> None:
        """A replacement's parity, made from its group's rows as they stand while they train: each member's rows
        read in chunks (bits and versions together) and installed; deltas arriving meanwhile wait for their row."""
        started = time.perf_counter()
        for space, parity in enumerate(self.parities):
            for member, shard in enumerate(self.shards):
                for start in range(0, parity.num_rows, chunk_rows):
                    stop = min(start + chunk_rows, parity.num_rows)
                    parity.install(member, start, *self._member_bits(space, shard, start, stop, width=parity.width))
        self.made_in_s = time.perf_counter() - started
        log.info("the parity of servers %s made from their rows in %.2f s (%d positions)",
                 ", ".join(map(str, self.shards)), self.made_in_s, sum(p.num_rows for p in self.parities))

    def stand_in(self, shard: int, *, job: JobInfo, num_shards: int, timeout: float) -> StandInServer:
        """Serve lost data shard ``shard`` of this group from now on (one loss per group: parity covers one)."""
        if self.standing_in is not None and self.standing_in.frozen and self.standing_in.shard == shard:
            self.handed_back(shard)  # its replacement took it back and was lost before this server let go
        if self.standing_in is not None:
            raise TwoLossesInAGroup(f"server {shard} lost while server {self.standing_in.shard} of the same parity "
                                    f"group is served by its parity server: parity covers one loss per group")
        if self.made_in_s is not None or not all(parity.complete() for parity in self.parities):
            # its counts of each member's write-backs (what a stand-in's snapshots wait for) begin at its making
            raise TwoLossesInAGroup(f"server {shard} lost after its group's parity server was replaced: this job's "
                                    f"replacement parity servers do not stand in (the checkpoints cover it)")
        config, layout = job.config, job.layout
        optimizer = make_row_optimizer(config.optimizer, lr=config.lr)
        member = self.shards.index(shard)
        stand_ins = []
        for space, parity in enumerate(self.parities):
            dim = layout.spaces[space].dim
            fresh = RowStore(layout=layout, space=space, optimizer=optimizer, seed=config.seed, shard=shard,
                             num_shards=num_shards)
            fresh.parity_sink = functools.partial(parity.apply, member)
            survivors = {index: RemoteMember(other, space, num_rows=shard_num_rows(layout, space, other, num_shards),
                                             dim=dim, state_width=optimizer.state_width(dim),
                                             epochs=self.epochs)
                         for index, other in enumerate(self.shards) if other != shard}
            stand_ins.append(StandIn(fresh, member=member, parity=parity, survivors=survivors, timeout=timeout))
        self.standing_in = StandInServer(stand_ins, shard=shard)
        log.warning("serving lost server %d's shard from its parity group; rebuilding it in the background", shard)
        return self.standing_in

    def serving(self, shard: int) -> StandInServer:
        if self.standing_in is None or self.standing_in.shard != shard:
            raise RuntimeError(f"the parity server of servers {', '.join(map(str, self.shards))} does not stand in "
                               f"for server {shard}")
        return self.standing_in

    def hand_over(self, shard: int) -> tuple[list[torch.Tensor], list[dict]]:
        """Stop serving lost shard ``shard`` (its replacement takes it back; see StandInServer.freeze)."""
        return self.serving(shard).freeze()

    def keep_standing_in(self, shard: int) -> None:
        """The replacement taking ``shard`` back was lost meanwhile: serve it again."""
        self.serving(shard).unfreeze()
        log.warning("serving server %d's shard again: its replacement was lost while taking it back", shard)

    def handed_back(self, shard: int) -> None:
        """``shard``'s replacement holds it and the route names it: let go of the rows (requests that still
        arrive are answered ``ShardMoved``)."""
        standing_in = self.serving(shard)
        figures = standing_in.dump()
        self.given_back.append({"shard": shard, "handed_back_after_s": round(time.perf_counter() -
                                                                              standing_in.started, 3),
                                 **{key: figures[key] for key in ("rebuilt_after_s", "rows",
                                                                  "rows_reconstructed_on_demand", "bytes_sent",
                                                                  "fetches", "fetches_waited", "rows_written")}})
        standing_in.stores, standing_in.stand_ins = [], []
        self.standing_in = None
        log.info("server %d's shard is back on its replacement: no longer served here", shard)

    def apply(self, space: int, member: int, local: torch.Tensor, delta: torch.Tensor, before: torch.Tensor,
              version: int) -> None:
        with self._counting:
            self.messages += 1
        self.parities[space].apply(member, local.numpy(), delta.numpy().view(np.uint32), before.numpy(), version)

    def check(self, *, timeout: float, chunk_rows: int = CHUNK_ROWS) -> dict:
        """Compare the parity with the XOR of its members' rows and their versions, read from them in chunks;
        the rows that differ, by space (none, unless a delta was lost or misapplied)."""
        mismatched = []
        for space, parity in enumerate(self.parities):
            wrong = 0
            for start in range(0, parity.num_rows, chunk_rows):
                stop = min(start + chunk_rows, parity.num_rows)
                expected = np.zeros((stop - start, parity.width), dtype=np.uint32)
                versions = np.full((stop - start, parity.k), -1, dtype=np.int64)
                for member, shard in enumerate(self.shards):
                    bits, versions[:, member] = self._member_bits(space, shard, start, stop, width=parity.width,
                                                                  timeout=timeout)
                    expected ^= bits
                bits, held = parity.read(np.arange(start, stop))
                wrong += int(np.count_nonzero((bits != expected).any(axis=1) | (held != versions).any(axis=1)))
            mismatched.append(wrong)
        self.checked = {"mismatched_rows": mismatched, "rows": [parity.num_rows for parity in self.parities]}
        return self.checked

    def _member_bits(self, space: int, shard: int, start: int, stop: int, *, width: int,
                     timeout: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Member ``shard``'s positions ``start:stop`` as the parity counts them: bits and versions, read together
        (from the stand-in here if this server serves that shard); zeros and -1 past a shorter member's end."""
        if self.standing_in is not None and shard == self.standing_in.shard:
            rows, state, have = self.standing_in.read_range(space, start, stop)
        else:
            rows, state, have = self.epochs.call(World.server_name(shard), SERVER.read_range, (space, start, stop),
                                                 timeout=timeout)
        bits = np.zeros((stop - start, width), dtype=np.uint32)
        versions = np.full(stop - start, -1, dtype=np.int64)
        bits[:len(rows)], versions[:len(rows)] = row_bits(rows, state), have.numpy()
        return bits, versions

    def dump(self) -> dict:
        standing_in = self.standing_in.dump() if self.standing_in is not None else {}
        served = {key: standing_in.get(key, 0) + sum(shard[key] for shard in self.given_back)
                  for key in ("bytes_sent", "fetches", "fetches_waited", "rows_written")}
        return {**served, "storage": {}, "peak_rss_bytes": peak_rss_bytes(), "cpu_s": cpu_seconds(),
                "parity": {"group": self.group, "shards": self.shards,
                           "deltas_applied": sum(p.deltas_applied for p in self.parities),
                           "messages": self.messages,
                           **({"made_in_s": round(self.made_in_s, 3)} if self.made_in_s is not None else {}),
                           "pending_rows": sum(p.pending_rows() for p in self.parities),
                           **({"check": self.checked} if self.checked is not None else {}),
                           **({"standing_in": {"shard": self.standing_in.shard,
                                               "rebuilt_after_s": standing_in["rebuilt_after_s"],
                                               "rows": standing_in["rows"],
                                               "rows_reconstructed_on_demand":
                                                   standing_in["rows_reconstructed_on_demand"]}}
                              if self.standing_in is not None else {}),
                           **({"handed_back": self.given_back} if self.given_back else {})}}


class ShardTakeOver:
    """A lost data server's replacement taking its shard back from the stand-in on its group's parity server,
    while training goes on there. ``copy``: once the stand-in has rebuilt the shard, every row is read from it in
    chunks (rows, state and versions, each chunk as it stands) into ``server``'s stores. ``take_over`` (once the
    stand-in is frozen: see StandInServer.freeze): the rows whose version moved since their chunk was read are
    read again (versions only grow: they are exactly the rows written meanwhile) and the write-back counts are
    taken over; from then on ``server`` is the shard's. ``source`` reads the stand-in: ``rebuilt()``,
    ``read_range(space, start, stop)`` and ``read_rows(space, local)`` (RemoteStandIn: by RPC)."""

    def __init__(self, server: Server, source, *, shard: int) -> None:
        self.server, self.source, self.shard = server, source, shard
        self.copied: list[np.ndarray] = [np.full(store.num_rows, -1, dtype=np.int64) for store in server.stores]
        self.copied_in_s: float | None = None

    def copy(self, *, chunk_rows: int = CHUNK_ROWS) -> None:
        started = time.perf_counter()
        self.source.rebuilt()  # (it may be rebuilding still: the replacement started as soon as the loss was known)
        for space, store in enumerate(self.server.stores):
            for start in range(0, store.num_rows, chunk_rows):
                rows, state, versions = self.source.read_range(space, start, start + chunk_rows)
                local = np.arange(start, start + len(rows), dtype=np.int64)
                store.put(local, rows, state, version=versions)
                self.copied[space][local] = versions
        self.copied_in_s = time.perf_counter() - started
        log.info("server %d's shard copied from its stand-in in %.2f s (%d rows)", self.shard, self.copied_in_s,
                 sum(store.num_rows for store in self.server.stores))

    def take_over(self, versions: list[np.ndarray], received: list[dict]) -> dict:
        """The frozen stand-in's row versions and counts of write-backs by version, per space: catch up."""
        started = time.perf_counter()
        again = 0
        for space, store in enumerate(self.server.stores):
            moved = np.flatnonzero(versions[space] != self.copied[space])
            for start in range(0, len(moved), CHUNK_ROWS):
                local = moved[start:start + CHUNK_ROWS]
                rows, state, have = self.source.read_rows(space, local)
                store.put(local, rows, state, version=have)
            again += len(moved)
            store.received = Counter({int(version): count for version, count in received[space].items()})
        log.info("server %d's shard taken back from its stand-in (%d rows written meanwhile read again in %.2f s)",
                 self.shard, again, time.perf_counter() - started)
        return {"copied_in_s": round(self.copied_in_s, 3), "rows_copied": sum(len(c) for c in self.copied),
                "rows_copied_again": again}


class RemoteStandIn:
    """The stand-in for ``shard`` on parity server ``name``, as ShardTakeOver reads it: by RPC."""

    def __init__(self, name: str, shard: int, *, epochs: Epochs, timeout: float) -> None:
        self.name, self.shard, self.epochs, self.timeout = name, shard, epochs, timeout

    def rebuilt(self) -> None:
        self.epochs.call(self.name, SERVER.stand_in_rebuilt, (self.shard,), timeout=10 * self.timeout)

    def read_range(self, space: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        rows, state, versions = self.epochs.call(self.name, SERVER.read_range, (space, start, stop))
        return rows, state, versions.numpy()

    def read_rows(self, space: int, local: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        # not sent again after a re-formation: the take-over is the oracle's to give up then
        rows, state, versions = SERVER.read_rows.call(self.name, (space, torch.from_numpy(local)), timeout=self.timeout)
        return rows, state, versions.numpy()


def storage_specs(config: TrainConfig, layout, *, num_shards: int, state_width) -> list[StorageSpec]:
    """Each space's storage on this server: the budget of ``--storage-budget-mb`` split among the spaces
    in proportion to the bytes of their shards."""
    if config.storage == "memory":
        return [StorageSpec() for _ in layout.spaces]
    bounded_heap()  # transient buffers go back to the system: the budget holds
    directory = storage_path(config.storage_dir, config.run_dir)
    shard_bytes = [(space.num_rows // num_shards + 1) * record_bytes(space.dim, state_width(space.dim))
                   for space in layout.spaces]
    budget = int(config.storage_budget_mb * 2**20)
    return [StorageSpec("disk", directory, budget * part // max(sum(shard_bytes), 1)) for part in shard_bytes]


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
        _send_deltas(self.taking_over.server, self.world, self.epochs)
        self.server, self.taking_over = self.taking_over.server, None
        return figures


def _pass_on_tagged(to: torch.futures.Future, tag: int, done: torch.futures.Future) -> None:
    """A fetch's answer: rows, state and versions, the request's ``tag`` and their digest (answer_digest)."""
    try:
        rows, state, versions = done.value()
        to.set_result((rows, state, versions, tag, answer_digest(rows, state, versions)))
    except BaseException as err:  # noqa: BLE001 - handed on (a ShardMoved included, as itself)
        to.set_exception(err)


def run_server(world: World, *, given: dict | None = None) -> None:
    """Serve one shard until the oracle says training has ended (a lost oracle is the heartbeats' to tell).

    ``given``: the settings this server's command line gave (an embedding size, table sizes), which
    the oracle agrees with every other role's at check-in. The same command started again for a server
    whose process was lost, while the oracle awaits its replacement, joins as that replacement.
    """
    store, world = check_in(world, "server", given=given)
    role, index = world.role
    liveness = Liveness(world, watch=[0])
    job = JobInfo.from_json(wait_for_job(world, store))
    world = job_world(world, job.config)
    handlers = ServerHandlers(world, job)  # served once whole (a request that comes sooner waits for it)
    liveness.recover = functools.partial(liveness.goes_on_without, replace_oracle=job.replace_oracle)
    config, layout = job.config, job.layout
    row_optimizer = make_row_optimizer(config.optimizer, lr=config.lr)
    started = time.perf_counter()
    if world.epoch:  # a replacement: ready before the RPC world is re-formed around it (training goes on)
        if index < world.num_shards:
            _replace_data_server(handlers, store, liveness, row_optimizer)
            return
        # the parity's structure first: its members' deltas arrive as soon as the RPC world has this process
        handlers.parity = parity = replacement_parity(world, job, index, row_optimizer, NoEpochs())
        transport.serve("server", handlers)
        epochs = join_rpc_as_replacement(world, store)
        if epochs is None:  # training ended before the job needed it
            liveness.stop()
            return
        handlers.epochs = parity.epochs = epochs
        parity.make()
        inject_fault("parity made")
        epochs.call("oracle", ORACLE.replaced, (world.rank, {"made_in_s": parity.made_in_s}))
        serve_until_stopped(handlers, store, liveness, stores=[])
        return
    init_rpc(world, store)
    handlers.epochs = epochs = Epochs(world, store)
    if index >= world.num_shards:
        handlers.parity = parity = start_parity(world, job, index, row_optimizer, epochs)
        transport.serve("server", handlers)
        log.info("server %d holds the parity of servers %s (%d positions); ready in %.1f s", index,
                 ", ".join(map(str, parity.shards)), sum(p.num_rows for p in parity.parities),
                 time.perf_counter() - started)
        serve_until_stopped(handlers, store, liveness, stores=[])
        return
    specs = storage_specs(config, layout, num_shards=world.num_shards, state_width=row_optimizer.state_width)
    server = Server(_shard_stores(world, job, row_optimizer, specs))
    if job.resume:
        directory, chain = resume_chain(config.run_dir, job.resume)
        server.restore(directory, chain, shard=index, num_shards=world.num_shards)
    if world.parity:
        _send_deltas(server, world, epochs)
    handlers.server = server
    transport.serve("server", handlers)
    where = "in memory" if specs[0].kind == "memory" else (f"on disk in {specs[0].directory}, "
                                                           f"{config.storage_budget_mb:g} MiB of it in memory")
    log.info("server %d holds %d rows (of %d) %s; ready in %.1f s", index, sum(st.num_rows for st in server.stores),
             layout.num_rows, where, time.perf_counter() - started)
    serve_until_stopped(handlers, store, liveness, stores=server.stores)


def _shard_stores(world: World, job: JobInfo, row_optimizer, specs: list[StorageSpec]) -> list[RowStore]:
    """This data server's shard of every space, initialised from the seed, where ``specs`` say."""
    return [RowStore(layout=job.layout, space=s, optimizer=row_optimizer, seed=job.config.seed,
                     shard=world.role[1], num_shards=world.num_shards, storage=spec) for s, spec in enumerate(specs)]


def _send_deltas(server: Server, world: World, epochs: Epochs) -> None:
    """Erasure coding: ``server``'s write-backs' deltas go to its group's parity server."""
    index = world.role[1]
    server.send_deltas_to(World.server_name(world.parity_server(index)), member=index % world.parity, epochs=epochs,
                          timeout=world.timeout)


def _replace_data_server(handlers: ServerHandlers, store, liveness: Liveness, row_optimizer) -> None:
    """A lost data server's replacement: its stores made first (so it is ready before the RPC world is re-formed
    around it), then its shard copied from the stand-in while training goes on; the oracle then has the stand-in
    hand the shard over (``ServerHandlers.take_over``) and routes it here again."""
    world, job = handlers.world, handlers.job
    index = world.role[1]
    specs = storage_specs(job.config, job.layout, num_shards=world.num_shards, state_width=row_optimizer.state_width)
    stores = _shard_stores(world, job, row_optimizer, specs)
    epochs = join_rpc_as_replacement(world, store)
    if epochs is None:  # training ended before the job needed it
        liveness.stop()
        for row_store in stores:
            row_store.close()
        return
    handlers.epochs = epochs
    transport.serve("server", handlers)  # (its shard's requests answered with ShardMoved until it takes it back)
    source = RemoteStandIn(World.server_name(world.parity_server(index)), index, epochs=epochs, timeout=world.timeout)
    taking_over = ShardTakeOver(Server(stores), source, shard=index)
    taking_over.copy()
    handlers.taking_over = taking_over
    inject_fault("shard copied")
    epochs.call("oracle", ORACLE.ready_to_take_over, (world.rank,))
    serve_until_stopped(handlers, store, liveness, stores=stores)


def serve_until_stopped(handlers: ServerHandlers, store, liveness: Liveness, *, stores: list[RowStore]) -> None:
    """Tell the oracle this server is ready, then serve until it says training has ended (its fetches parked for
    longer than the timeout failed meanwhile: those of ``stores``, or of the shard a parity server stands in for).
    A request to a lost oracle that the job replaces waits for its replacement."""
    world, epochs = handlers.world, handlers.epochs
    if handlers.job.replace_oracle:
        epochs.await_peer("oracle")
    epochs.call("oracle", ORACLE.server_ready, (world.name,))
    try:
        while not store.check([STOP_KEY]):
            time.sleep(0.2)
            standing_in = handlers.parity.standing_in if handlers.parity is not None else None
            for row_store in stores or (standing_in.stores if standing_in is not None else []):
                row_store.expire_waiting(timeout=world.timeout)
    except RuntimeError as err:
        if transport.peer_gone(err):  # the store's host, the oracle, has ended: the heartbeats name it
            liveness.await_verdict(err)
        raise
    epochs.stop()
    liveness.stop()
    transport.shutdown_rpc()  # the oracle has all it needs: no request is in flight
    for row_store in stores:
        row_store.close()


def replacement_parity(world: World, job: JobInfo, index: int, row_optimizer, epochs: Epochs) -> ParityServer:
    """A lost parity server's replacement: its parity empty, to be made (``ParityServer.make``) from its group's
    rows while they train."""
    layout, group = job.layout, index - world.num_shards
    shards = world.parity_group(group * world.parity)
    parities = []
    for space in range(len(layout.spaces)):
        dim = layout.spaces[space].dim
        parities.append(ParityRows.empty(
            num_rows=max(shard_num_rows(layout, space, shard, world.num_shards) for shard in shards),
            width=dim + row_optimizer.state_width(dim), k=len(shards)))
    return ParityServer(parities, group=group, shards=shards, epochs=epochs)


def start_parity(world: World, job: JobInfo, index: int, row_optimizer, epochs: Epochs) -> ParityServer:
    """The parity server of group ``index - num_shards``: the parity of its members as they start (from the
    seed, or restored from the checkpoint being resumed)."""
    config, layout = job.config, job.layout
    group = index - world.num_shards
    shards = world.parity_group(group * world.parity)
    if job.resume:  # the members as restored, held here while their parity is made
        directory, chain = resume_chain(config.run_dir, job.resume)
        members = []
        for shard in shards:
            member = Server([RowStore(layout=layout, space=s, optimizer=row_optimizer, seed=config.seed,
                                      shard=shard, num_shards=world.num_shards) for s in range(len(layout.spaces))])
            member.restore(directory, chain, shard=shard, num_shards=world.num_shards)
            members.append(member)
        parities = [ParityRows.of([member.stores[space] for member in members])
                    for space in range(len(layout.spaces))]
        del members
    else:
        parities = [ParityRows.initial(layout, space, shards=shards, num_shards=world.num_shards,
                                       state_width=row_optimizer.state_width(layout.spaces[space].dim),
                                       seed=config.seed) for space in range(len(layout.spaces))]
    return ParityServer(parities, group=group, shards=shards, epochs=epochs)
