"""How iteration time and bytes moved grow with trainers, lookahead, cache size and skew; a projection.

    .venv/bin/python benchmarks/bench_scaling.py [--iterations 80] [--work-dir DIR]
        [--project-trainers 8] [--project-gbit 25]

Synthetic Criteo-shaped data (26 tables capped at 100k rows, 840,543 rows), DLRM
13-512-256-16 / 512-256-1, global batch 2048, SGD, 1 server, every job run on this machine. One
run per point (short: the figures are for shape, not for a headline); each point prints the
steady-state iteration time, its breakdown, and the rows and bytes moved per iteration, for
`--policy lookahead` and for `--policy none` (no cache: every row of every batch is fetched
and written back).

The projection takes from the measurements (a) the per-trainer compute time per sample
(forward + backward + optimizer, measured here), (b) the bytes each trainer moves per iteration
for fetches, write-backs and gradient sync, and applies them to a cluster of N trainers and S
servers, each machine with a link of L Gbit/s: compute scales as the per-trainer batch (2048 / N),
fetches and write-backs run in the background (prefetch) and cost time only beyond the compute
they hide behind, the blocking all-reduce (the main sum: dense gradients + rows used next
iteration) moves 2 (N - 1) / N of its buffer per trainer (ring), and every link must carry its
bytes: a trainer's all of its own, a server's every trainer's fetches and write-backs of its
shard. An iteration takes max(C + K / L, B / L, B_server / L) (C compute, K the blocking bytes,
B a trainer's bytes, B_server a server's). Held against whole jobs over a shaped link by
bench_network.py --project (issue 29: within 24% with one shared link, where the first version,
with no server link and every all-reduced byte blocking, was off by up to 62%). It is a model,
stated with its assumptions, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bagpipe.config import ModelConfig, TrainConfig
from bagpipe.data.preprocess import preprocess
from bagpipe.runtime.launch import launch_local
from bagpipe.synth import generate, resolve_table_sizes

BATCH = 2048
MODEL = ModelConfig(emb_dim=16, arch_mlp_bot="13-512-256-16", arch_mlp_top="512-256-1")


def data_set(work: Path, *, zipf: float, iterations: int) -> Path:
    out = work / f"bin_zipf{zipf}"
    if not (out / "train" / "header.json").is_file():
        sizes = resolve_table_sizes(tables=None, table_sizes=None, max_rows_per_table=100_000)
        generate(work / f"tsv_zipf{zipf}", rows=BATCH * (iterations + 5), test_rows=BATCH, seed=0,
                 table_sizes=sizes, zipf=zipf, show_progress=False)
        preprocess(work / f"tsv_zipf{zipf}", out, show_progress=False)
    return out


def run(work: Path, *, iterations: int, trainers: int, lookahead: int, cache_fraction: float, zipf: float,
        policy: str) -> dict:
    data = data_set(work, zipf=zipf, iterations=iterations)
    total_rows = 840_543
    config = TrainConfig(data=str(data), run_dir=str(work / "run"), mode="bagpipe", iterations=iterations,
                         batch_size=BATCH, optimizer="sgd", lr=0.05, seed=0, warmup_iterations=10, log_every=20,
                         max_eval_rows=BATCH, trainers=trainers, servers=1,
                         cache_rows=int(cache_fraction * total_rows), lookahead=lookahead, policy=policy,
                         timeout=120.0, model=MODEL)
    s = launch_local(config, show_progress=False, overwrite=True)
    breakdown = s["time_breakdown_ms"]
    return {"trainers": trainers, "lookahead": lookahead, "cache_fraction": cache_fraction, "zipf": zipf,
            "policy": policy, "iteration_ms": sum(breakdown.values()), "samples_per_s": s["samples_per_s"],
            "compute_ms": sum(breakdown.get(p, 0.0) for p in ("forward", "backward", "optimizer")),
            "sync_ms": breakdown.get("sync", 0.0) + breakdown.get("sync_wait", 0.0),
            "stall_fraction": s["embedding_stall_fraction"], "hit_rate": s["cache_hit_rate"],
            "rows_moved_per_iteration": s["rows_moved_per_iteration"],
            # per trainer: every trainer fetches every planned row, and writes back its share
            "rows_moved_per_trainer": (s["rows_fetched"] + s["rows_written_back"]) / trainers / s["iterations"],
            "allreduce_bytes_per_trainer": s["allreduce_bytes_per_iteration"],
            "allreduce_main_bytes_per_trainer": s["allreduce_main_bytes_per_iteration"],
            "allreduce_main_row_bytes_per_trainer": s["allreduce_main_row_bytes_per_iteration"],
            "bytes_per_iteration": s["bytes_sent"] / s["iterations"]}


def project(points: list[dict], *, trainers: int, gbits: list[float], dims: list[int], servers: int = 1) -> list[str]:
    """Per-iteration time of a cluster, from the measured per-sample compute and per-trainer rows.

    Rows cost (4 D + 8) bytes each (a fp32 row and its key; SGD has no optimizer state); the
    blocking all-reduce carries the main sum's dense gradients plus D floats per row used next
    iteration (both measured at D = 16). The dense model's compute and size are taken as
    independent of D (at D = 128 the MLPs' input grows; this understates compute, so it
    overstates the share of communication).
    """
    lines = ["| policy | dim | Gbit/s | compute ms | fetch + write-back MB | their time ms | blocking all-reduce MB | "
             "its time ms | a server's link ms | projected ms / iteration | samples/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for dim in dims:
        for gbit in gbits:
            bandwidth = gbit * 1e9 / 8  # bytes/s
            for policy in ("lookahead", "none"):
                at = {p["trainers"]: p for p in points if p["policy"] == policy and p["zipf"] == 1.2
                      and p["lookahead"] == 200 and p["cache_fraction"] == 0.05}
                if 1 not in at or 2 not in at:
                    continue
                # compute per sample from one trainer (whole batch, no sync); rows per trainer from two
                compute = at[1]["compute_ms"] * 1 / trainers
                move_mb = at[2]["rows_moved_per_trainer"] * (4 * dim + 8) / 1e6
                move_ms = 1e3 * move_mb * 1e6 / bandwidth
                # the main sum only: its dense part, and its rows at width D (measured at 16)
                main, main_rows = at[2]["allreduce_main_bytes_per_trainer"], at[2]["allreduce_main_row_bytes_per_trainer"]
                allreduce_mb = (main - main_rows + main_rows * dim / 16) / 1e6
                allreduce_ms = 1e3 * 2 * (trainers - 1) / trainers * allreduce_mb * 1e6 / bandwidth
                server_ms = move_ms * trainers / servers  # every trainer's fetches and write-backs of its shard
                # fetches hide behind compute until a link is busy all the time
                total = max(compute + allreduce_ms, move_ms + allreduce_ms, server_ms)
                lines.append(f"| {policy} | {dim} | {gbit:g} | {compute:.1f} | {move_mb:.2f} | {move_ms:.2f} | "
                             f"{allreduce_mb:.2f} | {allreduce_ms:.2f} | {server_ms:.2f} | {total:.1f} | "
                             f"{1e3 * BATCH / total:,.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--iterations", type=int, default=80)
    parser.add_argument("--project-trainers", type=int, default=8)
    parser.add_argument("--project-gbit", default="1,10,25", help="network speeds to project, Gbit/s")
    parser.add_argument("--project-dims", default="16,128")
    parser.add_argument("--project-only", default=None, metavar="JSONL",
                        help="skip the measurements: project from the JSON lines a previous run printed")
    args = parser.parse_args()
    gbits = [float(g) for g in args.project_gbit.split(",")]
    dims = [int(d) for d in args.project_dims.split(",")]
    if args.project_only:
        points = [json.loads(line) for line in Path(args.project_only).read_text().splitlines()
                  if line.startswith("{")]
        print("\n".join(project(points, trainers=args.project_trainers, gbits=gbits, dims=dims)))
        return
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_scaling_"))
    grid = []
    for trainers in (1, 2, 4):
        for policy in ("lookahead", "none"):
            grid.append(dict(trainers=trainers, lookahead=200, cache_fraction=0.05, zipf=1.2, policy=policy))
    for lookahead in (10, 50):
        grid.append(dict(trainers=2, lookahead=lookahead, cache_fraction=0.05, zipf=1.2, policy="lookahead"))
    for cache_fraction in (0.02, 0.10):
        grid.append(dict(trainers=2, lookahead=200, cache_fraction=cache_fraction, zipf=1.2, policy="lookahead"))
    for zipf in (0.8, 1.6):
        for policy in ("lookahead", "none"):
            grid.append(dict(trainers=2, lookahead=200, cache_fraction=0.05, zipf=zipf, policy=policy))
    points = []
    for values in grid:
        point = run(work, iterations=args.iterations, **values)
        points.append(point)
        print(json.dumps(point), flush=True)
    print("\n| trainers | lookahead | cache | zipf | policy | ms / iteration | compute ms | sync ms | stall | "
          "hit rate | rows moved / it | MB sent / it |")
    print("| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for p in points:
        print(f"| {p['trainers']} | {p['lookahead']} | {100 * p['cache_fraction']:.0f}% | {p['zipf']} | {p['policy']} | "
              f"{p['iteration_ms']:.1f} | {p['compute_ms']:.1f} | {p['sync_ms']:.1f} | "
              f"{100 * p['stall_fraction']:.1f}% | {p['hit_rate']:.3f} | {p['rows_moved_per_iteration']:,.0f} | "
              f"{p['bytes_per_iteration'] / 1e6:.2f} |")
    print(f"\nprojection: {args.project_trainers} trainers\n")
    print("\n".join(project(points, trainers=args.project_trainers, gbits=gbits, dims=dims)))


if __name__ == "__main__":
    main()
