"""--mode bagpipe with the lookahead cache against --policy none (every row fetched each time).

    .venv/bin/python benchmarks/bench_runtime.py [--work-dir DIR] [--repeats N] [--quick]

Synthetic Criteo-shaped data (the 26 Criteo Kaggle tables, each capped at 100k rows: 840,543
rows), DLRM 13-512-256-D / 512-256-1, global batch 2048, Adagrad, 2 trainers and 1 server on this
machine, a cache of 5% of all rows, lookahead 200. For embedding dims 16 and 128 it runs both
policies in the same invocation (interleaved, `--repeats` times) and reports the medians of
steady-state samples/s, the embedding stall fraction, rows moved (fetched + written back) per
iteration and bytes sent, with the ratios lookahead / none. Nothing is slowed down on purpose:
loopback is far faster than a network, so the gap at dim 16 understates a real cluster's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bagpipe.config import ModelConfig, TrainConfig
from bagpipe.data.preprocess import preprocess
from bagpipe.runtime.launch import launch_local
from bagpipe.synth import generate, resolve_table_sizes

FIELDS = ("samples_per_s", "embedding_stall_fraction", "plan_wait_fraction", "fetch_wait_fraction",
          "lazy_sync_wait_fraction", "sync_fraction", "rows_moved_per_iteration", "bytes_sent", "cache_hit_rate",
          "wall_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--dims", default="16,128")
    parser.add_argument("--quick", action="store_true", help="30 iterations, dim 16, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.dims, args.repeats = 30, "16", 1
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_runtime_"))
    sizes = resolve_table_sizes(tables=None, table_sizes=None, max_rows_per_table=100_000)
    batch = 2048
    if not (work / "bin" / "train").is_dir():
        generate(work / "tsv", rows=batch * (args.iterations + 10), test_rows=2048, seed=0, table_sizes=sizes)
        preprocess(work / "tsv", work / "bin")
    cache_rows = int(0.05 * sum(sizes))
    results: dict[tuple[int, str], list[dict]] = {}
    for repeat in range(args.repeats):
        for dim in (int(d) for d in args.dims.split(",")):
            for policy in ("lookahead", "none"):
                config = TrainConfig(
                    data=str(work / "bin"), run_dir=str(work / f"run_{dim}_{policy}"), mode="bagpipe",
                    iterations=args.iterations, batch_size=batch, optimizer="adagrad", lr=0.01, seed=0,
                    warmup_iterations=10, log_every=20, max_eval_rows=2048, trainers=2, servers=1,
                    cache_rows=cache_rows, lookahead=200, policy=policy, timeout=120.0,
                    model=ModelConfig(emb_dim=dim, arch_mlp_bot=f"13-512-256-{dim}", arch_mlp_top="512-256-1"))
                started = time.perf_counter()
                summary = launch_local(config, show_progress=False, overwrite=True)
                row = {k: summary[k] for k in FIELDS}
                results.setdefault((dim, policy), []).append(row)
                print(json.dumps({"repeat": repeat, "dim": dim, "policy": policy, **row,
                                  "launch_s": time.perf_counter() - started}), flush=True)
    report(results, cache_rows=cache_rows, total_rows=sum(sizes), iterations=args.iterations)


def report(results: dict, *, cache_rows: int, total_rows: int, iterations: int) -> None:
    med = {key: {f: statistics.median(r[f] for r in runs) for f in FIELDS} for key, runs in results.items()}
    print(f"\ncache {cache_rows:,} of {total_rows:,} rows, {iterations} iterations, medians of "
          f"{len(next(iter(results.values())))} runs\n")
    print("| dim | policy | samples/s | stall | of which plan / fetch / lazy sync | blocking sync "
          "| rows moved / it | MB sent | hit rate |")
    print("| ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    for (dim, policy), m in sorted(med.items()):
        print(f"| {dim} | {policy} | {m['samples_per_s']:,.0f} | {pct(m['embedding_stall_fraction'])} | "
              f"{pct(m['plan_wait_fraction'])} / {pct(m['fetch_wait_fraction'])} / "
              f"{pct(m['lazy_sync_wait_fraction'])} | {pct(m['sync_fraction'])} | "
              f"{m['rows_moved_per_iteration']:,.0f} | {m['bytes_sent'] / 1e6:,.0f} | {m['cache_hit_rate']:.3f} |")
    print("\n| dim | samples/s lookahead / none | rows moved lookahead / none | bytes lookahead / none |")
    print("| ---: | ---: | ---: | ---: |")
    for dim in sorted({d for d, _ in med}):
        a, b = med[(dim, "lookahead")], med[(dim, "none")]
        print(f"| {dim} | {a['samples_per_s'] / b['samples_per_s']:.2f}x | "
              f"{a['rows_moved_per_iteration'] / b['rows_moved_per_iteration']:.3f} | "
              f"{a['bytes_sent'] / b['bytes_sent']:.3f} |")


if __name__ == "__main__":
    main()
