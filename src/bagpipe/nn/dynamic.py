"""``DynamicEmbeddingBag``: a ``CachedEmbeddingBag`` over any int64 id, its table growing with the ids it trains on
(the module form of a raw-id table: bagpipe.embeddings.dynamic).

A training look-up makes a row for each id that has none, in the order the batch first looks the ids up (row 1, 2,
...; with ``row_min_count`` N, at the look-up that brings an id's count to N), each row's initial value a function
of (seed, table, id) alone (``init_keyed``); row 0 is the table's default row, which every id without a row of its
own looks up (in an evaluation, ids never trained on). That is the numbering a ``--mode reference`` run of raw ids
makes of the same batches, so the module trains as the reference's table does, bit for bit. The host table grows
(amortised doubling) as rows are made: its memory follows the rows made, and the cache on the device stays
``cache_rows`` rows. Rows unused for ``retire_after`` batches are retired, and with a ``row_budget`` the least
frequently used past it, their numbers made again for the next ids (``embeddings.dynamic.TableRows``, the rule a
reference run's numbering follows).
"""

from __future__ import annotations

import numpy as np
import torch

from bagpipe.embeddings.dynamic import DEFAULT_KEY, TableRows, init_keyed
from bagpipe.nn.cached_bag import STATE_KEY, CachedEmbeddingBag
from bagpipe.nn.slots import CLEANUP_FRACTION
from bagpipe.storage.tiers import tier_class

KEYS_KEY, LIFE_KEY, COUNTERS_KEY = "row_keys", "key_state", "key_counters"  # in state_dict(), beside "weight"


class DynamicEmbeddingBag(CachedEmbeddingBag):
    """``CachedEmbeddingBag``'s interface (``forward(input, offsets=None, per_sample_weights=None)``; the rows step
    in backward) over ids that are any non-negative int64 (raw keys: ``bagpipe preprocess --raw-ids``), with no
    declared size: see the module's docstring.

    Rows are made by look-ups in training mode (``module.train()``, the default), each training forward one
    iteration; in ``eval()`` mode an id without a row looks the default row up and makes none. ``init_rows`` scales
    the initial values as a fixed table of that many rows would be (uniform in +-1/sqrt(init_rows);
    ``init="normal"``: N(0, 1/dim^2); "zeros"): a reference run uses its table's rows held + 1. ``seed`` and
    ``table`` salt each id's initial row. ``row_min_count``: look-ups before an id gets a row (admission);
    ``retire_after`` N: a row unused for N forwards is retired; ``row_budget`` B: B rows at most, the least
    frequently used retired past it (a batch needing more is refused). A retired row's number is reused: the row is
    made again from its new id, with fresh optimizer state, wherever it is (its cache slot or the host table).
    ``num_embeddings`` is the rows held and the default row; ``row_keys()`` each row's id now (-1: the default row or
    a number free); ``default_lookups`` counts the training look-ups of the default row since the module was made (a
    load does not restore it). ``weight`` is a copy. ``warm_up`` preloads the rows a sample's ids have;
    ``accumulate()`` is not supported yet (a micro-batch that makes rows changes the table the held gradients are
    sized to).

    ``state_dict()`` holds ``weight`` (``[num_embeddings, dim]``), the optimizer state as CachedEmbeddingBag's,
    ``row_keys`` and the ids' admission and retirement state (``key_state``: each id seen with its row, pending
    count, last look-up and uses; ``key_counters``), so that a reloaded module trains on as the saved one would
    have. Tables in memory only (``storage="memory"``)."""

    def __init__(self, embedding_dim: int, *, cache_rows: int, init_rows: int, seed: int = 0, table: int = 0,
                 init: str = "uniform", row_min_count: int = 1, retire_after: int = 0, row_budget: int = 0,
                 mode: str = "mean", include_last_offset: bool = False, optimizer: str | None = None,
                 lr: float | None = None, eps: float | None = None, betas: tuple[float, float] = (0.9, 0.999),
                 policy: str = "lru", cleanup_fraction: float = CLEANUP_FRACTION, storage: str = "memory",
                 device: torch.device | str | None = None) -> None:
        if not hasattr(tier_class(storage), "grow"):
            raise ValueError(f"DynamicEmbeddingBag's table grows, which the {storage!r} tier cannot yet: "
                             f"storage={storage!r} is not supported")
        if row_min_count < 1 or init_rows < 1 or retire_after < 0 or row_budget < 0:
            raise ValueError(f"row_min_count and init_rows must be at least 1, retire_after and row_budget not "
                             f"negative: got {row_min_count}, {init_rows}, {retire_after} and {row_budget}")
        self._init = dict(seed=seed, table=table, dim=embedding_dim, num_rows=init_rows, init=init)
        default = init_keyed(np.array([DEFAULT_KEY], dtype=np.uint64), **self._init)
        super().__init__(1, embedding_dim, cache_rows=cache_rows, mode=mode, include_last_offset=include_last_offset,
                         optimizer=optimizer, lr=lr, eps=eps, betas=betas, policy=policy,
                         cleanup_fraction=cleanup_fraction, _weight=default, storage="memory", device=device,
                         _grows=True)
        self.row_min_count = row_min_count
        self.life = TableRows(min_count=row_min_count, retire_after=retire_after, budget=row_budget, table=table)
        self.default_lookups = 0

    @property
    def num_embeddings(self) -> int:
        return self.rows.host.num_rows if "rows" in self._modules else 1

    @num_embeddings.setter
    def num_embeddings(self, value: int) -> None:
        pass  # (set by CachedTableModule to its first size: the table's rows are its host's)

    def row_keys(self) -> np.ndarray:
        """Each row's id now (int64; -1: the default row, or a number free)."""
        return self.life.row_keys(self.num_embeddings)

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """Each id's row (0: the default row, for an id without one), making (and retiring) rows first in training
        mode. A batch whose rows would not fit in the cache, or pass the budget, is refused before anything
        changes."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and ids.min() < 0:
            raise ValueError(f"ids must be non-negative int64 (raw keys), got {int(ids.min())}")
        if not self.training or not len(ids):
            return self.life.rows(ids)
        rows = self.life.step(ids, capacity=self.rows.index.capacity)
        numbers, keys = self.life.made_now
        grown = numbers >= self.num_embeddings  # (new numbers come in order, past the table)
        if grown.any():
            self.rows.host.grow(init_keyed(keys[grown].astype(np.uint64), **self._init))
        if not grown.all():
            self._remake(numbers[~grown], keys[~grown])
        self.default_lookups += int(np.count_nonzero(rows == 0))
        return rows

    def _remake(self, numbers: np.ndarray, keys: np.ndarray) -> None:
        """Rows whose numbers are reused made again for their new ids, optimizer state zero, wherever they are."""
        self.rows.remake(numbers, init_keyed(keys.astype(np.uint64), **self._init))

    @property
    def weight(self) -> torch.Tensor:
        """The full table (a copy: the table is reallocated as it grows), the cached rows written into it."""
        return super().weight.clone()

    def warm_up(self, sample: torch.Tensor, *, fraction: float = 0.7) -> int:
        """``CachedEmbeddingBag.warm_up`` over the rows ``sample``'s ids have (an id without a row: the default
        row); it makes none."""
        rows = self.life.rows(np.asarray(sample.detach().cpu().numpy(), dtype=np.int64).reshape(-1))
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
        life = self.life.state()
        destination[prefix + LIFE_KEY] = torch.from_numpy(life["keys"])
        destination[prefix + COUNTERS_KEY] = torch.from_numpy(life["counters"])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        names = (prefix + KEYS_KEY, prefix + LIFE_KEY, prefix + COUNTERS_KEY)
        missing = [name for name in names if name not in state_dict]
        if missing:
            missing_keys.extend(missing)
            return
        keys, life = state_dict[names[0]].numpy(), state_dict[names[1]].numpy().reshape(-1, 5)
        pending = life[life[:, 1] == 0, 2]
        if len(pending) and pending.max() >= self.row_min_count:
            error_msgs.append(f"{names[1]}: ids counted {int(pending.max())} look-ups without a row, which this "
                              f"module's row_min_count {self.row_min_count} would have given one: load into a module "
                              f"with the saved row_min_count")
            return
        rows = len(keys) - self.num_embeddings
        if rows > 0:  # (grown to the saved size first: the weights then load as a fixed table's)
            self.rows.host.grow(torch.zeros(rows, self.embedding_dim))
        elif rows < 0:
            error_msgs.append(f"{names[0]}: the saved table has {len(keys)} rows, this one {self.num_embeddings} "
                              f"already: load into a module that has made fewer")
            return
        self.life.load({"keys": life, "counters": state_dict[names[2]].numpy()})
        rest = {key: value for key, value in state_dict.items() if key not in names}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
