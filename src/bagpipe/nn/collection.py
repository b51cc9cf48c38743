"""``CachedEmbeddingBagCollection``: many tables behind one cache per embedding width, one admission for all.

Tables of one width share a flat key space (table offset + id, as bagpipe.embeddings' layout numbers them) and
one CachedRows, as TorchRec's EmbeddingBagCollection groups its tables: a batch's rows of every table are made
resident in one cache operation (one eviction choice, one host read), then each table's bags are pooled.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import ContextManager, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bagpipe.nn.cached_bag import MODES, STATE_KEY, row_optimizer
from bagpipe.nn.host import host_table, initial_blocks, storage_spec
from bagpipe.nn.rows import CachedRows, accumulating, hit_rate, total_stats
from bagpipe.nn.slots import CLEANUP_FRACTION
from bagpipe.storage import StorageSpec


class CachedEmbeddingBagCollection(nn.Module):
    """``tables``: ``(num_embeddings, embedding_dim)`` per table. ``forward(inputs, offsets=None,
    per_sample_weights=None)`` takes one entry per table, each as ``nn.EmbeddingBag`` takes it (1-D with
    offsets, or 2-D), and returns one pooled ``[bags, dim]`` tensor per table. ``mode``: "sum" by default, as
    TorchRec's EmbeddingBagCollection pools (``nn.EmbeddingBag``'s default is "mean"), or "mean". Ids must be
    integers (int64 or int32; anything else is a ValueError, as ``nn.EmbeddingBag`` refuses it).

    ``cache_rows``: rows cached in all (split among the widths in proportion to their rows), or one count
    per width in order of first appearance. ``weights``: each table's initial rows (default N(0, 1), as
    ``nn.EmbeddingBag``). ``state_dict()`` holds ``embedding_bags.{t}.weight``, the full tables, as an
    ``nn.ModuleList`` of ``nn.EmbeddingBag`` named ``embedding_bags`` holds them. ``storage``: where the full
    tables live, as for ``CachedEmbeddingBag`` (one file per width on disk, the DRAM budget split among the
    widths in proportion to their rows). As there, the rows are stepped inside ``backward()`` (``accumulate()``
    holds the steps for one on the summed gradient), and without ``optimizer`` with SGD at lr 1e-3 and a
    UserWarning. ``state_dict()`` also holds each table's optimizer state for Adagrad and Adam
    (``embedding_bags.{t}.optimizer_state``, as ``CachedEmbeddingBag``'s), so that a reloaded collection trains on
    as the saved one would have; a plain ``nn.ModuleList`` of ``nn.EmbeddingBag`` loads it with ``strict=False``.

    One lookup per width (space), not per table: a forward makes every table's rows of a width resident at once
    (one sort, one eviction choice), gathers them in one ``index_select`` and pools every table's bags in one
    ``embedding_bag``; the backward steps them in one fused update. The work dispatched per iteration does not
    grow with the number of tables (tests/unit/nn/test_nn_collection.py counts it).
    """

    def __init__(self, tables: Sequence[tuple[int, int]], *, cache_rows: int | Sequence[int], mode: str = "sum",
                 optimizer: str | None = None, lr: float | None = None, eps: float | None = None,
                 betas: tuple[float, float] = (0.9, 0.999), policy: str = "lru",
                 cleanup_fraction: float = CLEANUP_FRACTION, weights: Sequence[torch.Tensor] | None = None,
                 storage: str | StorageSpec = "memory", device: torch.device | str | None = None) -> None:
        super().__init__()
        if not tables:
            raise ValueError("a collection needs at least one table")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.tables, self.mode = [(int(rows), int(dim)) for rows, dim in tables], mode
        if weights is not None and [tuple(w.shape) for w in weights] != self.tables:
            raise ValueError(f"weights have shapes {[tuple(w.shape) for w in weights]}, the tables {self.tables}")
        dims = list(dict.fromkeys(dim for _, dim in self.tables))  # spaces in order of first appearance
        self.space_of = [dims.index(dim) for _, dim in self.tables]
        self.offset_of = []  # each table's first key in its space
        sizes = [0] * len(dims)
        for (rows, _), space in zip(self.tables, self.space_of):
            self.offset_of.append(sizes[space])
            sizes[space] += rows
        shares = _split(cache_rows, sizes)
        optimizer_ = row_optimizer(optimizer, lr=lr, eps=eps, betas=betas)
        storage = storage_spec(storage)
        storages = storage.split(sizes)  # the DRAM budget of a tier that keeps files, by rows
        spaces = []
        for space, dim in enumerate(dims):
            members = [t for t, s in enumerate(self.space_of) if s == space]
            blocks = itertools.chain.from_iterable(
                initial_blocks(*self.tables[t], None if weights is None else weights[t], storage=storage)
                for t in members)
            host = host_table(storages[space], num_rows=sizes[space], dim=dim, state_width=optimizer_.state_width(dim),
                              blocks=blocks)
            weakref.finalize(self, host.close)  # a table on disk is this module's working copy
            spaces.append(CachedRows(host, cache_rows=shares[space], optimizer=optimizer_, policy=policy,
                                     cleanup_fraction=cleanup_fraction, device=device))
        self.spaces = nn.ModuleList(spaces)
        self.members = [[t for t, s in enumerate(self.space_of) if s == space] for space in range(len(dims))]

    def forward(self, inputs: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor | None] | None = None,
                per_sample_weights: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        ids = self._checked_ids(inputs)
        offsets = [None] * len(inputs) if offsets is None else list(offsets)
        weights = [None] * len(inputs) if per_sample_weights is None else list(per_sample_weights)
        bags = [_bag_starts(i, x, o, num_ids=len(ids[t]), table=t)
                for t, (i, x, o) in enumerate(zip(ids, inputs, offsets))]
        outputs: list[torch.Tensor | None] = [None] * len(inputs)
        for space, rows in enumerate(self.spaces):
            members = self.members[space]
            # one lookup for the space: its tables' keys are disjoint ranges, so one sort numbers them all
            keys, slots, positions = rows.resident_positions(
                np.concatenate([ids[t] + self.offset_of[t] for t in members]))
            on_device, positions = rows.slots.to_device(slots, positions)  # (positions: int32 while copied)
            leaf = rows.cache_weight.index_select(0, on_device)
            if torch.is_grad_enabled():
                leaf.requires_grad_(True)
                leaf.register_hook(functools.partial(  # one step for the space
                    rows.fused_step, keys, tables=[(self.offset_of[t], self.tables[t][0]) for t in members],
                    slots=slots, as_of=rows.index.version))
            positions = positions.long()
            # the tables pooled in one embedding_bag (one per kind, with or without per-sample weights): their
            # bags one after the other, each's starts moved past the ids of the tables before it
            groups = [[t for t in members if weights[t] is None], [t for t in members if weights[t] is not None]]
            firsts = np.cumsum([0] + [len(ids[t]) for t in members])
            first_of = dict(zip(members, firsts[:-1].tolist()))
            for group in filter(None, groups):
                if len(group) < len(members):
                    at = np.concatenate([np.arange(first_of[t], first_of[t] + len(ids[t])) for t in group])
                    group_positions = positions[rows.slots.to_device(at)[0]]
                    starts = np.cumsum([0] + [len(ids[t]) for t in group])[:-1]
                else:
                    group_positions, starts = positions, firsts[:-1]
                bag_starts = np.concatenate([bags[t] + start for t, start in zip(group, starts)])
                pooled = F.embedding_bag(group_positions, leaf, rows.slots.to_device(bag_starts)[0],
                                         mode=self.mode, sparse=True,
                                         per_sample_weights=None if weights[group[0]] is None
                                         else _flat_cat([weights[t] for t in group]))
                for t, output in zip(group, torch.split(pooled, [len(bags[t]) for t in group])):
                    outputs[t] = output
        return outputs

    # -- the full tables ------------------------------------------------------------------------------------

    def weight(self, table: int) -> torch.Tensor:
        """Table ``table``'s rows, the cached rows written in: in memory, a view the module keeps updating; on
        disk, a copy read from the file."""
        return self._table_rows(table)[0]

    def _table_rows(self, table: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Table ``table``'s rows and their optimizer state, the cached rows written in first."""
        space = self.spaces[self.space_of[table]]
        space.flush()
        offset = self.offset_of[table]
        return space.host.rows(offset, offset + self.tables[table][0])

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        for t in range(len(self.tables)):
            weights, state = self._table_rows(t)
            destination[f"{prefix}embedding_bags.{t}.weight"] = weights
            if state.shape[1]:  # as CachedEmbeddingBag's: SGD keeps none
                destination[f"{prefix}embedding_bags.{t}.{STATE_KEY}"] = state

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """As CachedEmbeddingBag's: each table's weight and optimizer state; a table given its weight alone
        starts a fresh optimizer (zeros), one given neither is kept as it is."""
        expected = set()
        for t, (num_rows, dim) in enumerate(self.tables):
            space = self.spaces[self.space_of[t]]
            weight_key, state_key = f"{prefix}embedding_bags.{t}.weight", f"{prefix}embedding_bags.{t}.{STATE_KEY}"
            shapes = {weight_key: (num_rows, dim)}
            if space.host.state_width:
                shapes[state_key] = (num_rows, space.host.state_width)
            expected.update(shapes)
            if weight_key not in state_dict:
                missing_keys.append(weight_key)  # the optimizer state may be missing: it then starts afresh
                continue
            mismatched = [key for key in shapes if key in state_dict and tuple(state_dict[key].shape) != shapes[key]]
            for key in mismatched:
                error_msgs.append(f"size mismatch for {key}: {tuple(state_dict[key].shape)} against {shapes[key]}")
            if not mismatched:
                space.flush()
                space.host.load(state_dict[weight_key], state_dict.get(state_key) if state_key in shapes else None,
                                start=self.offset_of[t])
        for rows in self.spaces:
            rows.reload()
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected
                               and not k[len(prefix):].startswith("spaces."))

    def accumulate(self) -> ContextManager[None]:
        """As ``CachedEmbeddingBag.accumulate``: one step on the summed gradients of the backward passes inside."""
        return accumulating(list(self.spaces))

    def warm_up(self, sample: Sequence[torch.Tensor], *, fraction: float = 0.7) -> int:
        """Preload the rows ``sample`` (one id tensor per table, from some of the data) names most often, up to
        ``fraction`` of each width's cache; the number preloaded."""
        return sum(rows.warm_up(keys, fraction=fraction) for rows, keys in zip(self.spaces, self.plan_keys(sample)))

    # -- what bagpipe.nn.Lookahead plans for --------------------------------------------------------------

    def cached_spaces(self) -> list[CachedRows]:
        return list(self.spaces)

    def _checked_ids(self, inputs: Sequence[torch.Tensor]) -> list[np.ndarray]:
        """Each table's ids, flat int64 on the host, refused where ``forward`` could not look them up: a count of
        inputs other than the tables', ids that are not integers or an id outside its table."""
        if len(inputs) != len(self.tables):
            raise ValueError(f"{len(inputs)} inputs for {len(self.tables)} tables: give one tensor of ids per table, "
                             f"in the tables' order")
        ids = _host_ids(inputs)
        for t, table_ids in enumerate(ids):
            if len(table_ids) and (table_ids.min() < 0 or table_ids.max() >= self.tables[t][0]):
                raise IndexError(f"table {t}: an id outside [0, {self.tables[t][0]})")
        return ids

    def plan_keys(self, inputs: Sequence[torch.Tensor]) -> list[np.ndarray]:
        """The keys each width's space looks up for ``inputs`` (one entry per table, as ``forward`` takes them),
        refused as ``forward`` would refuse them."""
        keys = [[] for _ in self.spaces]
        for t, ids in enumerate(self._checked_ids(inputs)):
            keys[self.space_of[t]].append(ids + self.offset_of[t])
        return [np.concatenate(k) if k else np.zeros(0, dtype=np.int64) for k in keys]

    def hit_rate(self) -> float:
        return hit_rate(total_stats(list(self.spaces)))


def _host_ids(inputs: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Each table's ids, flat, as int64 in host memory (one copy from a device for all of them), refused as
    ``nn.EmbeddingBag`` refuses them where they are not integers (a float id would be truncated silently)."""
    for t, x in enumerate(inputs):
        if x.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"table {t}: ids must be integers (torch.int64 or torch.int32), got {x.dtype}")
        if x.dim() not in (1, 2):
            raise ValueError(f"table {t}: the input must be 2-D, or 1-D with offsets, got {x.dim()}-D")
    # (read through DLPack: no operation dispatched per table, where .numpy() dispatches a detach)
    if all(x.device.type == "cpu" for x in inputs):
        return [np.from_dlpack(x).reshape(-1).astype(np.int64, copy=False) for x in inputs]
    flat = np.from_dlpack(_flat_cat(inputs).cpu())
    return np.split(flat.astype(np.int64, copy=False), np.cumsum([x.numel() for x in inputs])[:-1])


def _flat_cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened one after the other: one cat where they have one shape past their first dimension
    (the usual case: no operation per tensor), else one after flattening each."""
    alike = all(x.shape[1:] == tensors[0].shape[1:] for x in tensors)
    return torch.cat(tensors if alike else [x.reshape(-1) for x in tensors]).reshape(-1)


def _bag_starts(ids: np.ndarray, x: torch.Tensor, offsets: torch.Tensor | None, *, num_ids: int,
                table: int) -> np.ndarray:
    """Where each bag of a table's input starts among its ``num_ids`` ids (1-D input: its offsets, checked;
    2-D: one bag a row)."""
    if x.dim() == 2:
        if offsets is not None:
            raise ValueError(f"table {table}: offsets must be None when the input is 2-D")
        return np.arange(x.shape[0], dtype=np.int64) * x.shape[1]
    if offsets is None:
        raise ValueError(f"table {table}: the input must be 2-D, or 1-D with offsets")
    starts = np.from_dlpack(offsets.cpu()).astype(np.int64, copy=False).reshape(-1)
    if len(starts) and (starts[0] != 0 or starts[-1] > num_ids or (np.diff(starts) < 0).any()):
        raise ValueError(f"table {table}: offsets must start at 0 and not decrease nor pass the {num_ids} ids")
    return starts


def _split(cache_rows: int | Sequence[int], sizes: list[int]) -> list[int]:
    if not isinstance(cache_rows, int):
        if len(cache_rows) != len(sizes):
            raise ValueError(f"{len(cache_rows)} cache sizes for {len(sizes)} embedding widths")
        return [int(c) for c in cache_rows]
    if cache_rows <= 0:
        raise ValueError(f"cache_rows must be positive, got {cache_rows}")
    return [max(1, cache_rows * size // sum(sizes)) for size in sizes]
