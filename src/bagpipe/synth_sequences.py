"""Synthetic interaction logs with a planted next-item structure, so the best ranking metric is known.

Items have a popularity (a bounded Zipf law) and a genre. A user's next item is, with probability
``follow``, an item of their last item's genre, else any item; either way drawn by popularity among
the items the user has not had yet (as in a ratings log, no item twice). The posterior of the next
item given the last one and the items had is then known, and ranking every item by it is the best
any model can do: its HR@10 and NDCG@10 on the test samples (each user's last item, ranked among the
items the user did not have before it: the standard protocol, bagpipe.ranking's "unseen", as
``bagpipe preprocess`` and the evaluation build them) go into meta.json. The structure has
rank ``genres``, so a model with embeddings at least that wide can learn it. The log is written as
MovieLens's ``ratings.csv``, with sparse raw ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bagpipe.data.sequences import SequenceSettings
from bagpipe.metrics import ranking_metrics
from bagpipe.progress import progress

DEFAULT_FOLLOW = 0.7
DEFAULT_GENRES = 10


def generate_sequences(out_dir: str | Path, *, users: int, items: int, interactions: int, seed: int = 0,
                       zipf: float = 1.0, follow: float = DEFAULT_FOLLOW, genres: int = DEFAULT_GENRES,
                       settings: SequenceSettings = SequenceSettings(), show_progress: bool = True) -> dict:
    """Write ``ratings.csv`` and ``meta.json`` into ``out_dir``; return the metadata."""
    if users <= 0 or items <= 2 * settings.history or genres <= 0:
        raise ValueError(f"need users > 0, genres > 0 and more than twice history items, got {users} users, "
                         f"{items} items, {genres} genres")
    if interactions < 2:
        raise ValueError(f"--interactions must be at least 2 (one to learn from, one to test), got {interactions}")
    if interactions > items:
        raise ValueError(f"--interactions {interactions} is more than the {items} items: a user has each item once")
    if not 0.0 <= follow <= 1.0:
        raise ValueError(f"--follow must be in [0, 1], got {follow}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 11])
    weight = (1.0 + rng.permutation(items)) ** -zipf  # each item's popularity
    genre = rng.integers(0, genres, items)
    planted = _Planted(weight, genre, follow)
    sequences = np.empty((users, interactions), dtype=np.int64)
    sequences[:, 0] = rng.choice(items, size=users, p=weight / weight.sum())
    had = np.zeros((users, items), dtype=bool)
    bar = progress(total=interactions - 1, desc="synth sequences", unit="steps", enabled=show_progress)
    for step in range(1, interactions):  # every user's next item at once
        had[np.arange(users), sequences[:, step - 1]] = True
        cdf = np.cumsum(planted.posteriors(sequences[:, step - 1], had), axis=1)
        draws = rng.random(users) * cdf[:, -1]
        sequences[:, step] = np.minimum((cdf < draws[:, None]).sum(axis=1), items - 1)
        bar.update(1)
    bar.close()
    # Sparse raw ids (the reader renumbers them) and interleaved timestamps (the log's time order).
    raw_users, raw_items = 1 + 3 * np.arange(users), 5 + 7 * np.arange(items)
    steps, owners = np.meshgrid(np.arange(interactions), np.arange(users))
    rows = np.stack([raw_users[owners.ravel()], raw_items[sequences.ravel()],
                     1_000_000 + steps.ravel() * users + owners.ravel()], axis=1)
    with open(out / "ratings.csv", "w") as handle:
        handle.write("userId,movieId,rating,timestamp\n")
        handle.write("".join(f"{u},{i},4.0,{t}\n" for u, i, t in rows.tolist()))
    hr, ndcg = ranking_metrics(planted.test_ranks(sequences), k=10)
    meta = {"kind": "sequences", "users": users, "items": items, "interactions": interactions, "seed": seed,
            "zipf": zipf, "follow": follow, "genres": genres, "sequence": settings.to_dict(), "best_hr10": hr,
            "best_ndcg10": ndcg}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


class _Planted:
    def __init__(self, weight: np.ndarray, genre: np.ndarray, follow: float) -> None:
        self.weight, self.genre, self.follow = weight, genre, follow

    def posteriors(self, last: np.ndarray, had: np.ndarray) -> np.ndarray:
        """P(next item) ``[n, items]`` given each last item, zero on the items had (``had [n, items]``: never
        drawn again)."""
        allowed = np.where(had, 0.0, self.weight[None, :])
        same = np.where(self.genre[None, :] == self.genre[last][:, None], allowed, 0.0)
        total, same_total = allowed.sum(axis=1, keepdims=True), same.sum(axis=1, keepdims=True)
        follow = np.where(same_total > 0, self.follow, 0.0)  # a genre with nothing left: any item
        return (1.0 - follow) * allowed / total + follow * same / np.maximum(same_total, 1e-300)

    def test_ranks(self, sequences: np.ndarray) -> np.ndarray:
        """Each user's last item's 0-based rank by the posterior, among the items the user did not have before."""
        had = np.zeros((len(sequences), len(self.weight)), dtype=bool)
        np.put_along_axis(had, sequences[:, :-1], True, axis=1)
        scores = self.posteriors(sequences[:, -2], had)
        scores[had] = -1.0  # not candidates
        target = np.take_along_axis(scores, sequences[:, -1:], axis=1)
        return (scores > target).sum(axis=1)
