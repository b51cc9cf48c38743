"""Raw ids against a vocabulary and against hashing into fixed tables, converting the same file (issue 47):
`bagpipe preprocess --raw-ids` (one pass, each value a 63-bit key) against `--vocab-min-count 1` (a counting pass
over the train split, then the conversion) and against the values hashed modulo the meta.json's table sizes
(what a fixed table of as many rows as the data's distinct ids does), each in a fresh process, alternated, on
`bagpipe synth --raw-ids` data (16-digit hex ids that keep arriving).

    .venv/bin/python benchmarks/bench_rawids.py [--rows 2000000] [--repeats 3] [--work-dir runs/bench_rawids]
        [--out runs/bench_rawids/result.json]

Prints, per path, the median rows/s of the whole call (train and test rows over its wall time) and its ratio to
the vocabulary path's; and, from the converted data, each path's rows: the distinct keys of the train split
against its distinct values (hashing into fixed tables shares rows between values; the other two never do).

``--epochs N`` (default 1; 0: none) then trains `--mode reference` on each path's data alike (DLRM, batch
--batch-size, Adagrad) and gives each one's test AUC beside the planted model's best: what sharing rows costs.

``--jobs N`` (default 0: none) then runs N alternated pairs of `--mode bagpipe` jobs in bench_peers' shape (an
oracle, 1 server, 2 trainers each caching --cache-fraction of the rows, DLRM of width --dim, global batch
--batch-size, SGD, one epoch, unshuffled): one on the raw ids (tables that grow with the data), one on the
vocabulary's data, whose tables have as many rows (every train value one, and an out-of-vocabulary row). Gives
each one's median steady-state samples/s, their ratio, and the server's peak RSS and its bytes per row held.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PATHS = {"raw-ids": ["--raw-ids"], "vocabulary": ["--vocab-min-count", "1"], "hashed": []}


def bagpipe(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "bagpipe.cli", *args], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-rows-per-table", type=int, default=200_000)
    parser.add_argument("--work-dir", default="runs/bench_rawids")
    parser.add_argument("--out", default="runs/bench_rawids/result.json")
    parser.add_argument("--epochs", type=int, default=1, help="train each path's data this long (0: no training)")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--jobs", type=int, default=0, help="alternated pairs of bagpipe jobs (raw ids, vocabulary)")
    parser.add_argument("--cache-fraction", type=float, default=0.05)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--skip-conversion", action="store_true",
                        help="reuse the converted data of an earlier run in --work-dir (the jobs alone)")
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    data = work / f"data-{args.rows}"
    if not (data / "meta.json").exists():
        bagpipe("synth", "--out", str(data), "--rows", str(args.rows), "--raw-ids", "--max-rows-per-table",
                str(args.max_rows_per_table), "--seed", "0")
    meta = json.loads((data / "meta.json").read_text())
    rows = meta["train_rows"] + meta["test_rows"]
    result: dict = {}
    if not args.skip_conversion:
        seconds: dict[str, list[float]] = {name: [] for name in PATHS}
        for repeat in range(args.repeats):
            for name, flags in PATHS.items():
                out = work / name
                shutil.rmtree(out, ignore_errors=True)
                started = time.perf_counter()
                bagpipe("preprocess", "--input", str(data), "--out", str(out), *flags)
                seconds[name].append(time.perf_counter() - started)
                print(f"repeat {repeat + 1}: {name} {rows / seconds[name][-1]:,.0f} rows/s", flush=True)
        from bagpipe.data.binary import open_dataset

        distinct = {name: sum(len(np.unique(column)) for column in np.asarray(open_dataset(work / name).train.ids).T)
                    for name in PATHS}
        medians = {name: rows / statistics.median(values) for name, values in seconds.items()}
        result |= {"rows": rows, "repeats": args.repeats, "rows_per_s": medians,
                  "vs_vocabulary": {name: medians[name] / medians["vocabulary"] for name in PATHS},
                  "seconds": seconds, "train_rows_of_each_path": distinct,
                  "train_distinct_values": sum(meta["raw_ids"]["train_distinct_ids"])}
        print("| path | rows/s (median) | vs vocabulary | train rows (distinct keys) |")
        print("| --- | ---: | ---: | ---: |")
        for name in PATHS:
            print(f"| {name} | {medians[name]:,.0f} | {result['vs_vocabulary'][name]:.2f}x | {distinct[name]:,} |")
        print(f"distinct values in the train split: {result['train_distinct_values']:,}")
        if args.epochs:
            result["test_auc"] = {}
            for name in PATHS:
                run = work / f"run-{name}"
                bagpipe("train", "--data", str(work / name), "--run-dir", str(run), "--overwrite", "--no-progress",
                        "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--optimizer", "adagrad")
                summary = json.loads((run / "summary.json").read_text())
                result["test_auc"][name] = summary["eval_auc"]
                print(f"{name}: test AUC {summary['eval_auc']:.4f} (best {meta['best_auc']:.4f})", flush=True)
            result["best_auc"] = meta["best_auc"]
    if args.jobs:
        result["jobs"] = compare_jobs(args, work)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def compare_jobs(args, work: Path) -> dict:
    """``--jobs``: bagpipe jobs on the raw ids and on the vocabulary's data, alternated; medians and ratios."""
    runs: dict[str, list[dict]] = {"raw-ids": [], "vocabulary": []}
    for repeat in range(args.jobs):
        for name in runs:
            run = work / f"job-{name}"
            rows = json.loads((work / name / "meta.json").read_text())["table_sizes"] if name == "vocabulary" else None
            total = sum(rows) if rows else None
            if total is None:  # raw ids: the rows a one-epoch run makes are the train split's distinct keys
                total = sum(len(np.unique(column)) for column in np.asarray(_train_ids(work / name)).T) + 26
            cache_rows = max(int(total * args.cache_fraction), 4 * args.batch_size)
            bagpipe("train", "--mode", "bagpipe", "--data", str(work / name), "--run-dir", str(run), "--overwrite",
                    "--no-progress", "--epochs", "1", "--batch-size", str(args.batch_size),
                    "--optimizer", "sgd", "--lr", "0.05", "--seed", "0", "--warmup-iterations", "20",
                    "--log-every", "20", "--max-eval-rows", str(args.batch_size), "--trainers", "2",
                    "--servers", "1", "--cache-rows", str(cache_rows), "--lookahead", "200", "--timeout", "120",
                    "--emb-dim", str(args.dim), "--arch-mlp-bot", f"13-512-256-{args.dim}",
                    "--arch-mlp-top", "512-256-1")
            summary = json.loads((run / "summary.json").read_text())
            server_rss = summary["peak_rss_bytes"]["server0"]
            runs[name].append({"samples_per_s": summary["samples_per_s"], "total_rows": summary["total_rows"],
                               "server_peak_rss_bytes": server_rss, "cache_rows": cache_rows})
            print(f"job repeat {repeat + 1}: {name} {summary['samples_per_s']:,.0f} samples/s, "
                  f"{summary['total_rows']:,} rows, server peak RSS {server_rss / 2**20:,.0f} MiB", flush=True)
    medians = {name: {key: statistics.median(run[key] for run in each) for key in each[0]}
               for name, each in runs.items()}
    raw, fixed = medians["raw-ids"], medians["vocabulary"]
    result = {"runs": runs, "medians": medians,
              "samples_per_s_ratio": raw["samples_per_s"] / fixed["samples_per_s"],
              "server_rss_ratio": raw["server_peak_rss_bytes"] / fixed["server_peak_rss_bytes"],
              "server_bytes_per_row": {name: m["server_peak_rss_bytes"] / m["total_rows"] for name, m in medians.items()}}
    print("| job | samples/s (median) | vs vocabulary | rows | server peak RSS | per row |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, m in medians.items():
        print(f"| {name} | {m['samples_per_s']:,.0f} | {m['samples_per_s'] / fixed['samples_per_s']:.2f}x | "
              f"{m['total_rows']:,.0f} | {m['server_peak_rss_bytes'] / 2**20:,.0f} MiB | "
              f"{result['server_bytes_per_row'][name]:,.0f} B |")
    return result


def _train_ids(data: Path):
    from bagpipe.data.binary import open_dataset

    return open_dataset(data).train.ids


if __name__ == "__main__":
    sys.exit(main())
