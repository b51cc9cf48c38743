"""Embedding tables by configuration, and how a batch's ids become each table's keys.

Every table has its own rows and width and embeds one or more of the data's sparse features (one
lookup each; several features may share a table, e.g. a sequence's items and its target item).
Tables of the same width share an embedding *space*: one flat key space (a table's offset in
the space + id), planned, cached, served and updated as a whole. A model whose tables have
several widths (factor and first-order embeddings, say) has several spaces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from bagpipe.data.schema import PAD, Schema

INITS = ("uniform", "normal", "zeros")


@dataclass(frozen=True, kw_only=True)
class TableConfig:
    name: str
    num_rows: int
    dim: int
    features: tuple[int, ...]  # the data's sparse features this table embeds, one lookup each
    init: str = "uniform"  # uniform: +-1/sqrt(num_rows), as DLRM; normal: N(0, (1/dim)^2), as Caser; zeros
    init_rows: int = 0  # raw-id tables: the rows the uniform init is scaled for instead (Feature.init_rows)

    def __post_init__(self) -> None:
        if self.num_rows <= 0 or self.dim <= 0:
            raise ValueError(f"table {self.name}: rows and dim must be positive, got {self.num_rows} and {self.dim}")
        if not self.features:
            raise ValueError(f"table {self.name}: embeds no feature")
        if self.init not in INITS:
            raise ValueError(f"table {self.name}: init must be one of {', '.join(INITS)}, got {self.init!r}")

    def to_dict(self) -> dict:
        return {"name": self.name, "num_rows": self.num_rows, "dim": self.dim, "features": list(self.features),
                "init": self.init, **({"init_rows": self.init_rows} if self.init_rows else {})}

    @classmethod
    def from_dict(cls, values: dict) -> "TableConfig":
        return cls(**{**values, "features": tuple(values["features"])})


def one_per_feature(schema: Schema, dim: int) -> list[TableConfig]:
    """A table of ``dim`` for each sparse feature, named after it (DLRM's tables, and a user script's)."""
    return [TableConfig(name=f.name, num_rows=f.cardinality, dim=dim, features=(i,))
            for i, f in enumerate(schema.features)]


@dataclass(frozen=True)
class LookupSpec:
    """One table embedding one feature: columns [start, stop) of its space's key matrix."""

    table: int
    feature: int
    space: int
    start: int
    stop: int


@dataclass(frozen=True)
class Space:
    """The tables of one width, as one flat key space."""

    dim: int
    tables: tuple[int, ...]  # indices into the layout's tables
    offsets: np.ndarray  # the first key of each of those tables
    num_rows: int
    data_columns: np.ndarray  # per column of the space's key matrix: the id-matrix column it reads
    key_offsets: np.ndarray  # and the offset its ids get
    padded: bool  # some of those columns may hold PAD (a multi-valued feature)
    all_columns: bool  # it reads every column of the id matrix, in order (DLRM's one space)


class EmbeddingLayout:
    """Tables grouped into spaces by width, and every lookup's place (pure: no tensors held)."""

    def __init__(self, tables: Sequence[TableConfig], schema: Schema) -> None:
        # (a raw-id table's initial values are scaled for its data's rows: Feature.init_rows)
        self.tables = tuple(dataclasses.replace(table, init_rows=schema.features[table.features[0]].init_rows)
                            if not table.init_rows and table.features and table.features[0] < len(schema.features)
                            and schema.features[table.features[0]].init_rows else table for table in tables)
        self.schema = schema
        if not self.tables:
            raise ValueError("a model needs at least one embedding table")
        for table in self.tables:
            for feature in table.features:
                if not 0 <= feature < len(schema.features):
                    raise ValueError(f"table {table.name} embeds feature {feature}, but the data has "
                                     f"{len(schema.features)} sparse features")
                if schema.features[feature].cardinality > table.num_rows:
                    raise ValueError(f"table {table.name} has {table.num_rows} rows, fewer than feature "
                                     f"{schema.features[feature].name}'s {schema.features[feature].cardinality} ids")
        dims = list(dict.fromkeys(t.dim for t in self.tables))  # in order of first appearance
        spaces, lookups = [], []
        for space_index, dim in enumerate(dims):
            members = tuple(i for i, t in enumerate(self.tables) if t.dim == dim)
            sizes = [self.tables[i].num_rows for i in members]
            offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            columns, key_offsets, padded = [], [], False
            for table_index, offset in zip(members, offsets.tolist()):
                for feature in self.tables[table_index].features:
                    start, stop = schema.columns(feature)
                    lookups.append(LookupSpec(table_index, feature, space_index, len(columns),
                                              len(columns) + stop - start))
                    columns.extend(range(start, stop))
                    key_offsets.extend([offset] * (stop - start))
                    padded |= stop - start > 1
            spaces.append(Space(dim, members, offsets, int(sum(sizes)), np.asarray(columns, dtype=np.int64),
                                np.asarray(key_offsets, dtype=np.int64), padded,
                                columns == list(range(schema.num_columns))))
        self.spaces = tuple(spaces)
        # lookups in table order, then feature order: the order a model receives its embeddings in
        self.lookups = tuple(sorted(lookups, key=lambda spec: (spec.table, self.tables[spec.table].features.index(
            spec.feature))))

    @property
    def num_rows(self) -> int:
        return sum(space.num_rows for space in self.spaces)

    def keys(self, ids: np.ndarray) -> list[np.ndarray]:
        """Per space, the keys of a batch's ids ``[B, K]``: ``[B, K_s]``, PAD where the ids have it."""
        keys = []
        for space in self.spaces:
            chosen = (ids if space.all_columns else ids[:, space.data_columns]).astype(np.int64, copy=False)
            if space.padded:
                keys.append(np.where(chosen >= 0, chosen + space.key_offsets, PAD))
            else:
                keys.append(chosen + space.key_offsets)
        return keys

    def place(self, table: int) -> tuple[int, int]:
        """(space, offset) of a table: its rows are keys offset .. offset + num_rows - 1 there."""
        for space_index, space in enumerate(self.spaces):
            if table in space.tables:
                return space_index, int(space.offsets[space.tables.index(table)])
        raise AssertionError(f"table {table} is in no space")

    def split_cache(self, cache_rows: int, *, batch_size: int) -> list[int]:
        """A cache of ``cache_rows`` rows shared among the spaces.

        Each space first gets what a batch of ``batch_size`` samples can touch of it (its rows, or its
        columns x batch_size if fewer), or a share of the cache in proportion to that if they do not
        all fit; the rest goes to the spaces in proportion to the rows they have beyond that. A small
        table read by every sample (an item table) is so cached whole, a large one (users) in part;
        no space gets more slots than it has rows.
        """
        need = [min(space.num_rows, batch_size * len(space.data_columns)) for space in self.spaces]
        if sum(need) >= cache_rows:
            return [max(1, cache_rows * n // sum(need)) for n in need]
        spare = [space.num_rows - n for space, n in zip(self.spaces, need)]
        extra = min(cache_rows, self.num_rows) - sum(need)  # more than every row would stay empty
        return [n + (extra * r // sum(spare) if sum(spare) else 0) for n, r in zip(need, spare)]
