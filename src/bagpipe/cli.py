"""The ``bagpipe`` command: synth, preprocess, train, export, plan-stats, and the job's roles."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path

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
    p.add_argument("--mode", default=None, help="reference (one process, all tables in memory) or bagpipe "
                   "(oracle, servers and trainers started on this machine)")
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
    p.add_argument("--slices", type=int, default=None,
                   help="--mode reference: compute each batch's gradient as this many trainers do, so that "
                        "--mode bagpipe with that many trainers gives the same result bit for bit (default 1)")
    p.add_argument("--arch-mlp-bot", default=None, help="e.g. 13-512-256-64-16 (ends in the embedding dim)")
    p.add_argument("--arch-mlp-top", default=None, help="e.g. 512-256-1 (sizes after the interaction)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: torch's default; 1 per role in --mode bagpipe)")
    p.add_argument("--no-progress", action="store_true")
    _add_job_flags(p)


def _add_job_flags(p) -> None:
    g = p.add_argument_group("--mode bagpipe")
    g.add_argument("--trainers", type=int, default=None, help="trainer processes (default 2)")
    g.add_argument("--servers", type=int, default=None, help="embedding server processes (default 1)")
    g.add_argument("--cache-rows", "--cache-size", dest="cache_rows", type=int, default=None,
                   help="rows each trainer caches (default: 5%% of all rows)")
    g.add_argument("--lookahead", "--lookahead-value", dest="lookahead", type=int, default=None,
                   help="batches the oracle plans ahead (default 200)")
    g.add_argument("--policy", default=None, help="lookahead (default), lru, lfu or none (no cache)")
    g.add_argument("--cleanup-fraction", "--cleanup-batch-proportion", dest="cleanup_fraction", type=float,
                   default=None, help="when evicting, also free this share of the cache")
    g.add_argument("--prefetch-depth", type=int, default=None, help="iterations fetched ahead (default 8)")
    g.add_argument("--timeout", type=float, default=None, help="seconds any remote wait may take (default 60)")
    g.add_argument("--master-port", type=int, default=None, help="the local job's port (0: a free one)")


def _add_world_flags(p) -> None:
    g = p.add_argument_group("the job's world (flags, else the variables torchrun sets)")
    g.add_argument("--worker-id", dest="rank", type=int, default=None,
                   help="rank among all processes: 0 oracle, 1..S servers, then trainers ($RANK)")
    g.add_argument("--world-size", type=int, default=None, help="oracle + servers + trainers ($WORLD_SIZE)")
    g.add_argument("--world-size-trainers", dest="num_trainers", type=int, default=None,
                   help="trainers in the job ($BAGPIPE_TRAINERS)")
    g.add_argument("--master-ip", dest="master_addr", default=None, help="the oracle's address ($MASTER_ADDR, "
                   "default 127.0.0.1; RPC is unauthenticated: use a trusted network)")
    g.add_argument("--master-port", dest="world_port", type=int, default=None,
                   help="the oracle's store port, the job's only fixed port ($MASTER_PORT, default 29500)")
    g.add_argument("--timeout", dest="world_timeout", type=float, default=None,
                   help="seconds any remote wait may take (default 60)")


def _add_roles(sub) -> None:
    for name, text in (("oracle", "the job's oracle: reads the data, plans, feeds the trainers (rank 0)"),
                       ("role", "the role this rank plays (0: oracle, 1..S: servers, then trainers): one "
                                "command line for every process, as torchrun launches them")):
        _add_oracle_flags(sub.add_parser(name, help=text))
    for role, text in (("server", "an embedding server: one shard of every table (ranks 1..S)"),
                       ("trainer", "a trainer running the DLRM loop of --mode bagpipe (the last ranks)")):
        p = sub.add_parser(role, help=text)
        _add_world_flags(p)
        p.add_argument("--writeback-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests only


def _add_oracle_flags(p) -> None:
    p.add_argument("--config", default=None, help="a TOML file of train settings; flags override it")
    p.add_argument("--data", "--processed-csv", dest="data", default=None, help="the data directory")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--mini-batch-size", dest="batch_size", type=int, default=None, help="the global batch")
    p.add_argument("--emb-size", dest="emb_dim", type=int, default=None)
    p.add_argument("--emb-info-file", default=None, help="one table size per line, checked against the data")
    for name in ("iterations", "seed", "log-every", "warmup-iterations", "max-eval-rows", "eval-batch-size"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--optimizer", default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--arch-mlp-bot", default=None)
    p.add_argument("--arch-mlp-top", default=None)
    g = p.add_argument_group("the plan")
    g.add_argument("--cache-size", "--cache-rows", dest="cache_rows", type=int, default=None)
    g.add_argument("--lookahead-value", "--lookahead", dest="lookahead", type=int, default=None)
    g.add_argument("--policy", default=None)
    g.add_argument("--cleanup-batch-proportion", "--cleanup-fraction", dest="cleanup_fraction", type=float,
                   default=None)
    g.add_argument("--prefetch-depth", type=int, default=None)
    _add_world_flags(p)
    p.add_argument("--writeback-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests only


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a run's parameters to one .pt file")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="print a summary of finished runs and write PNG plots")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="one or more run dirs, drawn in the same plots")
    p.add_argument("--out", default=None, help="where the PNGs go (default: FIRST_RUN_DIR/report)")
    p.add_argument("--labels", default=None, help="comma-separated legend labels, one per run dir")


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
    for add in (_add_synth, _add_preprocess, _add_train, _add_export, _add_report, _add_plan_stats,
                _add_roles):
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
    if config.mode == "bagpipe":
        from bagpipe.runtime.launch import launch_local

        summary = launch_local(config, show_progress=not args.no_progress, threads=args.threads or 1)
    else:
        summary = train_reference(config, show_progress=not args.no_progress)
    print(human_summary(summary))


def human_summary(summary: dict) -> str:
    lines = [
        f"mode {summary['mode']}: {summary['iterations']} iterations, {summary['samples']} samples",
        f"  throughput  {summary['samples_per_s']:,.0f} samples/s (steady state; wall {summary['wall_s']:.1f} s)",
        f"  train loss  {summary['final_train_loss']:.4f}",
        f"  eval AUC    {summary['eval_auc']:.4f}   log-loss {summary['eval_logloss']:.4f}",
    ]
    if summary["mode"] == "bagpipe":
        lines.append(f"  cache       {summary['cache_rows']:,} of {summary['total_rows']:,} rows, hit rate "
                     f"{summary['cache_hit_rate']:.3f}, {summary['rows_moved_per_iteration']:.0f} rows moved "
                     f"per iteration, stall {100 * summary['embedding_stall_fraction']:.1f}% of trainer time")
    if summary.get("best_auc") is not None:
        gap = summary["best_auc"] - summary["eval_auc"]
        lines.append(f"  best AUC    {summary['best_auc']:.4f} (planted model; gap {gap:+.4f})")
    return "\n".join(lines)


def run_export(args) -> None:
    from bagpipe.rundir import export

    exported = export(args.run_dir, args.out)
    log.info("wrote %s: %d dense tensors, %d tables", args.out, len(exported["dense"]), len(exported["embeddings"]))


def run_report(args) -> None:
    from bagpipe.report import report

    labels = args.labels.split(",") if args.labels else None
    text, files = report(args.run_dirs, out=args.out, labels=labels)
    print(text)
    print(f"\nplots: {', '.join(str(f) for f in files)}")


def run_plan_stats(args) -> None:
    from bagpipe.data.binary import open_dataset
    from bagpipe.planner.stats import plan_stats

    split = open_dataset(args.data).train
    print(json.dumps(plan_stats(split, batch_size=args.batch_size, cache_rows=args.cache_rows,
                                lookahead=args.lookahead, policy=args.policy, iterations=args.iterations,
                                num_trainers=args.trainers, cleanup_fraction=args.cleanup_fraction)))


def _world(args):
    from bagpipe.runtime.world import world_from_env

    return world_from_env(rank=args.rank, world_size=args.world_size, num_trainers=args.num_trainers,
                          master_addr=args.master_addr, master_port=args.world_port,
                          timeout=args.world_timeout or 60.0)


def run_oracle(args) -> None:
    import dataclasses

    from bagpipe.config import ModelConfig, TrainConfig, load_train_config
    from bagpipe.runtime.oracle import run_oracle as oracle_main

    setup_logging(role="oracle", rank=0)
    world = _world(args)
    names = {f for f in TrainConfig.__dataclass_fields__ if f != "model"} | set(ModelConfig.__dataclass_fields__)
    overrides = {name: getattr(args, name) for name in names if hasattr(args, name)}
    overrides.update(mode="bagpipe", trainers=world.num_trainers, servers=world.num_servers,
                     timeout=args.world_timeout)
    config = load_train_config(args.config, overrides)
    world = dataclasses.replace(world, timeout=config.timeout)
    if args.emb_info_file:
        check_emb_info(args.emb_info_file, config.data)
    summary = oracle_main(config, world)
    print(human_summary(summary))


def check_emb_info(path: str, data: str) -> None:
    """--emb-info-file (one table size per line) must match the data's table sizes."""
    from bagpipe.data.binary import open_dataset
    from bagpipe.data.preprocess import ensure_preprocessed

    try:
        sizes = [int(line) for line in open(path).read().split()]
    except (OSError, ValueError) as err:
        raise ValueError(f"--emb-info-file {path}: expected one table size per line ({err})") from None
    actual = open_dataset(ensure_preprocessed(data, show_progress=False)).table_sizes
    if list(sizes) != list(actual):
        raise ValueError(f"--emb-info-file {path} lists {len(sizes)} tables {sizes[:4]}..., "
                         f"but {data} has {len(actual)} tables {list(actual)[:4]}...")


def run_server(args) -> None:
    from bagpipe.runtime.server import run_server as server_main

    world = _world(args)
    setup_logging(role="server", rank=world.rank)
    server_main(world)


def run_trainer(args) -> None:
    from bagpipe.runtime.trainer import run_trainer as trainer_main

    world = _world(args)
    setup_logging(role="trainer", rank=world.rank)
    trainer_main(world, writeback_delay=args.writeback_delay)


def run_role(args) -> None:
    role, _ = _world(args).role
    {"oracle": run_oracle, "server": run_server, "trainer": run_trainer, "role": run_role}[role](args)


COMMANDS = {"synth": run_synth, "preprocess": run_preprocess, "train": run_train, "export": run_export,
            "report": run_report, "plan-stats": run_plan_stats, "oracle": run_oracle, "server": run_server, "trainer": run_trainer, "role": run_role}


ROLES = ("oracle", "server", "trainer", "role")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(role=args.command)
    code = 0
    profile_dir = os.environ.get("BAGPIPE_PROFILE_DIR") if args.command in ROLES else None
    try:
        if profile_dir:  # a cProfile of this role, for finding where its time goes
            import cProfile

            Path(profile_dir).mkdir(parents=True, exist_ok=True)
            name = f"{args.command}{args.rank if args.rank is not None else os.environ.get('RANK', '')}"
            cProfile.runctx("COMMANDS[args.command](args)", globals(), {"args": args},
                            str(Path(profile_dir) / f"{name}.prof"))
        else:
            COMMANDS[args.command](args)
    except ValueError as err:
        log.error("%s", err)
        code = 2
    except (RuntimeError, TimeoutError, ConnectionError) as err:
        log.error("%s", err)
        code = 1
    except Exception as err:
        log.exception("%s: %s", type(err).__name__, err)
        code = 1
    if code and args.command in ROLES:
        # A failed role leaves at once: tearing down RPC with peers gone can hang or abort.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
