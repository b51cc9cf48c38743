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
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    data = work / f"data-{args.rows}"
    if not (data / "meta.json").exists():
        bagpipe("synth", "--out", str(data), "--rows", str(args.rows), "--raw-ids", "--max-rows-per-table",
                str(args.max_rows_per_table), "--seed", "0")
    meta = json.loads((data / "meta.json").read_text())
    rows = meta["train_rows"] + meta["test_rows"]
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
    result = {"rows": rows, "repeats": args.repeats, "rows_per_s": medians,
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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
