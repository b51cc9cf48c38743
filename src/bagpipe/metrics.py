"""Evaluation metrics: ROC AUC (ties averaged) and binary log-loss; HR@k and NDCG@k of ranks; and the
growth of running counters over a metrics window (the cache figures every mode logs)."""

from __future__ import annotations

from typing import Callable

import numpy as np


class CounterWindow:
    """How much each of a set of running counters grew since the last ``take``: a metrics window's share."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self.read = read
        self.last = read()

    def take(self) -> dict[str, int]:
        now = self.read()
        grown = {name: now[name] - self.last.get(name, 0) for name in now}
        self.last = now
        return grown


def share(part: float, whole: float) -> float | None:
    """``part / whole``, or None when there is no whole (a hit rate with nothing looked up)."""
    return part / whole if whole else None


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve by the rank-sum formula; tied scores share their mean rank."""
    labels = np.asarray(labels, dtype=np.float64).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    if labels.shape != scores.shape:
        raise ValueError(f"labels {labels.shape} and scores {scores.shape} differ in shape")
    num_pos = float((labels > 0.5).sum())
    num_neg = float(labels.size - num_pos)
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # Average rank of each run of equal scores (1-based).
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], sorted_scores.size]
    run_ranks = (starts + ends + 1) / 2.0
    ranks = np.empty_like(scores)
    ranks[order] = np.repeat(run_ranks, ends - starts)
    rank_sum = ranks[labels > 0.5].sum()
    return float((rank_sum - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))


def log_loss(labels: np.ndarray, probabilities: np.ndarray, *, eps: float = 1e-7) -> float:
    labels = np.asarray(labels, dtype=np.float64).ravel()
    p = np.clip(np.asarray(probabilities, dtype=np.float64).ravel(), eps, 1.0 - eps)
    return float(-np.mean(labels * np.log(p) + (1.0 - labels) * np.log(1.0 - p)))


def ranking_metrics(ranks: np.ndarray, *, k: int = 10) -> tuple[float, float]:
    """HR@k and NDCG@k of the true items' 0-based ranks (one relevant item per sample)."""
    ranks = np.asarray(ranks)
    if not len(ranks):
        return float("nan"), float("nan")
    hit = ranks < k
    return float(hit.mean()), float(np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0).mean())
