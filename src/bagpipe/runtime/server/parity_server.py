"""A parity server: the parity of one group of data shards, and the stand-in it becomes for a lost member."""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from bagpipe.train.checkpoints import background_priority, resume_chain
from bagpipe.optim import make_row_optimizer
from bagpipe.runtime.endpoints import SERVER
from bagpipe.runtime.protocol import JobInfo
from bagpipe.runtime.server.data_server import CHUNK_ROWS, Server, shard_keys_of
from bagpipe.runtime.world import Epochs, ShardMoved, World
from bagpipe.timing import cpu_seconds, peak_rss_bytes
from bagpipe.storage import RowStore
from bagpipe.storage.bits import row_bits
from bagpipe.storage.parity import ParityRows, StandIn, TwoLossesInAGroup
from bagpipe.storage.rowstore import shard_num_rows

log = logging.getLogger(__name__)

class ParityServer:
    """The parity of one group of data shards (a ParityRows per space), behind server/handlers.py's handlers."""

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
            # (raw ids too made from the seed: every row is rebuilt from the parity before it is read)
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
    if job.resume:  # the members as restored (every row: a made one's initial value never shows), held here while
        # their parity is made
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
        keys_of = shard_keys_of(job, epochs)  # (raw ids: each member's rows made from their keys)
        parities = [ParityRows.initial(layout, space, shards=shards, num_shards=world.num_shards,
                                       state_width=row_optimizer.state_width(layout.spaces[space].dim),
                                       seed=config.seed, keys_of=keys_of and functools.partial(keys_of, space))
                    for space in range(len(layout.spaces))]
    return ParityServer(parities, group=group, shards=shards, epochs=epochs)
