"""What a data set's samples hold: dense features, and sparse features as columns of one id matrix.

A sparse feature takes ``width`` consecutive columns of a batch's ``[B, K]`` int64 id matrix:
one column for a one-hot feature, several for a multi-valued one (a bag, or a sequence such as a
user's last items), unused places padded with -1. Ids lie in ``[0, cardinality)``.
"""

from __future__ import annotations

from dataclasses import dataclass

PAD = -1  # an empty place in a multi-valued feature's columns


@dataclass(frozen=True, kw_only=True)
class Feature:
    name: str
    cardinality: int  # ids in [0, cardinality)
    width: int = 1  # columns: 1 one-hot, more a bag or a sequence (padded with PAD)
    # raw-id tables (embeddings.dynamic): the rows their initial values are scaled for, a property of the data (its
    # train split's distinct keys and the default row), not of the rows a run makes; 0: the cardinality
    init_rows: int = 0

    def __post_init__(self) -> None:
        if self.cardinality <= 0 or self.width <= 0:
            raise ValueError(f"feature {self.name}: cardinality and width must be positive, "
                             f"got {self.cardinality} and {self.width}")


@dataclass(frozen=True, kw_only=True)
class Schema:
    num_dense: int
    features: tuple[Feature, ...]

    @classmethod
    def one_hot(cls, cardinalities: list[int], *, num_dense: int) -> "Schema":
        """Criteo's shape: one id per sample and feature, features named C1, C2, ..."""
        return cls(num_dense=num_dense,
                   features=tuple(Feature(name=f"C{i + 1}", cardinality=int(n)) for i, n in enumerate(cardinalities)))

    @property
    def cardinalities(self) -> list[int]:
        return [f.cardinality for f in self.features]

    @property
    def num_columns(self) -> int:
        return sum(f.width for f in self.features)

    def columns(self, feature: int) -> tuple[int, int]:
        """The [start, stop) columns of ``feature`` in the id matrix."""
        start = sum(f.width for f in self.features[:feature])
        return start, start + self.features[feature].width

    @property
    def one_hot_only(self) -> bool:
        return all(f.width == 1 for f in self.features)


NEXT_ITEM_FEATURES = ("user", "history", "targets", "negatives")  # next-item samples (data.sequences)


def is_next_item(schema: Schema) -> bool:
    return tuple(f.name for f in schema.features) == NEXT_ITEM_FEATURES


def original_table_sizes(schema: Schema) -> list[int]:
    """The table sizes as the original system lists them (``ln_emb``, ``emb_table_info.txt``): one per
    sparse feature, or for next-item samples the users' and the items' (one item table for all three
    item features)."""
    if is_next_item(schema):
        return [schema.features[0].cardinality, schema.features[1].cardinality]
    return schema.cardinalities


def with_table_sizes(schema: Schema, sizes: list[int]) -> Schema:
    """``schema`` with the cardinalities of ``original_table_sizes`` replaced by ``sizes``."""
    if is_next_item(schema):
        sizes = [sizes[0], sizes[1], sizes[1], sizes[1]]
    return Schema(num_dense=schema.num_dense,
                  features=tuple(Feature(name=f.name, cardinality=int(n), width=f.width)
                                 for f, n in zip(schema.features, sizes, strict=True)))
