"""Lost processes the job goes on without: each loss judged, a replacement asked for and awaited, a lost data
server's shard served by its parity server's stand-in and later taken back by its replacement.

The heartbeats (runtime/liveness.py) hand the oracle every peer they find lost (``lose_peer``). A trainer that has
reported done is no longer needed; a lost trainer is replaced while the others wait in their gradient sums
(runtime/trainer/recovery.py); a lost data server's shard moves to its group's parity server at once, and a
replacement process copies it back; a lost parity server's replacement makes the parity again. A replacement is
asked for by naming a new epoch of the RPC world for the lost rank in the store (``REPLACE_PREFIX``: the local
launcher starts one; elsewhere the same command started again joins as it), and the world is re-formed around it
once it is ready. Every loss is a ``succession.Failure`` in the job's record, which a replacement oracle and the
launcher read.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from bagpipe.runtime.endpoints import SERVER
from bagpipe.runtime.names import EPOCH_KEY, JOINING_PREFIX, REPLACE_PREFIX, SERVER_BACK, SERVER_LOST, TRAINER_LOST
from bagpipe.runtime.succession import Failure
from bagpipe.runtime.world import World

if TYPE_CHECKING:
    from bagpipe.runtime.oracle.service import Oracle

log = logging.getLogger(__name__)


class Replacements:
    """The oracle's losses and replacements, for ``oracle`` (whose record keeps ``failures``): ``replacing`` maps
    the rank of each lost process being replaced to its failure record."""

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle
        self.config, self.world, self.job, self.state = oracle.config, oracle.world, oracle.job, oracle.state
        self.store, self.epochs, self.run, self.liveness = oracle.store, oracle.epochs, oracle.run, oracle.liveness
        self.routes, self.checkpoints, self.feed = oracle.routes, oracle.checkpoints, oracle.feed
        self.failures: list[Failure] = oracle.keeper.record.failures  # lost roles the job went on without
        self.replacing: dict[int, Failure] = {}
        self.helpers: list[threading.Thread] = []  # replacements awaited, shards taken over (``_helper``)

    def lose_peer(self, rank: int, *, store) -> bool:
        """A lost peer (``rank``); True if the job goes on without it: a trainer that has reported done (every
        row it wrote is back on the servers) is no longer needed; a data server may be covered by parity."""
        role, index = self.world.role_of(rank)
        if role == "trainer":
            with self.state.changed:
                reported = index in self.state.done
            if reported:
                log.warning("trainer %d ended after reporting done: the job no longer needs it", index)
                return True
            return self.job.replace_trainers and self._replace_trainer(rank, index)
        return self.lose_server(rank, store=store)

    def _replace_trainer(self, rank: int, index: int) -> bool:
        """A lost trainer: have a replacement made, which adds its shares to the sums that failed with it and takes a
        survivor's state (runtime/trainer/recovery.py ``replace_lost``) while the survivors wait in their sums. False
        when the RPC world cannot be re-formed (the job then restarts from its newest checkpoint)."""
        if self.replacing:
            return False  # another replacement is under way: the survivors' sums could not be done again
        failure = Failure(role=f"trainer {index}", trainer=index, rank=rank, planned_iteration=self.feed.planned,
                          at=time.time())
        if not self._ask_for_replacement(rank, failure):
            return False
        self.failures.append(failure)
        self.oracle.save_record()
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
        with self.state.changed:
            earlier = self.replacing.get(rank)
        failure = Failure(role=f"server {shard}", server=shard, rank=rank, parity_server=parity_server,
                          planned_iteration=self.feed.planned, at=time.time())
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
        self.oracle.save_record()
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
                          planned_iteration=self.feed.planned, at=time.time())
        # (a replacement for this rank lost before it was whole is replaced in turn: its group's rows are all there)
        if not self._ask_for_replacement(rank, failure):
            return False
        self.failures.append(failure)
        self.oracle.save_record()
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
        with self.state.changed:
            reported = bool(self.state.done)
        if gone or reported:
            why = (f"{', '.join(self.world.label(r) for r in gone)} gone for good" if gone
                   else "a trainer has left the job")
            log.warning("%s lost: no replacement, since the RPC world cannot be re-formed (%s)",
                        self.world.label(rank), why)
            return False
        failure.epoch = epoch = self.epochs.announced() + 1
        earlier = self.replacing.pop(rank, None)
        if earlier is not None:
            earlier.replaced = False  # its replacement was lost too, before it was whole: this one takes over
        self.replacing[rank] = failure
        self.oracle.save_record()
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
                if self.replacing.get(rank) is not failure or self.state.stop.is_set():  # lost too (a later one is
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
            self.liveness.readmit(rank)
            # a trainer that has reported leaves the RPC world: announced before, it takes part
            with self.state.changed:
                if self.replacing.get(rank) is not failure:
                    return
                if self.state.done:
                    log.warning("the replacement for %s is ready after training ended: the job does not need it",
                                self.world.label(rank))
                    return
                self.store.set(EPOCH_KEY, str(epoch))
            log.info("a replacement for %s (rank %d) is ready after %.2f s: the RPC world is re-formed around it "
                     "(epoch %d)", self.world.label(rank), rank, time.perf_counter() - started, epoch)
        except BaseException as err:  # noqa: BLE001 - the job cannot go on: its trainers' next pull says why
            self.state.fail(err)

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
                with self.state.changed:  # at once: the replacement lost from now on is a loss of the shard again
                    self.routes.move(self.store, shard, shard)
                    self.replaced(rank, {**figures, "handover_s": time.perf_counter() - started})
                self.run.log_metrics(event=SERVER_BACK, server=shard, rank=rank)
                self.epochs.call(parity, SERVER.handed_back, (shard,))
        except BaseException as err:  # noqa: BLE001 - the job cannot go on: its trainers' next pull says why
            self.state.fail(err)

    def replaced(self, rank: int, info: dict) -> None:
        """The replacement for ``rank`` has made what it holds (an RPC handler)."""
        failure = self.replacing.pop(rank)
        failure.replaced, failure.recovered_in_s = True, round(time.time() - failure.at, 3)
        # (a new dict, not updated in place: another thread's save_record may be serialising the old one)
        failure.figures = {**failure.figures, **{key: round(value, 3) for key, value in info.items()}}
        self.oracle.save_record()
        if self.world.role_of(rank) == ("trainer", 0):  # its checkpoint parts sent before its loss may be lost
            self.checkpoints.cache_parts_lost(before=info["at_iteration"])
        log.info("%s (rank %d) is replaced and whole again, %.2f s after it was lost", self.world.label(rank), rank,
                 failure.recovered_in_s)
