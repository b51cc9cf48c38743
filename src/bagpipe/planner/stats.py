"""`bagpipe plan-stats`: run a policy over a preprocessed data set and count what moves."""

from __future__ import annotations

import time

import numpy as np

from bagpipe.data.batches import batch_rows, batches_per_epoch
from bagpipe.data.binary import BinarySplit
from bagpipe.embeddings import EmbeddingLayout, one_per_feature, valid_keys
from bagpipe.planner.plan import PlannerConfig, plan
from bagpipe.planner.reference import belady

STATS_POLICIES = ("lookahead", "lru", "lfu", "none", "belady")


def key_batches(split: BinarySplit, *, batch_size: int, iterations: int) -> list[np.ndarray]:
    """Each global batch's rows as flat keys (one table per feature: its offset + id), in training order."""
    layout = EmbeddingLayout(one_per_feature(split.schema, 1), split.schema)
    assert len(layout.spaces) == 1  # one width: one key space
    iterations = iterations or batches_per_epoch(split, batch_size)
    return [valid_keys(layout.keys(np.asarray(split.ids[rows], dtype=np.int64))[0])
            for rows in batch_rows(split, batch_size=batch_size, iterations=iterations, shuffle=False,
                                   shuffle_seed=0)]


def plan_stats(split: BinarySplit, *, batch_size: int, cache_rows: int, lookahead: int, policy: str,
               iterations: int = 0, num_trainers: int = 1, cleanup_fraction: float = 0.0) -> dict:
    if policy not in STATS_POLICIES:
        raise ValueError(f"--policy must be one of {', '.join(STATS_POLICIES)}, got {policy!r}")
    batches = key_batches(split, batch_size=batch_size, iterations=iterations)
    num_rows = int(sum(split.table_sizes))
    started = time.perf_counter()
    if policy == "belady":
        counts = belady(batches, cache_rows=cache_rows)
        fetched, written, peak, lookups = (counts.rows_fetched, counts.rows_written_back,
                                           counts.peak_cache_rows, counts.lookups)
    else:
        config = PlannerConfig(num_rows=num_rows, cache_rows=cache_rows, lookahead=lookahead,
                               num_trainers=num_trainers, policy=policy, cleanup_fraction=cleanup_fraction)
        fetched = written = peak = lookups = 0
        for step in plan(batches, config):
            fetched += len(step.fetch_keys)
            written += len(step.evict_keys)
            peak = max(peak, step.resident_rows)
            lookups += step.lookups
    seconds = time.perf_counter() - started
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
    }
