"""The partitioned plan (planner/partitioned.py), replayed against what exactness needs: every user of a row holds
its current version before the iteration, no other trainer holds it, every fetch reads the version of the row's
last update, no update is lost (at the end the servers hold every row's last), and no cache overflows."""

from __future__ import annotations

import numpy as np
import pytest

from bagpipe.planner import PlannerConfig
from bagpipe.planner.partitioned import plan_partitioned


def zipf_slices(seed: int, *, iterations: int, trainers: int, per_trainer: int, num_rows: int,
                exponent: float = 1.1) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[np.minimum(rng.zipf(exponent, per_trainer) - 1, num_rows - 1) for _ in range(trainers)]
            for _ in range(iterations)]


def replay(slices: list[list[np.ndarray]], config: PlannerConfig) -> dict:
    """Carry the plan out on versions (a row's value is the iteration of its last update), asserting each rule;
    the traffic it moved."""
    trainers = config.num_trainers
    latest: dict[int, int] = {}  # row -> its last update (-1: the initial row)
    server: dict[int, int] = {}
    held: list[dict[int, int]] = [{} for _ in range(trainers)]  # per trainer: row -> the version of its copy
    slot_key: list[dict[int, int]] = [{} for _ in range(trainers)]  # per trainer: slot -> the row in it
    totals = {"fetched": 0, "written": 0, "shared": 0, "own": 0}
    steps = list(plan_partitioned(iter(slices), config))
    assert [step.iteration for step in steps] == list(range(len(slices) + 1))
    for step in steps:
        i = step.iteration
        for t, part in enumerate(step.trainers):  # write-backs first: from a current copy
            for key, version, slot in zip(part.write_keys.tolist(), part.write_versions.tolist(),
                                          part.write_slots.tolist()):
                assert held[t].get(key) == latest.get(key, -1) == version, (i, t, key)
                assert slot_key[t][slot] == key  # read from the slot that holds it
                server[key] = version
            totals["written"] += len(part.write_keys)
        for t, part in enumerate(step.trainers):
            for key, slot in zip(part.drop_keys.tolist(), part.drop_slots.tolist(), strict=True):
                assert key in held[t] and slot_key[t].pop(slot) == key, (i, t, key)
                del held[t][key]
        for t, part in enumerate(step.trainers):
            for key, version, slot in zip(part.fetch_keys.tolist(), part.fetch_versions.tolist(),
                                          part.fetch_slots.tolist(), strict=True):
                assert key not in held[t]
                assert version == latest.get(key, -1) == server.get(key, -1), (i, t, key)  # never stale
                assert 0 <= slot < config.cache_rows and slot not in slot_key[t]  # into a free slot
                held[t][key] = version
                slot_key[t][slot] = key
            totals["fetched"] += len(part.fetch_keys)
            assert len(held[t]) == part.resident_rows <= config.cache_rows
        if i == len(slices):  # the final flush
            assert all(not rows for rows in held)
            assert all(server.get(key, -1) == version for key, version in latest.items())  # no update lost
            break
        users: dict[int, set[int]] = {}
        for t, keys in enumerate(slices[i]):
            for key in set(keys.tolist()):
                users.setdefault(key, set()).add(t)
        for t, part in enumerate(step.trainers):
            mine = set(slices[i][t].tolist())
            assert part.batch_keys.tolist() == sorted(mine)
            assert [slot_key[t][slot] for slot in part.batch_slots.tolist()] == sorted(mine)
            assert set(part.own_keys.tolist()) | set(part.shared_keys.tolist()) == mine
            assert all(len(users[key]) == 1 for key in part.own_keys.tolist())
            assert all(len(users[key]) > 1 for key in part.shared_keys.tolist())
            assert all(owner in users[key] for key, owner in zip(part.shared_keys.tolist(),
                                                                  part.shared_owners.tolist()))
            assert [sum(1 << u for u in users[key]) for key in part.shared_keys.tolist()] == \
                part.shared_users.tolist()
            for key in mine:
                assert held[t].get(key) == latest.get(key, -1), (i, t, key)  # every user holds it, current
            totals["shared"] += len(part.shared_keys)
            totals["own"] += len(part.own_keys)
        for t in range(trainers):
            for key in set(held[t]) & set(users):
                assert t in users[key], (i, t, key)  # holders are among the users
        for key, who in users.items():  # the iteration: each user applies the same update
            latest[key] = i
            for t in who:
                held[t][key] = i
    return totals


@pytest.mark.parametrize("trainers, capacity, lookahead, cleanup", [
    (1, 40, 10, 0.0), (2, 60, 5, 0.0), (3, 50, 20, 0.1), (4, 45, 3, 0.0), (4, 200, 50, 0.25)])
def test_the_partitioned_plan_keeps_every_copy_exact(trainers, capacity, lookahead, cleanup):
    slices = zipf_slices(trainers, iterations=60, trainers=trainers, per_trainer=30, num_rows=400)
    config = PlannerConfig(num_rows=400, cache_rows=capacity, lookahead=lookahead, num_trainers=trainers,
                           cleanup_fraction=cleanup)
    totals = replay(slices, config)
    assert totals["fetched"] > 0 and totals["written"] > 0
    if trainers == 1:
        assert totals["shared"] == 0
    else:
        assert totals["shared"] > 0 and totals["own"] > 0


def test_a_row_another_trainer_holds_dirty_is_handed_off_before_it_is_fetched():
    """Trainer 0 updates row 7 at iterations 0 and 1; trainer 1 uses it at 2: trainer 0 writes it back (version 1)
    before trainer 1 fetches that version, and lets it go, since it does not use it at 2."""
    slices = [[np.array([7]), np.array([1])], [np.array([7]), np.array([2])], [np.array([3]), np.array([7])]]
    steps = list(plan_partitioned(iter(slices), PlannerConfig(num_rows=10, cache_rows=4, num_trainers=2)))
    zero, one = steps[2].trainers
    assert zero.write_keys.tolist() == [7] and zero.write_versions.tolist() == [1] and 7 in zero.drop_keys.tolist()
    assert one.fetch_keys.tolist() == [7] and one.fetch_versions.tolist() == [1]
    assert steps[1].trainers[0].fetch_keys.tolist() == []  # kept between its own uses: nobody else used it
    shared = [[np.array([5, 6]), np.array([5])]]
    (step, _), = [list(plan_partitioned(iter(shared), PlannerConfig(num_rows=10, cache_rows=4, num_trainers=2)))]
    assert step.trainers[0].own_keys.tolist() == [6] and step.trainers[0].shared_keys.tolist() == [5]
    assert step.trainers[1].shared_keys.tolist() == [5] and step.trainers[1].shared_owners.tolist() == [1]


def test_a_slice_larger_than_its_trainers_cache_is_refused():
    with pytest.raises(ValueError, match="trainer 1's slice of batch 0 touches 3 distinct rows"):
        list(plan_partitioned(iter([[np.array([1]), np.array([1, 2, 3])]]),
                              PlannerConfig(num_rows=10, cache_rows=2, num_trainers=2)))
