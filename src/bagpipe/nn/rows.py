"""``CachedRows``: one table (or one space of tables of a width) in host memory or on disk (bagpipe.nn.host), its
optimizer state beside it, and a cache of some of its rows on a device; rows move between the two with their state.

The building block of bagpipe.nn's modules: they look rows up in the cache; this class makes them resident
(by an online policy, or by a plan's steps), writes them back, and steps them with the row optimizer.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from bagpipe.cache import RowCache
from bagpipe.embeddings import Lookup, sparse_row_sums, update_rows
from bagpipe.nn.host import HostTable
from bagpipe.nn.slots import CLEANUP_FRACTION, SlotIndex
from bagpipe.optim import RowOptimizer, with_lr
from bagpipe.planner import PlanStep
from bagpipe.planner.keys import unique_inverse


class CachedRows(nn.Module):
    """``host``: the full table ``[N, D]`` and its optimizer state (a HostTable, in any storage tier); ``cache_rows``
    of its rows in the slots of a ``RowCache`` on the device (the project's one cache of rows: the trainers' too).

    A submodule, so that ``.to(device)`` moves the cache (its slots as buffers, not saved in a state dict) and
    leaves the host table where it is. The rows are float32 everywhere: a conversion to another dtype is refused.
    """

    def __init__(self, host: HostTable, *, cache_rows: int, optimizer: RowOptimizer,
                 policy: str = "lru", cleanup_fraction: float = CLEANUP_FRACTION,
                 device: torch.device | str | None = None, grows: bool = False) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.lr_of: Callable[[], float] | None = None  # the live learning rate (a FusedOptimizer's group), if any
        self.host = host
        # (a table that grows with the data gets the whole cache: it may hold fewer rows than that for now)
        self.index = SlotIndex(cache_rows if grows else min(cache_rows, host.num_rows), policy=policy,
                               cleanup_fraction=cleanup_fraction)
        self.slots = RowCache(capacity=self.index.capacity, dim=host.dim, optimizer=optimizer, device=device)
        self.register_buffer("cache_weight", self.slots.weights, persistent=False)  # (the slots', moved with us)
        self.register_buffer("cache_state", self.slots.state, persistent=False)
        self.stats = dict.fromkeys(COUNTERS, 0)
        self.dirty = False  # some cached row changed since the last flush
        self._planned: tuple[np.ndarray, np.ndarray] | None = None  # a plan step's batch: its keys and their slots
        self._placed: tuple[np.ndarray, np.ndarray] | None = None  # and the ids it was planned from, each's place
        # inside ``accumulating``: per table (its first key, its rows), its lookups' sparse gradients, in order
        self.pending: dict[tuple[int, int], list[torch.Tensor]] | None = None

    @property
    def planned(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The batch the last plan step made resident: its distinct keys (sorted) and their slots."""
        return self._planned

    @property
    def placed(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The ids the last plan step's batch was planned from (flat, in order) and each one's index among its
        distinct keys (the planner's, from its sort), where the plan gave them: a lookup of exactly those ids
        needs no sort of its own."""
        return self._placed

    @property
    def num_rows(self) -> int:
        return self.host.num_rows

    def make_resident(self, keys: np.ndarray) -> np.ndarray:
        """Make the distinct sorted ``keys`` resident (evicting by the policy); their slots."""
        self.stats["batches"] += 1
        self.stats["rows_looked_up"] += len(keys)
        if self._planned is not None and np.array_equal(self._planned[0], keys):
            return self._planned[1]  # the plan made them resident, and says where
        self._check_range(keys)
        self._planned = self._placed = None  # the policy moves rows from here on
        admission = self.index.admit(keys)
        self._write_back(admission.evict_keys, admission.evict_slots, evict=True)
        self._install(admission.fetch_keys, admission.fetch_slots)
        return admission.batch_slots

    def resident_positions(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A lookup of ``ids`` (keys, flat, repeats allowed) made resident: its distinct keys (sorted), their
        slots and each id's index among them. The batch a plan step placed (``placed``) takes the planner's
        numbering; any other is numbered by one sort."""
        placed = self._placed
        if placed is not None and np.array_equal(ids, placed[0]):
            keys, positions = self._planned[0], placed[1]
        else:
            keys, positions = unique_inverse(ids)  # (np.unique's, by one sort)
        return keys, self.make_resident(keys), positions

    def carry_out(self, step: PlanStep, rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                  ids: np.ndarray | None = None) -> None:
        """One step of a plan made elsewhere (``bagpipe.nn.Lookahead``): write the evicted rows back, then
        install the fetched ones (``rows``: read ahead by ``read_host``) in the slots it names. The step's
        batch is then looked up where the plan put it, without asking the policy (``ids``: the keys the step
        was planned from, if planned with ``inverse=True``: the lookup then takes each id's place from it)."""
        self.index.move(evict_keys=step.evict_keys, evict_slots=step.evict_slots, fetch_keys=step.fetch_keys,
                        fetch_slots=step.fetch_slots)
        self._write_back(step.evict_keys, step.evict_slots, evict=True)
        self._install(step.fetch_keys, step.fetch_slots, rows)
        self._planned = (step.batch_keys, step.batch_slots)
        self._placed = (ids, step.batch_inverse) if ids is not None and len(step.batch_inverse) == len(ids) else None

    def warm_up(self, keys: np.ndarray, *, fraction: float = 0.7) -> int:
        """Frequency-aware warm-up: count ``keys`` (the ids of a sample of the data, repeats and all) and
        preload the hottest rows not cached into free slots, up to ``fraction`` of the cache, their counts
        taken as their uses (so that LFU keeps them); the number of rows preloaded."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        distinct, counts = np.unique(np.asarray(keys, dtype=np.int64).reshape(-1), return_counts=True)
        self._check_range(distinct)
        absent = self.index.locate(distinct) < 0
        distinct, counts = distinct[absent], counts[absent]
        room = min(self.index.capacity - self.index.resident_rows, int(fraction * self.index.capacity))
        hottest = np.sort(np.argsort(-counts, kind="stable")[:room])  # the most counted, in key order
        slots = self.index.preload(distinct[hottest], counts[hottest])
        self._install(distinct[hottest], slots, count=False)
        self.stats["rows_preloaded"] = self.stats.get("rows_preloaded", 0) + len(hottest)
        return len(hottest)

    def read_host(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The host rows of ``keys`` and their state. Safe on another thread while the cache trains, for rows
        not cached (they are staged for the device when installed, on the training thread)."""
        return self.host.read(keys)

    def remake(self, keys: np.ndarray, weights: torch.Tensor) -> None:
        """Rows ``keys`` replaced by ``weights``, their optimizer state zero, wherever each is: a cached one in its
        slot (written back when it leaves), any other in the host table (a raw-id row whose number is reused)."""
        keys = np.asarray(keys, dtype=np.int64)
        slots = self.index.locate(keys)
        state = torch.zeros(len(keys), self.host.state_width)
        cached = slots >= 0
        if cached.any():
            mask = torch.from_numpy(cached)
            self.slots.install(slots[cached], keys[cached], weights[mask], state[mask], refill=True)
            self.dirty = True
        if not cached.all():
            mask = torch.from_numpy(~cached)
            self.host.write(keys[~cached], weights[mask], state[mask])

    def flush(self) -> None:
        """Write every cached row (and its state) into the host table; the rows stay cached."""
        if self.dirty:
            self._write_back(*self.index.resident(), count=False)
            self.dirty = False

    def empty(self) -> None:
        """Write every cached row back and free its slot (a plan starts from an empty cache)."""
        self.flush()
        self.index.clear()
        self.slots.clear()
        self._planned = self._placed = None

    def reload(self) -> None:
        """Read the cached rows and their state again from the host table (after it was replaced from a state
        dict)."""
        self.flush()
        keys, slots = self.index.resident()
        if len(keys):
            self._install(keys, slots, count=False, refill=True)

    def hit_rate(self) -> float:
        return hit_rate(self.stats)

    def apply(self, slots: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor | None) -> None:
        """Row-optimizer step on the cached rows in ``slots`` (a lookup's leaf ``rows``; ``grads``: its own)."""
        update_rows(self.optimizer, self.slots.weights, self.slots.state, Lookup(slots, rows), grads)
        self.dirty = True

    def step(self, keys: np.ndarray, grads: torch.Tensor, *, slots: np.ndarray | None = None,
             as_of: int = -1) -> None:
        """Row-optimizer step on rows ``keys``, wherever they are now: in the cache, or on the host if they
        were evicted since they were looked up. ``slots``: theirs as the lookup found them, at the index's
        ``version`` ``as_of``: still theirs if no row came or went since (the common case, a backward right
        after its forward), so not looked for again."""
        if self.lr_of is not None and (lr := self.lr_of()) != self.optimizer.lr:  # (an LR scheduler moved it)
            self.optimizer = self.slots.optimizer = with_lr(self.optimizer, lr)
        if slots is None or as_of != self.index.version:
            slots = self.index.locate(keys)
        cached = slots >= 0  # (decided on the host: the slots are the index's)
        self.dirty = True
        if cached.all():
            self.slots.apply(slots, grads)
            return
        self.slots.apply(slots[cached], grads[torch.from_numpy(cached).to(grads.device)])
        evicted = ~cached
        self.host.step(self.optimizer, keys[evicted], grads[torch.from_numpy(evicted).to(grads.device)].cpu())

    def fused_step(self, keys: np.ndarray, grad: torch.Tensor, *, tables: Sequence[tuple[int, int]] = (),
                   slots: np.ndarray | None = None, as_of: int = -1) -> None:
        """The backward reached a lookup of ``keys`` (a hook on its leaf, whose row i is key ``keys[i]``'s): step
        them with their gradient, or hold it while accumulating. ``tables``: the first key and the rows of each
        table the lookup spans, in key order; default: the whole space, as one table. ``slots``, ``as_of``: where
        the lookup found them, and when (``step``)."""
        if self.pending is None:
            self.step(keys, dense_rows(grad, len(keys)), slots=slots, as_of=as_of)
            return
        entry_keys, values = entry_gradients(grad, keys)
        tables = tables or ((0, self.num_rows),)
        if len(tables) > 1:  # each table's entries together, each's in the order they came (several poolings of
            # one leaf reach it in any order; a table's entries are all of one pooling)
            which = torch.searchsorted(torch.tensor([offset for offset, _ in tables], device=entry_keys.device),
                                       entry_keys, right=True) - 1
            order = torch.sort(which, stable=True).indices
            entry_keys, values = entry_keys[order], values[order]
            counts = torch.bincount(which, minlength=len(tables)).tolist()
        else:
            counts = [len(entry_keys)]
        for (offset, num_rows), table_keys, table_values in zip(tables, entry_keys.split(counts), values.split(counts)):
            self.pending.setdefault((offset, num_rows), []).append(torch.sparse_coo_tensor(
                (table_keys - offset).unsqueeze(0), table_values, (num_rows, values.shape[1]), check_invariants=False))

    def step_pending(self) -> None:
        """One step on the sum of the gradients held since accumulating began: each table's added up as autograd
        adds up the sparse gradients of its ``nn.EmbeddingBag(sparse=True)``'s weight over several backward
        passes (the same additions, so the same entries in the same order), then summed per row as RowWise sums
        them; the rows are stepped wherever they are now. (Only here does a collection's work go table by
        table: autograd's sum of sparse gradients is a merge whose order follows each table's own entries.)"""
        pending, self.pending = self.pending, None
        if not pending:
            return
        keys, values = [], []
        for (offset, _), grads in sorted(pending.items()):
            index, sums = sparse_row_sums(functools.reduce(operator.add, grads))
            keys.append(index + offset)
            values.append(sums)
        self.step(torch.cat(keys).cpu().numpy(), torch.cat(values))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "CachedRows":
        # .to(), .cuda(), .double(), .half() all come here: a dtype change is refused before any buffer changes
        dtype = fn(torch.empty(0, device=self.cache_weight.device)).dtype
        if dtype != torch.float32:
            raise ValueError(f"bagpipe.nn's cached tables are float32 (the table, its optimizer state and the "
                             f"cache), so this module cannot be converted to {dtype}: convert the other modules "
                             f"alone, or cast this one's output (e.g. bag(ids, offsets).to({dtype}))")
        moved = super()._apply(fn, recurse)
        self.slots.bind(self.cache_weight, self.cache_state)  # the slots where the buffers now are
        return moved

    def _check_range(self, keys: np.ndarray) -> None:
        """Sorted ``keys`` all rows of the table, or an IndexError naming one that is not."""
        if len(keys) and (keys[0] < 0 or keys[-1] >= self.num_rows):
            bad = keys[0] if keys[0] < 0 else keys[-1]
            raise IndexError(f"id {int(bad)} out of range for a table of {self.num_rows} rows")

    def _write_back(self, keys: np.ndarray, slots: np.ndarray, *, count: bool = True, evict: bool = False) -> None:
        """Rows ``keys`` (in ``slots``) and their state written into the host table; with ``evict``, their slots
        freed."""
        if not len(keys):
            return
        weights, state = (self.slots.evict if evict else self.slots.read)(slots, keys)
        self.host.write(keys, weights, state)
        if count:
            self.stats["rows_written_back"] += len(keys)

    def _install(self, keys: np.ndarray, slots: np.ndarray, rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                 *, count: bool = True, refill: bool = False) -> None:
        if not len(keys):
            return
        weights, state = self.read_host(keys) if rows is None else rows
        self.slots.install(slots, keys, weights, state, refill=refill)
        if self.slots.staging is not None:  # (copied to a device through reused pinned buffers)
            copies = self.slots.copy_stats()
            self.stats["pinned_allocations"] = copies["pinned_allocations"]
            self.stats["pinned_bytes"] = copies["pinned_bytes"]
        if count:
            self.stats["rows_fetched"] += len(keys)


COUNTERS = ("batches", "rows_looked_up", "rows_fetched", "rows_written_back")


def total_stats(spaces: list[CachedRows]) -> dict:
    """The counters of several CachedRows added up."""
    return {name: sum(rows.stats[name] for rows in spaces) for name in COUNTERS}


def hit_rate(stats: dict) -> float:
    """The share of looked-up rows that were already resident (NaN before any lookup: there is no rate yet)."""
    looked_up = stats["rows_looked_up"]
    return 1.0 - stats["rows_fetched"] / looked_up if looked_up else float("nan")


@contextlib.contextmanager
def accumulating(spaces: list[CachedRows]) -> Iterator[None]:
    """Hold the row gradients of the backward passes run inside, then take one step on their sum on leaving
    (none if the block raised: the held gradients are dropped)."""
    if any(rows.pending is not None for rows in spaces):
        raise ValueError("already accumulating: accumulate() blocks do not nest")
    for rows in spaces:
        rows.pending = {}
    try:
        yield
    except BaseException:
        for rows in spaces:
            rows.pending = None
        raise
    for rows in spaces:
        rows.step_pending()


def entry_gradients(grad: torch.Tensor, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A lookup's gradient (its leaf's row i is key ``keys[i]``'s) as the key of each entry and its values, in
    embedding_bag's order (one entry per id looked up): what RowWise sums for ``nn.EmbeddingBag(sparse=True)``."""
    keys = torch.from_numpy(keys).to(grad.device)
    return (keys[grad._indices()[0]], grad._values()) if grad.is_sparse else (keys, grad)


def dense_rows(grad: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A lookup's gradient as ``[num_rows, D]``: embedding_bag's sparse gradient summed per row by ``row_sums``
    (each row's contributions in the order they came, as RowWise sums them), rows it lacks zero.

    The sums follow each row's own entries alone, so a lookup of one table's ids sums as one of all a space's
    tables does, and as one of the ids themselves (numbered by rank) does."""
    if not grad.is_sparse:
        return grad
    indices, values = sparse_row_sums(grad)
    if len(indices) == num_rows:
        return values
    return values.new_zeros(num_rows, values.shape[1]).index_copy_(0, indices, values)
