"""Heartbeats: every role beats in the job's store once a second (four times per liveness window where that is
shorter: ``World.beat_s``) and watches the peers it waits on.

A peer whose beat stops for ``world.liveness_s`` is stopped, hung or gone, however long its
iterations take; so is the oracle when the store it hosts stops answering. The watcher names it
by role and rank (``lost trainer 1 (rank 2): ...``) and the role ends, recording the peer's rank in its
exit status (runtime/exit_status.py: what the local launcher blames from), or, once the job no longer
needs that peer, only warns.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable

from bagpipe.runtime.exit_status import ExitStatus, PeerLost, record_exit
from bagpipe.runtime.names import BEAT_PREFIX, EXITED_PREFIX, JOINING_PREFIX, LEFT_PREFIX, REPLACE_PREFIX
from bagpipe.runtime.world import World, connect_store, store_served_apart, uses_agent_store

log = logging.getLogger(__name__)

LOST_EXIT_CODE = 3  # a role that ends because a peer was lost: the peer, not this role, failed
NOT_RECOVERED = "it could not be recovered from"  # in a lost peer's message: why the job cannot go on without it


def exit_on_lost(lost: PeerLost) -> None:
    """What a role process does when a peer it needs is lost: say so, record whom, and end at once."""
    log.error("%s", lost.message)
    record_exit(ExitStatus.lost(lost))
    logging.shutdown()
    os._exit(LOST_EXIT_CODE)


def end_as_lost(reason: str) -> None:
    """End this process as a killed one ends (SIGKILL: no exit status): a part of it that it cannot replace in place
    was lost (the oracle's numbering process, planner/ahead.py). Whoever replaces a killed role then replaces it:
    the local launcher, or the same command started again by hand."""
    log.error("%s", reason)
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)


class Liveness:
    """This role's heartbeat, and its watch over ``watch`` (ranks; each watched once it first beats).

    Two threads: one beats and reads the peers' beats through a store client of its own (its calls
    block while the store's host is stopped); the other judges, so it can tell that too.
    """

    def __init__(self, world: World, *, watch: list[int], on_lost: Callable[[PeerLost], None] = exit_on_lost) -> None:
        self.world = world
        self.watch = [rank for rank in watch if rank != world.rank]
        self.on_lost = on_lost
        self.fatal = True  # False once the job no longer needs its peers: a lost one is only a warning
        # (the oracle's) a lost peer the job can go on without: recover(rank) is True once it is taken care of
        self.recover: Callable[[int], bool] | None = None
        self.lost: set[int] = set()
        self.left: set[int] = set()
        self._exited: dict[int, str] = {}  # rank -> how it ended, as its launcher saw it: judged lost at once
        self._returning: set[int] = set()  # lost ranks whose replacement is awaited (``await_return``)
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (beat count, when it last changed)
        self._answered = time.monotonic()  # the store's last answer
        self._asking_since: float | None = None
        self._stop = threading.Event()
        self._store = connect_store(world, timeout=world.timeout)
        for target, name in ((self._beat, "heartbeat"), (self._judge, "liveness")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def adopt(self, world: World) -> None:
        """Judge by the job's ``world`` (its liveness window: job_world) from now on."""
        self.world = world

    def stop(self) -> None:
        """Stop beating and say so (peers stop watching this role), once its part of the job is done."""
        self._stop.set()
        self._store.set(f"{LEFT_PREFIX}{self.world.rank}", "1")

    def readmit(self, rank: int) -> None:
        """``rank`` was lost and a replacement process holds it now: watch it afresh (judged once it beats)."""
        self._store.delete_key(f"{EXITED_PREFIX}{rank}")
        self._exited.pop(rank, None)
        self._seen.pop(rank, None)
        self.left.discard(rank)
        self.lost.discard(rank)

    def goes_on_without(self, rank: int, *, replace_oracle: bool, replace_trainers: bool = False) -> bool:
        """(A trainer's or server's ``recover``) Whether this role goes on through the loss of ``rank``: a lost
        oracle the job replaces (awaited: ``await_return``), or, for a trainer, a lost peer trainer the oracle
        replaces (its sums wait for the replacement)."""
        if rank == 0:
            if replace_oracle:
                self.await_return(0, within=self.world.replacement_s)
            return replace_oracle
        return replace_trainers and self.world.role_of(rank)[0] == "trainer"

    def await_return(self, rank: int, *, within: float) -> None:
        """Lost ``rank`` is being replaced (a lost oracle, whose replacement the local launcher starts): watch it
        again once its replacement says it is ready (``bagpipe/joining/RANK``), or take it as lost for good
        (``on_lost``) if none is within ``within`` seconds. Returns at once; a thread waits."""
        if rank in self._returning:
            return
        self._returning.add(rank)
        threading.Thread(target=self._await_return, args=(rank, within), name="awaiting", daemon=True).start()

    def _await_return(self, rank: int, within: float) -> None:
        deadline = time.monotonic() + within
        store = connect_store(self.world, timeout=self.world.timeout)  # (this thread's own client)
        while not self._stop.is_set():
            if store.check([f"{JOINING_PREFIX}{rank}"]):
                self._returning.discard(rank)
                self.readmit(rank)
                log.info("%s (rank %d) has a replacement: watched again", self.world.label(rank), rank)
                return
            if time.monotonic() > deadline:
                self._returning.discard(rank)
                if self.fatal:
                    self.on_lost(PeerLost(message=f"lost {self.world.label(rank)} (rank {rank}): no replacement "
                                                  f"joined within {within:.0f} s", peer=rank))
                return
            time.sleep(0.1)

    def wait_until_gone(self, ranks: list[int], *, timeout: float) -> list[int]:
        """Wait until each of ``ranks`` has left or is lost; return those still there after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            waiting = [r for r in ranks if r not in self.left and r not in self.lost]
            if not waiting:
                return []
            time.sleep(0.1)
        return [r for r in ranks if r not in self.left and r not in self.lost]

    def await_verdict(self, symptom: BaseException) -> None:
        """A collective or a request failed because a peer ended (``symptom``): let the heartbeats name which peer
        (``on_lost`` ends this process), waiting at most the liveness window; if none is named by
        then, end as a lost peer anyway, quoting the symptom."""
        if not self.fatal:
            return
        deadline = time.monotonic() + self.world.liveness_s + 2 * self.world.beat_s + 1.0
        log.warning("a peer is gone (%s): waiting for the heartbeats to name it", str(symptom).splitlines()[0])
        while time.monotonic() < deadline and not self.lost:
            time.sleep(0.1)
        self.on_lost(PeerLost(message=f"lost a peer: {str(symptom).splitlines()[0]}"))

    def _beat(self) -> None:
        try:
            self._beat_until_stopped()
        except (RuntimeError, OSError) as err:  # the store's connection broke
            if not self._stop.is_set():
                where = f"{self.world.master_addr}:{self.world.master_port}"
                self._lose(0, f"lost the oracle (rank 0): the job's store at {where} failed: {err}",
                           recoverable=False)

    def _beat_until_stopped(self) -> None:
        key = f"{BEAT_PREFIX}{self.world.rank}"
        replacing = f"{REPLACE_PREFIX}{self.world.rank}"
        while not self._stop.is_set():
            self._asking_since = time.monotonic()
            self._store.add(key, 1)
            if self._store.check([replacing]) and int(self._store.get(replacing)) > self.world.epoch:
                # taken for lost while cut off (a link down longer than the liveness window, a pause) and back: a
                # replacement is asked for, so this process must not go on beside it; ended as a killed one is
                # ended, it is replaced as one (the local launcher; elsewhere, its command started again)
                end_as_lost(f"{self.world.label(self.world.rank)} (rank {self.world.rank}) was taken for lost (its "
                            f"heartbeat did not reach the job's store for the liveness window, "
                            f"{self.world.liveness_s:g} s) and the job asks for its replacement: ending so that the "
                            f"replacement takes its place")
            for rank in self.watch:
                if rank in self.left or rank in self.lost:
                    continue
                if self._store.check([f"{LEFT_PREFIX}{rank}"]):
                    self.left.add(rank)
                    continue
                if rank not in self._exited and self._store.check([f"{EXITED_PREFIX}{rank}"]):
                    self._exited[rank] = self._store.get(f"{EXITED_PREFIX}{rank}").decode()
                count = self._store.add(f"{BEAT_PREFIX}{rank}", 0)
                if count and count != self._seen.get(rank, (0, 0.0))[0]:
                    self._seen[rank] = (count, time.monotonic())
            self._answered, self._asking_since = time.monotonic(), None
            self._stop.wait(self.world.beat_s)

    def _judge(self) -> None:
        while not self._stop.wait(self.world.beat_s / 2):
            limit = self.world.liveness_s  # (the job's, once adopted)
            now = time.monotonic()
            asking = self._asking_since
            if asking is not None and now - asking > limit:
                self._lose(0, self._store_silent(now - asking), recoverable=False)
                return
            for rank, how in list(self._exited.items()):
                if rank not in self.left and rank not in self.lost:
                    self._lose(rank, f"lost {self.world.label(rank)} (rank {rank}): its process ended ({how})")
            if now - self._answered > 2 * self.world.beat_s + 1.0:
                continue  # this process's own view is stale (starved or busy): judge no one on it
            for rank, (_, changed) in list(self._seen.items()):
                # Silence is counted over reads the store answered: a peer whose beats stopped reaching a store
                # that then stopped answering (its host stopped) is not blamed for the store's silence.
                silent = self._answered - changed
                if rank not in self.left and rank not in self.lost and silent > limit:
                    self._lose(rank, f"lost {self.world.label(rank)} (rank {rank}): no heartbeat for "
                                     f"{silent:.0f} s: it is stopped, hung or gone")

    def _store_silent(self, seconds: float) -> str:
        where = f"{self.world.master_addr}:{self.world.master_port}"
        if uses_agent_store():
            return f"lost the job's store at {where} (torchrun's agent): no answer for {seconds:.0f} s"
        if store_served_apart():
            return f"lost the job's store at {where} (served apart from the oracle): no answer for {seconds:.0f} s"
        return (f"lost the oracle (rank 0): the job's store it serves at {where} has not answered for "
                f"{seconds:.0f} s: it is stopped, hung or gone, or the network to it is down")

    def _lose(self, rank: int, message: str, *, recoverable: bool = True) -> None:
        """``recoverable``: False when the store itself failed (nothing can be replaced without it)."""
        self.lost.add(rank)
        if not self.fatal:
            log.warning("%s (the job no longer needs it)", message)
            return
        log.warning("%s", message)
        not_recovered = False
        try:
            recovered = recoverable and self.recover is not None and self.recover(rank)
        except Exception as err:  # noqa: BLE001 - why it could not be recovered ends the role below
            message, not_recovered = f"{message}; {NOT_RECOVERED}: {err}", True
            recovered = False
        if not recovered:
            self.on_lost(PeerLost(message=message, peer=rank, not_recovered=not_recovered))
