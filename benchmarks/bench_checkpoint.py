"""What checkpoints cost and how fast a killed job comes back.

    .venv/bin/python benchmarks/bench_checkpoint.py [--repeats 3] [--iterations 600] [--every 200]
        [--out runs/bench_checkpoint/result.json] [--work-dir DIR]

- Overhead: steady-state samples/s of one `--mode bagpipe` job (DLRM, 2 trainers, 1 server, 5% cache
  per trainer) with no checkpoints, with one every --every iterations, and with one every
  --every / 4, the three interleaved in every repeat; medians and ratios to no checkpoints. The
  same for `--mode reference` (1 thread). Checkpoint sizes (base and delta) from the last run.
- Resume: the job killed (SIGKILL of trainer 1, by fault injection) after iteration
  iterations - every / 2, then `--resume`d: the time from starting the resumed job to its first
  iteration done (it replays the plan to the checkpoint) against a fresh job's start-up, and
  whether the export equals the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from bench_models import cpu_snapshot
from bench_reference import _foreign_fraction, torch_threads
from bench_scaling import BATCH, data_set

from bagpipe.train.checkpoints import checkpoints_dir
from bagpipe.config import ModelConfig, TrainConfig
from bagpipe.train.reference import train_reference
from bagpipe.rundir import export
from bagpipe.runtime.launch import JobFailed, launch_local

MODEL = ModelConfig(emb_dim=16, arch_mlp_bot="13-128-16", arch_mlp_top="128-64-1")
TOTAL_ROWS = 840_543  # bench_scaling's data: the Criteo Kaggle tables capped at 100k rows


def job(data: Path, run_dir: Path, *, mode: str, iterations: int, every: int) -> TrainConfig:
    return TrainConfig(data=str(data), run_dir=str(run_dir), mode=mode, iterations=iterations, batch_size=BATCH,
                       optimizer="adagrad", lr=0.01, seed=0, warmup_iterations=20, log_every=50, max_eval_rows=2048,
                       trainers=2, servers=1, cache_rows=TOTAL_ROWS // 20, timeout=120.0, checkpoint_every=every,
                       keep_checkpoints=2, model=MODEL)


def run(config: TrainConfig, **options) -> dict:
    if config.mode == "reference":
        with torch_threads(1):
            return train_reference(config, show_progress=False, overwrite=True)
    return launch_local(config, show_progress=False, overwrite=not options.get("resume"), **options)


def sizes(run_dir: Path) -> dict:
    """Bytes of each checkpoint left in the run dir, by kind."""
    out: dict[str, list[int]] = {}
    for directory in sorted(checkpoints_dir(run_dir).glob("step-*")):
        kind = json.loads((directory / "manifest.json").read_text())["kind"]
        out.setdefault(kind, []).append(sum(p.stat().st_size for p in directory.iterdir()))
    return out


def overhead(data: Path, work: Path, args) -> dict:
    variants = {"none": 0, f"every {args.every}": args.every, f"every {args.every // 4}": args.every // 4}
    result = {}
    for mode in ("bagpipe", "reference"):
        samples: dict[str, list[float]] = {name: [] for name in variants}
        foreign: list[float] = []
        for repeat in range(args.repeats):
            for name, every in variants.items():
                config = job(data, work / f"{mode}_{every}", mode=mode, iterations=args.iterations, every=every)
                before = cpu_snapshot()
                summary = run(config)
                foreign.append(_foreign_fraction(before, cpu_snapshot()) or 0.0)
                samples[name].append(summary["samples_per_s"])
                print(json.dumps({"mode": mode, "variant": name, "repeat": repeat,
                                  "samples_per_s": summary["samples_per_s"]}), flush=True)
        medians = {name: statistics.median(values) for name, values in samples.items()}
        result[mode] = {"samples_per_s": samples, "medians": medians,
                        "ratios": {name: medians[name] / medians["none"] for name in variants},
                        "other_cpu_median": statistics.median(foreign),
                        "checkpoint_bytes": sizes(work / f"{mode}_{args.every // 4}")}
    return result


def resume(data: Path, work: Path, args) -> dict:
    whole = job(data, work / "whole", mode="bagpipe", iterations=args.iterations, every=args.every)
    fresh = launch_local(whole, show_progress=False, overwrite=True)
    broken = replace(whole, run_dir=str(work / "broken"))
    kill_at = args.iterations - args.every // 2
    try:
        launch_local(broken, show_progress=False, overwrite=True, env={"BAGPIPE_FAULTS": f"trainer1@iteration "
                                                                                         f"{kill_at}:kill"})
    except JobFailed:
        pass
    started = time.perf_counter()
    resumed = launch_local(broken, show_progress=False, resume=True)
    a, b = export(whole.run_dir, work / "a.pt"), export(broken.run_dir, work / "b.pt")
    same = all(torch.equal(a["dense"][k], b["dense"][k]) for k in a["dense"]) and all(
        torch.equal(x, y) for x, y in zip(a["embeddings"], b["embeddings"]))
    return {"killed_after_iteration": kill_at, "resumed_at": resumed["resumed_at"],
            "fresh_startup_s": fresh["startup_s"], "resumed_startup_s": resumed["startup_s"],
            "resumed_job_wall_s": time.perf_counter() - started, "export_bit_identical": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=None, help="data and run dirs (default: a new temporary dir)")
    parser.add_argument("--out", default="runs/bench_checkpoint/result.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=600)
    parser.add_argument("--every", type=int, default=200, help="iterations between checkpoints")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_checkpoint_"))
    data = data_set(work, zipf=1.2, iterations=args.iterations)
    result = {"settings": vars(args), "overhead": overhead(data, work, args), "resume": resume(data, work, args)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for mode, figures in result["overhead"].items():
        print(f"{mode}: " + ", ".join(f"{name} {figures['medians'][name]:,.0f} samples/s ({ratio:.3f}x)"
                                      for name, ratio in figures["ratios"].items())
              + f"; checkpoint bytes {figures['checkpoint_bytes']}; other CPU {figures['other_cpu_median']:.1%}")
    print("resume:", json.dumps(result["resume"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
