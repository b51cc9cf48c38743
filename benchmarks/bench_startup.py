"""How soon a local job trains, and how soon a lost trainer's replacement has it training again: before/after.

    .venv/bin/python benchmarks/bench_startup.py --before-src ../base/src [--repeats 3] [--work-dir DIR]
        [--out runs/bench_startup/result.json]

Small jobs (`bagpipe train --mode bagpipe`, DLRM at width 8, 2 trainers, 2 servers, batch 128, a cache of 700 of the
861 rows of Criteo's 26 tables capped at 40 rows), so that what is measured is the runtime's fixed costs, not
compute: ``startup_s`` (the job's start to its first iteration, summary.json) of a 100-iteration job, and, in a
400-iteration job whose trainer 1 is SIGKILLed after iteration 100, the seconds from the loss to its replacement
joined and to training going on (summary.json's failure record). Each repeat runs the code under --before-src
(PYTHONPATH) and this tree's alternately; medians, and the after/before ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from before_after import parse, synth_once  # (benchmarks/, beside this file)

JOB = ["--mode", "bagpipe", "--batch-size", "128", "--cache-rows", "700", "--emb-dim", "8", "--arch-mlp-bot",
       "13-16-8", "--arch-mlp-top", "16-1", "--trainers", "2", "--servers", "2", "--log-every", "10", "--no-progress"]
KILL = "trainer1@iteration 100:kill"


def run(src: Path, data: Path, run_dir: Path, *, iterations: int, faults: str = "") -> dict:
    env = dict(os.environ, PYTHONPATH=str(src), BAGPIPE_FAULTS=faults)
    done = subprocess.run([sys.executable, "-m", "bagpipe.cli", "train", "--data", str(data), "--run-dir",
                           str(run_dir), "--iterations", str(iterations), *JOB], env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"{src}: the job failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    figures = {"startup_s": summary["startup_s"]}
    if faults:
        (failure,) = summary["failures"]
        figures.update(joined_in_s=failure["joined_in_s"], recovered_in_s=failure["recovered_in_s"])
    return figures


def main() -> None:
    args, work, sources = parse(__doc__, name="bench_startup", repeats=3)
    data = synth_once(work / "data", "--rows", "40000", "--test-rows", "2000", "--seed", "3", "--max-rows-per-table",
                      "40")
    results: dict[str, list[dict]] = {name: [] for name in sources}
    for repeat in range(args.repeats):
        for name, src in sources.items():
            figures = run(src, data, work / f"{name}{repeat}", iterations=100)
            figures.update(run(src, data, work / f"{name}{repeat}-kill", iterations=400, faults=KILL))
            results[name].append(figures)
            print(f"repeat {repeat} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()), flush=True)
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
               for name, runs in results.items()}
    ratios = {key: medians["after"][key] / medians["before"][key] for key in medians["after"]}
    for key, ratio in ratios.items():
        print(f"{key}: before {medians['before'][key]:.3f} s, after {medians['after'][key]:.3f} s ({ratio:.2f}x)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": results, "medians": medians, "after_over_before": ratios}, indent=2) + "\n")


if __name__ == "__main__":
    main()
