"""Every CTR model at its defaults against the planted best AUC of synthetic data (issue 27).

    .venv/bin/python benchmarks/bench_defaults.py [--rows 131072] [--seeds 0,1,2] [--models dlrm,fgcnn]
        [--work DIR] [--out runs/bench_defaults/result.json] [--train-args "--lr 0.003"] [--gap 0.05]

For each data seed S, `bagpipe synth --rows ROWS --seed S --out WORK/data-ROWS-seedS` once (kept in --work
and reused by every model and by later runs given the same --work); then for each model
`bagpipe train --data DATA --run-dir RUN --model M`, nothing else (what a user types; --train-args adds
flags, e.g. an lr to compare). Records the final eval AUC (summary.json), the planted best (meta.json's
best_auc), their gap, and the first and largest logged train loss (metrics.jsonl: divergence shows there);
prints a Markdown table, writes every run to --out as JSON, and exits 1 if any gap exceeds --gap.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CTR_MODELS = ("dlrm", "wide-deep", "deepfm", "dcn", "fgcnn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=131072, help="training rows of each data set")
    parser.add_argument("--seeds", default="0,1,2", help="data seeds (bagpipe synth --seed)")
    parser.add_argument("--models", default=",".join(CTR_MODELS))
    parser.add_argument("--work", default=None, help="data (kept, reused) and run dirs (default: a new temporary dir)")
    parser.add_argument("--out", default="runs/bench_defaults/result.json")
    parser.add_argument("--train-args", default="", help="flags added to every `bagpipe train` (default: none)")
    parser.add_argument("--gap", type=float, default=0.05, help="the largest acceptable best AUC - AUC")
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = sorted(set(models) - set(CTR_MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(CTR_MODELS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    extra = shlex.split(args.train_args)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_defaults_"))
    runs = []
    for seed in seeds:
        data = synth(work / f"data-{args.rows}-seed{seed}", rows=args.rows, seed=seed)
        best_auc = json.loads((data / "meta.json").read_text())["best_auc"]
        for model in models:
            run_dir = work / "runs" / f"{model}-seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)
            started = time.perf_counter()
            bagpipe("train", "--data", data, "--run-dir", run_dir, "--model", model, "--no-progress", *extra)
            row = {"model": model, "seed": seed, **outcome(run_dir, best_auc),
                   "wall_s": round(time.perf_counter() - started, 1)}
            runs.append(row)
            print(json.dumps(row), flush=True)
    result = {"settings": {"rows": args.rows, "seeds": seeds, "models": models, "train_args": extra,
                           "gap": args.gap, "work": str(work)}, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(runs, gap=args.gap))
    print(f"\nwrote {out}")
    missed = [r for r in runs if not r["gap"] <= args.gap]
    if missed:
        print(f"{len(missed)} of {len(runs)} runs end more than {args.gap} below the planted best AUC")
        sys.exit(1)


def bagpipe(*args) -> None:
    subprocess.run([sys.executable, "-m", "bagpipe.cli", *map(str, args)], check=True)


def synth(data: Path, *, rows: int, seed: int) -> Path:
    if not (data / "meta.json").is_file():
        bagpipe("synth", "--rows", rows, "--seed", seed, "--out", data)
    return data


def outcome(run_dir: Path, best_auc: float) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    config = json.loads((run_dir / "config.json").read_text())
    return {"eval_auc": summary["eval_auc"], "best_auc": best_auc, "gap": best_auc - summary["eval_auc"],
            "first_loss": losses[0], "max_loss": max(losses), "final_train_loss": summary["final_train_loss"],
            "warnings": [w["kind"] for w in summary["warnings"]],
            **{name: config[name] for name in ("optimizer", "lr", "batch_size")}}


def table(runs: list[dict], *, gap: float) -> str:
    lines = [f"| model | seed | optimizer, lr, batch | AUC | best | gap | within {gap} | first / max train loss |",
             "| --- | ---: | --- | ---: | ---: | ---: | :---: | ---: |"]
    for r in runs:
        lines.append(f"| {r['model']} | {r['seed']} | {r['optimizer']} {r['lr']:g}, {r['batch_size']} | "
                     f"{r['eval_auc']:.4f} | {r['best_auc']:.4f} | "
                     f"{r['gap']:+.4f} | {'yes' if r['gap'] <= gap else '**no**'} | "
                     f"{r['first_loss']:.3f} / {r['max_loss']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
