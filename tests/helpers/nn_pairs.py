"""bagpipe.nn's tests' material: skewed bags of ids, and a cached module beside the nn.EmbeddingBag it must equal."""

from __future__ import annotations

import torch
from torch import nn

from bagpipe.nn import CachedEmbeddingBag
from bagpipe.optim import RowWise, make_row_optimizer
from bagpipe.synth import zipf_bags

NUM_ROWS, DIM = 400, 6


def zipf_batches(count: int, *, bags: int = 16, ids_per_bag: int = 3, num_rows: int = NUM_ROWS, seed: int = 0,
             skew: float = 1.3) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Zipf-skewed bags of ids (1-D + offsets, every bag ``ids_per_bag`` long) with a regression target."""
    return zipf_bags(count, num_rows=num_rows, dim=DIM, bags=bags, ids_per_bag=ids_per_bag, seed=seed, skew=skew)


def module_pair(optimizer: str, *, cache_rows: int, mode: str = "sum", policy: str = "lru", seed: int = 0, **options):
    """A reference (nn.EmbeddingBag(sparse=True) + RowWise) and a cached module starting from the same table
    (``options``: the cached module's others, e.g. ``storage``)."""
    weight = torch.randn(NUM_ROWS, DIM, generator=torch.Generator().manual_seed(seed))
    row_optimizer = make_row_optimizer(optimizer, lr=0.05)
    reference = nn.EmbeddingBag(NUM_ROWS, DIM, mode=mode, sparse=True, _weight=weight.clone())
    cached = CachedEmbeddingBag(NUM_ROWS, DIM, cache_rows=cache_rows, mode=mode, optimizer=optimizer, lr=0.05,
                                policy=policy, _weight=weight.clone(), **options)
    return reference, RowWise(reference.parameters(), row_optimizer), cached


def squared_loss(embeddings: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((embeddings - target) ** 2).sum()
