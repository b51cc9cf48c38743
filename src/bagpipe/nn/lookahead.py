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

from bagpipe.nn.slots import CLEANUP_FRACTION
from bagpipe.planner import PlannerConfig, plan_spaces

_STOP_POLL_S = 0.1


class Lookahead:
    """Iterate ``batches`` (any iterable) with ``module``'s cache planned ``lookahead`` batches ahead.

    ``module``: a CachedEmbeddingBag or a CachedEmbeddingBagCollection (``cached_spaces()``, ``plan_keys(ids)``).
    ``ids(batch)`` gives the ids the batch will look up in ``module`` (default: ``batch[0]``). The planner
    reads up to ``lookahead`` + 64 batches ahead of the one being trained, so that many are held in memory;
    when it must evict, it frees ``cleanup_fraction`` of the cache at least (fewer, larger rounds: each is a
    pass over the cache).
    With ``prefetch`` the next batch's rows are read from the host in the background (default: when the
    cache is on a GPU). The loop must look up
    exactly the planned ids; the module refuses a step that finds its cache used otherwise.
    """

    def __init__(self, batches: Iterable, module, *,
                 ids: Callable[[Any], torch.Tensor] = lambda batch: batch[0], lookahead: int = 64,
                 cleanup_fraction: float = CLEANUP_FRACTION, prefetch: bool | None = None) -> None:
        if lookahead <= 0:
            raise ValueError(f"lookahead must be positive, got {lookahead}")
        self.batches, self.module, self.ids = batches, module, ids
        self.spaces = module.cached_spaces()
        self.configs = [PlannerConfig(num_rows=space.num_rows, cache_rows=space.index.capacity, lookahead=lookahead,
                                      policy="lookahead", cleanup_fraction=cleanup_fraction) for space in self.spaces]
        # Reading ahead on a thread pays where the cache is on a GPU (the host is idle while kernels run); on
        # CPU the thread takes the cores the training's own threads use, and costs more than it hides.
        self.prefetch = prefetch if prefetch is not None else any(
            space.cache_weight.device.type != "cpu" for space in self.spaces)

    def __iter__(self) -> Iterator:
        for space in self.spaces:
            space.empty()
        steps = self._steps()
        if not self.prefetch:
            for batch, step in steps:
                self._carry_out(step, None)
                if batch is not None:
                    yield batch
            return
        yield from self._prefetched(steps)

    def _steps(self) -> Iterator[tuple[Any, tuple]]:
        """Each batch with its plan steps, one per space, and the keys each was planned from (the last step, with
        no batch, writes every row back). Planned with each id's place among its batch's rows, from the
        planner's own sort: the module's lookup of those ids needs none of its own."""
        waiting: deque = deque()

        def keys() -> Iterator[list[np.ndarray]]:
            for batch in self.batches:
                planned = self.module.plan_keys(self.ids(batch))
                waiting.append((batch, planned))
                yield planned

        for steps in plan_spaces(keys(), self.configs, inverse=True):
            batch, planned = waiting.popleft() if waiting else (None, [None] * len(steps))
            yield batch, tuple(zip(steps, planned))

    def _read(self, steps: tuple) -> list:
        return [space.read_host(step.fetch_keys) if len(step.fetch_keys) else None
                for space, (step, _) in zip(self.spaces, steps)]

    def _carry_out(self, steps: tuple, rows: list | None) -> None:
        for s, (space, (step, ids)) in enumerate(zip(self.spaces, steps)):
            space.carry_out(step, None if rows is None else rows[s], ids=ids)

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
                    ready.put((batch, step, self._read(step)))
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
