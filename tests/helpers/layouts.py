"""Small embedding layouts, a plan step's fields, and the members of a parity group, as several tests build them."""

from __future__ import annotations

import numpy as np

from bagpipe.data.schema import Feature, Schema
from bagpipe.embeddings import EmbeddingLayout, one_per_feature
from bagpipe.optim import make_row_optimizer
from bagpipe.storage import RowStore
from bagpipe.storage.parity import read_member

def layout_of(sizes: list[int], dim: int, *, widths: list[int] | None = None) -> EmbeddingLayout:
    """One table per feature of ``sizes`` (feature i ``widths[i]`` columns wide, default one-hot)."""
    widths = widths or [1] * len(sizes)
    schema = Schema(num_dense=13, features=tuple(Feature(name=f"C{i}", cardinality=n, width=w)
                                                 for i, (n, w) in enumerate(zip(sizes, widths))))
    return EmbeddingLayout(one_per_feature(schema, dim), schema)


PLAN_FIELDS = ("fetch_keys", "fetch_versions", "fetch_slots", "evict_keys", "evict_writers", "evict_slots",
               "sync_now_keys", "sync_later_keys", "sync_later_deadlines", "batch_keys", "batch_slots")


PARITY_SIZES = [50, 37, 64]  # 151 rows: shards of 51, 50 and 50 rows when split 3 ways


def members(optimizer="adam", num_shards=3):
    layout = layout_of(PARITY_SIZES, 4)
    row_optimizer = make_row_optimizer(optimizer, lr=0.1)
    return [RowStore(layout=layout, space=0, optimizer=row_optimizer, seed=3, shard=s, num_shards=num_shards)
            for s in range(num_shards)]


def member_bits(store):
    return read_member(store, np.arange(store.num_rows))
