"""The partitioned plan (planner/partitioned.py), replayed against what exactness needs: every user of a row holds
its current version before the iteration, every other trainer that holds it keeps it and receives the update, every
fetch reads the version of the row's last update, no update is lost (at the end the servers hold every row's last),
and no cache overflows."""

from __future__ import annotations

import dataclasses

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
    totals = {"fetched": 0, "written": 0, "shared": 0, "own": 0, "kept": 0}
    steps = list(plan_partitioned(iter(slices), config, inverse=True))
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
        holders = {key: set(who) for key, who in users.items()}
        for t, part in enumerate(step.trainers):
            kept = part.kept_keys.tolist()
            assert [slot_key[t][slot] for slot in part.kept_slots.tolist()] == kept == sorted(kept)
            for key in kept:
                assert key in users and t not in users[key] and held[t].get(key) == latest.get(key, -1), (i, t, key)
                holders[key].add(t)
            totals["kept"] += len(kept)
        def bits(who):
            return sum(1 << u for u in who)
        for t, part in enumerate(step.trainers):
            mine = set(slices[i][t].tolist())
            assert part.batch_keys.tolist() == sorted(mine)
            assert part.batch_keys[part.batch_inverse].tolist() == slices[i][t].tolist()  # each id's place
            assert [slot_key[t][slot] for slot in part.batch_slots.tolist()] == sorted(mine)
            assert set(part.own_keys.tolist()) | set(part.shared_keys.tolist()) == mine
            assert all(holders[key] == {t} for key in part.own_keys.tolist())
            assert all(len(holders[key]) > 1 for key in part.shared_keys.tolist())
            assert all(owner in users[key] for key, owner in zip(part.shared_keys.tolist(),
                                                                  part.shared_owners.tolist()))
            assert [bits(users[key]) for key in part.shared_keys.tolist()] == part.shared_users.tolist()
            assert [bits(holders[key]) for key in part.shared_keys.tolist()] == part.shared_holders.tolist()
            assert [bits(users[key]) for key in part.kept_keys.tolist()] == part.kept_users.tolist()
            assert [bits(holders[key]) for key in part.kept_keys.tolist()] == part.kept_holders.tolist()
            for key in mine:
                assert held[t].get(key) == latest.get(key, -1), (i, t, key)  # every user holds it, current
            totals["shared"] += len(part.shared_keys)
            totals["own"] += len(part.own_keys)
        for t in range(trainers):
            for key in set(held[t]) & set(users):
                assert t in holders[key], (i, t, key)  # a holder that does not use it keeps it
        for key, who in holders.items():  # the iteration: each holder applies the same update
            latest[key] = i
            for t in who:
                held[t][key] = i
    return totals


@pytest.mark.parametrize("trainers, capacity, lookahead, cleanup, keep", [
    (1, 40, 10, 0.0, 0), (2, 60, 5, 0.0, 0), (3, 50, 20, 0.1, 0), (4, 45, 3, 0.0, 0), (4, 200, 50, 0.25, 0),
    (2, 60, 5, 0.0, 2), (3, 50, 20, 0.1, 4), (4, 45, 3, 0.0, 8), (4, 200, 50, 0.25, 50)])
def test_the_partitioned_plan_keeps_every_copy_exact(trainers, capacity, lookahead, cleanup, keep):
    slices = zipf_slices(trainers, iterations=60, trainers=trainers, per_trainer=30, num_rows=400)
    config = PlannerConfig(num_rows=400, cache_rows=capacity, lookahead=lookahead, num_trainers=trainers,
                           cleanup_fraction=cleanup, keep_within=keep)
    totals = replay(slices, config)
    assert totals["fetched"] > 0 and totals["written"] > 0
    if trainers == 1:
        assert totals["shared"] == 0
    else:
        assert totals["shared"] > 0 and totals["own"] > 0
    assert (totals["kept"] > 0) == (keep > 0 and trainers > 1)
    if keep and trainers > 1:  # keeping rows between uses saves fetches and write-backs
        without = replay(slices, dataclasses.replace(config, keep_within=0))
        assert totals["fetched"] < without["fetched"] and totals["written"] < without["written"]


@pytest.mark.parametrize("trainers, keep, cleanup", [(4, 4, 0.0), (2, 8, 0.0), (3, 4, 0.2)])
def test_a_cache_just_large_enough_for_a_slice_plans_with_keepers_and_joins(trainers, keep, cleanup):
    """Joins are optional: where a trainer's cache has room for its slice only, it joins no more rows than fit
    (rather than ask for slots it cannot have), and the plan still keeps every copy exact."""
    slices = zipf_slices(1, iterations=60, trainers=trainers, per_trainer=30, num_rows=400)
    tight = max(len(np.unique(keys)) for parts in slices for keys in parts)
    config = PlannerConfig(num_rows=400, cache_rows=tight, lookahead=20, num_trainers=trainers, keep_within=keep,
                           cleanup_fraction=cleanup)
    totals = replay(slices, config)
    assert totals["kept"] > 0 and totals["fetched"] > 0


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


def test_a_row_another_trainer_uses_next_is_handed_off_at_the_next_boundary_so_its_fetch_can_go_ahead():
    """Trainer 0 updates row 7 at iteration 0 and keeps it (its cache has room); trainer 1 uses it at 3, before
    trainer 0 again: trainer 0 writes it back at boundary 1 (version 0), not 3, and keeps it until 3."""
    slices = [[np.array([7]), np.array([1])], [np.array([2]), np.array([1])], [np.array([2]), np.array([1])],
              [np.array([2]), np.array([7])], [np.array([7]), np.array([1])]]
    steps = list(plan_partitioned(iter(slices), PlannerConfig(num_rows=10, cache_rows=4, num_trainers=2)))
    assert [step.trainers[0].write_keys.tolist() for step in steps[:4]] == [[], [7], [], []]
    assert steps[1].trainers[0].write_versions.tolist() == [0] and 7 not in steps[1].trainers[0].drop_keys.tolist()
    assert 7 in steps[3].trainers[0].drop_keys.tolist()  # let go when trainer 1 uses it without trainer 0
    assert steps[3].trainers[1].fetch_keys.tolist() == [7] and steps[3].trainers[1].fetch_versions.tolist() == [0]


def test_a_holder_whose_next_use_is_near_keeps_the_row_and_receives_its_update():
    """Trainers 0 and 1 take turns with row 7: with keep_within 1 trainer 1 joins trainer 0 as a keeper at once
    (it uses the row next; its fetch may arrive an iteration late), each keeps it between its uses, so the row is
    fetched once by each and never handed off, and it is shared by its user and its keeper; trainer 0, with no use
    ahead, lets it go at the last turn."""
    slices = [[np.array([7]), np.array([1])], [np.array([2]), np.array([7])], [np.array([7]), np.array([3])],
              [np.array([4]), np.array([7])]]
    keeping = list(plan_partitioned(iter(slices), PlannerConfig(num_rows=10, cache_rows=4, num_trainers=2,
                                                                 keep_within=1)))
    assert [part.fetch_keys.tolist().count(7) for step in keeping for part in step.trainers] == [1, 1] + [0] * 8
    first = keeping[0].trainers[1]
    assert first.fetch_late[first.fetch_keys == 7].tolist() == [True] and first.fetch_versions.tolist()[-1] == -1
    assert not keeping[0].trainers[0].fetch_late.any()  # (its user's own fetch is due now)
    assert [step.trainers[0].kept_keys.tolist() for step in keeping[:4]] == [[], [7], [], []]
    assert [step.trainers[1].kept_keys.tolist() for step in keeping[:4]] == [[7], [], [7], []]
    assert 7 in keeping[3].trainers[0].drop_keys.tolist()
    assert keeping[1].trainers[1].shared_keys.tolist() == [7]
    assert keeping[1].trainers[1].shared_users.tolist() == [2] and keeping[1].trainers[1].shared_holders.tolist() == [3]
    assert all(not len(part.write_keys) for step in keeping[:4] for part in step.trainers)  # never handed off
    letting_go = list(plan_partitioned(iter(slices), PlannerConfig(num_rows=10, cache_rows=4, num_trainers=2)))
    assert sum(part.fetch_keys.tolist().count(7) for step in letting_go for part in step.trainers) == 4


def test_a_slice_larger_than_its_trainers_cache_is_refused():
    with pytest.raises(ValueError, match="trainer 1's slice of batch 0 touches 3 distinct rows"):
        list(plan_partitioned(iter([[np.array([1]), np.array([1, 2, 3])]]),
                              PlannerConfig(num_rows=10, cache_rows=2, num_trainers=2)))
