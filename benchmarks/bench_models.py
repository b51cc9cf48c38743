"""Steady-state samples/s of every model: the reference, bagpipe with the lookahead cache, and with none.

    .venv/bin/python benchmarks/bench_models.py [--repeats 3] [--iterations 120] [--models dlrm,caser]
        [--out runs/bench_models/result.json] [--work-dir DIR] [--reference-threads 1]

For each model (`--model dlrm|wide-deep|deepfm|dcn|fgcnn|caser`) three systems, interleaved in
every repeat so that machine noise hits them alike:

- reference  `--mode reference`: one process, every table in memory, --reference-threads torch
             threads (default 1: each bagpipe trainer has 1 too, and 2 collapse on a shared 2-core machine)
- lookahead  `--mode bagpipe --policy lookahead`: oracle, 1 server, 2 trainers (1 thread each),
             each trainer caching --cache-fraction of all rows
- none       the same job with `--policy none`: no cache, every row fetched every iteration

Data: the CTR models share one synthetic Criteo-shaped set (the 26 Criteo Kaggle tables capped
at 100k rows, Zipf 1.2, as bench_scaling.py makes it), CASER a synthetic interaction log
(`bagpipe synth --kind sequences`). Shapes are small on purpose (see MODELS) so that the default
run ends in about 11 minutes on 2 cores. Each run's samples/s, cache hit rate and rows moved per
iteration come from its summary.json; medians over the repeats and the ratios lookahead /
reference and lookahead / none are printed as a markdown table and written with every run to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench_reference import _cpu_snapshot, _foreign_fraction, torch_threads
from bench_scaling import BATCH, data_set

import bagpipe
from bagpipe.config import ModelConfig, TrainConfig
from bagpipe.data.prepare import ensure_preprocessed
from bagpipe.preflight import job_layout, prepare_data
from bagpipe.train.reference import train_reference
from bagpipe.runtime.launch import launch_local
from bagpipe.synth_sequences import generate_sequences

DIM = 16
MODELS = {  # each model's shape, small enough for 2 cores; every other setting at its default
    "dlrm": {"arch_mlp_bot": f"13-128-{DIM}", "arch_mlp_top": "128-64-1"},
    "wide-deep": {"deep_mlp": "256-128"},
    "deepfm": {"deep_mlp": "256-128"},
    "dcn": {"deep_mlp": "256-128", "cross_layers": 3},
    "fgcnn": {"deep_mlp": "128", "conv_channels": "4-4", "conv_kernel": 3, "conv_pool": 2, "recombine": 1},
    "caser": {"vertical_filters": 4, "horizontal_filters": 16},
}
SYSTEMS = ("reference", "lookahead", "none")
# FGCNN is the heaviest by far (its pairwise products over the raw and generated fields): a smaller
# batch keeps its runs as long as the others'. Caser's batches touch most of a small item
# vocabulary (2,300 of 3,000 output items in a batch of 1,024): its cache must hold the item tables
# whole, so it also gets a cache of its own (--caser-cache-fraction).
BATCH_OF = {"fgcnn": 1024, "caser": 1024}
SEQUENCES = {"users": 20_000, "items": 3_000, "interactions": 20}
FIELDS = ("samples_per_s", "cache_hit_rate", "rows_moved_per_iteration", "embedding_stall_fraction", "startup_s",
          "final_train_loss", "wall_s", "cache_rows", "total_rows", "foreign_cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=None, help="data and run dirs (default: a new temporary dir)")
    parser.add_argument("--out", default="runs/bench_models/result.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20, help="iterations left out of samples/s")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--cache-fraction", type=float, default=0.05, help="rows each trainer caches (CTR models)")
    parser.add_argument("--caser-cache-fraction", type=float, default=0.5, help="the same for caser")
    parser.add_argument("--reference-threads", type=int, default=1,
                        help="torch threads of the reference (each bagpipe role has 1); on a shared 2-core machine "
                             "2 threads collapse when other processes run (docs/history/benchmarks.md)")
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if args.warmup >= args.iterations:
        parser.error("--warmup must be below --iterations")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_models_"))
    ctr_data = data_set(work, zipf=1.2, iterations=args.iterations)
    sequence_data = make_sequences(work) if "caser" in models else None
    settings = {"iterations": args.iterations, "warmup": args.warmup, "repeats": args.repeats, "emb_dim": DIM,
                "optimizer": "adagrad", "trainers": 2, "servers": 1, "lookahead": 200,
                "reference_threads": args.reference_threads, "batch": {m: BATCH_OF.get(m, BATCH) for m in models},
                "cache_fraction": {m: args.caser_cache_fraction if m == "caser" else args.cache_fraction
                                   for m in models},
                "shapes": {m: MODELS[m] for m in models}, "sequences": SEQUENCES, "cpu_count": os.cpu_count(),
                "bagpipe_src": str(Path(bagpipe.__file__).parent),
                "load_average_before": os.getloadavg()}
    jobs = {}
    for model in models:
        data = sequence_data if model == "caser" else ctr_data
        shape = dict(data=data, model=model, args=args)
        cache_rows = cache_rows_for(job("lookahead", run_dir=work / "-", cache_rows=0, **shape),
                                    settings["cache_fraction"][model])
        for system in SYSTEMS:
            jobs[model, system] = job(system, run_dir=work / f"run_{model}_{system}", cache_rows=cache_rows, **shape)
    runs: list[dict] = []
    for repeat in range(args.repeats):
        for model in models:
            for system in SYSTEMS:
                started, cpu = time.perf_counter(), cpu_snapshot()
                summary = run(jobs[model, system], reference_threads=args.reference_threads)
                summary["foreign_cpu"] = _foreign_fraction(cpu, cpu_snapshot())
                row = {"model": model, "system": system, "repeat": repeat,
                       **{k: summary.get(k) for k in FIELDS}, "launch_s": time.perf_counter() - started}
                runs.append(row)
                print(json.dumps(row), flush=True)
    settings["load_average_after"] = os.getloadavg()
    result = {"settings": settings, "medians": medians(runs), "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"\nwrote {out}")


def make_sequences(work: Path) -> Path:
    raw = work / "sequences"
    if not (raw / "ratings.csv").is_file():
        generate_sequences(raw, seed=0, show_progress=False, **SEQUENCES)
    return Path(ensure_preprocessed(raw, show_progress=False))


def job(system: str, *, data: Path, run_dir: Path, model: str, cache_rows: int, args) -> TrainConfig:
    common = dict(data=str(data), run_dir=str(run_dir), iterations=args.iterations,
                  batch_size=BATCH_OF.get(model, BATCH), optimizer="adagrad", lr=0.01, seed=0,
                  warmup_iterations=args.warmup, log_every=20, max_eval_rows=2048,
                  model=ModelConfig(name=model, emb_dim=DIM, **MODELS[model]))
    if system == "reference":
        return TrainConfig(mode="reference", **common)
    return TrainConfig(mode="bagpipe", trainers=2, servers=1, cache_rows=cache_rows, lookahead=200, policy=system,
                       timeout=120.0, **common)


def cache_rows_for(config: TrainConfig, fraction: float) -> int:
    """``fraction`` of the model's embedding rows (two spaces for wide-deep and deepfm, four tables for caser)."""
    return int(fraction * job_layout(config, prepare_data(config)).num_rows)


def cpu_snapshot() -> tuple[float, float, float] | None:
    """bench_reference's snapshot with our children's CPU (the bagpipe roles, once reaped) counted as ours."""
    snapshot, own = _cpu_snapshot(), os.times()
    return snapshot and (*snapshot[:2], own.user + own.system + own.children_user + own.children_system)


def run(config: TrainConfig, *, reference_threads: int) -> dict:
    """One run; its summary.json."""
    if config.mode == "reference":
        with torch_threads(reference_threads):
            train_reference(config, show_progress=False, overwrite=True)
    else:
        launch_local(config, show_progress=False, overwrite=True)
    return json.loads((Path(config.run_dir) / "summary.json").read_text())


def medians(runs: list[dict]) -> dict:
    """{model: {system: median of each field}} and each model's ratios."""
    out: dict[str, dict] = {}
    for model in dict.fromkeys(r["model"] for r in runs):
        per = {}
        for system in SYSTEMS:
            rows = [r for r in runs if r["model"] == model and r["system"] == system]
            per[system] = {k: statistics.median(r[k] for r in rows) for k in FIELDS
                           if all(isinstance(r[k], (int, float)) for r in rows)}
            per[system]["runs"] = [r["samples_per_s"] for r in rows]
        per["lookahead_over_reference"] = per["lookahead"]["samples_per_s"] / per["reference"]["samples_per_s"]
        per["none_over_reference"] = per["none"]["samples_per_s"] / per["reference"]["samples_per_s"]
        per["lookahead_over_none"] = per["lookahead"]["samples_per_s"] / per["none"]["samples_per_s"]
        out[model] = per
    return out


def table(result: dict) -> str:
    s, pct = result["settings"], lambda x: f"{100 * x:.1f}%"  # noqa: E731
    lines = [f"\n{s['iterations']} iterations ({s['warmup']} warm-up), medians of {s['repeats']}; dim {s['emb_dim']}, "
             f"{s['optimizer']}; reference {s['reference_threads']} thread(s); bagpipe {s['trainers']} trainers, "
             f"{s['servers']} server, lookahead {s['lookahead']}; other CPU: the median share of the "
             f"{s['cpu_count']} cores that other processes used during the model's runs\n",
             "| model | reference | lookahead | none | lookahead / reference | none / reference | lookahead / none "
             "| other CPU |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for model, m in result["medians"].items():
        foreign = statistics.median(m[system]["foreign_cpu"] for system in SYSTEMS)
        lines.append(f"| {model} | " + " | ".join(f"{m[system]['samples_per_s']:,.0f}" for system in SYSTEMS)
                     + f" | {m['lookahead_over_reference']:.2f}x | {m['none_over_reference']:.2f}x "
                     f"| {m['lookahead_over_none']:.2f}x | {pct(foreign)} |")
    lines += ["", "| model | shape | batch | cache / trainer | hit rate | rows moved / it (lookahead / none) "
              "| stall (lookahead / none) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for model, m in result["medians"].items():
        la, no = m["lookahead"], m["none"]
        shape = ", ".join(f"{k} {v}" for k, v in s["shapes"][model].items())
        lines.append(f"| {model} | {shape} | {s['batch'][model]} | {la['cache_rows']:,.0f} of {la['total_rows']:,.0f} "
                     f"| {la['cache_hit_rate']:.3f} | {la['rows_moved_per_iteration']:,.0f} / "
                     f"{no['rows_moved_per_iteration']:,.0f} | {pct(la['embedding_stall_fraction'])} / "
                     f"{pct(no['embedding_stall_fraction'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
