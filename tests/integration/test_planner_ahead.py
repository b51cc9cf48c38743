"""planner/ahead.py: batches numbered in a process of their own give the plan numbered here, bit for bit; errors
come back with their text; a consumer that stops early leaves no process behind."""

import os
from pathlib import Path

import numpy as np
import pytest

from bagpipe.planner import PlannerConfig, plan
from bagpipe.planner.ahead import numbered_ahead
from bagpipe.planner.plan import number_batches, plan_numbered
from helpers.layouts import PLAN_FIELDS


def _zipf_batches(num_rows: int, count: int, size: int, seed: int, *, spread: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = np.arange(1, num_rows + 1, dtype=float) ** -1.1
    return [rng.choice(num_rows, size=size, p=weights / weights.sum()) * spread for _ in range(count)]


@pytest.mark.parametrize("space", [5_000, 2**40])  # keys narrowed to int32 through the pipes, and not
def test_batches_numbered_in_a_process_are_numbered_as_here(space):
    batches = _zipf_batches(5_000, 150, 300, seed=1, spread=space // 5_000)
    ahead = list(numbered_ahead(batches, num_rows=space, depth=7))
    here = list(number_batches(batches, num_rows=space))
    assert len(ahead) == len(here) == len(batches)
    for a, b in zip(ahead, here):
        assert a.keys.dtype == b.keys.dtype == np.int64 and a.numbers.dtype == np.int64
        assert np.array_equal(a.keys, b.keys) and np.array_equal(a.numbers, b.numbers)
        assert (a.lookups, a.count) == (b.lookups, b.count)


def test_a_plan_of_batches_numbered_ahead_equals_the_plan():
    batches = _zipf_batches(3_000, 200, 200, seed=2)
    config = PlannerConfig(num_rows=3_000, cache_rows=400, lookahead=20, num_trainers=2)
    ahead = list(plan_numbered(numbered_ahead(batches, num_rows=3_000), config))
    here = list(plan(batches, config))
    assert sum(len(step.evict_keys) for step in here) > 1_000  # evictions, write-backs and fetches again
    for a, b in zip(ahead, here, strict=True):
        for field in PLAN_FIELDS:
            assert np.array_equal(getattr(a, field), getattr(b, field)), field


def test_a_batch_outside_the_key_space_is_refused_with_the_text_it_is_refused_with_here():
    batches = [np.array([1, 2]), np.array([3]), np.array([4, 12])]
    with pytest.raises(ValueError, match=r"batch 2 has a row outside \[0, 10\)"):
        list(numbered_ahead(batches, num_rows=10))


def test_an_error_in_the_batches_reaches_the_consumer():
    def batches():
        yield np.array([1, 2])
        raise OSError("the data file went away")

    with pytest.raises(RuntimeError, match="the data file went away"):
        list(numbered_ahead(batches(), num_rows=10))


def _numbering_children() -> list[int]:
    """This process's children running the numbering (from /proc: Linux)."""
    children = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids = (task / "children").read_text().split()
        except FileNotFoundError:  # a thread that ended meanwhile (the numbering's own, once stopped)
            continue
        for pid in pids:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except FileNotFoundError:
                continue
            if b"bagpipe.planner.ahead" in command:
                children.append(int(pid))
    return children


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_a_consumer_that_stops_early_leaves_no_process_behind():
    numbered = numbered_ahead(_zipf_batches(1_000, 400, 100, seed=3), num_rows=1_000, depth=4)
    next(numbered)
    assert len(_numbering_children()) == 1
    numbered.close()
    assert _numbering_children() == []


def test_spaces_numbered_in_processes_of_their_own_plan_as_in_one():
    """plan_spaces_ahead: a numbering process per embedding space (their batches read on the feeding threads, one at
    a time), with each id's place (inverse=True): the same steps as plan_spaces in one process."""
    from bagpipe.planner.ahead import plan_spaces_ahead
    from bagpipe.planner.plan import plan_spaces

    rng = np.random.default_rng(0)
    batches = [[rng.integers(0, 5000, 300), rng.integers(0, 2**40, 500)] for _ in range(40)]
    configs = [PlannerConfig(num_rows=5000, cache_rows=800, lookahead=5),
               PlannerConfig(num_rows=2**40, cache_rows=1200, lookahead=5)]
    one = list(plan_spaces(iter(batches), configs, inverse=True))
    two = list(plan_spaces_ahead(iter(batches), configs, inverse=True))
    assert len(one) == len(two) == 41
    for steps, same in zip(one, two):
        for step, other in zip(steps, same):
            for name in ("fetch_keys", "fetch_slots", "fetch_versions", "evict_keys", "evict_slots", "evict_writers",
                         "batch_keys", "batch_slots", "batch_inverse", "sync_now_keys", "sync_later_deadlines"):
                assert np.array_equal(getattr(step, name), getattr(other, name)), name
    assert two[3][0].batch_inverse.dtype == np.int32 and len(two[3][1].batch_inverse) == 500
