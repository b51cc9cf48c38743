"""The disk tier against the memory tier: samples/s of the same job, and what each server holds.

    .venv/bin/python benchmarks/bench_storage.py [--repeats 3] [--iterations 600] [--budget-fraction 0.05]
        [--out runs/bench_storage/result.json] [--work-dir DIR]

One `--mode bagpipe` job (DLRM, Adagrad, 2 trainers, 1 server, a 5% cache per trainer) on Zipf 1.2
data (bench_scaling's: the Criteo Kaggle tables capped at 100k rows, 840,543 rows), run with
`--storage memory` and with `--storage disk --storage-budget-mb` at --budget-fraction of the
server's shard (records of the rows, their optimizer state and version), the two interleaved in
every repeat; medians of the steady-state samples/s and their ratio (and each repeat's), the
server's peak RSS and CPU time per iteration in each tier, and the disk tier's rows read from and
written to its file. The files go to the run
dir (local disk); the page cache is the kernel's and may hold them (a file this size fits in it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench_checkpoint import MODEL, TOTAL_ROWS
from bench_models import cpu_snapshot
from bench_reference import _foreign_fraction
from bench_scaling import BATCH, data_set

from bagpipe.config import TrainConfig
from bagpipe.optim import make_row_optimizer
from bagpipe.runtime.launch import launch_local
from bagpipe.storage.disk import record_bytes

DIM = MODEL.emb_dim


def shard_bytes(optimizer: str) -> int:
    """The one server's shard on disk: a record per row (row, optimizer state, version)."""
    return TOTAL_ROWS * record_bytes(DIM, make_row_optimizer(optimizer, lr=0.01).state_width(DIM))


def job(data: Path, run_dir: Path, *, iterations: int, storage: str, budget_mb: float) -> TrainConfig:
    return TrainConfig(data=str(data), run_dir=str(run_dir), mode="bagpipe", iterations=iterations, batch_size=BATCH,
                       optimizer="adagrad", lr=0.01, seed=0, warmup_iterations=20, log_every=50, max_eval_rows=2048,
                       trainers=2, servers=1, cache_rows=TOTAL_ROWS // 20, timeout=120.0, storage=storage,
                       storage_budget_mb=budget_mb, model=MODEL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=None, help="data and run dirs (default: a new temporary dir)")
    parser.add_argument("--out", default="runs/bench_storage/result.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=600)
    parser.add_argument("--budget-fraction", type=float, default=0.05, help="the disk tier's DRAM budget, as a "
                        "share of the server's shard")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_storage_"))
    data = data_set(work, zipf=1.2, iterations=args.iterations)
    budget_mb = args.budget_fraction * shard_bytes("adagrad") / 2**20
    samples: dict[str, list[float]] = {"memory": [], "disk": []}
    server_rss: dict[str, list[int]] = {"memory": [], "disk": []}
    server_cpu: dict[str, list[float]] = {"memory": [], "disk": []}  # CPU seconds per iteration
    storage_stats, foreign = [], []
    for repeat in range(args.repeats):
        for tier in ("memory", "disk"):
            config = job(data, work / tier, iterations=args.iterations, storage=tier, budget_mb=budget_mb)
            before = cpu_snapshot()
            summary = launch_local(config, show_progress=False, overwrite=True)
            foreign.append(_foreign_fraction(before, cpu_snapshot()) or 0.0)
            samples[tier].append(summary["samples_per_s"])
            server_rss[tier].append(summary["peak_rss_bytes"]["server0"])
            server_cpu[tier].append(summary["cpu_s"]["server0"] / args.iterations)
            if tier == "disk":
                storage_stats.append(summary["storage"])
            print(json.dumps({"tier": tier, "repeat": repeat, "samples_per_s": summary["samples_per_s"],
                              "server_peak_rss_mb": summary["peak_rss_bytes"]["server0"] / 2**20,
                              "server_cpu_ms_per_iteration": 1e3 * server_cpu[tier][-1],
                              "storage": summary["storage"]}), flush=True)
    medians = {tier: statistics.median(values) for tier, values in samples.items()}
    result = {"settings": vars(args), "shard_mb": shard_bytes("adagrad") / 2**20, "budget_mb": budget_mb,
              "samples_per_s": samples, "medians": medians, "ratio_disk_to_memory": medians["disk"] / medians["memory"],
              "server_peak_rss_mb": {tier: statistics.median(v) / 2**20 for tier, v in server_rss.items()},
              "server_cpu_ms_per_iteration": {tier: 1e3 * statistics.median(v) for tier, v in server_cpu.items()},
              "pairwise_ratios": [d / m for m, d in zip(samples["memory"], samples["disk"])],
              "disk_storage": storage_stats[-1], "other_cpu_median": statistics.median(foreign)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"memory {medians['memory']:,.0f} samples/s, disk {medians['disk']:,.0f} samples/s "
          f"({result['ratio_disk_to_memory']:.3f}x) with a {budget_mb:.1f} MiB budget for a "
          f"{result['shard_mb']:.1f} MiB shard; server peak RSS {result['server_peak_rss_mb']}, CPU ms per "
          f"iteration {result['server_cpu_ms_per_iteration']}; "
          f"disk tier {storage_stats[-1]}; other CPU {result['other_cpu_median']:.1%}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
