"""A trainer's side of the partitioned cache (planner/partitioned.py): its own part of every plan step carried out
on its caches, and each iteration's row gradients summed among each row's users only, and applied by its holders.

At a boundary the trainer first installs the last boundary's late fetches (rows it joined as a keeper), applies the
previous iteration's shared rows' updates (their exchange was started after the backward, just before the dense
sum in the group's order of collectives, and is waited for only now), then sends its write-backs (hand-offs to a
trainer about to fetch the row, and dirty rows it is the last to hold), lets its rows go, and only then waits for
its own fetches: a fetch may wait, at its server, for another trainer's write-back of this boundary, and every
trainer sends its write-backs before it waits, so none waits for one that is not sent. Every write-back carries the boundary's version (``iteration - 1``): the row's last
update was at an iteration before it, and any later one at this boundary or after.

After the backward, a row this trainer alone holds (``holders`` is this trainer's bit only) is updated at once with
its gradient over the trainers (the sliced reference adds the other trainers' zeros, which leave it unchanged); the
shared rows' gradients go to their other holders in one all-to-all per space (``SharedSum``: every holder adds the
users' contributions in trainer order; a trainer keeping a row it does not use now only receives), and the dense
gradients are averaged over all trainers as with the replicated cache. Every holder of a row applies the same sum
with the same row optimizer to an equal copy, so the copies stay equal to one another and to the sliced reference's
row.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from bagpipe.cache import RowCache
from bagpipe.embeddings import Lookup
from bagpipe.runtime.protocol import PartSpaceStep, StepMessage, TrainerStats
from bagpipe.runtime.reduce import SharedSum
from bagpipe.runtime.trainer.grad_sync import GradientSync, stalled


class SharedRows:
    """One trainer's row-gradient sync with the partitioned cache: own rows applied at once, shared rows summed
    among their users (``SharedSum`` over ``grads.group``) and applied at the next boundary (``apply``)."""

    def __init__(self, grads: GradientSync, *, caches: list[RowCache], stats: TrainerStats, index: int,
                 trainers: int, timeout: float) -> None:
        self.grads, self.caches, self.stats = grads, caches, stats
        self.index, self.trainers, self.timeout = index, trainers, timeout
        self.pending: list[tuple[int, np.ndarray, SharedSum]] = []  # (space, slots, sum) of the last iteration

    def sync(self, message: StepMessage, lookups: list[Lookup], extra: torch.Tensor | None
             ) -> torch.Tensor | None:
        """Update this trainer's rows of ``message``'s iteration: its own rows now, the shared ones once their sums
        arrive (``apply``); ``extra`` (the flattened dense gradients) is averaged over all trainers and returned."""
        if all(lookup.rows.grad is None for lookup in lookups):
            raise RuntimeError("backward() did not reach the embeddings of this batch")
        if self.pending:
            raise RuntimeError("the last iteration's shared rows were not applied before this one's sync")
        alone = 1 << self.index
        for space, (lookup, step) in enumerate(zip(lookups, message.spaces)):
            grads = (lookup.rows.grad if lookup.rows.grad is not None else torch.zeros_like(lookup.rows)).cpu()
            holders = step.holders.numpy()
            shared = np.flatnonzero(holders != alone)
            if self.grads.group is not None:  # every trainer starts one every iteration, in space order
                # the rows it shares and those it keeps, in key order (its contributions to the kept ones: none)
                keys = np.concatenate([step.batch_keys.numpy()[shared], step.kept_keys.numpy()])
                order = torch.from_numpy(np.argsort(keys, kind="stable"))
                kept = len(step.kept_keys)
                part = torch.cat([grads.index_select(0, torch.from_numpy(shared)),
                                  grads.new_zeros(kept, grads.shape[1])]).index_select(0, order)
                at = order.numpy()
                summed = SharedSum(self.grads.group, part,
                                   np.concatenate([step.users.numpy()[shared], step.kept_users.numpy()])[at],
                                   np.concatenate([holders[shared], step.kept_holders.numpy()])[at],
                                   trainers=self.trainers, timeout=self.timeout)
                self.stats.rows_exchanged += summed.sent_rows
                self.stats.bytes_sent += summed.sent_rows * part.shape[1] * 4
                slots = np.concatenate([step.batch_slots.numpy()[shared], step.kept_slots.numpy()])
                self.pending.append((space, slots[at], summed))
            own = np.flatnonzero(holders == alone)
            if len(own):
                self.caches[space].apply(step.batch_slots.numpy()[own],
                                         grads.index_select(0, torch.from_numpy(own)).div_(self.trainers))
        if extra is None:
            return None
        return self.grads.finish(self.grads.start(extra, what=("main", message.iteration, None)))

    def apply(self) -> None:
        """Apply the last iteration's shared rows' sums (waiting for any still in flight)."""
        for space, slots, summed in self.pending:
            waited = time.perf_counter()
            mean = summed.wait()
            stalled(self.stats, "lazy_sync_wait_s", waited)
            if len(slots):
                self.caches[space].apply(slots, mean)
        self.pending.clear()


def write_and_drop(step: PartSpaceStep, cache: RowCache) -> tuple[torch.Tensor, torch.Tensor]:
    """One space's write-backs of a boundary, read from their slots (rows and state), then the rows let go."""
    write_keys = step.write_keys.numpy()
    rows, state = cache.read(step.write_slots.numpy(), write_keys)
    if len(step.drop_keys):
        cache.evict(step.drop_slots.numpy(), step.drop_keys.numpy())
    return rows, state
