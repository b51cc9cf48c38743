"""bagpipe against TorchRec (and our reference trainer) on the same data, model and global batch.

    .venv/bin/python benchmarks/bench_peers.py [--repeats 3] [--iterations 200] [--quick]
        [--torchrec-sharding table_wise] [--optimizer sgd] [--cache-fraction 0.05] [--dim 16]
        [--systems torchrec,bagpipe,bagpipe-partitioned,reference] [--link 1gbit]

With --link RATE (or BAGPIPE_LINK=RATE; `make bench-peers LINK=1gbit`) the whole benchmark runs in a network
namespace of its own whose loopback is shaped to RATE (benchmarks/bench_network.py: root, unshare and tc needed),
so every byte between a job's processes crosses a link of that rate.

Data: synthetic Criteo-shaped, 26 tables of 100,000 rows (2.6M rows), Zipf ids. Model: DLRM,
dim 16 (--dim), bottom MLP 13-512-256-DIM, top MLP 512-256-1, global batch 2048. Systems, interleaved
in every repeat so that machine noise hits all of them alike:

- torchrec   TorchRec's DLRM in DistributedModelParallel over gloo on 2 processes, fused
             embedding optimizer (benchmarks/peer/torchrec_dlrm.py, in its own environment
             .venv-torchrec made by benchmarks/peer/setup_torchrec.sh)
- bagpipe    `--mode bagpipe`: oracle, 1 server, 2 trainers, each trainer caching
             --cache-fraction of all rows (the replicated cache: every trainer the same rows)
- bagpipe-partitioned  the same with `--cache-mode partitioned`: each trainer caches the rows
             its slices use, a row's gradient summed among its users only
- reference  `--mode reference`: one process, every table in memory, torch's default threads

Samples/s is steady state (the first --warmup iterations excluded), start-up is reported apart,
and peak RSS is per process. Medians over --repeats and the ratios between the medians are
printed as a markdown table for docs/history/benchmarks.md; raw runs go to WORK_DIR/peers.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bagpipe.config import ModelConfig, TrainConfig
from bagpipe.data.preprocess import preprocess
from bagpipe.train.reference import train_reference
from bagpipe.runtime.launch import launch_local
from bagpipe.synth import generate

ROOT = Path(__file__).resolve().parent.parent
TORCHREC_PYTHON = ROOT / ".venv-torchrec" / "bin" / "python"
TABLES, ROWS_PER_TABLE, BATCH = 26, 100_000, 2048
TOP = "512-256-1"


def bottom(dim: int) -> str:
    return f"13-512-256-{dim}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--optimizer", choices=("sgd", "adagrad"), default="sgd")
    parser.add_argument("--dim", type=int, default=16, help="embedding width (the bottom MLP ends in it)")
    parser.add_argument("--keep-within", type=int, default=4, help="bagpipe-partitioned's --keep-within")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--cache-fraction", type=float, default=0.05, help="rows each bagpipe trainer caches")
    parser.add_argument("--torchrec-sharding", default="table_wise")
    parser.add_argument("--systems", default="torchrec,bagpipe,reference",
                        help="any of torchrec, bagpipe, bagpipe-partitioned, reference, and bagpipe-before "
                             "(needs --before-src)")
    parser.add_argument("--before-src", default=None,
                        help="the src/ dir of another bagpipe checkout (e.g. `git worktree add ../before REV`), "
                             "run as system bagpipe-before: before/after figures in one run")
    parser.add_argument("--quick", action="store_true", help="60 iterations, one repeat")
    parser.add_argument("--link", default=os.environ.get("BAGPIPE_LINK", ""),
                        help="run over a loopback shaped to this rate (e.g. 1gbit; none: a namespace unshaped)")
    args = parser.parse_args()
    if args.link:
        shape(args.link)
    if args.quick:
        args.iterations, args.repeats, args.warmup = 60, 1, 10
    if not 0 < args.cache_fraction <= 0.10:
        parser.error("--cache-fraction must be in (0, 0.10]: the target is at most 10% of the rows per trainer")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_peers_"))
    data = make_data(work, iterations=args.iterations)
    systems = args.systems.split(",")
    if "torchrec" in systems:
        subprocess.run(["bash", str(ROOT / "benchmarks" / "peer" / "setup_torchrec.sh")], check=True,
                       stdout=sys.stderr)
    cache_rows = int(args.cache_fraction * TABLES * ROWS_PER_TABLE)
    results: dict[str, list[dict]] = {s: [] for s in systems}
    log = open(work / "peers.jsonl", "a")
    for repeat in range(args.repeats):
        for system in systems:
            started = time.perf_counter()
            row = RUNNERS[system](args, data, work / f"run_{system}", cache_rows)
            row.update(system=system, repeat=repeat, launch_s=time.perf_counter() - started)
            results[system].append(row)
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")
    log.close()
    print(table(results, args=args, cache_rows=cache_rows))


def shape(rate: str) -> None:
    """Run this benchmark again, as given but for --link, in a namespace whose loopback is shaped to ``rate``."""
    import bench_network

    bench_network.rate_bits(rate)
    why = bench_network.cannot_shape()
    if why:
        raise SystemExit(f"--link {rate}: {why}")
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip or arg == "--link" or arg.startswith("--link="):
            skip = arg == "--link"
            continue
        argv.append(arg)
    os.environ["BAGPIPE_LINK"] = ""  # (inside, run as given)
    print(f"bench_peers: over a loopback shaped to {rate}", file=sys.stderr)
    command = bench_network.shaped([sys.executable, str(Path(__file__).resolve()), *argv], rate)
    os.execvp(command[0], command)


def make_data(work: Path, *, iterations: int) -> Path:
    data = work / "bin"
    if not (data / "train" / "header.json").is_file():
        generate(work / "tsv", rows=BATCH * (iterations + 10), test_rows=BATCH, seed=0,
                 table_sizes=[ROWS_PER_TABLE] * TABLES)
        preprocess(work / "tsv", data)
    return data


def config(args, data: Path, run_dir: Path, **values) -> TrainConfig:
    return TrainConfig(data=str(data), run_dir=str(run_dir), iterations=args.iterations, batch_size=BATCH,
                       optimizer=args.optimizer, lr=args.lr, seed=0, warmup_iterations=args.warmup, log_every=20,
                       max_eval_rows=BATCH, model=ModelConfig(emb_dim=args.dim, arch_mlp_bot=bottom(args.dim),
                                                              arch_mlp_top=TOP),
                       **values)


def run_bagpipe(args, data: Path, run_dir: Path, cache_rows: int, *, cache_mode: str = "replicated",
                policy: str = "lookahead") -> dict:
    # over a shaped link (--link, bench_network.py) tensors go by TCP, as between machines: TensorPipe would move them
    # between processes of one machine by cross-memory attach, past the link
    channels = "basic" if os.environ.get("BAGPIPE_SHAPED_LINK") else ""
    summary = launch_local(config(args, data, run_dir, mode="bagpipe", trainers=2, servers=1, cache_rows=cache_rows,
                                  lookahead=200, policy=policy, cache_mode=cache_mode, timeout=120.0,
                                  rpc_channels=channels,
                                  keep_within=args.keep_within if cache_mode == "partitioned" else 0),
                           show_progress=False, overwrite=True)
    return {"samples_per_s": summary["samples_per_s"], "startup_s": summary["startup_s"],
            "timed_window": summary["timed_window"],
            "peak_rss_bytes": summary["peak_rss_bytes"], "final_loss": summary["final_train_loss"],
            "embedding_stall_fraction": summary["embedding_stall_fraction"],
            "time_breakdown_ms": summary["time_breakdown_ms"], "cpu_s": summary["cpu_s"],
            "rows_fetched": summary["rows_fetched"], "rows_written_back": summary["rows_written_back"],
            "allreduce_bytes_per_iteration": summary["allreduce_bytes_per_iteration"],
            "allreduce_main_bytes_per_iteration": summary["allreduce_main_bytes_per_iteration"],
            "rows_exchanged_per_iteration": summary["rows_exchanged_per_iteration"],
            "oracle_ms_per_iteration": summary["oracle_ms_per_iteration"],
            # each server's CPU while serving (from ready: its tables' initialisation left out) per iteration
            "server_ms_per_iteration": {name: ms * (summary["rows_fetched"] + summary["rows_written_back"]) / 1e3
                                        / summary["iterations"]
                                        for name, ms in summary["server_ms_per_1k_rows"].items()}}


def run_bagpipe_partitioned(args, data: Path, run_dir: Path, cache_rows: int) -> dict:
    return run_bagpipe(args, data, run_dir, cache_rows, cache_mode="partitioned")


def run_bagpipe_before(args, data: Path, run_dir: Path, cache_rows: int) -> dict:
    """The same job with another checkout's code (PYTHONPATH first), through its command line."""
    if not args.before_src:
        raise SystemExit("system bagpipe-before needs --before-src")
    command = [sys.executable, "-m", "bagpipe.cli", "train", "--mode", "bagpipe", "--data", str(data),
               "--run-dir", str(run_dir), "--iterations", str(args.iterations), "--batch-size", str(BATCH),
               "--optimizer", args.optimizer, "--lr", str(args.lr), "--seed", "0",
               "--warmup-iterations", str(args.warmup), "--log-every", "20", "--max-eval-rows", str(BATCH),
               "--trainers", "2", "--servers", "1", "--cache-rows", str(cache_rows), "--lookahead", "200",
               "--timeout", "120", "--emb-dim", str(args.dim), "--arch-mlp-bot", bottom(args.dim), "--arch-mlp-top", TOP,
               "--no-progress", "--overwrite"]  # a repeat replaces the last run
    env = dict(os.environ, PYTHONPATH=str(Path(args.before_src).resolve()))
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=sys.stderr, timeout=1800)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"samples_per_s": summary["samples_per_s"], "startup_s": summary.get("startup_s", float("nan")),
            "peak_rss_bytes": summary.get("peak_rss_bytes", {}), "final_loss": summary["final_train_loss"]}


def run_reference(args, data: Path, run_dir: Path, cache_rows: int) -> dict:
    summary = train_reference(config(args, data, run_dir, mode="reference"), show_progress=False, overwrite=True)
    return {"samples_per_s": summary["samples_per_s"], "startup_s": summary["startup_s"],
            "timed_window": summary["timed_window"],
            "peak_rss_bytes": summary["peak_rss_bytes"], "final_loss": summary["final_train_loss"],
            "time_breakdown_ms": summary["time_breakdown_ms"]}


def run_torchrec(args, data: Path, run_dir: Path, cache_rows: int, *, processes: int = 2,
                 placed: list[str] | None = None) -> dict:
    """``placed``: TorchRec's launcher's --rank-netns and --master-addr (each rank on a host of its own)."""
    command = [str(TORCHREC_PYTHON), str(ROOT / "benchmarks" / "peer" / "torchrec_dlrm.py"), "--data", str(data),
               "--processes", str(processes), "--sharding", args.torchrec_sharding, "--optimizer", args.optimizer,
               "--lr", str(args.lr), "--dim", str(args.dim), "--batch-size", str(BATCH),
               "--iterations", str(args.iterations), "--warmup", str(args.warmup), *(placed or [])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"torchrec run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    peaks = result["peak_rss_bytes"]
    return {"samples_per_s": result["samples_per_s"], "startup_s": result["startup_s"],
            "timed_window": result.get("timed_window"),
            "peak_rss_bytes": {f"rank{i}": b for i, b in enumerate(peaks)}, "final_loss": result["final_loss"],
            "sharding": result.get("sharding")}


RUNNERS = {"bagpipe": run_bagpipe, "bagpipe-partitioned": run_bagpipe_partitioned, "reference": run_reference,
           "torchrec": run_torchrec, "bagpipe-before": run_bagpipe_before}


def table(results: dict[str, list[dict]], *, args, cache_rows: int) -> str:
    med = {s: statistics.median(r["samples_per_s"] for r in runs) for s, runs in results.items() if runs}
    lines = [f"\n{TABLES} tables x {ROWS_PER_TABLE:,} rows, dim {args.dim}, DLRM {bottom(args.dim)} / {TOP}, "
             f"global batch {BATCH}, "
             f"{args.optimizer} lr {args.lr}, {args.iterations} iterations ({args.warmup} warm-up), medians of "
             f"{args.repeats}; bagpipe caches {cache_rows:,} rows per trainer "
             f"({100 * cache_rows / (TABLES * ROWS_PER_TABLE):.0f}%)\n",
             "| system | samples/s (median) | runs | vs " + ("torchrec" if "torchrec" in med else "before")
             + " | start-up s | peak RSS per process (MiB) | final loss |",
             "| --- | ---: | --- | ---: | ---: | --- | ---: |"]
    for system, runs in results.items():
        if not runs:
            continue
        base = "torchrec" if "torchrec" in med else "bagpipe-before" if "bagpipe-before" in med else None
        ratio = f"{med[system] / med[base]:.2f}x" if base else "-"
        peak = {k: max(r["peak_rss_bytes"][k] for r in runs) for k in runs[0]["peak_rss_bytes"]}
        startup = statistics.median(r["startup_s"] for r in runs)
        each = ", ".join(f"{r['samples_per_s']:,.0f}" for r in runs)
        lines.append(f"| {system} | {med[system]:,.0f} | {each} | "
                     f"{ratio} | {startup:.1f} | "
                     + (", ".join(f"{k} {v / 2**20:,.0f}" for k, v in peak.items()) or "not recorded")
                     + f" | {statistics.median(r['final_loss'] for r in runs):.4f} |")
    roles = {system: runs for system, runs in results.items() if runs and "cpu_s" in runs[0]}
    if roles:  # where each bagpipe job's time and CPU went (medians)
        lines += ["", "| system | embedding stall | CPU ms per iteration (oracle feeding / server serving / each "
                  "trainer, its start-up included) | "
                  "rows fetched / written back per iteration | rows exchanged per trainer per iteration | "
                  "all-reduce KB per trainer per iteration |", "| --- | ---: | --- | --- | ---: | ---: |"]
        for system, runs in roles.items():
            def median(get):
                return statistics.median(get(r) for r in runs)
            per = 1e3 / args.iterations
            trainers = [k for k in runs[0]["cpu_s"] if k.startswith("trainer")]
            lines.append(
                f"| {system} | {median(lambda r: r['embedding_stall_fraction']):.1%} | "
                f"{median(lambda r: r['oracle_ms_per_iteration']['cpu']):.1f} / "
                f"{median(lambda r: sum(r['server_ms_per_iteration'].values())):.1f} / "
                f"{median(lambda r: sum(r['cpu_s'][k] for k in trainers) / len(trainers)) * per:.1f} | "
                f"{median(lambda r: r['rows_fetched']) / args.iterations:,.0f} / "
                f"{median(lambda r: r['rows_written_back']) / args.iterations:,.0f} | "
                f"{median(lambda r: r['rows_exchanged_per_iteration']):,.0f} | "
                f"{median(lambda r: r['allreduce_bytes_per_iteration']) / 1e3:,.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
