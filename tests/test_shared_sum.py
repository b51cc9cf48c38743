"""The partitioned cache's exchange (runtime/reduce.SharedSum), on real gloo groups of threads in one process: each
shared row's gradient summed among its users only, in trainer order, over T, equals the sum the sliced reference
makes, bit for bit, on every user."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from bagpipe.runtime.reduce import SharedSum
from bagpipe.runtime.transport import gloo_group


def in_trainer_order(contributions: dict[int, torch.Tensor], trainers: int, *, reverse: bool = False) -> torch.Tensor:
    order = sorted(contributions, reverse=reverse)
    total = contributions[order[0]].clone()
    for t in order[1:]:
        total += contributions[t]
    return total / trainers


@pytest.mark.parametrize("trainers", [2, 3, 4])
def test_each_shared_row_is_summed_among_its_users_in_trainer_order_on_every_user(trainers):
    rng = np.random.default_rng(trainers)
    rows, dim = 60, 5
    users = [sorted(rng.choice(trainers, size=rng.integers(2, trainers + 1), replace=False).tolist())
             for _ in range(rows)]
    grads = {(t, r): torch.from_numpy((rng.standard_normal(dim) * 10.0 ** rng.integers(-3, 4)).astype(np.float32))
             for r in range(rows) for t in users[r]}
    store, results, errors = dist.HashStore(), {}, []

    def trainer(rank: int) -> None:
        try:
            group = gloo_group(store, "shared", rank, trainers, timeout=20.0, loopback=True)
            mine = [r for r in range(rows) if rank in users[r]]  # (row numbers stand for sorted keys)
            mask = np.array([sum(1 << u for u in users[r]) for r in mine], dtype=np.int64)
            operand = torch.stack([grads[(rank, r)] for r in mine])
            total = SharedSum(group, operand, mask, trainers=trainers, timeout=20.0).wait()
            results[rank] = dict(zip(mine, total))
        except BaseException as err:  # noqa: BLE001 - the test's thread: reported below
            errors.append(err)

    threads = [threading.Thread(target=trainer, args=(rank,)) for rank in range(trainers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    differs = 0
    for r in range(rows):
        want = in_trainer_order({t: grads[(t, r)] for t in users[r]}, trainers)
        for t in users[r]:
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

    with pytest.raises(ValueError, match="not a user of every row"):
        SharedSum(One(), torch.zeros(2, 3), np.array([0b11, 0b10]), trainers=2, timeout=1.0)
    with pytest.raises(ValueError, match="names a user outside the 2 trainers"):
        SharedSum(One(), torch.zeros(1, 3), np.array([0b101]), trainers=2, timeout=1.0)
