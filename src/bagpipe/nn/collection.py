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

from bagpipe.nn.cached_bag import MODES, row_optimizer
from bagpipe.nn.host import host_table, initial_blocks, storage_spec
from bagpipe.nn.rows import CachedRows, accumulating, hit_rate, total_stats
from bagpipe.nn.slots import CLEANUP_FRACTION
from bagpipe.planner.keys import unique_inverse
from bagpipe.storage import StorageSpec


class CachedEmbeddingBagCollection(nn.Module):
    """``tables``: ``(num_embeddings, embedding_dim)`` per table. ``forward(inputs, offsets=None,
    per_sample_weights=None)`` takes one entry per table, each as ``nn.EmbeddingBag`` takes it (1-D with
    offsets, or 2-D), and returns one pooled ``[bags, dim]`` tensor per table.

    ``cache_rows``: rows cached in all (split among the widths in proportion to their rows), or one count
    per width in order of first appearance. ``weights``: each table's initial rows (default N(0, 1), as
    ``nn.EmbeddingBag``). ``state_dict()`` holds ``embedding_bags.{t}.weight``, the full tables, as an
    ``nn.ModuleList`` of ``nn.EmbeddingBag`` named ``embedding_bags`` holds them. ``storage``: where the full
    tables live, as for ``CachedEmbeddingBag`` (one file per width on disk, the DRAM budget split among the
    widths in proportion to their rows). As there, the rows are stepped inside ``backward()`` (``accumulate()``
    holds the steps for one on the summed gradient), and without ``optimizer`` with SGD at lr 1e-3 and a
    UserWarning; the optimizer state is not in ``state_dict()``.
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
        spaces = []
        for space, dim in enumerate(dims):
            members = [t for t, s in enumerate(self.space_of) if s == space]
            blocks = itertools.chain.from_iterable(
                initial_blocks(*self.tables[t], None if weights is None else weights[t], storage=storage)
                for t in members)
            share = StorageSpec(storage.kind, storage.directory, storage.budget_bytes * sizes[space] // sum(sizes))
            host = host_table(share, num_rows=sizes[space], dim=dim, state_width=optimizer_.state_width(dim),
                              blocks=blocks)
            weakref.finalize(self, host.close)  # a table on disk is this module's working copy
            spaces.append(CachedRows(host, cache_rows=shares[space], optimizer=optimizer_, policy=policy,
                                     cleanup_fraction=cleanup_fraction, device=device))
        self.spaces = nn.ModuleList(spaces)

    def forward(self, inputs: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor | None] | None = None,
                per_sample_weights: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        if len(inputs) != len(self.tables):
            raise ValueError(f"{len(inputs)} inputs for {len(self.tables)} tables")
        offsets = [None] * len(inputs) if offsets is None else list(offsets)
        weights = [None] * len(inputs) if per_sample_weights is None else list(per_sample_weights)
        bags = [_as_bags(x, o, table=t) for t, (x, o) in enumerate(zip(inputs, offsets))]
        outputs: list[torch.Tensor | None] = [None] * len(inputs)
        for space, rows in enumerate(self.spaces):
            members = [t for t, s in enumerate(self.space_of) if s == space]
            for t in members:
                if len(bags[t][0]) and (int(bags[t][0].min()) < 0 or int(bags[t][0].max()) >= self.tables[t][0]):
                    raise IndexError(f"table {t}: an id outside [0, {self.tables[t][0]})")
            # one admission for all members (their keys are in disjoint, increasing ranges: concatenated, sorted)
            distinct = [unique_inverse(bags[t][0].cpu().numpy()) for t in members]  # (np.unique's, faster)
            keys = [keys + self.offset_of[t] for t, (keys, _) in zip(members, distinct)]
            slots = np.split(rows.make_resident(np.concatenate(keys)), np.cumsum([len(k) for k in keys])[:-1])
            device = rows.cache_weight.device
            for t, table_keys, table_slots, (_, positions) in zip(members, keys, slots, distinct):
                # a leaf and a pooling per table: its gradient then sums as nn.EmbeddingBag's own does (rows.dense_rows)
                leaf = rows.cache_weight.index_select(0, torch.from_numpy(table_slots).to(device))
                if torch.is_grad_enabled():
                    leaf.requires_grad_(True)
                    leaf.register_hook(functools.partial(rows.fused_step, table_keys,
                                                         table=(self.offset_of[t], self.tables[t][0])))
                outputs[t] = F.embedding_bag(torch.from_numpy(positions).to(device).long(), leaf, bags[t][1].to(device),
                                             mode=self.mode, sparse=True, per_sample_weights=weights[t])
        return outputs

    # -- the full tables ------------------------------------------------------------------------------------

    def weight(self, table: int) -> torch.Tensor:
        """Table ``table``'s rows, the cached rows written in: in memory, a view the module keeps updating; on
        disk, a copy read from the file."""
        space = self.spaces[self.space_of[table]]
        space.flush()
        offset = self.offset_of[table]
        return space.host.rows(offset, offset + self.tables[table][0])[0]

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        for t in range(len(self.tables)):
            destination[f"{prefix}embedding_bags.{t}.weight"] = self.weight(t)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        names = {f"{prefix}embedding_bags.{t}.weight": t for t in range(len(self.tables))}
        for name, t in names.items():
            if name not in state_dict:
                missing_keys.append(name)
            elif tuple(state_dict[name].shape) != self.tables[t]:
                error_msgs.append(f"size mismatch for {name}: {tuple(state_dict[name].shape)} against {self.tables[t]}")
            else:
                space = self.spaces[self.space_of[t]]
                space.flush()
                space.host.set_rows(self.offset_of[t], state_dict[name].detach())
        for rows in self.spaces:
            rows.reload()
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in names
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

    def plan_keys(self, inputs: Sequence[torch.Tensor]) -> list[np.ndarray]:
        """The keys each width's space looks up for ``inputs`` (one entry per table, as ``forward`` takes them)."""
        keys = [[] for _ in self.spaces]
        for t, ids in enumerate(inputs):
            keys[self.space_of[t]].append(ids.detach().cpu().numpy().reshape(-1).astype(np.int64) + self.offset_of[t])
        return [np.concatenate(k) if k else np.zeros(0, dtype=np.int64) for k in keys]

    def hit_rate(self) -> float:
        return hit_rate(total_stats(list(self.spaces)))


def _as_bags(ids: torch.Tensor, offsets: torch.Tensor | None, *, table: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A table's input as 1-D ids and the offset of each bag."""
    if ids.dim() == 2:
        if offsets is not None:
            raise ValueError(f"table {table}: offsets must be None when the input is 2-D")
        return ids.reshape(-1), torch.arange(0, ids.numel(), max(ids.shape[1], 1), device=ids.device)[:ids.shape[0]]
    if ids.dim() != 1 or offsets is None:
        raise ValueError(f"table {table}: the input must be 2-D, or 1-D with offsets")
    return ids, offsets


def _split(cache_rows: int | Sequence[int], sizes: list[int]) -> list[int]:
    if not isinstance(cache_rows, int):
        if len(cache_rows) != len(sizes):
            raise ValueError(f"{len(cache_rows)} cache sizes for {len(sizes)} embedding widths")
        return [int(c) for c in cache_rows]
    if cache_rows <= 0:
        raise ValueError(f"cache_rows must be positive, got {cache_rows}")
    return [max(1, cache_rows * size // sum(sizes)) for size in sizes]
