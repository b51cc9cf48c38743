"""Fresh negatives for each pass over a next-item training split.

A next-item sample carries ``negatives`` items its user never interacted with (data.sequences draws them
once, at preprocessing). Trained for several passes on the same few negatives, a model learns to reject
those items rather than to rank (Caser's paper draws new ones every epoch). ``FreshNegatives`` draws a new
set for every pass after the first: uniform over the items, redrawn where the user had the item in training,
a function of (seed, pass, row) alone, so the oracle, every trainer and the one-process modes read the same
ids for the same batch, and the plan and the training stay exact.
"""

from __future__ import annotations

import numpy as np

from bagpipe.data.schema import Schema, is_next_item

REDRAWS = 10  # draws of an item the user had before one is kept anyway (a user who had nearly every item)


class FreshNegatives:
    """New negative items for each pass (``epoch >= 1``) over the training split ``ids [n, 1 + L + T + N]``;
    pass 0 keeps the split's own."""

    def __init__(self, ids: np.ndarray, schema: Schema, *, seed: int) -> None:
        if not is_next_item(schema):
            raise ValueError("fresh negatives are drawn for next-item data (user, history, targets, negatives)")
        self.ids, self.seed = ids, seed
        self.num_items = schema.features[1].cardinality
        self.columns = slice(*schema.columns(3))
        first_item, end = schema.columns(1)[0], schema.columns(2)[1]
        users = np.asarray(ids[:, 0], dtype=np.int64)
        items = np.asarray(ids[:, first_item:end], dtype=np.int64)
        known = items >= 0
        codes = np.repeat(users, items.shape[1]).reshape(items.shape)[known] * self.num_items + items[known]
        self._seen = np.unique(codes)  # user * items + item of every training interaction
        self._users = users
        self._epoch, self._drawn = -1, np.zeros((0, 0), dtype=np.int64)

    def for_epoch(self, epoch: int) -> np.ndarray:
        """``[n, N]``: every row's negatives in pass ``epoch`` (the last pass asked for is kept)."""
        if epoch == 0:
            return np.asarray(self.ids[:, self.columns], dtype=np.int64)
        if epoch != self._epoch:
            rows, width = len(self._users), self.columns.stop - self.columns.start
            rng = np.random.default_rng([self.seed, 13, epoch])
            drawn = rng.integers(0, self.num_items, (rows, width))
            owners = np.repeat(self._users, width).reshape(rows, width)
            for _ in range(REDRAWS):
                clash = np.isin(owners * self.num_items + drawn, self._seen)
                if not clash.any():
                    break
                drawn[clash] = rng.integers(0, self.num_items, int(clash.sum()))
            self._epoch, self._drawn = epoch, drawn
        return self._drawn

    def apply(self, ids: np.ndarray, rows: slice | np.ndarray, epoch: int) -> np.ndarray:
        """``ids`` (the split's ``ids[rows]``) with pass ``epoch``'s negatives in place of the stored ones."""
        if epoch > 0:
            ids[:, self.columns] = self.for_epoch(epoch)[rows]
        return ids
