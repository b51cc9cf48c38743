"""A trainer's gradient sync: each iteration's sums over trainers (gloo), and the rows' updates that wait for theirs.

Gradients of the batch's rows are summed over trainers: the rows used again next iteration (the first ``num_now``
of each space's batch) in the blocking main sum, with the dense gradients riding along; the others in the
background, their updates applied before the row's next use or eviction. The parameters a model completes first in
the backward (DLRM's top MLP) are summed as soon as they are ready (``EarlyBucket``, as DDP's buckets). Each
iteration's update is applied on its own, in order, so the result equals synchronous training on the global batch.
A sum that fails because a trainer was lost goes to ``recover`` (trainer/recovery.py), which starts it again in a
group re-formed with the lost trainer's replacement; it is then waited for again.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import numpy as np
import torch

from bagpipe.cache import RowCache
from bagpipe.embeddings import Lookup
from bagpipe.runtime.protocol import StepMessage, TrainerStats
from bagpipe.runtime.reduce import Mean
from bagpipe.runtime.redo import main_share, row_shares


def stalled(stats: TrainerStats, kind: str, since: float) -> None:
    """Count the time since ``since`` as a stall of ``kind`` (a TrainerStats field) and in the total."""
    waited = time.perf_counter() - since
    setattr(stats, kind, getattr(stats, kind) + waited)
    stats.stall_s += waited


class GradientSync:
    """One trainer's sums over the trainers' ``group`` (None for a lost trainer's replacement until it forms the
    group of its epoch, or with one trainer) and the updates waiting for them, per space of ``caches``."""

    def __init__(self, group, *, caches: list[RowCache], stats: TrainerStats, timeout: float,
                 recover: Callable[[BaseException], bool]) -> None:
        self.group = group
        self.caches, self.stats, self.timeout, self.recover = caches, stats, timeout, recover
        self.sums: list[Mean] = []  # the sums started and not yet waited for, in the order started
        # per space, lazily synced updates: (iteration, slots, grads, mean)
        self.pending: list[deque] = [deque() for _ in caches]

    def regroup(self, group) -> None:
        """Sum in ``group`` from now on (re-formed with a lost trainer's replacement); the old one closed (its sums'
        thread and gloo's end once the sums it was given fail or finish)."""
        if self.group is not None:
            self.group.close()
        self.group = group

    def start(self, buffer: torch.Tensor, what: tuple | None = None) -> Mean:
        """Start averaging ``buffer`` over trainers in the background. ``what``: which share it is, (kind,
        iteration, space) with kind early, main or later (runtime/redo.py), so that it can be computed again
        should a trainer be lost before the sum is done."""
        if self.group is not None:
            self.stats.bytes_sent += buffer.numel() * 4
            self.stats.allreduce_bytes += buffer.numel() * 4
            if what is not None and what[0] == "main":  # the one the iteration waits for
                self.stats.allreduce_main_bytes += buffer.numel() * 4
        mean = Mean(self.group, buffer, timeout=self.timeout, what=what)
        if self.group is not None:
            self.sums.append(mean)
        return mean

    def finish(self, mean: Mean) -> torch.Tensor:
        """Wait for ``start``'s mean over trainers, left in its buffer (counted as time in sync)."""
        waited = time.perf_counter()
        buffer = self.wait(mean)
        self.stats.sync_s += time.perf_counter() - waited
        return buffer

    def wait(self, mean: Mean) -> torch.Tensor:
        """A sum's mean; one that failed because a trainer was lost is done again with its replacement."""
        while True:
            try:
                buffer = mean.wait()
            except RuntimeError as err:
                if not self.recover(err):
                    raise
                continue
            if mean in self.sums:
                self.sums.remove(mean)
            return buffer

    def sync(self, message: StepMessage, lookups: list[Lookup], extra: torch.Tensor | None = None
             ) -> torch.Tensor | None:
        """Average the rows' gradients of ``message``'s iteration over trainers and update the cached rows, space
        by space: those used next iteration now, the rest when their sum completes (``apply_pending``). ``extra``
        (the flattened dense gradients) rides along in the blocking sum and comes back averaged."""
        if all(lookup.rows.grad is None for lookup in lookups):
            raise RuntimeError("backward() did not reach the embeddings of this batch")
        now_grads, later_grads = row_shares(lookups, message)
        dense = 0 if extra is None else extra.numel()
        buffer = self.finish(self.start(main_share(extra, now_grads), what=("main", message.iteration, None)))
        if self.group is not None:
            self.stats.allreduce_main_row_bytes += (buffer.numel() - dense) * 4
        offset = dense
        for space, (grads, step) in enumerate(zip(later_grads, message.spaces)):
            cache = self.caches[space]
            now, dim = step.num_now, cache.dim
            cache.apply(step.batch_slots[:now], buffer[offset:offset + now * dim].view(-1, dim))
            offset += now * dim
            if now < len(step.batch_slots):
                mean = self.start(grads, what=("later", message.iteration, space))
                self.pending[space].append((message.iteration, step.batch_slots[now:].numpy(), grads, mean))
        return None if extra is None else buffer[:dense]

    def apply_alone(self, message: StepMessage, lookups: list[Lookup]) -> None:
        """``sync`` for a job of one trainer: nothing to sum, so the rows' gradients stay where the backward left
        them (a GPU's memory: no copies to the host and back, no waiting for the device) and update every cached
        row of the batch at once, one row-optimizer step per space, as the reference does. (``sync`` splits a
        space's rows to overlap the sums of those not used next iteration; a row's update depends on its own
        gradient and state alone, so the same values, in half the steps.)"""
        if self.group is not None:
            raise RuntimeError("apply_alone is for a trainer with no others to sum with")
        if all(lookup.rows.grad is None for lookup in lookups):
            raise RuntimeError("backward() did not reach the embeddings of this batch")
        for space, (lookup, step) in enumerate(zip(lookups, message.spaces)):
            grads = lookup.rows.grad if lookup.rows.grad is not None else torch.zeros_like(lookup.rows)
            self.caches[space].apply(step.batch_slots, grads)

    def apply_pending(self, space: int, *, upto: int, evicting: np.ndarray) -> None:
        """Apply a space's lazily synced updates from iterations <= upto, and any whose rows are evicted now."""
        pending, cache = self.pending[space], self.caches[space]
        evicted = None
        while pending:
            iteration, slots, grads, mean = pending[0]
            if iteration > upto:
                if not len(evicting):
                    break
                if evicted is None:
                    evicted = np.zeros(cache.capacity, dtype=bool)
                    evicted[evicting] = True
                if not evicted[slots].any():
                    break
            pending.popleft()
            waited = time.perf_counter()
            self.wait(mean)
            stalled(self.stats, "lazy_sync_wait_s", waited)
            cache.apply(slots, grads)

    def complete_pending(self) -> None:
        """Wait for every background sum whose update is still to be applied (a replacement takes part in them)."""
        for pending in self.pending:
            for _, _, _, mean in pending:
                self.wait(mean)


class EarlyBucket:
    """Parameters whose gradients are summed over trainers as soon as the backward completes them (none with one
    trainer). ``iteration()``: the iteration being trained, which names the sum."""

    def __init__(self, grads: GradientSync, params: list[torch.nn.Parameter], iteration: Callable[[], int]) -> None:
        self.grads, self.iteration = grads, iteration
        self.params = params if grads.group is not None else []
        self.ready = 0
        self.work = self.buffer = None
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_ready)

    def reset(self) -> None:
        self.ready, self.work, self.buffer = 0, None, None

    def _on_ready(self, _param) -> None:
        self.ready += 1
        if self.ready == len(self.params):
            self.buffer = torch.cat([p.grad.reshape(-1) for p in self.params]).cpu()  # (summed on the host)
            self.work = self.grads.start(self.buffer, what=("early", self.iteration(), None))

    def finish(self) -> torch.Tensor:
        if not self.params:
            return torch.zeros(0)
        if self.buffer is None:
            raise RuntimeError("the backward did not reach every one of the model's early parameters")
        return self.grads.finish(self.work)
