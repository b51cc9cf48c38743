"""The end of a job: the trained model evaluated from the servers' shards on disk, written to the run dir's
``model/`` table by table, and the run's summary (the reference's run-dir layout)."""

from __future__ import annotations

import collections
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bagpipe.train.checkpoints import ChainRows, checkpoints_dir
from bagpipe.train.evaluation import no_evaluation
from bagpipe.model_dir import MODEL_DIR, write_model_dir
from bagpipe.train.reference import best_metrics, build_model, health_summary, keeps_final, write_model
from bagpipe.rundir import RunDir
from bagpipe.runtime.protocol import TrainerStats
from bagpipe.timing import cpu_seconds, peak_rss_bytes

if TYPE_CHECKING:
    from bagpipe.runtime.oracle.service import Oracle

log = logging.getLogger(__name__)


def finish(oracle: Oracle, run: RunDir, shards: list[dict], final_rows: ChainRows, final_dir: Path) -> dict:
    """Evaluate the trained model from the servers' shards on disk, write it as ``model/`` table by table,
    then the summary (the reference's run-dir layout)."""
    config, dataset, layout = oracle.config, oracle.dataset, oracle.layout
    started_at = oracle.keeper.record.started_at  # the job's first oracle's start (a replacement's record has it)
    train_s = time.time() - started_at
    train_cpu_s = cpu_seconds()
    stats = {t: s for t, (s, _) in oracle.state.done.items()}
    dense_state = oracle.state.done[0][1] or {}
    eval_started = time.perf_counter()
    metrics = {}
    model = None if not config.model.card.built else build_model(config, dataset.schema)
    if model is None:
        log.info("the trainers' model is their own: model/ holds trainer 0's weights as it reported them "
                 "(%s), and the oracle does not evaluate it", "none" if not dense_state else f"{len(dense_state)} tensors")
    else:
        try:
            model.load_state_dict(dense_state)
        except RuntimeError as err:  # a script that named our model but trained another
            log.warning("trainer 0's weights are not the job's %s (%s): they go to model/ as reported, "
                        "unevaluated", config.model.name, str(err).splitlines()[0])
            model = None
    if model is not None:
        dense_state = model.state_dict()
        metrics = no_evaluation(model)
        if oracle.evaluations is not None:
            oracle.evaluations.submit(oracle.iterations, dense_state, final_rows)
    if oracle.evaluations is not None:
        metrics.update(oracle.evaluations.close().get(oracle.iterations, {}))
    eval_s = time.perf_counter() - eval_started
    if oracle.watch is None:  # not evaluated
        write_model_dir(run.path / MODEL_DIR, dense=dense_state, layout=layout, source=final_rows,
                        row_keys=oracle.model_row_keys(oracle.iterations),
                        info={"iteration": oracle.iterations, "mode": "bagpipe", "model": config.model.name})
    elif keeps_final(config, oracle.watch, oracle.iterations):
        write_model(run, config, oracle.iterations, metrics, dense=dense_state, layout=layout, source=final_rows,
                    row_keys=oracle.model_row_keys(oracle.iterations))
    shutil.rmtree(final_dir)
    if not config.checkpoints:  # those taken to evaluate from (--eval-every) served their purpose
        shutil.rmtree(checkpoints_dir(config.run_dir), ignore_errors=True)
    all_stats = list(stats.values())
    recoveries = {f"trainer{t}": s.extra["recoveries"] for t, s in sorted(stats.items()) if "recoveries" in s.extra}
    batch_rows = sum(s.batch_rows for s in all_stats)
    summary = {
        "mode": "bagpipe",
        "iterations": oracle.iterations,
        "samples": oracle.iterations * config.batch_size,
        "samples_per_s": stats[0].samples_per_s,
        "timed_window": stats[0].extra.get("timed_window"),  # trainer 0's steady state in wall-clock time
        "final_train_loss": (stats[0].extra.get("final_train_loss") if oracle.iterations > oracle.start
                             else run.last_train_loss()),  # (a resumed run with nothing left to train)
        **metrics,
        **best_metrics(dataset.meta),
        **({"raw_ids": dataset.numbering.summary(dataset.test)} if dataset.numbering is not None else {}),
        **health_summary(config, run, oracle.watch),
        **({"resumed_at": oracle.start} if oracle.start else {}),
        "trainers": oracle.world.num_trainers,
        "servers": oracle.world.num_servers,
        **({"parity": [s["parity"] for s in shards if "parity" in s]} if oracle.world.parity else {}),
        "failures": [failure.to_dict() for failure in oracle.replacements.failures],
        **({"epochs": oracle.reformed(),  # each re-formation of the RPC world (a replacement joined)
            # write-backs the data servers acknowledged while their parity server was lost
            "unprotected_write_backs": sum(s.get("unprotected_write_backs", 0) for s in shards)}
           if oracle.reformed() else {}),
        "model": config.model.name,
        "cache_rows": sum(oracle.job.cache_rows),
        "total_rows": layout.num_rows,
        "lookahead": config.lookahead,
        "policy": config.policy,
        "cache_mode": config.cache_mode,
        "device": stats[0].extra.get("device", "cpu"),  # where trainer 0 trained (a trainer's own --device may differ)
        "rows_fetched": sum(s.rows_fetched for s in all_stats),
        # each trainer's fetched rows copied to its device (a GPU: through reused pinned buffers; zeros on a CPU)
        "copies_to_device": {f"trainer{t}": s.extra.get("copies_to_device", {}) for t, s in sorted(stats.items())},
        "rows_written_back": sum(s.rows_written_back for s in all_stats),
        "rows_moved_per_iteration": sum(s.rows_fetched + s.rows_written_back for s in all_stats)
        / max(oracle.iterations, 1),
        # the most rows a trainer held at once that other trainers write back (until acknowledged by all)
        "others_evicted_peak_rows": max(s.extra.get("others_evicted_peak_rows", 0) for s in all_stats),
        "cache_hit_rate": sum(s.batch_hits for s in all_stats) / batch_rows if batch_rows else float("nan"),
        "embedding_stall_fraction": float(np.mean([s.stall_s / s.loop_s if s.loop_s else 0.0
                                                   for s in all_stats])),
        **{f"{kind}_fraction": float(np.mean([getattr(s, f"{kind}_s") / s.loop_s if s.loop_s else 0.0
                                               for s in all_stats]))
           for kind in ("plan_wait", "fetch_wait", "lazy_sync_wait", "sync")},
        "bytes_sent": oracle.feed.bytes_sent + sum(s.bytes_sent for s in all_stats)
        + sum(s["bytes_sent"] for s in shards),
        # what one trainer puts through gradient all-reduces per iteration (dense + rows)
        "allreduce_bytes_per_iteration": float(np.mean([s.allreduce_bytes for s in all_stats]))
        / max(oracle.iterations, 1),
        # of which the blocking main sum's (dense gradients and, replicated, the rows used again next iteration)
        "allreduce_main_bytes_per_iteration": float(np.mean([s.allreduce_main_bytes for s in all_stats]))
        / max(oracle.iterations, 1),
        "allreduce_main_row_bytes_per_iteration": float(np.mean([s.allreduce_main_row_bytes for s in all_stats]))
        / max(oracle.iterations, 1),  # of which the rows' gradients (the rest: dense)
        # partitioned cache: shared rows' gradients a trainer sends to their other users per iteration (mean)
        "rows_exchanged_per_iteration": float(np.mean([s.rows_exchanged for s in all_stats]))
        / max(oracle.iterations, 1),
        "server_fetches": sum(s["fetches"] for s in shards),
        "server_fetches_waited": sum(s["fetches_waited"] for s in shards),
        # the disk tier's rows read from and written to the servers' files, and its cache's hits and rows
        "storage": dict(sum((collections.Counter(s.get("storage", {})) for s in shards), collections.Counter())),
        "train_s": train_s,
        "eval_s": eval_s,
        "wall_s": time.time() - started_at,
        "warmup_iterations": config.warmup_iterations,
        # from the oracle's start to the end of trainer 0's first iteration
        "startup_s": stats[0].extra.get("first_iteration_at", float("nan")) - started_at,
        "time_breakdown_ms": _mean_breakdown([s.extra.get("time_breakdown_ms", {}) for s in all_stats]),
        # each trainer's aten operations and host reads in its last warm-up iteration (bagpipe.opcount), and on a
        # GPU its waits for the device there and the lines that asked for them
        **{key: {f"trainer{t}": s.extra[key] for t, s in sorted(stats.items()) if key in s.extra}
           for key in ("ops_per_iteration", "host_reads_per_iteration", "device_syncs_per_iteration",
                       "device_sync_sites") if any(key in s.extra for s in stats.values())},
        # each trainer's re-formations of the trainers' group around a replacement: when, how long, and its live
        # threads after each (bounded: nothing of an old group stays behind)
        **({"recoveries": recoveries} if recoveries else {}),
        "peak_rss_bytes": _per_role("peak_rss_bytes", peak_rss_bytes(), shards, stats),
        # CPU seconds per role up to the end of training (the oracle's: before evaluation)
        "cpu_s": _per_role("cpu_s", train_cpu_s, shards, stats),
        # the oracle while it fed the trainers, per iteration: its CPU (every thread), the producer's, the planner's
        **oracle.feed.figures.summary(),
        # each data server's CPU from ready to the end, per 1,000 rows it served (fetched or written back)
        "server_ms_per_1k_rows": {f"server{i}": round(s["serving_cpu_s"] * 1e6
                                                      / max(s.get("rows_fetched", 0) + s["rows_written"], 1), 4)
                                  for i, s in enumerate(shards) if "serving_cpu_s" in s},
    }
    run.finish(summary)
    return summary


def _per_role(key: str, oracle_value, shards: list[dict], stats: dict[int, TrainerStats]) -> dict:
    """One process figure (``key``) for every role: the oracle's own, each server's, each trainer's."""
    return {"oracle": oracle_value, **{f"server{i}": s.get(key, 0) for i, s in enumerate(shards)},
            **{f"trainer{t}": s.extra.get(key, 0) for t, s in sorted(stats.items())}}


def _mean_breakdown(breakdowns: list[dict]) -> dict:
    """Milliseconds per iteration by phase, averaged over the trainers that reported one."""
    breakdowns = [b for b in breakdowns if b]
    phases = list(dict.fromkeys(p for b in breakdowns for p in b))
    return {p: float(np.mean([b.get(p, 0.0) for b in breakdowns])) for p in phases}

