"""Property tests of the planner's invariants over random streams and configs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bagpipe.planner import NEVER, PlannerConfig, plan
from bagpipe.planner.belady import belady
from helpers.layouts import PLAN_FIELDS


@st.composite
def streams(draw):
    num_rows = draw(st.integers(2, 60))
    num_batches = draw(st.integers(1, 40))
    batch_size = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    skew = draw(st.sampled_from([0.0, 1.0, 2.0]))
    weights = np.arange(1, num_rows + 1, dtype=float) ** -skew
    batches = [rng.choice(num_rows, size=batch_size, p=weights / weights.sum()) for _ in range(num_batches)]
    largest = max(len(np.unique(b)) for b in batches)
    cache_rows = draw(st.integers(largest, max(largest, num_rows)))
    return num_rows, batches, cache_rows


def simulate(batches, steps, *, cache_rows, num_trainers):
    """Replay a plan against a model cache and server, checking every invariant on the way."""
    resident: set[int] = set()
    dirty: set[int] = set()
    server_version = {}  # key -> iteration after which it was last written back
    written_by = []
    fetched = 0
    slot_key = np.full(cache_rows, -1)  # the slots every trainer's cache fills as the plan says
    for step in steps:
        evicted = step.evict_keys.tolist()
        assert len(set(evicted)) == len(evicted)
        assert slot_key[step.evict_slots].tolist() == evicted, "an evicted row leaves the slot it was in"
        slot_key[step.evict_slots] = -1
        assert (slot_key[step.fetch_slots] == -1).all(), "a fetched row goes to a free slot"
        assert len(np.unique(step.fetch_slots)) == len(step.fetch_slots)
        slot_key[step.fetch_slots] = step.fetch_keys
        for key, writer in zip(evicted, step.evict_writers.tolist()):
            assert key in resident and key in dirty, "only resident, dirty rows are written back"
            assert 0 <= writer < num_trainers
            resident.discard(key)
            dirty.discard(key)
            server_version[key] = step.iteration - 1
            written_by.append(writer)
        for key, version in zip(step.fetch_keys.tolist(), step.fetch_versions.tolist()):
            assert key not in resident
            assert version == server_version.get(key, -1), "a fetch asks for its last write-back"
            resident.add(key)
            fetched += 1
        assert len(resident) <= cache_rows, "residency never exceeds the capacity"
        assert len(resident) == step.resident_rows
        if step.iteration < len(batches):
            needed = set(np.unique(batches[step.iteration]).tolist())
            assert needed <= resident, "every row a batch needs is resident when it runs"
            assert set(step.sync_now_keys.tolist()) | set(step.sync_later_keys.tolist()) == needed
            assert step.batch_keys.tolist() == sorted(needed)
            assert slot_key[step.batch_slots].tolist() == step.batch_keys.tolist(), "batch slots hold the batch"
            dirty |= needed
    assert not resident and not dirty, "every dirty row is written back exactly once by the end"
    counts = np.bincount(written_by, minlength=num_trainers) if written_by else np.zeros(num_trainers)
    assert counts.max() - counts.min() <= 1, "write-backs are shared out evenly"
    return fetched


@settings(max_examples=150, deadline=None)
@given(streams(), st.sampled_from(["lookahead", "lru", "lfu", "none"]), st.integers(1, 8), st.integers(1, 4),
       st.sampled_from([0.0, 0.25, 0.9]))
def test_plans_keep_every_invariant(stream, policy, lookahead, num_trainers, cleanup_fraction):
    num_rows, batches, cache_rows = stream
    config = PlannerConfig(num_rows=num_rows, cache_rows=cache_rows, lookahead=lookahead,
                           num_trainers=num_trainers, policy=policy, cleanup_fraction=cleanup_fraction)
    steps = list(plan(batches, config))
    assert len(steps) == len(batches) + 1
    simulate(batches, steps, cache_rows=cache_rows, num_trainers=num_trainers)


@settings(max_examples=150, deadline=None)
@given(streams())
def test_full_window_lookahead_fetches_exactly_what_belady_does(stream):
    num_rows, batches, cache_rows = stream
    config = PlannerConfig(num_rows=num_rows, cache_rows=cache_rows, lookahead=len(batches) + 1)
    fetched = simulate(batches, list(plan(batches, config)), cache_rows=cache_rows, num_trainers=1)
    optimum = belady(batches, cache_rows=cache_rows)
    assert fetched == optimum.rows_fetched
    lru = PlannerConfig(num_rows=num_rows, cache_rows=cache_rows, policy="lru")
    assert sum(len(s.fetch_keys) for s in plan(batches, lru)) >= optimum.rows_fetched


@settings(max_examples=50, deadline=None)
@given(streams(), st.integers(1, 8))
def test_identical_inputs_give_identical_plans(stream, lookahead):
    num_rows, batches, cache_rows = stream
    config = PlannerConfig(num_rows=num_rows, cache_rows=cache_rows, lookahead=lookahead, num_trainers=3)
    first, second = list(plan(batches, config)), list(plan([b.copy() for b in batches], config))
    for a, b in zip(first, second, strict=True):
        for field in ("fetch_keys", "fetch_versions", "evict_keys", "evict_writers", "sync_now_keys",
                      "sync_later_keys", "sync_later_deadlines"):
            assert np.array_equal(getattr(a, field), getattr(b, field))


@settings(max_examples=40, deadline=None)
@given(streams(), st.sampled_from(["lookahead", "lru", "lfu", "none"]), st.integers(1, 8), st.integers(0, 40))
def test_per_row_state_past_int32s_end_plans_the_same(stream, policy, lookahead, limit):
    """Slots, use counts and versions per row are int32 until values could pass int32's end (a cache of 2^31 slots,
    iteration 2^31 - 1), then int64: with that end moved to ``limit`` (int64 slots, and the switch mid-plan), the
    plan is the same, dtypes included."""
    import importlib

    planner = importlib.import_module("bagpipe.planner.plan")  # (the package's ``plan`` is the function)
    num_rows, batches, cache_rows = stream
    config = PlannerConfig(num_rows=num_rows, cache_rows=cache_rows, lookahead=lookahead, num_trainers=2, policy=policy)
    expected = list(plan(batches, config))
    saved, planner._INT32_LIMIT = planner._INT32_LIMIT, limit
    try:
        moved = list(plan(batches, config))
    finally:
        planner._INT32_LIMIT = saved
    for a, b in zip(expected, moved, strict=True):
        for field in PLAN_FIELDS:
            x, y = getattr(a, field), getattr(b, field)
            assert x.dtype == y.dtype and np.array_equal(x, y), field


@settings(max_examples=60, deadline=None)
@given(streams(), st.sampled_from(["lookahead", "lru", "lfu", "none"]), st.integers(1, 8),
       st.integers(0, 2**31))
def test_a_sparse_key_space_of_2_40_rows_is_planned_as_its_dense_image(stream, policy, lookahead, seed):
    """The planner's state grows with the rows it sees, not the key space: the same trace with its rows spread over
    2^40 keys (in the same order: an increasing map) gets the same plan, mapped, where a per-row array would need
    8 TB; and planning it allocates no more than the dense trace does, within a small margin."""
    import tracemalloc

    num_rows, batches, cache_rows = stream
    rng = np.random.default_rng(seed)
    spread = np.sort(rng.choice(2**40, size=num_rows, replace=False))  # key k -> spread[k], increasing
    config = PlannerConfig(num_rows=num_rows, cache_rows=cache_rows, lookahead=lookahead, num_trainers=2,
                           policy=policy)
    sparse = PlannerConfig(num_rows=2**40, cache_rows=cache_rows, lookahead=lookahead, num_trainers=2,
                           policy=policy)
    tracemalloc.start()
    try:
        dense_steps = list(plan(batches, config))
        tracemalloc.reset_peak()
        sparse_steps = list(plan([spread[b] for b in batches], sparse))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20
    keyed = ("fetch_keys", "evict_keys", "sync_now_keys", "sync_later_keys", "batch_keys")
    for a, b in zip(dense_steps, sparse_steps, strict=True):
        for field in PLAN_FIELDS:
            mine = getattr(a, field)
            assert np.array_equal(spread[mine] if field in keyed else mine, getattr(b, field)), field


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20_000), st.integers(0, 2**31), st.sampled_from([2, 50, 2**40]), st.floats(0.0, 1.2))
def test_the_highest_scores_are_a_defined_set_ties_to_the_earlier_position(n, seed, spread, share):
    """``highest`` (the planner's eviction choice) is the stable order's first ``count``: the scores alone decide,
    many equal scores included (the common case: rows not used within the window), whatever path it takes."""
    from bagpipe.planner.evict import highest

    rng = np.random.default_rng(seed)
    score = rng.integers(0, spread, n)
    count = min(n, int(share * n))
    expected = np.sort(np.argsort(-score, kind="stable")[:count])
    assert np.array_equal(highest(score, count), expected)


def _with_and_without_the_eviction_shortcut(batches, config):
    """The plan with the lookahead policy's eviction shortcut and with every slot scored instead, and for each
    eviction whether the shortcut found it."""
    import sys

    plan_module = sys.modules["bagpipe.planner.plan"]
    shortcut, taken = plan_module._idle_evictions, []

    def counted(*args, **kwargs):
        chosen = shortcut(*args, **kwargs)
        taken.append(chosen is not None)
        return chosen

    try:
        plan_module._idle_evictions = counted
        fast = list(plan(batches, config))
        plan_module._idle_evictions = lambda *args, **kwargs: None
        scored = list(plan(batches, config))
    finally:
        plan_module._idle_evictions = shortcut
    return fast, scored, taken


@settings(max_examples=80, deadline=None)
@given(st.integers(50, 3000), st.integers(1, 60), st.integers(0, 2**31), st.sampled_from([0.0, 0.8, 1.2]),
       st.integers(1, 60))
def test_evictions_found_without_scoring_the_cache_are_the_scored_ones(num_rows, lookahead, seed, skew, size):
    """The lookahead policy's shortcut (the lowest slots holding rows used once and not again within the window,
    where there are enough: the highest score there is) plans exactly what scoring every slot plans."""
    rng = np.random.default_rng(seed)
    weights = np.arange(1, num_rows + 1, dtype=float) ** -skew
    batches = [rng.choice(num_rows, size=size, p=weights / weights.sum()) for _ in range(int(rng.integers(5, 80)))]
    largest = max(len(np.unique(b)) for b in batches)
    config = PlannerConfig(num_rows=num_rows, cache_rows=int(rng.integers(largest, max(largest + 1, num_rows // 3))),
                           lookahead=lookahead, num_trainers=2)
    fast, scored, _ = _with_and_without_the_eviction_shortcut(batches, config)
    for a, b in zip(fast, scored, strict=True):
        for field in PLAN_FIELDS:
            assert np.array_equal(getattr(a, field), getattr(b, field)), field


def test_the_eviction_shortcut_is_taken_on_a_zipf_trace_and_plans_the_same():
    """A Zipf trace through a small cache: its evictions are found without scoring every slot (where there are too
    few idle rows for that, the shortcut declines: the property test below), and the plans agree."""
    rng = np.random.default_rng(0)
    weights = np.arange(1, 2001, dtype=float) ** -1.2
    batches = [rng.choice(2000, size=40, p=weights / weights.sum()) for _ in range(60)]
    import sys

    scan = sys.modules["bagpipe.planner.plan"]._OnceScan
    lowest, starts = scan.lowest, []

    def recorded(self, *args, **kwargs):
        starts.append(self.start)
        return lowest(self, *args, **kwargs)

    scan.lowest = recorded
    try:
        fast, scored, taken = _with_and_without_the_eviction_shortcut(
            batches, PlannerConfig(num_rows=2000, cache_rows=120, lookahead=8))
    finally:
        scan.lowest = lowest
    assert len(taken) > 40 and all(taken)
    assert sum(start > 0 for start in starts) > 20  # (most scans went on from where the last one ended)
    for a, b in zip(fast, scored, strict=True):
        for field in PLAN_FIELDS:
            assert np.array_equal(getattr(a, field), getattr(b, field)), field


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(0, 2**31), st.integers(1, 50), st.floats(0.0, 1.0), st.integers(1, 6))
def test_idle_evictions_are_the_highest_scores_by_either_path(capacity, seed, lookahead, share, most_uses):
    """``_idle_evictions`` (the scan for rows used once, and the pass over idle rows by use count) chooses what
    scoring every slot and taking the highest chooses, or declines (None) where the cache has too few idle rows;
    in the planner's state, where a free slot's next use is _FREED and batch i's rows' is i."""
    import sys

    plan_module = sys.modules["bagpipe.planner.plan"]
    rng = np.random.default_rng(seed)
    i = int(rng.integers(0, 1000))
    slot_row = np.where(rng.random(capacity) < 0.9, np.arange(capacity), -1)  # some slots free
    slot_next = np.where(rng.random(capacity) < 0.5, NEVER, i + rng.integers(1, 2 * lookahead + 2, capacity))
    slot_freq = rng.integers(1, most_uses + 1, capacity)
    in_batch = rng.choice(capacity, size=int(rng.integers(0, capacity // 4 + 1)), replace=False)
    slot_next[in_batch] = i
    free = np.flatnonzero(slot_row < 0)
    slot_next[free] = plan_module._FREED
    count = max(1, int(share * (capacity - len(free) - len(in_batch))))
    score = plan_module._scores(slot_next=slot_next, slot_far=(1 << 50) - slot_freq, i=i, lookahead=lookahead)
    score[in_batch] = np.iinfo(np.int64).min
    score[free] = np.iinfo(np.int64).min
    expected = plan_module.highest(score, count)
    idle = int(((slot_next >= i + lookahead) & (slot_row >= 0)).sum())
    for scan in (True, False):
        chosen = plan_module._idle_evictions(count, slot_next=slot_next, slot_freq=slot_freq, i=i,
                                             lookahead=lookahead, scan=scan)
        if idle < count:
            assert chosen is None
        else:
            assert chosen is not None and np.array_equal(chosen, expected)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 2**31), st.sampled_from([1, 2, 300, 2**16 + 7, 2**31 - 1, 2**40, 2**62]),
       st.sampled_from([np.int32, np.int64]), st.booleans())
def test_sorted_order_is_a_stable_argsort(n, seed, bound, dtype, negative):
    """keys.sorted_order (values and positions packed in one int64 and sorted, where they fit; else a stable argsort)
    gives numpy's sorted values and its stable order, repeats, negative values and values too wide to pack
    included, for int32 and int64 input; the batches' distinct keys (plan.distinct, int32 or int64 sorts) and
    keys.sorted_distinct are np.unique's."""
    from bagpipe.planner.keys import sorted_distinct, sorted_order
    from bagpipe.planner.plan import distinct

    if dtype is np.int32:
        bound = min(bound, 2**31 - 1)
    rng = np.random.default_rng(seed)
    values = rng.integers(-bound if negative else 0, bound, n).astype(dtype)
    ordered, order = sorted_order(values)
    assert ordered.dtype == np.int64
    assert np.array_equal(order, np.argsort(values, kind="stable")) and np.array_equal(ordered, np.sort(values))
    assert np.array_equal(sorted_distinct(values), np.unique(values))
    if not negative:
        assert np.array_equal(distinct(values, num_rows=bound)[0], np.unique(values))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 3000), st.integers(0, 2**31), st.sampled_from([1, 300, 2**16 + 7, 2**31, 2**40]),
       st.sampled_from([(-1,), (20, 30)]))
def test_unique_inverse_is_numpys_unique_with_its_inverse(n, seed, bound, shape):
    """keys.unique_inverse (one sort: keys.sorted_order) gives np.unique's distinct
    keys and inverse, int64 and int32, for any shape; the same batch mapped through BatchRows (which searches only
    the distinct ids) gets the places a binary search per id finds, PAD (-1) at the empty place."""
    from bagpipe.cache import BatchRows, BatchView
    from bagpipe.planner.keys import unique_inverse

    rng = np.random.default_rng(seed)
    values = rng.integers(0, bound, n if shape == (-1,) else 600)
    values = values.reshape(shape) if shape != (-1,) else values
    distinct, inverse = unique_inverse(values)
    expected, expected_inverse = np.unique(values, return_inverse=True)
    assert distinct.dtype == np.int64 and inverse.dtype == np.int32
    assert np.array_equal(distinct, expected) and np.array_equal(inverse, expected_inverse.ravel())
    view = BatchView(rng.permutation(expected), np.arange(len(expected)), 0, np.zeros(0, dtype=np.int32))
    rows = BatchRows()
    rows.load(view)
    ids = np.where(rng.random(values.shape) < 0.1, -1, values)
    positions = rows.at(ids).positions
    order = np.argsort(view.keys)
    assert positions.dtype == np.int32 and positions.shape == ids.shape
    by_search = np.where(ids >= 0, order[np.minimum(np.searchsorted(view.keys[order], ids), len(order) - 1)],
                         len(view.keys))
    assert np.array_equal(positions, by_search if len(view.keys) else np.zeros(ids.shape))


def test_unique_inverse_of_negative_values_is_numpys_too():
    from bagpipe.planner.keys import unique_inverse

    values = np.array([3, -1, 7, -1, 3, -2**40])
    distinct, inverse = unique_inverse(values)
    expected, expected_inverse = np.unique(values, return_inverse=True)
    assert np.array_equal(distinct, expected) and np.array_equal(inverse, expected_inverse)


def test_the_planner_holds_at_most_its_stated_bytes_per_row_seen():
    """PLANNER_BYTES_PER_SEEN_ROW (what preflight counts a job's planner at) bounds what planning allocates per
    distinct row it sees: 200k rows spread over 2^40 keys, a small cache, every step consumed as it comes."""
    import tracemalloc

    from bagpipe.planner.plan import PLANNER_BYTES_PER_SEEN_ROW

    def batches():
        rng = np.random.default_rng(0)
        for _ in range(100):
            yield rng.integers(0, 2**40, 2000)

    config = PlannerConfig(num_rows=2**40, cache_rows=4000, lookahead=20)
    tracemalloc.start()
    try:
        seen = sum(len(step.fetch_keys) for step in plan(batches(), config))  # every row fetched once: none repeat
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen > 199_000
    assert peak < seen * PLANNER_BYTES_PER_SEEN_ROW
    assert peak > seen * 16  # (it does hold state per row seen: a number and a key at least)
    # the partitioned plan, with its more per trainer
    from bagpipe.planner.partitioned import plan_partitioned
    from bagpipe.planner.plan import PARTITIONED_BYTES_PER_SEEN_ROW_PER_TRAINER

    trainers = 8
    tracemalloc.start()
    try:
        seen = sum(len(part.fetch_keys) for step in plan_partitioned(
            (np.array_split(batch, trainers) for batch in batches()),
            PlannerConfig(num_rows=2**40, cache_rows=4000, lookahead=20, num_trainers=trainers)) for part in step.trainers)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < seen * (PLANNER_BYTES_PER_SEEN_ROW + trainers * PARTITIONED_BYTES_PER_SEEN_ROW_PER_TRAINER)


def test_the_planners_window_is_counted_per_id_of_the_batches_ahead():
    """Large batches over few rows: the window of batches ahead (their distinct keys, numbers, next uses and each
    id's place) outweighs the state per row seen, and planner_window_bytes (which preflight adds) bounds it."""
    import tracemalloc

    from bagpipe.planner.plan import PLANNER_BYTES_PER_SEEN_ROW, planner_window_bytes

    rng = np.random.default_rng(0)
    keys = rng.choice(2**40, 5000, replace=False)
    batch_ids, lookahead = 50_000, 20
    tracemalloc.start()
    try:
        steps = plan((keys[rng.integers(0, len(keys), batch_ids)] for _ in range(100)),
                     PlannerConfig(num_rows=2**40, cache_rows=6000, lookahead=lookahead), inverse=True)
        seen = sum(len(step.fetch_keys) for step in steps)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == len(keys)  # (the cache holds every row: each fetched once)
    assert peak > 4 * seen * PLANNER_BYTES_PER_SEEN_ROW  # the window, not the rows, is most of it
    assert peak < seen * PLANNER_BYTES_PER_SEEN_ROW + planner_window_bytes(lookahead=lookahead, batch_ids=batch_ids)
    # the partitioned plan: each id streamed twice (its trainer's slice, the whole batch)
    from bagpipe.planner.partitioned import plan_partitioned
    from bagpipe.planner.plan import PARTITIONED_BYTES_PER_SEEN_ROW_PER_TRAINER

    trainers = 4
    tracemalloc.start()
    try:
        for _ in plan_partitioned((np.array_split(keys[rng.integers(0, len(keys), batch_ids)], trainers)
                                   for _ in range(100)),
                                  PlannerConfig(num_rows=2**40, cache_rows=6000, lookahead=lookahead,
                                                num_trainers=trainers), inverse=True):
            pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    per_row = PLANNER_BYTES_PER_SEEN_ROW + trainers * PARTITIONED_BYTES_PER_SEEN_ROW_PER_TRAINER
    assert 4 * len(keys) * per_row < peak < len(keys) * per_row + planner_window_bytes(
        lookahead=lookahead, batch_ids=batch_ids, partitioned=True)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3000), st.integers(0, 2**31), st.sampled_from([4, 2**12, 2**31, 2**40]), st.booleans(),
       st.sampled_from([0, 7, 4096]))
def test_key_index_numbers_keys_in_the_order_first_seen_through_every_growth(count, seed, space, bounded, spans):
    """KeyIndex (the planner's sparse rows -> numbers) against a dict, across table rebuilds (``KeyTable.fill``,
    whose runs wrap past the table's end when they reach it) and inserts started where a lookup's probe ended; with
    the key space bounded below 2^31, keys and numbers packed into one int64 a place (``value_bits``), and a packed
    table's removals; values or keys too wide to pack are refused. Lookups probe a place a key a round, then a span
    of places a key (below ``spans`` keys left: never, for the last few, for all)."""
    import bagpipe.planner.keys as keys_module

    below, keys_module._SPAN_BELOW = keys_module._SPAN_BELOW, spans
    try:
        _check_key_index(count, seed, space, bounded)
    finally:
        keys_module._SPAN_BELOW = below


def _check_key_index(count, seed, space, bounded):
    from bagpipe.planner.keys import KeyIndex, KeyTable

    rng = np.random.default_rng(seed)
    index, reference = KeyIndex(capacity=4, key_bound=space if bounded else None), {}
    assert index.value_bits == (32 if bounded and space <= 2**31 else 0)
    for _ in range(6):
        keys = np.unique(rng.integers(0, space, rng.integers(1, count + 1)))
        expected = [reference.setdefault(int(k), len(reference)) for k in keys]
        assert index.numbers(keys).tolist() == expected
    known = np.array(sorted(reference), dtype=np.int64)
    assert index.known(known).tolist() == [reference[int(k)] for k in known]
    assert np.array_equal(index.keys_of(np.arange(index.count)), np.array(list(reference), dtype=np.int64))
    assert index.known(np.array([space + 1])).tolist() == [-1]
    full = KeyTable(len(known))  # as full as a table gets: long runs, some wrapping
    full.fill(known, np.arange(len(known)))
    assert full.get(known).tolist() == list(range(len(known))) and full.live == len(known)
    # keys whose homes are the table's last places: their run must wrap around to its start
    table = KeyTable(8)
    candidates = np.unique(rng.integers(0, 2**40, 20_000))
    last = candidates[table._home(candidates) >= table.mask - 1][:6]
    table.fill(last, np.arange(len(last)))
    assert len(last) == 6 and table.get(last).tolist() == list(range(6)) and (table.keys[:3] >= 0).any()
    held = np.unique(rng.integers(0, 2**31, len(known)))
    packed = KeyTable(len(held), value_bits=32)
    values = rng.integers(0, 2**32, len(held))
    packed.fill(held[::2], values[::2])
    packed.insert(held[1::2], values[1::2])
    assert np.array_equal(packed.get(held), values) and len(packed.values) == 0
    gone = held[rng.random(len(held)) < 0.5]
    packed.remove(gone)
    assert np.array_equal(packed.get(held), np.where(np.isin(held, gone), -1, values))
    with pytest.raises(ValueError, match="packing 32-bit values"):
        packed.insert(np.array([2**31 + 5]), np.array([1]))
    with pytest.raises(ValueError, match="packing 32-bit values"):
        packed.insert(np.array([3]), np.array([2**32]))


def test_sync_split_follows_next_use():
    batches = [np.array([1, 2, 3]), np.array([1]), np.array([2]), np.array([9])]
    steps = list(plan(batches, PlannerConfig(num_rows=10, cache_rows=4, lookahead=2)))
    assert steps[0].sync_now_keys.tolist() == [1]
    assert steps[0].sync_later_keys.tolist() == [2, 3]
    assert steps[0].sync_later_deadlines.tolist() == [2, NEVER]


def test_eviction_waits_for_capacity_and_takes_the_furthest_use():
    # Room for 3: nothing is evicted until row 4 arrives; then row 3 (next use furthest) goes.
    batches = [np.array([1, 2, 3]), np.array([1]), np.array([4]), np.array([1, 2]), np.array([3])]
    steps = list(plan(batches, PlannerConfig(num_rows=5, cache_rows=3, lookahead=10)))
    assert [s.evict_keys.tolist() for s in steps[:5]] == [[], [], [3], [], [4]]
    assert steps[4].fetch_keys.tolist() == [3] and steps[4].fetch_versions.tolist() == [1]


def test_cleanup_fraction_evicts_in_fewer_larger_rounds():
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 400, 30) for _ in range(60)]
    rounds = {}
    for fraction in (0.0, 0.5):
        steps = list(plan(batches, PlannerConfig(num_rows=400, cache_rows=100, lookahead=5,
                                                 cleanup_fraction=fraction)))
        rounds[fraction] = sum(1 for s in steps[:-1] if len(s.evict_keys))
        if fraction:
            assert all(len(s.evict_keys) >= 50 for s in steps[:-1] if len(s.evict_keys))
    assert rounds[0.5] < rounds[0.0]


def test_a_batch_larger_than_the_cache_is_refused():
    with pytest.raises(ValueError, match="batch 1 touches 3 distinct rows"):
        list(plan([np.array([0, 0]), np.array([0, 1, 2])], PlannerConfig(num_rows=3, cache_rows=2)))
    with pytest.raises(ValueError, match="policy must be one of"):
        PlannerConfig(num_rows=3, cache_rows=2, policy="fifo")


def test_plan_stats_with_trainers_compares_a_replicated_and_a_partitioned_cache(small_binary, capsys):
    """With several trainers plan-stats says what each moves per iteration in both designs: replicated, every
    trainer fetches every planned row and all-reduces every row of the global batch; partitioned, a trainer
    exchanges only the rows it shares, and every row it uses is either shared or its own."""
    import json

    from bagpipe.cli import main

    assert main(["plan-stats", "--data", str(small_binary), "--batch-size", "64", "--cache-rows", "600",
                 "--lookahead", "50", "--iterations", "40", "--trainers", "4", "--emb-dim", "8",
                 "--optimizer", "adagrad"]) == 0
    stats = json.loads(capsys.readouterr().out)
    traffic = stats["traffic"]
    replicated, partitioned = traffic["replicated"], traffic["partitioned"]
    assert traffic["row_bytes"] == 4 * (8 + 8)  # the row and Adagrad's state
    assert replicated["rows_fetched_per_iteration"] == pytest.approx(stats["rows_fetched"] / 40)
    assert replicated["rows_written_back_per_iteration"] == pytest.approx(stats["rows_written_back"] / 40 / 4)
    # replicated, each trainer sends 2(T-1)/T of the global batch's rows in its all-reduce
    from bagpipe.planner.stats import key_batches
    from bagpipe.data.binary import open_dataset

    batches = key_batches(open_dataset(small_binary).train, batch_size=64, iterations=40)
    assert replicated["rows_synchronised_per_iteration"] == pytest.approx(
        np.mean([len(np.unique(keys)) for keys in batches]) * 2 * 3 / 4)
    assert 0 < partitioned["rows_synchronised_per_iteration"] < replicated["rows_synchronised_per_iteration"]
    assert partitioned["busiest_trainer_rows_fetched_per_iteration"] >= partitioned["rows_fetched_per_iteration"] > 0
    assert partitioned["rows_own_per_iteration"] > 0
    assert traffic["partitioned_vs_replicated"]["bytes_per_iteration"] == pytest.approx(
        partitioned["bytes_per_iteration"] / replicated["bytes_per_iteration"])
    # slices need a batch the trainers divide: without one, the rest of the figures, and no traffic
    assert main(["plan-stats", "--data", str(small_binary), "--batch-size", "64", "--cache-rows", "600",
                 "--iterations", "5", "--trainers", "3"]) == 0
    assert "traffic" not in json.loads(capsys.readouterr().out)
    assert main(["plan-stats", "--data", str(small_binary), "--batch-size", "64", "--cache-rows", "600",
                 "--trainers", "2", "--emb-dim", "0"]) == 2  # a width the bytes cannot be counted in


@settings(max_examples=100, deadline=None)
@given(streams(), st.sampled_from([0.0, 0.1, 0.3]))
def test_the_planners_lru_and_bagpipe_nns_are_one_engine(stream, cleanup_fraction):
    """The online policies are written once (planner/evict.py): the oracle's LRU plan and bagpipe.nn's SlotIndex,
    given the same batches, evict the same rows and put every row in the same slot, step by step."""
    from bagpipe.nn import SlotIndex

    num_rows, batches, cache_rows = stream
    index = SlotIndex(cache_rows, policy="lru", cleanup_fraction=cleanup_fraction)
    config = PlannerConfig(num_rows=num_rows, cache_rows=cache_rows, policy="lru", cleanup_fraction=cleanup_fraction)
    for step, batch in zip(plan(batches, config), batches):
        admission = index.admit(np.unique(batch))
        assert step.evict_keys.tolist() == admission.evict_keys.tolist()
        assert step.evict_slots.tolist() == admission.evict_slots.tolist()
        assert step.fetch_keys.tolist() == admission.fetch_keys.tolist()
        assert step.fetch_slots.tolist() == admission.fetch_slots.tolist()
        assert step.batch_slots.tolist() == admission.batch_slots.tolist()


def test_online_victims_are_the_highest_scores_ties_to_the_lower_slot():
    from bagpipe.planner.evict import OnlineHistory, evictions_needed

    history = OnlineHistory(6, "lfu")
    history.used(np.arange(6), 0)
    history.used(np.array([0, 1, 2]), 1)  # slots 3-5 used once, at tick 0; 0-2 twice
    history.used(np.array([4]), 2, uses=np.array([1]))  # slot 4 used once too, but lately
    assert history.victims(2, tick=3, keep=[]).tolist() == [3, 5]
    assert history.victims(2, tick=3, keep=[np.array([3])]).tolist() == [4, 5]
    history.freed(np.array([5]))
    lru = OnlineHistory(6, "lru")
    lru.last_use[:] = history.last_use
    assert lru.victims(3, tick=3, keep=[np.array([5])]).tolist() == [0, 1, 3]  # 3 oldest, then two of 0-2
    assert evictions_needed(3, candidates=10, capacity=100, cleanup_fraction=0.05) == 8
    assert evictions_needed(3, candidates=6, capacity=100, cleanup_fraction=0.05) == 6
    with pytest.raises(ValueError, match="policy must be one of lru, lfu"):
        OnlineHistory(4, "lookahead")
