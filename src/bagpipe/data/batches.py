"""Deterministic global batches over a binary split: consecutive rows, or shuffled by a seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from bagpipe.data.binary import BinarySplit
from bagpipe.data.negatives import FreshNegatives
from bagpipe.data.schema import is_next_item


@dataclass(frozen=True)
class Batch:
    dense_x: torch.Tensor  # float32 [B, num_dense]
    ids: torch.Tensor  # int64 [B, columns]: each sparse feature's ids (data.schema), -1 where empty
    target: torch.Tensor  # float32 [B]

    def __len__(self) -> int:
        return self.target.shape[0]

    def slice(self, samples: slice) -> "Batch":
        """Samples ``samples`` of this batch (a trainer's part of a global batch)."""
        return Batch(dense_x=self.dense_x[samples], ids=self.ids[samples], target=self.target[samples])

    def to(self, device: torch.device | str) -> "Batch":
        """The batch for a model on ``device``: its dense features and targets moved there, its ids left in host
        memory (the tables compute their keys there, and send the device only the keys)."""
        if torch.device(device).type == "cpu":
            return self
        return Batch(dense_x=self.dense_x.to(device, non_blocking=True), ids=self.ids,
                     target=self.target.to(device, non_blocking=True))

    def slices(self, count: int) -> list["Batch"]:
        """The batch cut into ``count`` equal consecutive parts, as the trainers take it."""
        size = len(self) // count
        assert size * count == len(self), "the batch must divide evenly"
        return [self.slice(slice(part * size, (part + 1) * size)) for part in range(count)]


def batches_per_epoch(split: BinarySplit, batch_size: int) -> int:
    return split.rows // batch_size


def planned_iterations(config, split: BinarySplit) -> int:
    """A run's iterations: ``config.iterations``, or ``config.epochs`` passes over ``split`` when that is 0."""
    return config.iterations or config.epochs * batches_per_epoch(split, config.batch_size)


def batch_rows(split: BinarySplit, *, batch_size: int, iterations: int, shuffle: bool,
               shuffle_seed: int, start: int = 0) -> Iterator[slice | np.ndarray]:
    """Row selectors of each iteration's global batch from ``start`` on; an incomplete last batch is dropped.

    Without shuffling, batch i holds rows [i * B, (i + 1) * B) of the epoch, in file order.
    With shuffling, each epoch has its own permutation drawn from (shuffle_seed, epoch).
    """
    for _, rows in epoch_rows(split, batch_size=batch_size, iterations=iterations, shuffle=shuffle,
                              shuffle_seed=shuffle_seed, start=start):
        yield rows


def epoch_rows(split: BinarySplit, *, batch_size: int, iterations: int, shuffle: bool,
               shuffle_seed: int, start: int = 0) -> Iterator[tuple[int, slice | np.ndarray]]:
    """``batch_rows``'s selectors, each with the pass over the split it belongs to (what fresh negatives and
    the shuffle are drawn by)."""
    per_epoch = batches_per_epoch(split, batch_size)
    if per_epoch == 0:
        raise ValueError(f"{split.directory}: {split.rows} rows is fewer than one batch of {batch_size}")
    order = None
    for iteration in range(start, iterations):
        epoch, index = divmod(iteration, per_epoch)
        if shuffle:
            if index == 0 or order is None:
                order = np.random.default_rng([shuffle_seed, epoch]).permutation(split.rows)
            yield epoch, np.sort(order[index * batch_size:(index + 1) * batch_size])
        else:
            yield epoch, slice(index * batch_size, (index + 1) * batch_size)


def read_batch(split: BinarySplit, rows: slice | np.ndarray, *, epoch: int = 0,
               negatives: FreshNegatives | None = None) -> Batch:
    """The batch of ``rows``; an id outside its table is refused (it would read another table's row). With
    ``negatives``, a next-item batch of pass ``epoch`` carries that pass's negatives (data.negatives)."""
    ids = np.array(split.ids[rows], dtype=np.int64)
    if negatives is not None:
        negatives.apply(ids, rows, epoch)
    cardinalities, lowest = split.column_bounds()
    bad = (ids < lowest) | (ids >= cardinalities)
    if bad.any():
        row, column = np.argwhere(bad)[0]
        feature = next(f for f in range(split.num_tables) if column < split.schema.columns(f)[1])
        first = (rows.start or 0) + row if isinstance(rows, slice) else rows[row]
        raise ValueError(f"{split.directory}: row {int(first)} has id {int(ids[row, column])} for table {feature}, "
                         f"outside [0, {int(cardinalities[column])}); {int(bad.sum())} such ids in this batch")
    return Batch(
        dense_x=torch.from_numpy(np.array(split.dense[rows], dtype=np.float32)),
        ids=torch.from_numpy(ids),
        target=torch.from_numpy(np.array(split.labels[rows], dtype=np.float32)),
    )


def iterate_batches(split: BinarySplit, *, batch_size: int, iterations: int, shuffle: bool = False,
                    shuffle_seed: int = 0, start: int = 0, negatives: FreshNegatives | None = None) -> Iterator[Batch]:
    for epoch, rows in epoch_rows(split, batch_size=batch_size, iterations=iterations, shuffle=shuffle,
                                  shuffle_seed=shuffle_seed, start=start):
        yield read_batch(split, rows, epoch=epoch, negatives=negatives)


def fresh_negatives(config, split: BinarySplit) -> FreshNegatives | None:
    """The negatives a run's passes after the first draw (``config.fresh_negatives`` on next-item data), or None."""
    one_pass = planned_iterations(config, split) <= batches_per_epoch(split, config.batch_size)
    if one_pass or not (config.fresh_negatives and is_next_item(split.schema)):
        return None
    return FreshNegatives(split.ids, split.schema, seed=config.seed)
