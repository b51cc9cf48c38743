"""The ``bagpipe`` command: synth, preprocess, train, export, plan-stats."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

from bagpipe.progress import setup_logging

log = logging.getLogger("bagpipe")


def _add_synth(sub) -> None:
    p = sub.add_parser("synth", help="write synthetic Criteo-format data with a known best AUC")
    p.add_argument("--out", required=True, help="output directory (train.tsv, test.tsv, meta.json)")
    p.add_argument("--rows", type=int, required=True, help="training rows")
    p.add_argument("--test-rows", type=int, default=None, help="test rows (default: rows / 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tables", default=None, help="a preset of table sizes (default: criteo-kaggle)")
    p.add_argument("--table-sizes", default=None, help="comma-separated table sizes, instead of --tables")
    p.add_argument("--max-rows-per-table", type=int, default=0, help="cap every table at this many rows")
    p.add_argument("--zipf", type=float, default=None, help="Zipf exponent of the ids (default 1.2)")


def _add_preprocess(sub) -> None:
    p = sub.add_parser("preprocess", help="convert Criteo TSV or JSON lines to the binary format")
    p.add_argument("--input", required=True, help="a file, or a directory holding train.* and test.*")
    p.add_argument("--format", choices=("criteo", "jsonl"), default=None, help="default: from the suffix")
    p.add_argument("--out", required=True)
    p.add_argument("--table-sizes", default=None, help="comma-separated table sizes")
    p.add_argument("--meta", default=None, help="a meta.json holding table_sizes (as `bagpipe synth` writes)")
    p.add_argument("--on-bad-row", choices=("error", "skip"), default="error")


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a DLRM")
    p.add_argument("--config", default=None, help="a TOML file; flags override it")
    p.add_argument("--data", default=None)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--mode", default=None, help="reference (one process, all tables in memory)")
    p.add_argument("--iterations", type=int, default=None, help="0: one pass over the training split")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--eval-batch-size", type=int, default=None)
    p.add_argument("--emb-dim", type=int, default=None)
    p.add_argument("--optimizer", default=None, help="sgd, adagrad or adam")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--shuffle", action="store_true", default=None)
    p.add_argument("--shuffle-seed", type=int, default=None)
    p.add_argument("--warmup-iterations", type=int, default=None)
    p.add_argument("--log-every", type=int, default=None)
    p.add_argument("--max-eval-rows", type=int, default=None)
    p.add_argument("--arch-mlp-bot", default=None, help="e.g. 13-512-256-64-16 (ends in the embedding dim)")
    p.add_argument("--arch-mlp-top", default=None, help="e.g. 512-256-1 (sizes after the interaction)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-progress", action="store_true")


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a run's parameters to one .pt file")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)


def _add_plan_stats(sub) -> None:
    p = sub.add_parser("plan-stats", help="plan a cache policy over a data set and print what it moves")
    p.add_argument("--data", required=True, help="a preprocessed data set (its train split is planned)")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--cache-rows", type=int, required=True)
    p.add_argument("--lookahead", type=int, default=200)
    p.add_argument("--policy", default="lookahead", help="lookahead, lru, lfu, none or belady")
    p.add_argument("--iterations", type=int, default=0, help="0: one pass over the split")
    p.add_argument("--trainers", type=int, default=1)
    p.add_argument("--cleanup-fraction", type=float, default=0.0,
                   help="when evicting, also free this share of the cache (fewer, larger eviction rounds)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bagpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_synth, _add_preprocess, _add_train, _add_export, _add_plan_stats):
        add(sub)
    return parser


def run_synth(args) -> None:
    from bagpipe.synth import DEFAULT_ZIPF, generate, resolve_table_sizes

    sizes = resolve_table_sizes(tables=args.tables, table_sizes=args.table_sizes,
                                max_rows_per_table=args.max_rows_per_table)
    test_rows = args.test_rows if args.test_rows is not None else max(args.rows // 10, 1)
    meta = generate(args.out, rows=args.rows, test_rows=test_rows, seed=args.seed, table_sizes=sizes,
                    zipf=args.zipf if args.zipf is not None else DEFAULT_ZIPF)
    log.info("wrote %d train and %d test rows to %s (best achievable AUC %.4f)", meta["train_rows"],
             meta["test_rows"], args.out, meta.get("best_auc", math.nan))


def run_preprocess(args) -> None:
    from bagpipe.data.preprocess import preprocess

    meta = preprocess(args.input, args.out, fmt=args.format, table_sizes=args.table_sizes,
                      meta_file=args.meta, on_bad_row=args.on_bad_row)
    print(json.dumps({k: meta[k] for k in ("rows", "table_sizes", "skipped_rows", "skipped_by_reason")}))


def run_train(args) -> None:
    import torch

    from bagpipe.config import ModelConfig, TrainConfig, load_train_config
    from bagpipe.reference import train_reference

    if args.threads < 0:
        raise ValueError(f"--threads must not be negative, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    names = {f for f in TrainConfig.__dataclass_fields__ if f != "model"} | set(ModelConfig.__dataclass_fields__)
    overrides = {name: getattr(args, name) for name in names if hasattr(args, name)}
    config = load_train_config(args.config, overrides)
    summary = train_reference(config, show_progress=not args.no_progress)
    print(human_summary(summary))


def human_summary(summary: dict) -> str:
    lines = [
        f"mode {summary['mode']}: {summary['iterations']} iterations, {summary['samples']} samples",
        f"  throughput  {summary['samples_per_s']:,.0f} samples/s (steady state; wall {summary['wall_s']:.1f} s)",
        f"  train loss  {summary['final_train_loss']:.4f}",
        f"  eval AUC    {summary['eval_auc']:.4f}   log-loss {summary['eval_logloss']:.4f}",
    ]
    if summary.get("best_auc") is not None:
        gap = summary["best_auc"] - summary["eval_auc"]
        lines.append(f"  best AUC    {summary['best_auc']:.4f} (planted model; gap {gap:+.4f})")
    return "\n".join(lines)


def run_export(args) -> None:
    from bagpipe.rundir import export

    exported = export(args.run_dir, args.out)
    log.info("wrote %s: %d dense tensors, %d tables", args.out, len(exported["dense"]), len(exported["embeddings"]))


def run_plan_stats(args) -> None:
    from bagpipe.data.binary import open_dataset
    from bagpipe.planner.stats import plan_stats

    split = open_dataset(args.data).train
    print(json.dumps(plan_stats(split, batch_size=args.batch_size, cache_rows=args.cache_rows,
                                lookahead=args.lookahead, policy=args.policy, iterations=args.iterations,
                                num_trainers=args.trainers, cleanup_fraction=args.cleanup_fraction)))


COMMANDS = {"synth": run_synth, "preprocess": run_preprocess, "train": run_train, "export": run_export,
            "plan-stats": run_plan_stats}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(role=args.command)
    try:
        COMMANDS[args.command](args)
    except ValueError as err:
        log.error("%s", err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
