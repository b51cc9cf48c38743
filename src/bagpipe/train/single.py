"""Single-process cached training: planner + row stores + one trainer cache per space, in one loop.

The distributed runtime's reference: the same plan steps carried out in order, synchronously.
Its result must equal the reference trainer's (every row read reflects all earlier updates).
``train_partitioned_batches`` is the same for the partitioned plan (planner/partitioned.py): one cache per
trainer and space, each trainer's slice trained from its own cache, rows summed among their users only; it equals
the sliced reference (``--mode reference --slices T``) bit for bit.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from bagpipe.cache import BatchRows, BatchView, RowCache, StepTables, batch_view
from bagpipe.data.batches import Batch, iterate_batches
from bagpipe.data.binary import BinarySplit
from bagpipe.embeddings import EmbeddingLayout, valid_keys
from bagpipe.optim import RowOptimizer
from bagpipe.planner import PlannerConfig, plan_spaces
from bagpipe.planner.partitioned import plan_partitioned_spaces
from bagpipe.models.layers import set_dropout_step
from bagpipe.train.reference import train_step
from bagpipe.storage import RowStore, gather_flat
from bagpipe.storage.parity import ParityGroups


def train_cached(model: nn.Module, dense_optimizer: torch.optim.Optimizer, split: BinarySplit, *,
                 batch_size: int, iterations: int, **options) -> list[list[RowStore]]:
    """Train ``iterations`` batches of a split from a cache; return each space's row stores."""
    batches = list(iterate_batches(split, batch_size=batch_size, iterations=iterations))
    return train_cached_batches(model, dense_optimizer, batches, **options)


def train_cached_batches(model: nn.Module, dense_optimizer: torch.optim.Optimizer, batches: list[Batch], *,
                         layout: EmbeddingLayout, row_optimizer: RowOptimizer, seed: int, cache_rows: int,
                         lookahead: int, policy: str = "lookahead", num_shards: int = 1,
                         timeout: float = 30.0, parity: int = 0, losses: dict[int, list[int]] | None = None,
                         rebuild_rows: int = 0) -> list[list[RowStore]]:
    """Train on ``batches`` from a cache of ``cache_rows`` rows (shared among the spaces).

    ``parity`` k > 0: the shards form erasure-coded groups of k (storage.parity); ``losses``: the shards lost
    just before each iteration (their rows dropped, served by their group from then on), rebuilt ``rebuild_rows``
    rows per iteration (all at once if 0) until each takes its place again.
    """
    spaces = range(len(layout.spaces))
    losses = losses or {}
    if losses and not parity:
        raise ValueError("losing a shard needs parity groups (parity=k)")

    def make_store(space: int, shard: int) -> RowStore:
        return RowStore(layout=layout, space=space, optimizer=row_optimizer, seed=seed, shard=shard,
                        num_shards=num_shards)

    groups = [ParityGroups(functools.partial(make_store, s), num_shards=num_shards, k=parity) for s in spaces
              ] if parity else []
    # a shard's store, or its stand-in while it is rebuilt: ParityGroups keeps these lists current
    stores = [group.members for group in groups] or [[make_store(s, shard) for shard in range(num_shards)]
                                                     for s in spaces]
    shares = layout.split_cache(cache_rows, batch_size=len(batches[0]))
    caches = [RowCache(capacity=shares[s], dim=layout.spaces[s].dim, optimizer=row_optimizer) for s in spaces]
    keys = [layout.keys(b.ids.numpy()) for b in batches]
    configs = [PlannerConfig(num_rows=layout.spaces[s].num_rows, cache_rows=shares[s], lookahead=lookahead,
                             policy=policy) for s in spaces]
    rows_of = [BatchRows() for s in spaces]
    for steps in plan_spaces(([valid_keys(k) for k in batch_keys] for batch_keys in keys), configs):
        for shard in losses.get(steps[0].iteration, []):
            for group in groups:
                group.lose(shard)
        for group in groups:
            group.rebuild(rebuild_rows or group.rows_to_rebuild())
        for s, step in enumerate(steps):
            carry_out(step, caches[s], stores[s], dim=layout.spaces[s].dim, row_optimizer=row_optimizer,
                      timeout=timeout)
        iteration = steps[0].iteration
        if iteration < len(batches):
            views = []
            for s, step in enumerate(steps):
                rows_of[s].load(batch_view(step))
                views.append(rows_of[s].at(keys[iteration][s]))
            train_step(model, StepTables(caches, views, layout), dense_optimizer, batches[iteration], seed=seed,
                       iteration=iteration)
    for group in groups:
        group.rebuild(group.rows_to_rebuild())
    return [group.stores for group in groups] or stores


def train_partitioned_batches(model: nn.Module, dense_optimizer: torch.optim.Optimizer, batches: list[Batch], *,
                              layout: EmbeddingLayout, row_optimizer: RowOptimizer, seed: int, cache_rows: int,
                              lookahead: int, trainers: int, num_shards: int = 1, keep_within: int = 0,
                              timeout: float = 30.0) -> list[list[RowStore]]:
    """Train on ``batches`` as ``trainers`` trainers with a partitioned cache of ``cache_rows`` rows each (shared
    among the spaces): each trainer carries out its part of every plan step on its own caches (write-backs, drops,
    fetches), trains its slice of the batch from them, and each row's gradient is the sum of its users'
    contributions in trainer order over ``trainers`` (the dense gradients' sum over all of them, likewise), applied
    by every user to its copy (and by a trainer that keeps the row without using it: ``keep_within``). Returns each
    space's row stores, every row written back."""
    spaces = range(len(layout.spaces))
    stores = [[RowStore(layout=layout, space=s, optimizer=row_optimizer, seed=seed, shard=shard,
                        num_shards=num_shards) for shard in range(num_shards)] for s in spaces]
    size = len(batches[0]) // trainers
    shares = layout.split_cache(cache_rows, batch_size=size)
    caches = [[RowCache(capacity=shares[s], dim=layout.spaces[s].dim, optimizer=row_optimizer) for s in spaces]
              for _ in range(trainers)]
    rows_of = [[BatchRows() for s in spaces] for _ in range(trainers)]
    parts = [batch.slices(trainers) for batch in batches]
    keys = [[layout.keys(part.ids.numpy()) for part in batch_parts] for batch_parts in parts]
    configs = [PlannerConfig(num_rows=layout.spaces[s].num_rows, cache_rows=shares[s], lookahead=lookahead,
                             num_trainers=trainers, keep_within=keep_within) for s in spaces]
    params = list(model.parameters())
    slices = ([[valid_keys(keys[i][t][s]) for t in range(trainers)] for s in spaces] for i in range(len(batches)))
    for steps in plan_partitioned_spaces(slices, configs):
        for s, step in enumerate(steps):  # every trainer's write-backs (hand-offs among them) before any fetch
            for t, part in enumerate(step.trainers):
                _write_back_and_drop(part, caches[t][s], stores[s])
            for t, part in enumerate(step.trainers):
                _fetch(part, caches[t][s], stores[s], dim=layout.spaces[s].dim, row_optimizer=row_optimizer,
                       timeout=timeout)
        iteration = steps[0].iteration
        if iteration == len(batches):
            break
        sums, row_grads = None, []
        for t in range(trainers):
            views = []
            for s, step in enumerate(steps):
                part = step.trainers[t]
                rows_of[t][s].load(BatchView(part.batch_keys, part.batch_slots, 0, np.zeros(0, dtype=np.int32)))
                views.append(rows_of[t][s].at(keys[iteration][t][s]))
            set_dropout_step(model, seed=seed, iteration=iteration, part=t)  # as trainer t draws it
            embeddings, lookups = StepTables(caches[t], views, layout).lookup(parts[iteration][t].ids)
            loss = model.training_loss(parts[iteration][t].dense_x, embeddings, parts[iteration][t].target)
            dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            with torch.no_grad():
                grads = [*(p.grad for p in params), loss.detach()]
                sums = [g.clone() for g in grads] if sums is None else [a.add_(g) for a, g in zip(sums, grads)]
            row_grads.append([lookup.rows.grad if lookup.rows.grad is not None else torch.zeros_like(lookup.rows)
                              for lookup in lookups])
        with torch.no_grad():
            for total in sums:
                total.div_(trainers)  # the mean over trainers, as the sliced reference divides
        for p, grad in zip(params, sums[:-1]):
            p.grad = grad
        dense_optimizer.step()
        for s, step in enumerate(steps):
            _apply_shared(step, [caches[t][s] for t in range(trainers)], [grads[s] for grads in row_grads],
                          trainers=trainers)
    return stores


def _write_back_and_drop(part, cache: RowCache, stores: list[RowStore]) -> None:
    """One trainer's write-backs of a partitioned plan step (read from their slots), then its drops."""
    if len(part.write_keys):
        rows, state = cache.read(part.write_slots, part.write_keys)
        for store, mine, at in _by_shard(stores, part.write_keys):
            for version in np.unique(part.write_versions[mine]):  # a write-back carries one version
                same = np.flatnonzero(mine)[part.write_versions[mine] == version]
                store.write_back(part.write_keys[same], rows[same], state[same], version=int(version))
    if len(part.drop_keys):
        cache.evict(part.drop_slots, part.drop_keys)


def _fetch(part, cache: RowCache, stores: list[RowStore], *, dim: int, row_optimizer: RowOptimizer,
           timeout: float) -> None:
    """A plan step's fetches (a trainer's part of one, partitioned), installed in their slots."""
    if len(part.fetch_keys):
        rows = torch.empty(len(part.fetch_keys), dim)
        state = torch.empty(len(part.fetch_keys), row_optimizer.state_width(dim))
        for store, mine, index in _by_shard(stores, part.fetch_keys):
            rows[index], state[index] = store.fetch(part.fetch_keys[mine], part.fetch_versions[mine], timeout=timeout)
        cache.install(part.fetch_slots, part.fetch_keys, rows, state)


def _apply_shared(step, caches: list[RowCache], grads: list[torch.Tensor], *, trainers: int) -> None:
    """Each row's update of one space: its users' gradients summed in trainer order, over ``trainers``, applied by
    every holder to its copy, users and keepers (a row of one user: its own gradient over ``trainers``)."""
    total: dict[int, torch.Tensor] = {}
    for t, part in enumerate(step.trainers):  # in trainer order, users only
        for row, key in enumerate(part.batch_keys.tolist()):
            grad = grads[t][row]
            total[key] = grad.clone() if key not in total else total[key].add_(grad)
    for t, part in enumerate(step.trainers):
        for keys, slots in ((part.batch_keys, part.batch_slots), (part.kept_keys, part.kept_slots)):
            if len(keys):
                caches[t].apply(slots, torch.stack([total[key] for key in keys.tolist()]).div_(trainers))


def carry_out(step, cache: RowCache, stores: list[RowStore], *, dim: int, row_optimizer: RowOptimizer,
              timeout: float) -> None:
    """A plan step's evictions (written back) and fetches (installed), in order."""
    if len(step.evict_keys):
        rows, state = cache.evict(step.evict_slots, step.evict_keys)
        for store, mine, index in _by_shard(stores, step.evict_keys):
            store.write_back(step.evict_keys[mine], rows[index], state[index], version=step.iteration - 1)
    _fetch(step, cache, stores, dim=dim, row_optimizer=row_optimizer, timeout=timeout)


def _by_shard(stores: list[RowStore], keys: np.ndarray):
    """Each store with the mask and tensor index of the keys it owns."""
    for shard, store in enumerate(stores):
        mine = keys % len(stores) == shard
        yield store, mine, torch.from_numpy(np.flatnonzero(mine))


def gather_tables(stores: list[list[RowStore]], layout: EmbeddingLayout) -> list[torch.Tensor]:
    """Reassemble every table from its space's shards (for export and tests)."""
    spaces = [gather_flat([store.all_weights() for store in shards], space.num_rows)
              for shards, space in zip(stores, layout.spaces)]
    tables = []
    for t, table in enumerate(layout.tables):
        space, offset = layout.place(t)
        tables.append(spaces[space][offset:offset + table.num_rows])
    return tables
