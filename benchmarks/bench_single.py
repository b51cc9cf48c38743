"""--mode single against --mode reference: samples/s, hit rates and rows copied, by cache size and policy.

    .venv/bin/python benchmarks/bench_single.py [--repeats 3] [--iterations 200] [--dims 16,128]
        [--fractions 0.01,0.05,0.2] [--policies lookahead,lfu,lru] [--out runs/bench_single/result.json]
        [--work-dir DIR] [--disk-budgets MB,MB]

Synthetic Criteo-shaped data: Zipf 1.2 ids over the 26 Criteo Kaggle tables capped at --max-rows-per-table
(default 1,000,000: 5,569,296 rows), DLRM 13-128-D / 128-64-1, Adagrad (its state travels with each row),
batch 2048, one process with the machine's torch threads. For each embedding width D, every repeat runs
`--mode reference` (every table in memory) and then `--mode single` with each cache size (a share of all
rows) and policy; a run's steady-state samples/s is divided by the same repeat's reference. Hit rates and
rows copied per iteration are deterministic (the same in every repeat). Reports medians and each repeat's
ratios, and the share of the machine's CPU that other processes used during the runs. With --disk-budgets,
each cache size and policy also runs with its tables on disk (`--storage disk`, the files in the work dir)
at each DRAM budget (MiB), and the rows read from and written to the files are reported.

    .venv/bin/python benchmarks/bench_single.py --hit-rates 2000 [--fractions ...] [--out ...]

Hit rates only, over a longer stream than training runs afford (200 iterations hardly fill a 5% cache, so
their misses are nearly all first uses): batches drawn as `bagpipe synth` draws them (the same Zipf
samplers and tables), each policy run by the code --mode single runs (the planner for lookahead,
bagpipe.nn.SlotIndex for LRU and LFU), with cleanup fraction 0 (exact policies) and 0.05 (the default).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
from pathlib import Path

from bench_reference import cpu_watch

import numpy as np

from bagpipe.config import ModelConfig, TrainConfig
from bagpipe.data.preprocess import preprocess
from bagpipe.nn import SlotIndex
from bagpipe.planner import PlannerConfig, plan
from bagpipe.train.reference import train_reference
from bagpipe.synth import ZipfSampler, generate, resolve_table_sizes

BATCH = 2048


def data_set(work: Path, *, zipf: float, iterations: int, max_rows_per_table: int) -> tuple[Path, int]:
    """The binary data set (made once per work dir) and its total rows."""
    sizes = resolve_table_sizes(tables=None, table_sizes=None, max_rows_per_table=max_rows_per_table)
    out = work / f"bin_zipf{zipf}_cap{max_rows_per_table}_it{iterations}"
    if not (out / "train" / "header.json").is_file():
        generate(work / f"tsv_zipf{zipf}_cap{max_rows_per_table}_it{iterations}", rows=BATCH * (iterations + 5), test_rows=BATCH,
                 seed=0, table_sizes=sizes, zipf=zipf, show_progress=False)
        preprocess(work / f"tsv_zipf{zipf}_cap{max_rows_per_table}_it{iterations}", out, show_progress=False)
    return out, sum(sizes)


def run(data: Path, work: Path, *, dim: int, iterations: int, mode: str, cache_rows: int = 0,
        policy: str = "lookahead", disk_budget_mb: float | None = None) -> dict:
    storage = {} if disk_budget_mb is None else {"storage": "disk", "storage_budget_mb": disk_budget_mb,
                                                 "storage_dir": str(work / "tables")}
    config = TrainConfig(data=str(data), run_dir=str(work / "run"), mode=mode, iterations=iterations,
                         batch_size=BATCH, optimizer="adagrad", lr=0.01, seed=0, warmup_iterations=20,
                         log_every=max(iterations // 4, 1), max_eval_rows=BATCH, cache_rows=cache_rows, policy=policy,
                         model=ModelConfig(emb_dim=dim, arch_mlp_bot=f"13-128-{dim}", arch_mlp_top="128-64-1"),
                         **storage)
    record: dict = {}
    with cpu_watch(record):
        summary = train_reference(config, show_progress=False, overwrite=True)
    keep = ("samples_per_s", "cache_hit_rate", "rows_fetched_per_iteration", "rows_moved_per_iteration",
            "time_breakdown_ms", "storage")
    return {**{k: summary[k] for k in keep if k in summary}, **record}


def simulated_hit_rates(sizes: list[int], *, iterations: int, fractions: list[float], policies: list[str],
                        zipf: float, cleanups: tuple[float, ...] = (0.0, 0.05)) -> dict:
    """Each policy's hit rate (rows found resident / distinct rows looked up) on a stream of ``iterations``
    batches, over all of it and over its second half; and rows fetched per iteration."""
    rng = np.random.default_rng([0, 0])
    samplers = [ZipfSampler(num_rows=n, exponent=zipf, rng=rng) for n in sizes]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    batches = [np.unique(np.concatenate([s.sample(BATCH, rng) + o for s, o in zip(samplers, offsets)]))
               for _ in range(iterations)]
    total = sum(sizes)
    result = {}
    for fraction in fractions:
        capacity = int(fraction * total)
        for cleanup in cleanups:
            for policy in policies:
                if policy == "lookahead":
                    config = PlannerConfig(num_rows=total, cache_rows=capacity, lookahead=200,
                                           cleanup_fraction=cleanup)
                    fetched = [len(step.fetch_keys) for step in plan(iter(batches), config)][:iterations]
                else:
                    index = SlotIndex(capacity, policy=policy, cleanup_fraction=cleanup)
                    fetched = [len(index.admit(keys).fetch_keys) for keys in batches]
                half = iterations // 2
                looked = [len(keys) for keys in batches]
                result[f"{policy}@{fraction:g}/cleanup{cleanup:g}"] = {
                    "hit_rate": 1 - sum(fetched) / sum(looked),
                    "hit_rate_second_half": 1 - sum(fetched[half:]) / sum(looked[half:]),
                    "rows_fetched_per_iteration": sum(fetched) / iterations}
                print(f"{policy}@{fraction:g} cleanup {cleanup:g}: hit rate {result[list(result)[-1]]['hit_rate']:.4f}, "
                      f"second half {result[list(result)[-1]]['hit_rate_second_half']:.4f}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=None, help="data and run dirs (default: a new temporary dir)")
    parser.add_argument("--out", default="runs/bench_single/result.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--dims", default="16,128")
    parser.add_argument("--fractions", default="0.01,0.05,0.2", help="cache sizes, as shares of all rows")
    parser.add_argument("--policies", default="lookahead,lfu,lru")
    parser.add_argument("--zipf", type=float, default=1.2)
    parser.add_argument("--max-rows-per-table", type=int, default=1_000_000)
    parser.add_argument("--hit-rates", type=int, default=0, help="only simulate the policies' hit rates on a "
                        "stream of this many batches")
    parser.add_argument("--disk-budgets", default="", help="also run each cache size and policy with the tables "
                        "on disk, at each of these DRAM budgets (MiB, comma-separated)")
    args = parser.parse_args()
    budgets = [float(b) for b in args.disk_budgets.split(",") if b]
    fractions = [float(f) for f in args.fractions.split(",")]
    policies = args.policies.split(",")
    if args.hit_rates:
        sizes = resolve_table_sizes(tables=None, table_sizes=None, max_rows_per_table=args.max_rows_per_table)
        result = {"total_rows": sum(sizes), "batch_size": BATCH, "iterations": args.hit_rates, "zipf": args.zipf,
                  "policies": simulated_hit_rates(sizes, iterations=args.hit_rates, fractions=fractions,
                                                  policies=policies, zipf=args.zipf)}
        _write(result, args.out)
        return
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_single_"))
    data, total_rows = data_set(work, zipf=args.zipf, iterations=args.iterations,
                                max_rows_per_table=args.max_rows_per_table)
    result = {"total_rows": total_rows, "batch_size": BATCH, "iterations": args.iterations, "zipf": args.zipf,
              "repeats": args.repeats, "dims": {}}
    for dim in (int(d) for d in args.dims.split(",")):
        runs: dict[str, list[dict]] = {}
        for repeat in range(args.repeats):
            runs.setdefault("reference", []).append(run(data, work, dim=dim, iterations=args.iterations,
                                                        mode="reference"))
            for fraction in fractions:
                for policy, budget in itertools.product(policies, [None, *budgets]):
                    name = f"{policy}@{fraction:g}" + ("" if budget is None else f"/disk{budget:g}MiB")
                    runs.setdefault(name, []).append(run(data, work, dim=dim, iterations=args.iterations,
                                                         mode="single", cache_rows=int(fraction * total_rows),
                                                         policy=policy, disk_budget_mb=budget))
                    print(f"dim {dim} repeat {repeat} {name}: {runs[name][-1]['samples_per_s']:,.0f} samples/s "
                          f"against {runs['reference'][-1]['samples_per_s']:,.0f}, hit rate "
                          f"{runs[name][-1]['cache_hit_rate']:.3f}", flush=True)
        reference = [r["samples_per_s"] for r in runs["reference"]]
        table = {"reference": {"samples_per_s": reference, "median": statistics.median(reference),
                               "time_breakdown_ms": runs["reference"][0]["time_breakdown_ms"],
                               "foreign_cpu": [r["foreign_cpu"] for r in runs["reference"]]}}
        for name, records in runs.items():
            if name == "reference":
                continue
            speeds = [r["samples_per_s"] for r in records]
            ratios = [s / ref for s, ref in zip(speeds, reference)]
            first = records[0]
            table[name] = {"samples_per_s": speeds, "median": statistics.median(speeds), "ratios": ratios,
                           "median_ratio": statistics.median(ratios), "hit_rate": first["cache_hit_rate"],
                           "rows_fetched_per_iteration": first["rows_fetched_per_iteration"],
                           "rows_moved_per_iteration": first["rows_moved_per_iteration"],
                           "time_breakdown_ms": first["time_breakdown_ms"], "storage": first.get("storage", {}),
                           "foreign_cpu": [r["foreign_cpu"] for r in records]}
        result["dims"][str(dim)] = table
        print(json.dumps({name: {k: v for k, v in row.items() if k in ("median", "median_ratio", "hit_rate",
                                                                        "rows_fetched_per_iteration")}
                          for name, row in table.items()}, indent=1), flush=True)
    _write(result, args.out)


def _write(result: dict, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
