"""The embedding cache's slots: a fixed number of them on a device, holding rows and their optimizer state.

Every cache of the project keeps its rows here: a bagpipe trainer's (the planner names every row's slot), the
single-process cached reference's (train/single.py) and bagpipe.nn's ``CachedRows`` (which adds a host table and an
online policy or a plan). Memory is O(cache rows x dim). It installs fetched rows by slot (through reused pinned
buffers on a GPU), reads rows out for write-back, evicts, looks a batch up through a BatchView (each id's slot)
and applies the row optimizer to cached rows in place; every operation checks the slots against the rows it
names, so a plan and a cache that disagree are an error, not silent corruption.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bagpipe.device import HostStaging
from bagpipe.embeddings import EmbeddingLayout, Embeddings, Lookup, gather, id_places, update_rows, valid_keys
from bagpipe.optim import RowOptimizer
from bagpipe.planner.keys import sorted_distinct, unique_inverse
from bagpipe.planner.plan import PlanStep


INDEX_SLOTS = 8  # ring slots of a cache's staged index copies (RowCache.to_device)


class RowCache:
    """Rows and optimizer state in ``capacity`` slots, addressed by the slots the plan names.

    The planner assigns every row its slot (``PlanStep.fetch_slots`` and friends), so the cache
    keeps no key -> slot index: each operation is a vectorised gather or scatter. ``slot_key``
    (O(capacity)) records which row each slot holds, to refuse a step that disagrees with it.
    """

    def __init__(self, *, capacity: int, dim: int, optimizer: RowOptimizer,
                 device: torch.device | str | None = "cpu") -> None:
        if capacity <= 0:
            raise ValueError(f"cache capacity must be positive, got {capacity}")
        self.capacity, self.dim, self.optimizer = capacity, dim, optimizer
        self.weights: torch.Tensor | None = None
        self.bind(torch.zeros(capacity, dim, device=device),
                  torch.zeros(capacity, optimizer.state_width(dim), device=device))
        self.slot_key = np.full(capacity, -1, dtype=np.int64)
        self.resident_rows = 0

    def bind(self, weights: torch.Tensor, state: torch.Tensor) -> None:
        """Keep the slots' rows and state in ``weights`` and ``state`` (the same slots on another device: a module
        that owns this cache was moved)."""
        assert weights.shape == (self.capacity, self.dim) and len(state) == self.capacity
        moved = self.weights is None or self.weights.device != weights.device
        self.weights, self.state = weights, state
        if not moved:  # (the same device: its staging buffers and copy stream serve on)
            return
        # on a GPU, fetched rows go in through reused pinned buffers, copied on a side stream of the cache's own
        # (so that a copy runs beside the kernels still queued on the compute stream); the compute stream waits for
        # the copy's event before it writes the rows into their slots: nothing waits on the host
        on_gpu = self.weights.device.type == "cuda"
        self.staging = HostStaging(self.weights.device) if self.weights.device.type != "cpu" else None
        self.copy_stream = torch.cuda.Stream(device=self.weights.device) if on_gpu else None
        # the slots and positions each step names go the same way, on the compute stream: a copy from pageable
        # memory would make the host wait for every kernel queued before it (seen on an H200: 4 of a trainer's 6
        # waits an iteration). Enough ring slots for the host to run two iterations ahead (3-4 copies each).
        self.indices = HostStaging(self.weights.device, slots=INDEX_SLOTS) if on_gpu else None

    def _check(self, slots: np.ndarray, keys: np.ndarray, *, what: str) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots) != len(keys):
            raise ValueError(f"{what}: {len(slots)} slots for {len(keys)} rows")
        if len(slots) and (slots.min() < 0 or slots.max() >= self.capacity):
            raise ValueError(f"{what}: a slot outside the cache's {self.capacity}")
        held = self.slot_key[slots]
        wrong = held != keys
        if wrong.any():
            first = int(np.flatnonzero(wrong)[0])
            state = "free" if held[first] < 0 else f"holding row {int(held[first])}"
            raise KeyError(f"{what}: slot {int(slots[first])} is {state}, the plan expects row "
                           f"{int(keys[first])} ({int(wrong.sum())} such); the plan and the cache disagree")
        return slots

    def read(self, slots: np.ndarray, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the rows and state of ``keys``, held in ``slots`` (a write-back that keeps them), in host
        memory whatever the cache's device: they go to the servers."""
        slots = self._check(slots, np.asarray(keys, dtype=np.int64), what="read")
        index = torch.from_numpy(slots).to(self.weights.device)
        return self.weights.index_select(0, index).cpu(), self.state.index_select(0, index).cpu()

    def evict(self, slots: np.ndarray, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Free the slots of ``keys``; return their rows and state for the write-back."""
        rows, state = self.read(slots, keys)
        slots = np.asarray(slots, dtype=np.int64)
        self.slot_key[slots] = -1
        self.resident_rows -= len(slots)
        return rows, state

    def install(self, slots: np.ndarray, keys: np.ndarray, rows: torch.Tensor, state: torch.Tensor, *,
                refill: bool = False) -> None:
        """Put fetched ``rows`` (and their state) of ``keys`` into the free ``slots``; with ``refill``, into the
        slots that hold those keys already (their rows read again from the host)."""
        keys = np.asarray(keys, dtype=np.int64)
        slots = self._check(slots, keys if refill else np.full(len(keys), -1, dtype=np.int64), what="install")
        if not refill:
            if len(sorted_distinct(slots)) != len(slots):
                raise ValueError("install: a slot named twice")
            self.slot_key[slots] = keys
            self.resident_rows += len(slots)
        (index,) = self.to_device(slots)
        if self.staging is not None and rows.device.type == "cpu":
            rows, state = self._copy_in(rows, state)
        self.weights.index_copy_(0, index, rows.to(self.weights.device))
        if state.shape[1]:
            self.state.index_copy_(0, index, state.to(self.state.device))

    def state_dict(self) -> dict:
        """The slots as they are, in host memory (copies, safe to send): which row each holds, the rows, their
        optimizer state. What a lost trainer's replacement takes from a survivor."""
        return {"slot_key": self.slot_key.copy(), "weights": self.weights.to("cpu", copy=True),
                "state": self.state.to("cpu", copy=True)}

    def load_state_dict(self, state: dict) -> None:
        """The slots of ``state_dict()`` (of a cache of the same capacity and width) in place of these."""
        slot_key = np.asarray(state["slot_key"], dtype=np.int64)
        if slot_key.shape != self.slot_key.shape or tuple(state["weights"].shape) != tuple(self.weights.shape):
            raise ValueError(f"a cache of {len(slot_key)} slots of {tuple(state['weights'].shape)[1:]} cannot be "
                             f"loaded into one of {self.capacity} of ({self.dim},)")
        self.slot_key[:] = slot_key
        self.resident_rows = int(np.count_nonzero(slot_key >= 0))
        self.weights.copy_(state["weights"])
        self.state.copy_(state["state"])

    def clear(self) -> None:
        """Every slot free (their rows written back by the caller first)."""
        self.slot_key.fill(-1)
        self.resident_rows = 0

    def _copy_in(self, rows: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Host ``rows`` and ``state`` on the cache's device: staged, copied on the side stream (on a CUDA device),
        with the compute stream ordered after the copy by an event (``wait_stream``), not by the host waiting."""
        if self.copy_stream is None:
            return tuple(self.staging.to_device(rows, state))
        compute = torch.cuda.current_stream(self.weights.device)
        rows, state = self.staging.to_device(rows, state, stream=self.copy_stream)
        compute.wait_stream(self.copy_stream)
        for copy in (rows, state):  # made on the side stream, read on the compute stream: not reused before that
            copy.record_stream(compute)
        return rows, state

    def to_device(self, *indices: np.ndarray | torch.Tensor) -> list[torch.Tensor]:
        """Host ``indices`` (slots, positions; their dtypes kept) on the cache's device, in the compute stream's
        order: on a GPU through reused pinned buffers, so the host does not wait for the device; on the CPU as
        they are."""
        tensors = [torch.as_tensor(index) for index in indices]
        if self.indices is None or any(tensor.device.type != "cpu" for tensor in tensors):
            return [tensor.to(self.weights.device) for tensor in tensors]
        return self.indices.to_device(*tensors)

    def copy_stats(self) -> dict:
        """Host-to-device staging of fetched rows: pinned allocations (a few, whatever the batches) and bytes
        staged; zeros on the CPU."""
        stats = self.staging.stats() if self.staging is not None else {}
        return {"pinned_allocations": stats.get("allocations", 0), "pinned_bytes": stats.get("bytes_allocated", 0),
                "bytes_to_device": stats.get("staged_bytes", 0)}

    def gather(self, view: "BatchView", *, padded: bool) -> tuple[torch.Tensor, Lookup]:
        """A batch's embeddings of this cache's space: ``[*view.positions.shape, D]``.

        The Lookup's leaf holds the view's rows in the view's order (``view.slots``), so after the
        backward its gradient is the batch's per-row gradient, ready to sync or apply.
        """
        slots, positions = self.to_device(self._check(view.slots, view.keys, what="lookup"),
                                         torch.as_tensor(view.positions, dtype=torch.int64))
        return gather(self.weights, slots, positions, padded=padded)

    def apply(self, slots: np.ndarray | torch.Tensor, grads: torch.Tensor) -> None:
        """Row-optimizer step on the rows in ``slots`` with the given (e.g. all-reduced) gradients."""
        if not len(slots):
            return
        (index,) = self.to_device(torch.as_tensor(slots, dtype=torch.int64))
        update_rows(self.optimizer, self.weights, self.state, Lookup(index, self.weights.index_select(0, index)),
                    grads.to(self.weights.device))


@dataclass(frozen=True)
class BatchView:
    """A batch as the cache sees it: its distinct rows, their slots, and each id's row.

    ``keys``/``slots`` list the distinct rows with the ``num_now`` rows that are used again next
    iteration first (their gradients are synced at once, the others later), each group sorted.
    ``positions`` has the shape of the batch's (or a slice's) key matrix: the index into ``keys``
    of every id, ``len(keys)`` where the ids hold PAD (see ``BatchRows``).
    """

    keys: np.ndarray
    slots: np.ndarray
    num_now: int
    positions: np.ndarray


def batch_view(step: PlanStep, keys: np.ndarray | None = None) -> BatchView:
    """The rows of a plan step's batch, in sync order. With ``keys`` (the batch's key matrix of the step's space,
    PAD where empty: the ids whose valid ones the planner was given, in order, planned with ``inverse=True``),
    each id's place among them from the planner's ``batch_inverse`` (no search; PAD at the empty place after the
    rows); without, positions are left empty (``BatchRows`` finds them for any ids)."""
    now = np.isin(step.batch_keys, step.sync_now_keys, assume_unique=True)
    order = np.argsort(~now, kind="stable")  # the rows synced at once first, each group sorted
    positions = np.zeros(0, dtype=np.int32)
    if keys is not None:
        place = np.empty(len(order), dtype=np.int32)  # each sorted row's place in the view
        place[order] = np.arange(len(order), dtype=np.int32)
        positions = id_places(keys, place[step.batch_inverse], empty=len(order))
    return BatchView(step.batch_keys[order], step.batch_slots[order], int(now.sum()), positions)


class BatchRows:
    """Each batch row's index in its BatchView, by flat key: a binary search among the batch's keys, sorted once
    per batch, so that memory and time go with the batch, never with the tables (a key space may be 2^40)."""

    def __init__(self) -> None:
        self._view: BatchView | None = None
        self._sorted = np.zeros(0, dtype=np.int64)  # the view's keys, sorted
        self._place = np.zeros(0, dtype=np.int32)  # each sorted key's index in the view (int32: as in messages)

    def load(self, view: BatchView) -> None:
        """Make ``view`` the batch that ``at`` maps ids into."""
        order = np.argsort(view.keys, kind="stable")
        self._sorted, self._place = view.keys[order], order.astype(np.int32)
        self._view = view

    def at(self, keys: np.ndarray) -> BatchView:
        """The loaded view with the positions of ``keys`` (any shape; PAD maps to the empty place). A key not in
        the batch gets some place: callers pass the batch's own ids (or check, as CachedTables does).

        The ids are deduplicated first (keys.unique_inverse: one sort) and only the distinct ones searched
        for, in increasing order: a binary search per id reads memory at random, three times slower."""
        view = self._view
        if not len(view.keys):
            return BatchView(view.keys, view.slots, view.num_now, np.zeros(np.shape(keys), dtype=np.int32))
        keys = np.asarray(keys)
        distinct, inverse = unique_inverse(valid_keys(keys))
        found = self._place[np.minimum(np.searchsorted(self._sorted, distinct), len(view.keys) - 1)][inverse]
        return BatchView(view.keys, view.slots, view.num_now, id_places(keys, found, empty=len(view.keys)))


class StepTables:
    """One plan step's batch seen through the reference tables' interface (``lookup``, ``apply_gradients``)."""

    def __init__(self, caches: list[RowCache], views: list[BatchView], layout: EmbeddingLayout) -> None:
        self.caches, self.views, self.layout = caches, views, layout

    def lookup(self, ids: torch.Tensor) -> tuple[Embeddings, list[Lookup]]:
        blocks, lookups = [], []
        for cache, view, space in zip(self.caches, self.views, self.layout.spaces):
            block, lookup = cache.gather(view, padded=space.padded)
            blocks.append(block)
            lookups.append(lookup)
        return Embeddings(blocks, self.layout, ids), lookups

    def apply_gradients(self, lookups: list[Lookup], grads: list[torch.Tensor] | None = None) -> None:
        for s, (cache, lookup) in enumerate(zip(self.caches, lookups)):
            update_rows(cache.optimizer, cache.weights, cache.state, lookup, None if grads is None else grads[s])
