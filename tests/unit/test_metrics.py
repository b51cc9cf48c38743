import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bagpipe.metrics import log_loss, roc_auc


def brute_force_auc(labels, scores):
    pos = [s for l, s in zip(labels, scores) if l == 1]
    neg = [s for l, s in zip(labels, scores) if l == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 5)), min_size=2, max_size=40))
def test_auc_equals_pairwise_definition_with_ties(pairs):
    labels = [p[0] for p in pairs]
    scores = [float(p[1]) for p in pairs]
    if len(set(labels)) < 2:
        assert np.isnan(roc_auc(np.array(labels), np.array(scores)))
        return
    assert abs(roc_auc(np.array(labels), np.array(scores)) - brute_force_auc(labels, scores)) < 1e-12


def test_log_loss_of_known_values():
    assert abs(log_loss(np.array([1, 0]), np.array([0.5, 0.5])) - np.log(2)) < 1e-12
    assert log_loss(np.array([1, 0]), np.array([1.0, 0.0])) < 1e-6
