"""`bagpipe plan-stats`: run a policy over a preprocessed data set and count what moves."""

from __future__ import annotations

import dataclasses

import time

import numpy as np

from bagpipe.data.batches import batch_rows, batches_per_epoch
from bagpipe.data.binary import BinarySplit
from bagpipe.embeddings import EmbeddingLayout, one_per_feature, valid_keys
from bagpipe.heap import kept_heap
from bagpipe.timing import peak_rss_bytes
from bagpipe.planner.ahead import numbered_ahead
from bagpipe.planner.partitioned import plan_partitioned
from bagpipe.planner.plan import POLICIES, PlannerConfig, number_batches, plan, plan_numbered
from bagpipe.planner.belady import belady

STATS_POLICIES = (*POLICIES, "belady")  # the planner's, and Belady's MIN (planner/belady.py) beside them


def key_batches(split: BinarySplit, *, batch_size: int, iterations: int) -> list[np.ndarray]:
    """Each global batch's rows as flat keys (one table per feature: its offset + id), in training order."""
    return [whole for whole, in slice_key_batches(split, batch_size=batch_size, iterations=iterations, trainers=1)]


def slice_key_batches(split: BinarySplit, *, batch_size: int, iterations: int, trainers: int) -> list[list[np.ndarray]]:
    """Each global batch cut into ``trainers`` equal consecutive slices, as the trainers take it, each slice's rows
    as flat keys (one table per feature: its offset + id), in training order."""
    layout = EmbeddingLayout(one_per_feature(split.schema, 1), split.schema)
    assert len(layout.spaces) == 1  # one width: one key space
    if batch_size % trainers:
        raise ValueError(f"--batch-size {batch_size} is not a multiple of the {trainers} trainers")
    size = batch_size // trainers
    iterations = iterations or batches_per_epoch(split, batch_size)
    batches = []
    for rows in batch_rows(split, batch_size=batch_size, iterations=iterations, shuffle=False, shuffle_seed=0):
        ids = np.asarray(split.ids[rows], dtype=np.int64)
        batches.append([valid_keys(layout.keys(ids[t * size:(t + 1) * size])[0]) for t in range(trainers)])
    return batches


def traffic(split: BinarySplit, *, batch_size: int, cache_rows: int, lookahead: int, trainers: int,
            iterations: int = 0, cleanup_fraction: float = 0.0, dim: int = 16, state_width: int = 0,
            keep_within: int = 0) -> dict:
    """What each trainer moves per iteration, on average over the trainers, in the two designs with ``cache_rows``
    rows per trainer: *replicated* (every trainer holds the same rows, planned on the global batch: each fetches
    every row fetched, writes back its share of the evictions and all-reduces every row of the global batch) and
    *partitioned* (planner/partitioned.py: each holds the rows its slices use, and exchanges the rows it shares with
    other users of them only). Rows fetched and written back carry the row and its optimizer state. Rows
    synchronised are the row gradients a trainer sends: replicated, 2(T-1)/T of the global batch's rows (an
    all-reduce: the ordered sum's all-to-all and all-gather, or gloo's own at two trainers, send that much);
    partitioned, each shared row once to each of its other holders (runtime/reduce.SharedSum; ``keep_within``: a
    trainer keeping a row it does not use receives its update). Rows exchanged are the distinct rows a trainer sums
    with others (the global batch's, or its shared and kept ones). The dense gradients' all-reduce, the same in
    both designs, is not counted."""
    row_bytes, grad_bytes = 4 * (dim + state_width), 4 * dim
    global_batches = key_batches(split, batch_size=batch_size, iterations=iterations)
    config = PlannerConfig(num_rows=int(sum(split.table_sizes)), cache_rows=cache_rows, lookahead=lookahead,
                           num_trainers=trainers, cleanup_fraction=cleanup_fraction)
    fetched = written = batch_rows = 0
    for step in plan(global_batches, config):
        fetched += len(step.fetch_keys)
        written += len(step.evict_keys)
        batch_rows += len(step.batch_keys)
    count = len(global_batches)
    replicated = _per_iteration(fetched, written / trainers, batch_rows * 2 * (trainers - 1) / trainers, count,
                                row_bytes, grad_bytes)
    replicated["rows_exchanged_per_iteration"] = batch_rows / max(count, 1)  # distinct rows a trainer's sum covers
    per_trainer = np.zeros((trainers, 5), dtype=np.int64)  # fetched, written back, gradients sent, own, exchanged
    for step in plan_partitioned(slice_key_batches(split, batch_size=batch_size, iterations=iterations,
                                                   trainers=trainers),
                                 dataclasses.replace(config, keep_within=keep_within)):
        for t, part in enumerate(step.trainers):
            sent = int(sum(bin(holders).count("1") - 1 for holders in part.shared_holders.tolist()))
            per_trainer[t] += (len(part.fetch_keys), len(part.write_keys), sent, len(part.own_keys),
                               len(part.shared_keys) + len(part.kept_keys))
    mean = per_trainer.mean(axis=0)
    partitioned = _per_iteration(mean[0], mean[1], mean[2], count, row_bytes, grad_bytes)
    partitioned["rows_own_per_iteration"] = float(mean[3] / count)  # updated with no exchange
    partitioned["rows_exchanged_per_iteration"] = float(mean[4] / count)  # distinct rows it sums with others
    partitioned["busiest_trainer_rows_fetched_per_iteration"] = float(per_trainer[:, 0].max() / count)
    return {"trainers": trainers, "cache_rows_per_trainer": cache_rows, "row_bytes": row_bytes,
            "replicated": replicated, "partitioned": partitioned,
            "partitioned_vs_replicated": {
                name: (partitioned[name] / replicated[name] if replicated[name] else float("nan"))
                for name in ("rows_fetched_per_iteration", "rows_written_back_per_iteration",
                             "rows_exchanged_per_iteration", "rows_synchronised_per_iteration",
                             "bytes_per_iteration")}}


def _per_iteration(fetched: float, written: float, synchronised: float, iterations: int, row_bytes: int,
                   grad_bytes: int) -> dict:
    per = 1 / max(iterations, 1)
    return {"rows_fetched_per_iteration": float(fetched * per), "rows_written_back_per_iteration": float(written * per),
            "rows_synchronised_per_iteration": float(synchronised * per),
            "bytes_per_iteration": float(((fetched + written) * row_bytes + synchronised * grad_bytes) * per)}


def plan_stats(split: BinarySplit, *, batch_size: int, cache_rows: int, lookahead: int, policy: str,
               iterations: int = 0, num_trainers: int = 1, cleanup_fraction: float = 0.0, processes: int = 1) -> dict:
    """What ``policy`` moves over the split's first ``iterations`` batches, and how fast it plans them: the whole
    run (``ids_per_s``) and after the first step (``ids_per_s_after_first_step``: the first waits for the
    lookahead's batches to be numbered, and with ``processes`` = 2 for the numbering process to start)."""
    if policy not in STATS_POLICIES:
        raise ValueError(f"--policy must be one of {', '.join(STATS_POLICIES)}, got {policy!r}")
    if processes not in (1, 2) or (processes == 2 and policy == "belady"):
        raise ValueError(f"planner processes must be 1 or 2 (2: not with belady), got {processes}")
    batches = key_batches(split, batch_size=batch_size, iterations=iterations)
    num_rows = int(sum(split.table_sizes))
    started = time.perf_counter()
    first_step = None
    child: dict = {}  # the numbering process's report (processes = 2)
    if policy == "belady":
        counts = belady(batches, cache_rows=cache_rows)
        fetched, written, peak, lookups = (counts.rows_fetched, counts.rows_written_back,
                                           counts.peak_cache_rows, counts.lookups)
        later = lookups
    else:
        config = PlannerConfig(num_rows=num_rows, cache_rows=cache_rows, lookahead=lookahead,
                               num_trainers=num_trainers, policy=policy, cleanup_fraction=cleanup_fraction)
        fetched = written = peak = lookups = 0
        numbered = (numbered_ahead(batches, num_rows=num_rows, report=child) if processes == 2
                    else number_batches(batches, num_rows=num_rows))
        with kept_heap():  # the planner's large numpy temporaries reused, not faulted in again each iteration
            for step in plan_numbered(numbered, config):
                if first_step is None:
                    first_step = time.perf_counter()
                fetched += len(step.fetch_keys)
                written += len(step.evict_keys)
                peak = max(peak, step.resident_rows)
                lookups += step.lookups
        later = lookups - (len(batches[0]) if batches else 0)
    ended = time.perf_counter()
    seconds = ended - started
    return {
        "policy": policy,
        "iterations": len(batches),
        "batch_size": batch_size,
        "cache_rows": cache_rows,
        "lookahead": lookahead,
        "num_rows": num_rows,
        "lookups": lookups,
        "rows_fetched": fetched,
        "rows_written_back": written,
        "peak_cache_rows": peak,
        "plan_seconds": seconds,
        "ids_per_s": lookups / seconds if seconds > 0 else float("nan"),
        "planner_processes": processes,
        # peak RSS of the planning process (with the batches loaded) and, with 2, of the numbering process
        "peak_rss_bytes": {"planner": peak_rss_bytes(),
                           **({"numbering": child.get("peak_rss_bytes", 0)} if processes == 2 else {})},
        "first_step_s": (first_step or ended) - started,
        "ids_per_s_after_first_step": later / (ended - first_step) if first_step and ended > first_step
        else float("nan"),
    }
