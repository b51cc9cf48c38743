"""Does planning cost follow the tables' size or the work? The same batches planned in key spaces of every size.

    .venv/bin/python benchmarks/bench_plan_scale.py --data BIN [--data BIN2 ...] [--iterations 300] [--repeats 3]

Each data set's first ``--iterations`` batches (batch 4,096, cache 1M rows, lookahead 50, one process) are
numbered, then planned from the numbered batches (the two halves timed apart), after a warm-up run of every case:
as they are (their tables' own key space), and with every key moved to a random place in a key space of 2^31 - 1
keys (the largest that sorts as int32) and of 2^40 keys (int64 keys). The move keeps the keys' order, so each plan
makes the same decisions, slot for slot (checked: the same rows fetched and evicted, the same slots); what may
change is the planner's cost alone. Beside each case's ids/s, the work its batches bring: distinct rows a batch,
rows fetched, rows evicted (not counting the final flush); and the cost per distinct row.

    .venv/bin/python benchmarks/bench_plan_scale.py --data BIN --partitioned 2 [--repeats 3]

times the partitioned plan instead (2 trainers, each a cache of --cache-rows rows), in the tables' key space.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bagpipe.data.binary import open_dataset
from bagpipe.heap import kept_heap
from bagpipe.planner.plan import PlannerConfig, number_batches, plan_numbered
from bagpipe.planner.partitioned import plan_partitioned
from bagpipe.planner.stats import key_batches, slice_key_batches

SPACES = {"int32": 2**31 - 1, "2^40": 2**40}


def moved(batches: list[np.ndarray], space: int, seed: int = 0) -> list[np.ndarray]:
    """``batches`` with each key sent to a random place in [0, space), keeping the keys' order."""
    keys = np.unique(np.concatenate(batches))
    places = np.sort(np.random.default_rng(seed).choice(space, size=len(keys), replace=False))
    return [places[np.searchsorted(keys, batch)] for batch in batches]


def timed_plan(batches: list[np.ndarray], config: PlannerConfig) -> tuple[float, float, dict]:
    """Seconds to number every batch, then to make every decision from the numbered batches (one process), and
    what the plan did."""
    fetched = evicted = distinct = 0
    slots = []
    with kept_heap():
        started = time.perf_counter()
        numbered = list(number_batches(batches, num_rows=config.num_rows))
        numbering = time.perf_counter() - started
        started = time.perf_counter()
        for step in plan_numbered(iter(numbered), config):
            fetched += len(step.fetch_keys)
            evicted += len(step.evict_keys) if step.lookups else 0  # (not the final step's flush)
            distinct += len(step.batch_keys)
            slots.append(step.fetch_slots)
        deciding = time.perf_counter() - started
    work = {"fetched": fetched, "evicted": evicted, "distinct": distinct,
            "slots": hash(np.concatenate(slots).tobytes()) if slots else 0}
    return numbering, deciding, work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", action="append", required=True, help="a preprocessed data set (repeatable)")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--cache-rows", type=int, default=1_000_000)
    parser.add_argument("--lookahead", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case, alternated; medians reported")
    parser.add_argument("--partitioned", type=int, default=0, metavar="TRAINERS",
                        help="instead: time the partitioned plan for this many trainers (each a cache of --cache-rows) "
                             "over each data set in its own key space")
    args = parser.parse_args()
    if args.partitioned:
        return partitioned(args)
    cases = []
    for data in args.data:
        split = open_dataset(data).train
        batches = key_batches(split, batch_size=args.batch_size, iterations=args.iterations)
        num_rows = int(sum(split.table_sizes))
        cases.append((data, "tables", num_rows, batches))
        for name, space in SPACES.items():
            cases.append((data, name, space, moved(batches, space)))
    seconds: dict[int, list[tuple[float, float]]] = {n: [] for n in range(len(cases))}
    works = {}
    for repeat in range(-1, args.repeats):  # (-1: a warm-up run of every case, not counted)
        for n, (data, name, space, batches) in enumerate(cases):
            config = PlannerConfig(num_rows=space, cache_rows=args.cache_rows, lookahead=args.lookahead)
            numbering, deciding, work = timed_plan(batches, config)
            if repeat >= 0:
                seconds[n].append((numbering, deciding))
            works[n] = work
            print(f"repeat {repeat}: {data} in {name} ({space:,} keys): numbering {numbering:.2f} s, decisions "
                  f"{deciding:.2f} s", flush=True)
    print("\n| data | key space | ids/s (median) | numbering, ms a batch | decisions, ms a batch "
          "| distinct rows a batch | fetched a batch | evicted a batch | ns per distinct row |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, (data, name, space, batches) in enumerate(cases):
        same = [m for m, case in enumerate(cases) if case[0] == data]
        if any(works[m] != works[n] for m in same):
            raise SystemExit(f"{data}: the plan in {name} differs from the plan in the tables' own key space")
        took = statistics.median(numbering + deciding for numbering, deciding in seconds[n])
        numbering, deciding = (statistics.median(part) for part in zip(*seconds[n]))
        work, count, ids = works[n], len(batches), sum(len(batch) for batch in batches)
        print(f"| {data} | {name} ({space:,}) | {ids / took / 1e6:.1f}M | {1e3 * numbering / count:.2f} "
              f"| {1e3 * deciding / count:.2f} | {work['distinct'] / count:,.0f} "
              f"| {work['fetched'] / count:,.0f} | {work['evicted'] / count:,.0f} "
              f"| {1e9 * took / work['distinct']:.0f} |")


def partitioned(args) -> None:
    """ms a batch of ``plan_partitioned`` over each data set's batches cut into the trainers' slices."""
    for data in args.data:
        split = open_dataset(data).train
        slices = slice_key_batches(split, batch_size=args.batch_size, iterations=args.iterations,
                                   trainers=args.partitioned)
        config = PlannerConfig(num_rows=int(sum(split.table_sizes)), cache_rows=args.cache_rows,
                               lookahead=args.lookahead, num_trainers=args.partitioned)
        took = []
        for repeat in range(-1, args.repeats):  # (-1: a warm-up run)
            with kept_heap():
                started = time.perf_counter()
                steps = plan_partitioned(slices, config)
                fetched = sum(len(part.fetch_keys) for step in steps for part in step.trainers)
                if repeat >= 0:
                    took.append(time.perf_counter() - started)
        ids, median = sum(len(part) for parts in slices for part in parts), statistics.median(took)
        print(f"{data}: partitioned plan, {args.partitioned} trainers: {1e3 * median / len(slices):.1f} ms a batch "
              f"({ids / median / 1e6:.1f}M ids/s; runs {[round(t, 2) for t in took]} s), {fetched:,} rows fetched")


if __name__ == "__main__":
    main()
