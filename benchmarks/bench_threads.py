"""`bagpipe train` at its default threads on an idle machine and beside one busy process: before/after.

    .venv/bin/python benchmarks/bench_threads.py --before-src ../before/src [--repeats 5] [--iterations 150]
        [--work-dir DIR] [--out runs/bench_threads/result.json]

A user's machine is rarely idle. OpenMP's worker threads, as torch's CPU build starts them, spin while they wait
for work unless ``OMP_WAIT_POLICY=PASSIVE`` is set before torch loads; beside another busy process they take the
cores it needs and wait on each other (issue 44 saw 0.37x of ``--threads 1`` on 2 cores). This runs
``--mode reference`` and ``--mode single`` (DLRM on `bagpipe synth` data, 50,000 rows) with the settings a user
gets, three ways: the code under --before-src at its defaults, this tree at its defaults, and this tree with
``--threads 1``; first on the idle machine, then beside ``python -c 'while True: pass'``. Each repeat runs the
variants one after another in a rotated order; the table gives median samples/s (summary.json, steady state) and
the ratios the issue asks for: after/before at default settings, and default/--threads 1 beside the busy process.
The children get this process's environment less OMP_WAIT_POLICY and OMP_NUM_THREADS (what a user's shell has).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from before_after import parse, synth_once  # (benchmarks/, beside this file)

MODES = ("reference", "single")
VARIANTS = ("before", "after", "after --threads 1")
BUSY = [sys.executable, "-c", "while True: pass"]


def train(src: Path, data: Path, run_dir: Path, *, mode: str, iterations: int, extra: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = str(src)
    done = subprocess.run([sys.executable, "-m", "bagpipe.cli", "train", "--data", str(data), "--run-dir",
                           str(run_dir), "--overwrite", "--mode", mode, "--iterations", str(iterations),
                           "--no-progress", *extra], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{src} {mode} {extra}: the run failed:\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())["samples_per_s"]


def measure(sources: dict[str, Path], data: Path, work: Path, *, repeats: int, iterations: int) -> dict:
    figures: dict[str, list[float]] = {}
    for r in range(repeats):
        for mode in MODES:
            order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
            for variant in order:
                src = sources[variant.split()[0]]
                extra = ["--threads", "1"] if "--threads" in variant else []
                value = train(src, data, work / "run", mode=mode, iterations=iterations, extra=extra)
                figures.setdefault(f"{mode}|{variant}", []).append(value)
                print(f"  repeat {r + 1} {mode:<9} {variant:<18} {value:>9,.0f} samples/s", flush=True)
    return {key: statistics.median(values) for key, values in figures.items()} | {"runs": figures}


def main() -> None:
    args, work, sources = parse(__doc__, name="bench_threads", repeats=5, more=lambda parser: parser.add_argument(
        "--iterations", type=int, default=150))
    data = synth_once(work / "data", "--rows", "50000", "--seed", "1", "--max-rows-per-table", "20000")
    result = {"cores": os.cpu_count(), "iterations": args.iterations, "repeats": args.repeats}
    print("idle machine:", flush=True)
    result["idle"] = measure(sources, data, work, repeats=args.repeats, iterations=args.iterations)
    print("beside one busy process:", flush=True)
    busy = subprocess.Popen(BUSY, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        result["busy"] = measure(sources, data, work, repeats=args.repeats, iterations=args.iterations)
    finally:
        busy.kill()
        busy.wait()
    print(f"\nmedian samples/s ({args.repeats} repeats, {args.iterations} iterations, {os.cpu_count()} cores)")
    print(f"{'mode':<10}{'machine':<8}" + "".join(f"{v:>20}" for v in VARIANTS) + f"{'after/before':>14}"
          + f"{'default/t1':>12}")
    for load in ("idle", "busy"):
        for mode in MODES:
            row = [result[load][f"{mode}|{v}"] for v in VARIANTS]
            print(f"{mode:<10}{load:<8}" + "".join(f"{x:>20,.0f}" for x in row)
                  + f"{row[1] / row[0]:>14.2f}{row[1] / row[2]:>12.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
