"""The partitioned cache's exchange (runtime/reduce.SharedSum), on real gloo groups of threads in one process: each
shared row's gradient summed among its users only, in trainer order, over T, equals the sum the sliced reference
makes, bit for bit, on every holder (its users, and the trainers that keep it without using it)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from bagpipe.runtime.reduce import Mean, SharedSum, TrainerGroup
from bagpipe.runtime.transport import gloo_group
from bagpipe.threads import live_threads


def on_trainers(trainers: int, body, *, store=None, prefix: str = "sums", kept: list | None = None) -> dict:
    """``body(rank, group)`` on a thread per trainer, in a TrainerGroup of them all (closed after, and appended to
    ``kept`` if given); each one's result by rank (any thread's error raised)."""
    store, results, errors = store or dist.HashStore(), {}, []

    def trainer(rank: int) -> None:
        group = TrainerGroup(gloo_group(store, prefix, rank, trainers, timeout=20.0, interface="lo"), timeout=20.0)
        try:
            results[rank] = body(rank, group)
        except BaseException as err:  # noqa: BLE001 - the test's thread: reported below
            errors.append(err)
        finally:
            group.close()
            if kept is not None:
                kept.append(group)

    threads = [threading.Thread(target=trainer, args=(rank,)) for rank in range(trainers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert len(results) == trainers, "a trainer's thread did not finish"
    return results


def in_trainer_order(contributions: dict[int, torch.Tensor], trainers: int, *, reverse: bool = False) -> torch.Tensor:
    order = sorted(contributions, reverse=reverse)
    total = contributions[order[0]].clone()
    for t in order[1:]:
        total += contributions[t]
    return total / trainers


@pytest.mark.parametrize("trainers, keepers", [(2, False), (3, False), (4, False), (2, True), (3, True), (4, True)])
def test_each_shared_row_is_summed_among_its_users_in_trainer_order_on_every_holder(trainers, keepers):
    rng = np.random.default_rng(trainers)
    rows, dim = 60, 5
    users = [sorted(rng.choice(trainers, size=rng.integers(1 if keepers else 2, trainers + 1),
                               replace=False).tolist()) for _ in range(rows)]
    holders = [sorted(set(who) | ({int(rng.integers(trainers))} if keepers else set())) for who in users]
    users = [who if len(held) > 1 else [0, 1] for who, held in zip(users, holders)]  # (a row of one holder: own)
    holders = [sorted(set(held) | set(who)) for who, held in zip(users, holders)]
    # a keeper's operand is noise: only the users' contributions may reach the sum
    grads = {(t, r): torch.from_numpy((rng.standard_normal(dim) * 10.0 ** rng.integers(-3, 4)).astype(np.float32))
             for r in range(rows) for t in holders[r]}
    def trainer(rank: int, group) -> dict:
        mine = [r for r in range(rows) if rank in holders[r]]  # (row numbers stand for sorted keys)
        mask = np.array([sum(1 << u for u in users[r]) for r in mine], dtype=np.int64)
        held = np.array([sum(1 << u for u in holders[r]) for r in mine], dtype=np.int64)
        operand = torch.stack([grads[(rank, r)] for r in mine])
        total = SharedSum(group, operand, mask, held if keepers else None, trainers=trainers, timeout=20.0).wait()
        return dict(zip(mine, total))

    results = on_trainers(trainers, trainer)
    differs = 0
    for r in range(rows):
        want = in_trainer_order({t: grads[(t, r)] for t in users[r]}, trainers)
        for t in holders[r]:
            assert torch.equal(results[t][r], want), (r, t)
        differs += not torch.equal(want, in_trainer_order({t: grads[(t, r)] for t in users[r]}, trainers,
                                                          reverse=True))
    if trainers > 2:
        assert differs > 0  # (the order is visible in the bits: another order would fail the test)


def test_a_trainer_given_a_row_it_does_not_use_is_refused():
    class One:
        def rank(self):
            return 0

        def size(self):
            return 2

    with pytest.raises(ValueError, match="does not hold every row"):
        SharedSum(One(), torch.zeros(2, 3), np.array([0b11, 0b10]), trainers=2, timeout=1.0)
    with pytest.raises(ValueError, match="names a holder outside the 2 trainers"):
        SharedSum(One(), torch.zeros(1, 3), np.array([0b101]), trainers=2, timeout=1.0)
    with pytest.raises(ValueError, match="has a user that does not hold it"):
        SharedSum(One(), torch.zeros(1, 3), np.array([0b11]), np.array([0b01]), trainers=2, timeout=1.0)


@pytest.mark.parametrize("trainers", [2, 3])
def test_an_iteration_with_no_shared_rows_still_takes_its_turn_beside_the_dense_mean(trainers):
    """Every trainer starts a SharedSum every iteration, some with no rows at all (the all-to-all needs every rank),
    then the dense Mean: the group's collectives stay in step, and a later exchange with rows sums correctly."""
    from bagpipe.runtime.reduce import Mean

    def trainer(rank: int, group) -> tuple:
        empty = SharedSum(group, torch.zeros(0, 4), np.zeros(0, dtype=np.int64), trainers=trainers, timeout=20.0)
        dense = Mean(group, torch.full((3,), float(rank + 1)), timeout=20.0)
        shared = np.array([(1 << trainers) - 1], dtype=np.int64)  # one row every trainer uses
        row = SharedSum(group, torch.full((1, 4), float(rank)), shared, trainers=trainers, timeout=20.0)
        return empty.wait(), dense.wait(), row.wait()

    results = on_trainers(trainers, trainer)
    for rank in range(trainers):
        empty, dense, row = results[rank]
        assert empty.shape == (0, 4)
        assert torch.equal(dense, torch.full((3,), sum(range(1, trainers + 1)) / trainers))
        assert torch.equal(row, torch.full((1, 4), sum(range(trainers)) / trainers))


def test_a_re_formed_group_leaves_no_thread_behind():
    """Closing a group (as a trainer does with its old group when the world re-forms around a replacement) ends the
    thread that orders the sums of three trainers or more and lets the gloo group go, whose workers and TCP loop
    end with it: 20 re-formations of two and of three trainers, and the process's threads (native ones counted)
    bounded, though the closed groups are still referenced (as a trainer's sums of an earlier epoch hold theirs)."""
    store, closed = dist.HashStore(), []

    def sum_once(rank: int, group) -> torch.Tensor:
        return Mean(group, torch.full((4,), float(rank + 1)), timeout=20.0).wait()

    before = live_threads()
    for epoch in range(20):
        trainers = 2 + epoch % 2
        totals = on_trainers(trainers, sum_once, store=store, prefix=f"sums/{epoch}", kept=closed)
        assert all(torch.equal(total, torch.full((4,), (trainers + 1) / 2)) for total in totals.values())
    deadline = time.monotonic() + 10
    while live_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)  # (a closed group's threads end once the thread letting it go has run)
    assert live_threads() <= before, [t.name for t in threading.enumerate()]
    closed = TrainerGroup(_FakeGroup(3), timeout=1.0)
    closed.close()
    with pytest.raises(RuntimeError, match="was closed"):  # a sum started after: refused, as on a broken group
        Mean(closed, torch.ones(3), timeout=1.0).wait()


class _FakeGroup:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size
