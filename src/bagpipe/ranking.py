"""Next-item evaluation: which items a test sample's target is ranked among, and the simple baselines.

A next-item test sample is a user's last ``history`` items and the item that followed (``bagpipe
preprocess`` holds each user's last interaction out, and the one before it as the validation split's;
each split is ranked the same way, by a ranking of its own). Two protocols say which items compete with
the target:

- ``unseen`` (the default; the standard full-ranking protocol of the literature): every item the user did
  not interact with in training. A model is not credited for recommending what the user already has.
- ``history`` (this project's protocol until 2026-11): every item except the sample's own history items; the
  user's other training items stay in as candidates. Its figures are lower and not comparable with
  published ones (on MovieLens-100k most-popular scores HR@10 0.050 this way, 0.086 the standard way).

The user's training items are read from the splits themselves (each training sample's history and targets,
and the evaluated sample's history: for a test sample it holds the validation item, known by then): no extra
file, so data preprocessed before this module works as it is.

Two baselines are ranked the same way, so a figure can be read at once against them: ``popular`` (items by
the number of users who had them in training) and ``cooccurrence`` (the sum, over the sample's history
items, of how often each item directly followed that one in the training sequences; ties broken by
popularity). A sequential model that does not beat the second has learnt nothing a few lines of counting
would not.

Ranks are 0-based: the number of candidates scored above the target, a candidate scored equal counting as
above (a model whose scores collapsed to one value ranks every target last, where counting only those strictly
above would rank it first: HR@10 1.0), except for the baselines, whose integer counts tie often: there a tie
counts above if the candidate's id is smaller, i.e. it is more popular (ids are numbered by descending
popularity).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bagpipe.metrics import ranking_metrics

PROTOCOLS = ("unseen", "history")
CUTOFFS = (1, 5, 10, 20)  # K of HR@K and NDCG@K
BASELINES = ("popular", "cooccurrence")


def metrics_at(ranks: np.ndarray, *, prefix: str = "eval_") -> dict[str, float]:
    """``{prefix}hr{K}`` and ``{prefix}ndcg{K}`` for every K in CUTOFFS."""
    out = {}
    for k in CUTOFFS:
        out[f"{prefix}hr{k}"], out[f"{prefix}ndcg{k}"] = ranking_metrics(ranks, k=k)
    return out


@dataclass(frozen=True)
class _Csr:
    """Rows of sorted column indices (and values): ``columns[starts[r]:starts[r + 1]]``."""

    starts: np.ndarray
    columns: np.ndarray
    values: np.ndarray

    @classmethod
    def of(cls, rows: np.ndarray, columns: np.ndarray, num_rows: int, num_columns: int) -> "_Csr":
        """Distinct (row, column) pairs, each with the number of times it occurs."""
        codes, counts = np.unique(rows * num_columns + columns, return_counts=True)
        starts = np.searchsorted(codes // num_columns, np.arange(num_rows + 1))
        return cls(starts, codes % num_columns, counts.astype(np.float64))

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each entry of ``rows``: (its position in ``rows`` repeated, columns, values) of that row."""
        lengths = self.starts[rows + 1] - self.starts[rows]
        owner = np.repeat(np.arange(len(rows)), lengths)
        within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        at = np.repeat(self.starts[rows], lengths) + within
        return owner, self.columns[at], self.values[at]


class NextItemRanking:
    """Everything a next-item evaluation needs beyond the model: each user's training items, the items'
    popularity and the item -> next item counts, made once from the splits' id matrices.

    ``train_ids`` and ``test_ids`` are ``[n, 1 + L + T + N]`` (user, history, targets, negatives; -1 where a
    history is short or a test sample has fewer targets), as data.sequences lays them out.
    """

    def __init__(self, train_ids: np.ndarray, test_ids: np.ndarray, *, num_users: int, num_items: int,
                 history: int, targets: int, protocol: str = "unseen") -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"the next-item protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        self.protocol, self.num_items, self.history = protocol, num_items, history
        train_ids, test_ids = np.asarray(train_ids, dtype=np.int64), np.asarray(test_ids, dtype=np.int64)
        L, T = history, targets
        items = np.concatenate([train_ids[:, 1:1 + L + T].ravel(), test_ids[:, 1:1 + L].ravel()])
        users = np.concatenate([np.repeat(train_ids[:, 0], L + T), np.repeat(test_ids[:, 0], L)])
        known = items >= 0
        self.seen = _Csr.of(users[known], items[known], num_users, num_items)
        self.popularity = np.bincount(self.seen.columns, minlength=num_items).astype(np.float64)
        first, second = _consecutive_pairs(train_ids, test_ids, L, T)
        self.follows = _Csr.of(first, second, num_items, num_items)
        self._baselines: dict[int, dict[str, float]] = {}

    @classmethod
    def of_dataset(cls, dataset, *, protocol: str = "unseen", split: str = "test") -> "NextItemRanking":
        """The ranking of a BinaryDataset's ``split`` ("test" or "valid"; a next-item schema: user, history,
        targets, negatives)."""
        features = dataset.schema.features
        return cls(dataset.train.ids, getattr(dataset, split).ids, num_users=features[0].cardinality,
                   num_items=features[1].cardinality, history=features[1].width, targets=features[2].width,
                   protocol=protocol)

    def excluded(self, users: np.ndarray, history: np.ndarray) -> torch.Tensor:
        """``[B, items]``: True for the items that are not candidates for each sample."""
        mask = torch.zeros(len(users), self.num_items, dtype=torch.bool)
        if self.protocol == "unseen":
            owner, columns, _ = self.seen.gather(np.asarray(users))
        else:
            owner, columns = _known(history)
        mask[torch.from_numpy(owner), torch.from_numpy(columns)] = True
        return mask

    def ranks(self, scores: torch.Tensor, users: np.ndarray, history: np.ndarray, target: np.ndarray, *,
              ties: str = "above") -> np.ndarray:
        """The 0-based rank of each target among its candidates by ``scores [B, items]``. A candidate scored
        equal to the target counts above it (``ties="above"``: a model whose scores collapsed to a constant
        ranks every target last, not first) or, with ``ties="smaller-id"``, if its id is smaller (the baselines:
        ids are numbered by descending popularity, so popularity breaks their ties)."""
        scores = scores.masked_fill(self.excluded(users, history), float("-inf"))
        target_t = torch.from_numpy(np.asarray(target)).unsqueeze(1)
        at_target = scores.gather(1, target_t)
        items = torch.arange(self.num_items).unsqueeze(0)
        tied = (scores == at_target) & (items < target_t if ties == "smaller-id" else items != target_t)
        return ((scores > at_target) | tied).sum(dim=1).numpy()

    def baseline_scores(self, name: str, history: np.ndarray) -> torch.Tensor:
        """``[B, items]``: a baseline's score of every item for samples with these histories."""
        popularity = torch.from_numpy(self.popularity).unsqueeze(0).expand(len(history), -1)
        if name == "popular":
            return popularity.clone()
        if name != "cooccurrence":
            raise ValueError(f"no baseline {name!r}; the baselines are {', '.join(BASELINES)}")
        counts = np.zeros((len(history), self.num_items))
        rows, items = _known(history)
        owner, columns, values = self.follows.gather(items)
        np.add.at(counts, (rows[owner], columns), values)
        # popularity only breaks ties between equal counts: it is below 1 after scaling
        return torch.from_numpy(counts) + popularity / (self.popularity.max() + 1.0)

    def baselines(self, test_ids: np.ndarray, *, batch_size: int = 4096, prefix: str = "eval_") -> dict[str, float]:
        """``{prefix}{baseline}_hr{K}`` / ``_ndcg{K}`` of each baseline on these samples (the first
        ``len(test_ids)`` of the split ranked: cached by that count)."""
        if len(test_ids) not in self._baselines:
            ranks = {name: [] for name in BASELINES}
            for start in range(0, len(test_ids), batch_size):
                ids = np.asarray(test_ids[start:start + batch_size], dtype=np.int64)
                users, history, target = ids[:, 0], ids[:, 1:1 + self.history], ids[:, 1 + self.history]
                for name in BASELINES:
                    scores = self.baseline_scores(name, history)
                    ranks[name].append(self.ranks(scores, users, history, target, ties="smaller-id"))
            figures = {}
            for name in BASELINES:
                figures.update(metrics_at(np.concatenate(ranks[name]) if ranks[name] else np.zeros(0),
                                          prefix=f"{name}_"))
            self._baselines[len(test_ids)] = figures
        return {prefix + name: value for name, value in self._baselines[len(test_ids)].items()}


def _known(history: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sample (row) and the item of every known entry of ``history [B, L]`` (-1: none)."""
    rows, positions = np.nonzero(history >= 0)
    return rows, history[rows, positions]


def _consecutive_pairs(train_ids: np.ndarray, test_ids: np.ndarray, L: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (item, the item right after it) of the users' training sequences, each once.

    A training sample's first target follows its last history item; the pairs among the targets of a user's
    last training sample complete the sequence (its targets end just before the held-out item). A user with
    no training sample (a sequence too short for one) has its training items in its test sample's history.
    """
    history, targets = train_ids[:, 1:1 + L], train_ids[:, 1 + L:1 + L + T]
    pairs = [(history[:, -1], targets[:, 0])]
    if len(train_ids):
        _, from_end = np.unique(train_ids[::-1, 0], return_index=True)
        last = len(train_ids) - 1 - from_end
        pairs += [(targets[last, k - 1], targets[last, k]) for k in range(1, T)]
    untrained = ~np.isin(test_ids[:, 0], train_ids[:, 0])
    test_history = test_ids[untrained, 1:1 + L]
    pairs += [(test_history[:, k - 1], test_history[:, k]) for k in range(1, L)]
    first = np.concatenate([p[0] for p in pairs]) if pairs else np.zeros(0, np.int64)
    second = np.concatenate([p[1] for p in pairs]) if pairs else np.zeros(0, np.int64)
    known = (first >= 0) & (second >= 0)
    return first[known], second[known]
