"""Replacement processes, while training goes on: a lost parity server's replacement makes the parity from its
group's rows as they stand (deltas arriving meanwhile wait for their row, or are no-ops where the row read holds them
already); a lost data server's replacement copies its shard from the stand-in while it is written back to, then
takes it back (the stand-in frozen, the rows written meanwhile read again). The job's RPC world is re-formed around
each (runtime.world.Epochs), and the job ends bit for bit as without the loss, its parity equal to its group."""


import numpy as np
import pytest
import torch

from bagpipe.storage.parity import ParityRows
from helpers.layouts import member_bits, members


def _write_backs(stores, rng, versions, sink):
    for version in versions:
        for index, store in enumerate(stores):
            store.parity_sink = lambda local, delta, before, v, index=index: sink((index, local, delta, before, v))
            local = rng.choice(store.num_rows, size=int(rng.integers(1, 12)), replace=False)
            keys = local * 3 + index
            store.write_back(keys, torch.from_numpy(rng.standard_normal((len(keys), 4)).astype(np.float32)),
                             torch.from_numpy(rng.standard_normal((len(keys), 9)).astype(np.float32)), version=version)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_parity_made_while_its_members_train_equals_the_parity_of_their_rows(seed):
    """Chunks of each member installed between write-backs; the deltas of write-backs before a chunk was read
    (kept while the parity server was lost, sent late, some twice) and after it (some before their row is
    installed), in shuffled order: the made parity is the XOR of the members' rows, versions too."""
    rng = np.random.default_rng(seed)
    stores = members()
    early: list = []
    _write_backs(stores, rng, range(10), early.append)  # while no parity server was there: kept
    num_rows = max(store.num_rows for store in stores)
    parity = ParityRows.empty(num_rows=num_rows, width=13, k=3)
    late: list = []
    chunks = [(index, start) for index in range(3) for start in range(0, num_rows, 16)]
    for step, (index, start) in enumerate(rng.permutation(chunks)):
        _write_backs(stores, rng, [10 + step], late.append)
        store = stores[index]
        bits, versions = member_bits(store)
        stop = min(start + 16, num_rows)
        chunk_bits = np.zeros((stop - start, 13), dtype=np.uint32)
        held = np.full(stop - start, -1, dtype=np.int64)
        mine = max(min(stop, store.num_rows) - start, 0)
        chunk_bits[:mine], held[:mine] = bits[start:start + mine], versions[start:start + mine]
        parity.install(int(index), int(start), chunk_bits, held)
        for i in rng.permutation(len(late))[: len(late) // 2]:  # some deltas arrive while chunks go in
            parity.apply(*late[i])
    assert parity.complete()
    deltas = early + late
    for i in [*rng.permutation(len(deltas)), *rng.choice(len(deltas), size=20)]:
        parity.apply(*deltas[i])
    assert parity.pending_rows() == 0
    expected = ParityRows.of(stores)
    assert (parity.bits == expected.bits).all() and (parity.versions == expected.versions).all()


def test_a_delta_for_a_row_not_installed_waits_for_it():
    stores = members("sgd")
    parity = ParityRows.empty(num_rows=max(s.num_rows for s in stores), width=4, k=3)  # SGD: no state
    deltas: list = []
    for index, store in enumerate(stores):  # the rows as they start
        bits, versions = member_bits(store)
        full = np.zeros((parity.num_rows, 4), dtype=np.uint32)
        held = np.full(parity.num_rows, -1, dtype=np.int64)
        full[:store.num_rows], held[:store.num_rows] = bits, versions
        if index:
            parity.install(index, 0, full, held)
        else:
            first = (full, held)
    stores[0].parity_sink = lambda *entry: deltas.append((0, *entry))
    stores[0].write_back(np.array([0, 3]), torch.ones(2, 4), torch.zeros(2, 0), version=0)
    parity.apply(*deltas[0])
    assert parity.pending_rows() == 2 and not parity.complete()  # member 0's rows are not there yet
    parity.install(0, 0, *first)  # read before the write-back: the delta then folds in
    assert parity.pending_rows() == 0
    expected = ParityRows.of(stores)
    assert (parity.bits == expected.bits).all() and (parity.versions == expected.versions).all()


class _TrainedWhileRead:
    """A stand-in's store as a replacement reads it (ShardTakeOver's source), written back to between reads."""

    def __init__(self, store, rng) -> None:
        self.store, self.rng, self.version = store, rng, 0

    def write(self, count: int = 1) -> None:
        for _ in range(count):
            local = self.rng.choice(self.store.num_rows, size=int(self.rng.integers(1, 12)), replace=False)
            self.store.write_back(local * 3 + 1, torch.from_numpy(self.rng.standard_normal((len(local), 4))
                                                                  .astype(np.float32)),
                                  torch.from_numpy(self.rng.standard_normal((len(local), 9)).astype(np.float32)),
                                  version=self.version)
            self.version += 1

    def rebuilt(self) -> None:
        pass

    def read_range(self, space, start, stop):
        self.write(int(self.rng.integers(0, 3)))  # training goes on between the chunks
        rows, state, versions = self.store.read_range(start, stop)
        return torch.from_numpy(rows), torch.from_numpy(state), versions

    def read_rows(self, space, local):
        return self.store.read(local)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_shard_copied_while_it_is_written_back_to_is_taken_over_bit_for_bit(seed):
    """A replacement copies a stand-in's shard in chunks while write-backs land there between the reads; once
    the stand-in is frozen, its versions and counts bring the copy level: rows, optimizer state, versions and
    write-back counts equal the stand-in's, and a write-back sent again to the replacement is a no-op."""
    from bagpipe.runtime.server.data_server import Server
    from bagpipe.runtime.server.takeover import ShardTakeOver

    rng = np.random.default_rng(seed)
    source = _TrainedWhileRead(members()[1], rng)
    source.write(20)  # before the replacement started
    replacement = Server([members()[1]])
    taking_over = ShardTakeOver(replacement, source, shard=1)
    taking_over.copy(chunk_rows=8)
    source.write(5)  # after the copy, before the freeze
    frozen = source.store.read_range(0, source.store.num_rows)
    figures = taking_over.take_over([frozen[2]], [dict(source.store.received)])
    assert figures["rows_copied"] == source.store.num_rows and figures["rows_copied_again"] > 0
    mine = replacement.stores[0]
    for got, want in zip(mine.read_range(0, mine.num_rows), frozen):
        assert np.array_equal(got.view(np.uint32) if got.dtype == np.float32 else got,
                              want.view(np.uint32) if want.dtype == np.float32 else want)
    assert mine.received == source.store.received
    # a write-back the stand-in had, sent again to the replacement (its answer lost): left alone, not counted
    row = int(np.flatnonzero(frozen[2] == source.version - 1)[0])
    mine.write_back(np.array([row * 3 + 1]), torch.full((1, 4), 7.0), torch.zeros(1, 9), version=source.version - 1)
    assert np.array_equal(mine.read_range(row, row + 1)[0], frozen[0][row:row + 1])
    assert mine.received == source.store.received


def test_an_answer_the_rpc_agent_takes_while_it_is_shut_down_fails_at_once():
    """A re-formation fails the answers the old RPC agent waits on before shutting it down, and those of requests
    it still takes until then at once: none is left to complete later on the dead agent (whose callback would
    run then); after ``reopen`` answers pass on again."""
    from bagpipe.runtime.transport import AgentAnswers

    answers = AgentAnswers()
    before, done = torch.futures.Future(), torch.futures.Future()
    waiting, answered = answers.answer(before), answers.answer(done)
    done.set_result(("rows", 1))
    assert answered.wait() == ("rows", 1) and not waiting.done()
    answers.leave(1)
    taken_meanwhile = answers.answer(torch.futures.Future())
    for failed in (waiting, taken_meanwhile):
        assert failed.done()
        with pytest.raises(RuntimeError, match="re-formed"):
            failed.wait()
    before.set_result("late")  # completed after the re-formation: not passed on
    answers.reopen()
    later = torch.futures.Future()
    proxy = answers.answer(later)
    later.set_exception(ValueError("the handler's own error"))
    with pytest.raises(ValueError, match="own error"):
        proxy.wait()


def test_a_fetch_answered_with_rows_older_than_asked_for_is_refused():
    """Fetch answers carry their rows' versions and echo their request's tag; a row older than the plan asked for,
    or another request's answer (a fault that would leave the reference's path silently) stops training with the
    key and versions named; newer is a resume's."""
    from bagpipe.runtime.trainer.runtime import check_fetched

    keys, wanted = torch.tensor([3, 7, 11]), torch.tensor([4, 9, -1])
    check_fetched(0, keys, wanted, 5, torch.tensor([4, 9, -1]), 5, server=1, iteration=10)
    check_fetched(0, keys, wanted, 5, torch.tensor([5, 12, 3]), 5, server=1, iteration=10)  # restored later on
    with pytest.raises(RuntimeError, match=r"server 2 answered a fetch of space 1 with 1 rows older than asked for "
                                           r"\(first: key 7 at version 8, asked for 9\)"):
        check_fetched(1, keys, wanted, 5, torch.tensor([4, 8, -1]), 5, server=2, iteration=10)
    with pytest.raises(RuntimeError, match="answered fetch 5 of space 0 with the answer to fetch 4"):
        check_fetched(0, keys, wanted, 5, torch.tensor([4, 9, -1]), 4, server=1, iteration=10)
    store = members("sgd")[0]
    key = np.array([store.shard + store.num_shards])
    store.write_back(key, torch.ones(1, 4), torch.zeros(1, 0), version=6)
    assert store.fetch_async(key, np.array([6])).wait()[2].tolist() == [6]


def test_a_fetch_answer_whose_rows_arrived_damaged_is_sent_again_and_never_trained_on():
    """A fetch's answer carries the digest of its rows, state and versions as the server sent them: an answer whose
    rows arrived otherwise (half of a row zeroed, as a re-formation once delivered) is sent again at once, and one
    damaged every time stops training rather than train on it."""
    import functools
    import types

    from bagpipe.runtime.endpoints import SERVER
    from bagpipe.runtime.protocol import DAMAGED_RESENDS
    from bagpipe.runtime.server.handlers import _pass_on_tagged
    from bagpipe.runtime.trainer.runtime import TrainerRuntime, TrainerStats, _Request

    rows, state, versions = torch.randn(3, 8), torch.zeros(3, 0), torch.tensor([4, 9, 2])
    sent: torch.futures.Future = torch.futures.Future()
    fetched: torch.futures.Future = torch.futures.Future()
    fetched.add_done_callback(functools.partial(_pass_on_tagged, sent, 7))
    fetched.set_result((rows, state, versions))
    whole = sent.wait()
    damaged_rows = rows.clone()
    damaged_rows[1, :4] = 0.0
    damaged = (damaged_rows, *whole[1:])

    def trainer(answers: list) -> types.SimpleNamespace:
        def send(endpoint, shard, args):
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(answers.pop(0))
            return _Request(endpoint, shard, args, 0, future, 0)
        return types.SimpleNamespace(_send=send, stats=TrainerStats(), index=0)

    args = (0, torch.tensor([3, 7, 11]), versions, 7)
    runtime = trainer([damaged, damaged, whole])
    got = TrainerRuntime._answer(runtime, runtime._send(SERVER.fetch, 0, args), what="fetch")
    assert len(got) == 4 and torch.equal(got[0], rows) and got[3] == 7
    assert runtime.stats.extra["damaged_answers"] == 2
    runtime = trainer([damaged] * (DAMAGED_RESENDS + 2))
    with pytest.raises(RuntimeError, match="answers in a row arrived damaged"):
        TrainerRuntime._answer(runtime, runtime._send(SERVER.fetch, 0, args), what="fetch")
