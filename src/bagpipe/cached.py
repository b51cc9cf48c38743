"""Single-process cached training: planner + row stores + one trainer cache, in one loop.

The distributed runtime's reference: the same plan steps carried out in order, synchronously.
Its result must equal the reference trainer's (every row read reflects all earlier updates).
"""

from __future__ import annotations

import numpy as np
import torch

from bagpipe.cache import BatchRows, RowCache, StepTables, batch_view
from bagpipe.data.batches import Batch, iterate_batches
from bagpipe.data.binary import BinarySplit
from bagpipe.embeddings import flat_keys, table_offsets
from bagpipe.models.dlrm import DLRM
from bagpipe.optim import RowOptimizer
from bagpipe.planner import PlannerConfig, plan
from bagpipe.reference import train_step
from bagpipe.storage import RowStore, gather_flat


def train_cached(model: DLRM, dense_optimizer: torch.optim.Optimizer, split: BinarySplit, *,
                 batch_size: int, iterations: int, **options) -> list[RowStore]:
    """Train ``iterations`` batches of a split from a cache; return the row stores."""
    batches = list(iterate_batches(split, batch_size=batch_size, iterations=iterations))
    return train_cached_batches(model, dense_optimizer, batches, table_sizes=split.table_sizes, **options)


def train_cached_batches(model: DLRM, dense_optimizer: torch.optim.Optimizer, batches: list[Batch], *,
                         table_sizes: list[int], row_optimizer: RowOptimizer, seed: int, cache_rows: int,
                         lookahead: int, policy: str = "lookahead", num_shards: int = 1,
                         timeout: float = 30.0) -> list[RowStore]:
    """Train on ``batches`` (one-hot ids or multi-hot bags) from a cache of ``cache_rows`` rows."""
    sizes = list(table_sizes)
    stores = [RowStore(table_sizes=sizes, dim=model.emb_dim, optimizer=row_optimizer, seed=seed, shard=s,
                       num_shards=num_shards) for s in range(num_shards)]
    cache = RowCache(capacity=cache_rows, dim=model.emb_dim, optimizer=row_optimizer)
    offsets = torch.from_numpy(table_offsets(sizes))
    keys = [flat_keys(b.ids, offsets).numpy() for b in batches]
    config = PlannerConfig(num_rows=int(sum(sizes)), cache_rows=cache_rows, lookahead=lookahead, policy=policy)
    rows_of = BatchRows(config.num_rows)
    for step in plan((k.ravel() for k in keys), config):
        if len(step.evict_keys):
            rows, state = cache.evict(step.evict_slots, step.evict_keys)
            for store, mine, index in _by_shard(stores, step.evict_keys):
                store.write_back(step.evict_keys[mine], rows[index], state[index], version=step.iteration - 1)
        if len(step.fetch_keys):
            rows = torch.empty(len(step.fetch_keys), model.emb_dim)
            state = torch.empty(len(step.fetch_keys), row_optimizer.state_width(model.emb_dim))
            for store, mine, index in _by_shard(stores, step.fetch_keys):
                rows[index], state[index] = store.fetch(step.fetch_keys[mine], step.fetch_versions[mine],
                                                        timeout=timeout)
            cache.install(step.fetch_slots, step.fetch_keys, rows, state)
        if step.iteration < len(batches):
            rows_of.load(batch_view(step))
            tables = StepTables(cache, rows_of.at(keys[step.iteration]))
            train_step(model, tables, dense_optimizer, batches[step.iteration])
    return stores


def _by_shard(stores: list[RowStore], keys: np.ndarray):
    """Each store with the mask and tensor index of the keys it owns."""
    for shard, store in enumerate(stores):
        mine = keys % len(stores) == shard
        yield store, mine, torch.from_numpy(np.flatnonzero(mine))


def gather_tables(stores: list[RowStore], table_sizes: list[int]) -> list[torch.Tensor]:
    """Reassemble every table from its shards (for export and tests)."""
    flat = gather_flat([store.weights for store in stores], int(sum(table_sizes)))
    return list(torch.split(flat, list(table_sizes)))
