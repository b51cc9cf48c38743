"""``DynamicEmbeddingBag``: a ``CachedEmbeddingBag`` over any int64 id, its table growing with the ids it trains on
(the module form of a raw-id table: bagpipe.embeddings.dynamic).

A training look-up makes a row for each id that has none, in the order the batch first looks the ids up (row 1, 2,
...; with ``row_min_count`` N, at the look-up that brings an id's count to N), each row's initial value a function
of (seed, table, id) alone (``init_keyed``); row 0 is the table's default row, which every id without a row of its
own looks up (in an evaluation, ids never trained on). That is the numbering a ``--mode reference`` run of raw ids
makes of the same batches, so the module trains as the reference's table does, bit for bit. The host table grows
(amortised doubling) as rows are made: its memory follows the rows made, and the cache on the device stays
``cache_rows`` rows.
"""

from __future__ import annotations

import numpy as np
import torch

from bagpipe.embeddings.dynamic import DEFAULT_KEY, init_keyed
from bagpipe.nn.cached_bag import STATE_KEY, CachedEmbeddingBag
from bagpipe.nn.slots import CLEANUP_FRACTION
from bagpipe.planner.keys import KeyIndex
from bagpipe.storage.tiers import tier_class

KEYS_KEY, PENDING_KEY = "row_keys", "pending_counts"  # in state_dict(), beside "weight"


class DynamicEmbeddingBag(CachedEmbeddingBag):
    """``CachedEmbeddingBag``'s interface (``forward(input, offsets=None, per_sample_weights=None)``; the rows step
    in backward) over ids that are any non-negative int64 (raw keys: ``bagpipe preprocess --raw-ids``), with no
    declared size: see the module's docstring.

    Rows are made by look-ups in training mode (``module.train()``, the default); in ``eval()`` mode an id without a
    row looks the default row up and makes none. ``init_rows`` scales the initial values as a fixed table of that
    many rows would be (uniform in +-1/sqrt(init_rows); ``init="normal"``: N(0, 1/dim^2); "zeros"): a reference run
    uses its table's rows made + 1. ``seed`` and ``table`` salt each id's initial row. ``num_embeddings`` is the
    rows made so far and the default row; ``row_keys()`` each row's id (the default row's -1); ``default_lookups``
    counts the training look-ups of the default row since the module was made (a load does not restore it).
    ``weight`` is a copy. ``warm_up`` preloads the rows a sample's ids have; ``accumulate()`` is not supported yet
    (a micro-batch that makes rows changes the table the held gradients are sized to).

    ``state_dict()`` holds ``weight`` (``[num_embeddings, dim]``), the optimizer state as CachedEmbeddingBag's,
    ``row_keys`` and, with ``row_min_count`` > 1, ``pending_counts`` (``[n, 2]``: ids without a row yet and their
    look-ups so far), so that a reloaded module trains on as the saved one would have. Tables in memory only
    (``storage="memory"``)."""

    def __init__(self, embedding_dim: int, *, cache_rows: int, init_rows: int, seed: int = 0, table: int = 0,
                 init: str = "uniform", row_min_count: int = 1, mode: str = "mean", include_last_offset: bool = False,
                 optimizer: str | None = None, lr: float | None = None, eps: float | None = None,
                 betas: tuple[float, float] = (0.9, 0.999), policy: str = "lru",
                 cleanup_fraction: float = CLEANUP_FRACTION, storage: str = "memory",
                 device: torch.device | str | None = None) -> None:
        if not hasattr(tier_class(storage), "grow"):
            raise ValueError(f"DynamicEmbeddingBag's table grows, which the {storage!r} tier cannot yet: "
                             f"storage={storage!r} is not supported")
        if row_min_count < 1 or init_rows < 1:
            raise ValueError(f"row_min_count and init_rows must be at least 1, got {row_min_count} and {init_rows}")
        self._init = dict(seed=seed, table=table, dim=embedding_dim, num_rows=init_rows, init=init)
        default = init_keyed(np.array([DEFAULT_KEY], dtype=np.uint64), **self._init)
        super().__init__(1, embedding_dim, cache_rows=cache_rows, mode=mode, include_last_offset=include_last_offset,
                         optimizer=optimizer, lr=lr, eps=eps, betas=betas, policy=policy,
                         cleanup_fraction=cleanup_fraction, _weight=default, storage="memory", device=device,
                         _grows=True)
        self.row_min_count = row_min_count
        self.index = KeyIndex()  # the ids with rows: id -> its row - 1
        self.pending = KeyIndex()  # admission: the ids looked up, and (``counts``) their look-ups while rowless
        self.counts = np.zeros(0, dtype=np.int64)
        self.default_lookups = 0

    @property
    def num_embeddings(self) -> int:
        return self.rows.host.num_rows if "rows" in self._modules else 1

    @num_embeddings.setter
    def num_embeddings(self, value: int) -> None:
        pass  # (set by CachedTableModule to its first size: the table's rows are its host's)

    def row_keys(self) -> np.ndarray:
        """Each row's id (int64; the default row's -1)."""
        return np.concatenate([[-1], self.index.keys_of(np.arange(self.index.count))]).astype(np.int64)

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """Each id's row (0: the default row, for an id without one), making rows first in training mode. A batch
        whose rows would not fit in the cache is refused before any row is made or any look-up counted."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and ids.min() < 0:
            raise ValueError(f"ids must be non-negative int64 (raw keys), got {int(ids.min())}")
        if self.training and len(ids):
            self._make_rows(ids)
        rows = self.index.known(ids) + 1 if len(ids) else ids  # (known: -1 for an id without a row)
        if self.training:
            self.default_lookups += int(np.count_nonzero(rows == 0))
        return rows

    def _make_rows(self, ids: np.ndarray) -> None:
        """Rows for the ids of this batch that reach ``row_min_count`` look-ups, numbered in the order of the
        look-up that does (embeddings.dynamic.RowNumbering.of_run, online)."""
        keys, first, counts = np.unique(ids, return_index=True, return_counts=True)
        rowless = self.index.known(keys) < 0
        if self.row_min_count == 1:
            admitted, at, numbers, after = keys[rowless], first[rowless], None, None
        else:
            keys, counts = keys[rowless], counts[rowless]
            numbers = self.pending.numbers(keys)  # (an id's entry, its count still 0 until the batch is taken)
            if len(self.counts) < self.pending.count:  # (room to double: amortised O(1) an id)
                grown = np.zeros(max(self.pending.count, 2 * len(self.counts)), dtype=np.int64)
                grown[:len(self.counts)] = self.counts
                self.counts = grown
            before = self.counts[numbers]
            after = before + counts
            admit = after >= self.row_min_count
            by_key = np.argsort(ids, kind="stable")  # each id's look-ups together, in batch order
            starts = np.searchsorted(ids[by_key], keys[admit])
            admitted, at = keys[admit], by_key[starts + self.row_min_count - before[admit] - 1]
        # the batch's rows: those it has, those it makes, and the default row if any of its ids stays without one
        touched = int(np.count_nonzero(~rowless)) + len(admitted) + int(len(admitted) < int(np.count_nonzero(rowless)))
        if touched > self.rows.index.capacity:
            raise ValueError(f"a batch touches {touched} distinct rows, more than the cache's "
                             f"{self.rows.index.capacity}: give the bag more cache_rows or use smaller batches")
        if numbers is not None:
            self.counts[numbers] = after
        if not len(admitted):
            return
        admitted = admitted[np.argsort(at, kind="stable")]
        self.index.numbers(admitted)
        self.rows.host.grow(init_keyed(admitted.astype(np.uint64), **self._init))

    @property
    def weight(self) -> torch.Tensor:
        """The full table (a copy: the table is reallocated as it grows), the cached rows written into it."""
        return super().weight.clone()

    def warm_up(self, sample: torch.Tensor, *, fraction: float = 0.7) -> int:
        """``CachedEmbeddingBag.warm_up`` over the rows ``sample``'s ids have (an id without a row: the default
        row); it makes none."""
        rows = self.index.known(np.asarray(sample.detach().cpu().numpy(), dtype=np.int64).reshape(-1)) + 1
        return self.rows.warm_up(rows, fraction=fraction)

    def accumulate(self):
        raise NotImplementedError("DynamicEmbeddingBag.accumulate: a micro-batch that makes rows changes the table "
                                  "the held gradients are sized to; not supported yet")

    def _looked_up(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input must hold integer ids (torch.int64 or torch.int32), got {ids.dtype}")
        rows = self.rows_of(ids.detach().cpu().numpy())
        return super()._looked_up(torch.from_numpy(rows).view(ids.shape))

    def plan_keys(self, ids: torch.Tensor) -> list[np.ndarray]:
        raise NotImplementedError("a DynamicEmbeddingBag's rows are made as it trains: Lookahead cannot plan them "
                                  "ahead yet (use policy='lru' or 'lfu')")

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for key in (prefix + "weight", prefix + STATE_KEY):  # copies: views of a buffer with room to grow
            if key in destination:
                destination[key] = destination[key].clone()
        destination[prefix + KEYS_KEY] = torch.from_numpy(self.row_keys())
        if self.row_min_count > 1:
            keys, counts = self.pending.keys_of(np.arange(self.pending.count)), self.counts[:self.pending.count]
            waiting = (counts > 0) & (self.index.known(keys) < 0)  # (an id that got its row waits no more)
            pending = np.stack([keys[waiting], counts[waiting]], axis=1)
            destination[prefix + PENDING_KEY] = torch.from_numpy(pending.astype(np.int64))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        keys_key, pending_key = prefix + KEYS_KEY, prefix + PENDING_KEY
        if keys_key not in state_dict:
            missing_keys.append(keys_key)
            return
        keys = state_dict[keys_key].numpy().astype(np.int64)
        pending = (state_dict[pending_key].numpy().astype(np.int64).reshape(-1, 2) if pending_key in state_dict
                   else np.zeros((0, 2), dtype=np.int64))
        if len(pending) and pending[:, 1].max() >= self.row_min_count:
            error_msgs.append(f"{pending_key}: ids counted {int(pending[:, 1].max())} look-ups without a row, which "
                              f"this module's row_min_count {self.row_min_count} would have given one: load into a "
                              f"module with the saved row_min_count")
            return
        rows = len(keys) - self.num_embeddings
        if rows > 0:  # (grown to the saved size first: the weights then load as a fixed table's)
            self.rows.host.grow(torch.zeros(rows, self.embedding_dim))
        elif rows < 0:
            error_msgs.append(f"{keys_key}: the saved table has {len(keys)} rows, this one {self.num_embeddings} "
                              f"already: load into a module that has made fewer")
            return
        self.index = KeyIndex()
        self.index.numbers(keys[1:])
        self.pending = KeyIndex()
        self.counts = pending[:, 1].copy()
        self.pending.numbers(pending[:, 0])
        rest = {key: value for key, value in state_dict.items() if key not in (keys_key, pending_key)}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
