"""Simple references for the planner: Belady's MIN with unlimited lookahead, counted in rows.

Written for clarity, not speed: the planner's tests and `plan-stats --policy belady` use it as
the optimum that the lookahead policy is measured against.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class CacheCounts:
    iterations: int
    lookups: int
    rows_fetched: int
    rows_written_back: int
    peak_cache_rows: int


def belady(batches: Sequence[np.ndarray], *, cache_rows: int) -> CacheCounts:
    """Before batch i every row of batch i is resident: fetch those missing; then, while more
    than ``cache_rows`` rows are resident, evict a resident row not used in batch i whose next
    use is furthest away (never used again counts as furthest)."""
    uniques = [np.unique(np.asarray(b, dtype=np.int64)).tolist() for b in batches]
    never = len(uniques)
    next_after: list[list[int]] = [[] for _ in uniques]
    upcoming: dict[int, int] = {}
    for i in range(len(uniques) - 1, -1, -1):
        next_after[i] = [upcoming.get(key, never) for key in uniques[i]]
        for key in uniques[i]:
            upcoming[key] = i
    resident: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key); stale entries are skipped
    fetched = written = peak = lookups = 0
    for i, keys in enumerate(uniques):
        lookups += len(batches[i])
        if len(keys) > cache_rows:
            raise ValueError(f"batch {i} touches {len(keys)} distinct rows, more than the cache's {cache_rows}")
        in_batch = set(keys)
        for key in keys:
            if key not in resident:
                resident[key] = i
                fetched += 1
        held = []
        while len(resident) > cache_rows:
            negative_next, key = heapq.heappop(heap)
            if resident.get(key) != -negative_next:
                continue  # stale entry
            if key in in_batch:
                held.append((negative_next, key))
                continue
            del resident[key]
            written += 1
        for entry in held:
            heapq.heappush(heap, entry)
        peak = max(peak, len(resident))
        for key, nxt in zip(keys, next_after[i]):
            resident[key] = nxt
            heapq.heappush(heap, (-nxt, key))
    written += len(resident)  # the final flush
    return CacheCounts(iterations=len(uniques), lookups=lookups, rows_fetched=fetched,
                       rows_written_back=written, peak_cache_rows=peak)
