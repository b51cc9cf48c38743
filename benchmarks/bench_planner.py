"""Rows fetched by each cache policy against Belady's MIN, and the planner's speed.

    .venv/bin/python benchmarks/bench_planner.py [--work-dir DIR] [--quick]

Synthetic Criteo-shaped data: the 26 Criteo Kaggle tables scaled to about 1M rows in all, Zipf
ids, 1M samples; batch 4096, lookahead 200, caches of 1%, 2% and 5% of all rows.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from bagpipe.data.binary import open_dataset
from bagpipe.data.preprocess import preprocess
from bagpipe.planner.stats import plan_stats
from bagpipe.synth import CRITEO_KAGGLE_TABLE_SIZES, generate


def scaled_sizes(total_rows: int) -> list[int]:
    scale = total_rows / sum(CRITEO_KAGGLE_TABLE_SIZES)
    return [max(2, math.ceil(n * scale)) for n in CRITEO_KAGGLE_TABLE_SIZES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--quick", action="store_true", help="100k samples, one cache size")
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats of the lookahead planner")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_planner_"))
    samples = 100_000 if args.quick else 1_000_000
    sizes = scaled_sizes(1_000_000)
    if not (work / "bin" / "meta.json").is_file():
        generate(work / "tsv", rows=samples, test_rows=1000, seed=0, table_sizes=sizes)
        preprocess(work / "tsv", work / "bin")
    split = open_dataset(work / "bin").train
    total = sum(sizes)
    fractions = (0.01,) if args.quick else (0.01, 0.02, 0.05)
    rows = []
    for fraction in fractions:
        cache_rows = int(total * fraction)
        results = {}
        for policy in ("belady", "lookahead", "lfu", "lru", "none"):
            results[policy] = plan_stats(split, batch_size=4096, cache_rows=cache_rows, lookahead=200,
                                         policy=policy, num_trainers=2)
        speeds = [results["lookahead"]["ids_per_s"]]
        for _ in range(args.repeats - 1):
            speeds.append(plan_stats(split, batch_size=4096, cache_rows=cache_rows, lookahead=200,
                                     policy="lookahead", num_trainers=2)["ids_per_s"])
        optimum = results["belady"]["rows_fetched"]
        for policy, stats in results.items():
            rows.append({"cache_fraction": fraction, "cache_rows": cache_rows, "policy": policy,
                         "rows_fetched": stats["rows_fetched"],
                         "vs_belady": stats["rows_fetched"] / optimum,
                         "ids_per_s": statistics.median(speeds) if policy == "lookahead" else stats["ids_per_s"]})
    print(json.dumps(rows, indent=1))
    print("\n| cache | policy | rows fetched | x Belady | planner ids/s |\n| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['cache_fraction']:.0%} ({row['cache_rows']:,}) | {row['policy']} | {row['rows_fetched']:,} "
              f"| {row['vs_belady']:.3f} | {row['ids_per_s'] / 1e6:.1f}M |")


if __name__ == "__main__":
    main()
