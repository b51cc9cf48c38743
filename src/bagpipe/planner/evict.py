"""Choosing which cached rows go: the one eviction engine of the online policies (LRU, LFU), and the choice among
scored slots that every policy's evictions share.

Pure numpy over per-slot arrays, O(cache rows): no keys, no device. Two users drive ``OnlineHistory``: the
oracle's planner (plan.py) for its online baselines (``--policy lru``, ``lfu``: ONLINE_SCORES), and bagpipe.nn's single-process caches
(nn/slots.py's ``SlotIndex``: ``--mode single --policy lru``, a ``CachedEmbeddingBag``). Both ask it for the same
thing, the ``count`` slots to free for a batch, so a policy is written once and means the same in every mode.
(The lookahead policy needs the future, which only the planner has: plan.py scores it, and partitioned.py for the
partitioned plan; both pick by ``highest`` too.)
"""

from __future__ import annotations

import numpy as np

# The policies that need no future, by name: each slot's eviction priority (the highest go first) from its row's
# ``age`` (iterations, or batches admitted, since its last use) and ``uses`` (OnlineHistory). A policy is one entry
# here: the planner, --mode single, bagpipe.nn, the flags and plan-stats all take their names from it.
ONLINE_SCORES = {
    "lru": lambda age, uses: age,  # the longest unused
    "lfu": lambda age, uses: -uses * (1 << 32) + age,  # the least used, and among equals the longest unused
}
ONLINE_POLICIES = tuple(ONLINE_SCORES)
LOWEST = np.iinfo(np.int64).min  # the score of a slot that may not go (free, or holding a row of the batch)
_SAMPLE = 4096  # scores sampled to find a threshold above which the highest lie


def online_scores(policy: str, age: np.ndarray, uses: np.ndarray) -> np.ndarray:
    """Eviction priority under an online policy (ONLINE_SCORES), highest first."""
    if policy not in ONLINE_SCORES:
        raise ValueError(f"{policy!r} is not an online policy ({', '.join(ONLINE_POLICIES)})")
    return ONLINE_SCORES[policy](age, uses)


def evictions_needed(overflow: int, *, candidates: int, capacity: int, cleanup_fraction: float) -> int:
    """How many rows a batch's admission evicts: the ``overflow`` (its rows that find no free slot) and, to make
    rounds fewer and larger, ``cleanup_fraction`` of the cache more, as far as there are ``candidates`` (resident
    rows the batch does not use). Every policy and both engines count by this rule."""
    return min(candidates, overflow + int(cleanup_fraction * capacity))


def highest(score: np.ndarray, count: int) -> np.ndarray:
    """The positions (increasing) of the ``count`` highest of ``score``, equal scores going to the earlier position.

    The set is defined by the scores alone (a partial sort's choice among equal scores is not), so plans do not
    depend on the sorting algorithm. The partial sort runs over the few scores above a threshold: the value that
    about 2 ``count`` of them exceed, taken from a strided sample, and lowered to all of them where fewer than
    ``count`` reach it; one pass over the scores besides."""
    n = len(score)
    if count >= n:
        return np.arange(n)
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    keep = None
    sample = score[::max(1, n // _SAMPLE)]
    above = int(np.ceil(2 * count * len(sample) / n))
    if above < len(sample):
        threshold = np.partition(sample, len(sample) - above)[len(sample) - above]
        keep = np.flatnonzero(score >= threshold)
        if len(keep) < count:
            keep = None
    if keep is None:
        keep = np.arange(n)
    kept = score[keep]
    value = np.partition(kept, len(kept) - count)[len(kept) - count]  # the count-th highest score
    over = keep[kept > value]
    return np.sort(np.concatenate([over, keep[kept == value][:count - len(over)]]))


class OnlineHistory:
    """The use history of a cache's ``capacity`` slots, and an online policy's choice of the slots to free.

    Per slot: the tick (iteration, or batch admitted) of its row's last use, and its row's use count. What a use
    count counts is the owner's to say (``used(..., uses=)``): the planner passes each row's uses since the start
    (it keeps per-row state anyway), a SlotIndex lets it count the uses since the row came in (its memory stays
    O(cache rows)). Victims are the highest ``online_scores``, equal scores to the lower slot (``highest``), so a
    choice depends on the history alone.
    """

    def __init__(self, capacity: int, policy: str) -> None:
        if policy not in ONLINE_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(ONLINE_POLICIES)}, got {policy!r}")
        self.policy = policy
        self.last_use = np.full(capacity, -1, dtype=np.int64)
        self.uses = np.zeros(capacity, dtype=np.int64)

    def used(self, slots: np.ndarray, tick: int, *, uses: np.ndarray | None = None) -> None:
        """The rows in ``slots`` were used at ``tick``: their use counts one more, or ``uses`` where given."""
        self.last_use[slots] = tick
        if uses is None:
            self.uses[slots] += 1
        else:
            self.uses[slots] = uses

    def freed(self, slots: np.ndarray) -> None:
        """``slots`` hold no row now."""
        self.last_use[slots] = -1
        self.uses[slots] = 0

    def victims(self, count: int, *, tick: int, keep: list[np.ndarray]) -> np.ndarray:
        """The ``count`` slots to free at ``tick`` (increasing), never one of ``keep`` (free slots, and those of
        the rows the batch uses): the caller has checked that so many others hold rows."""
        score = online_scores(self.policy, tick - self.last_use, self.uses)
        for slots in keep:
            score[slots] = LOWEST
        return highest(score, count)
