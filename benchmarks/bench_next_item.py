"""Caser at its defaults against the simple baselines, on MovieLens-100k and on planted sequences.

Each data set is preprocessed and trained with nothing but ``--data``, ``--run-dir`` and ``--model caser``
(what a new user types); the test HR@10 / NDCG@10 of the model it delivers (Caser's defaults keep the one best on
the validation split) and of its last state are read from summary.json beside the baselines the same evaluation
ranked (most popular, item-to-item co-occurrence over the last 5 items: bagpipe.ranking) and, for
planted data, the best any model can do (meta.json).

MovieLens-100k is not shipped here (its licence forbids redistribution): give the copy a package installed,
e.g. RecBole's ``ml-100k.inter`` (``pip download recbole==1.2.0 --no-deps`` and unzip
``recbole/dataset_example/ml-100k/ml-100k.inter``), with ``--movielens``.

    .venv/bin/python benchmarks/bench_next_item.py --movielens PATH/ml-100k.inter --synth-seeds 3 --out results.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BAGPIPE = [sys.executable, "-m", "bagpipe.cli"]
BASELINES = (("model", "eval_"), ("most popular", "eval_popular_"), ("co-occurrence, last 5", "eval_cooccurrence_"))


def run(args: list[str]) -> None:
    subprocess.run(BAGPIPE + args, check=True, stdout=subprocess.DEVNULL)


def measure(name: str, raw: Path, work: Path, extra: list[str]) -> dict:
    data, run_dir = work / f"{name}-data", work / f"{name}-run"
    if not data.exists():
        run(["preprocess", "--input", str(raw), "--out", str(data)])
    run(["train", "--data", str(data), "--run-dir", str(run_dir), "--model", "caser", *extra])
    summary = json.loads((run_dir / "summary.json").read_text())
    figures = {label: {m: summary[prefix + m] for m in ("hr10", "ndcg10")} for label, prefix in BASELINES}
    if summary.get("keep_best") and summary.get("best_metrics"):  # the model delivered in model/, and the last
        figures["model, last state"] = figures.pop("model")
        kept = summary["best_metrics"]
        figures = {f"model kept (iteration {summary['best_iteration']}, by validation HR@10 "
                   f"{kept.get('valid_hr10', float('nan')):.4f})": {m: kept["eval_" + m] for m in ("hr10", "ndcg10")},
                   **figures}
    if "best_hr10" in summary:
        figures["planted best"] = {"hr10": summary["best_hr10"], "ndcg10": summary["best_ndcg10"]}
    return {"data": name, "iterations": summary["iterations"], "wall_s": summary["wall_s"], "figures": figures}


def table(results: list[dict]) -> str:
    lines = ["| data | ranked | HR@10 | NDCG@10 |", "| --- | --- | ---: | ---: |"]
    for result in results:
        for label, values in result["figures"].items():
            lines.append(f"| {result['data']} | {label} | {values['hr10']:.4f} | {values['ndcg10']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--movielens", type=Path, help="an installed copy of MovieLens-100k (u.data or ml-100k.inter)")
    parser.add_argument("--synth-seeds", default="3", help="comma-separated seeds of `bagpipe synth --kind sequences`")
    parser.add_argument("--work", type=Path, default=None, help="where data and runs go (default: a temporary dir)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("train_args", nargs="*", help="extra `bagpipe train` flags (after --), e.g. --epochs 5")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_next_item-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    if args.movielens:
        results.append(measure("movielens-100k", args.movielens, work, args.train_args))
    for seed in [s for s in args.synth_seeds.split(",") if s]:
        raw = work / f"synth-{seed}"
        if not raw.exists():
            run(["synth", "--kind", "sequences", "--seed", seed, "--out", str(raw)])
        results.append(measure(f"synth sequences, seed {seed}", raw, work, args.train_args))
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
