"""``Lookahead``: batches handed out with a CachedEmbeddingBag's cache run by the planner that sees them coming.

The planner (bagpipe.planner, the oracle's own, near Belady's MIN) reads the ids of the batches ahead and
says, before each batch, which rows to evict and which to fetch into which slots. While the caller trains
on batch i, a background thread reads batch i+1's missing rows from the host table; they are installed
when the caller asks for batch i+1, after batch i's backward has updated its rows. A row to fetch is never
cached while it is read (it is missing), and a row written back to the host is written before the read
that follows its step, so the read rows are exactly the ones a synchronous fetch would read.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from bagpipe.nn.cached_bag import CachedEmbeddingBag
from bagpipe.planner import PlannerConfig, plan

_STOP_POLL_S = 0.1


class Lookahead:
    """Iterate ``batches`` (any iterable) with ``module``'s cache planned ``lookahead`` batches ahead.

    ``ids(batch)`` gives the ids the batch will look up in ``module`` (default: ``batch[0]``). The planner
    reads up to ``lookahead`` + 64 batches ahead of the one being trained, so that many are held in memory.
    With ``prefetch`` the next batch's rows are read from the host in the background. The loop must look up
    exactly the planned ids; the module refuses a step that finds its cache used otherwise.
    """

    def __init__(self, batches: Iterable, module: CachedEmbeddingBag, *,
                 ids: Callable[[Any], torch.Tensor] = lambda batch: batch[0], lookahead: int = 64,
                 prefetch: bool = True) -> None:
        if lookahead <= 0:
            raise ValueError(f"lookahead must be positive, got {lookahead}")
        self.batches, self.module, self.ids = batches, module, ids
        self.config = PlannerConfig(num_rows=module.num_embeddings, cache_rows=module.index.capacity,
                                    lookahead=lookahead, policy="lookahead")
        self.prefetch = prefetch

    def __iter__(self) -> Iterator:
        self.module.empty_cache()
        steps = self._steps()
        if not self.prefetch:
            for batch, step in steps:
                self._carry_out(step, None)
                if batch is not None:
                    yield batch
            return
        yield from self._prefetched(steps)

    def _steps(self) -> Iterator[tuple[Any, Any]]:
        """Each batch with its plan step (the last step, with no batch, writes every row back)."""
        waiting: deque = deque()

        def keys() -> Iterator[np.ndarray]:
            for batch in self.batches:
                waiting.append(batch)
                yield np.asarray(self.ids(batch).detach().cpu().numpy(), dtype=np.int64).reshape(-1)

        for step in plan(keys(), self.config):
            yield (waiting.popleft() if waiting else None), step

    def _carry_out(self, step, rows) -> None:
        self.module.carry_out(evict_keys=step.evict_keys, evict_slots=step.evict_slots, fetch_keys=step.fetch_keys,
                              fetch_slots=step.fetch_slots, rows=rows)

    def _prefetched(self, steps: Iterator[tuple[Any, Any]]) -> Iterator:
        ready: queue.Queue = queue.Queue(maxsize=1)
        carried_out = threading.Semaphore(1)  # the reader's licence: the step before its next has been carried out
        stop = threading.Event()

        def read_ahead() -> None:
            try:
                for batch, step in steps:
                    while not carried_out.acquire(timeout=_STOP_POLL_S):
                        if stop.is_set():
                            return
                    rows = self.module.read_host(step.fetch_keys) if len(step.fetch_keys) else None
                    ready.put((batch, step, rows))
                ready.put(None)
            except BaseException as error:  # handed to the caller's thread
                ready.put(error)

        reader = threading.Thread(target=read_ahead, name="lookahead", daemon=True)
        reader.start()
        try:
            while (item := ready.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                batch, step, rows = item
                self._carry_out(step, rows)
                carried_out.release()
                if batch is not None:
                    yield batch
        finally:
            stop.set()
            while reader.is_alive():  # unblock a reader waiting to put its next step
                try:
                    ready.get(timeout=_STOP_POLL_S)
                except queue.Empty:
                    pass
            reader.join()
