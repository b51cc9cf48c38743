"""A plain PyTorch DLRM training loop, with its nn.EmbeddingBag tables swapped for bagpipe.nn's cached ones.

    python examples/cached_dlrm.py --embeddings cached --cache-rows 20000 --policy lookahead
    python examples/cached_dlrm.py --embeddings plain          # the same loop with nn.EmbeddingBag
    python examples/cached_dlrm.py --storage disk --storage-dir /tmp/tables --storage-budget-mb 16

The loop is what a DLRM script writes by hand: a bottom MLP for the dense features, one embedding bag per
categorical feature, dot-product interactions, a top MLP, BCE loss. Only the embeddings change:

- plain: ``nn.EmbeddingBag(sparse=True)`` per table, stepped by ``bagpipe.optim.RowWise`` (row-wise
  Adagrad/Adam state; SGD and Adagrad equal torch.optim's sparse updates up to rounding);
- cached: one ``bagpipe.nn.CachedEmbeddingBagCollection`` for all tables, the tables in host memory and
  ``--cache-rows`` of their rows cached; its optimizer runs inside the backward, so the loop only steps
  the dense optimizer. With ``--policy lookahead`` the data loader is wrapped in ``bagpipe.nn.Lookahead``.
  With ``--storage disk`` the full tables live in a file of records behind ``--storage-budget-mb`` of DRAM.

Both end with the same parameters bit for bit (``--save`` writes them; a state dict loads into either, into the plain
loop's with ``strict=False``: the cached tables' also hold their optimizer state).
The data is synthetic: Zipf-distributed ids over 26 tables and a label that depends on them.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bagpipe.nn import CachedEmbeddingBagCollection, Lookahead
from bagpipe.optim import RowWise, make_row_optimizer
from bagpipe.storage import StorageSpec


def synthetic_batches(*, num_batches: int, batch_size: int, table_sizes: list[int], seed: int):
    """Dense features, one id per table and a click label, batch by batch (Zipf 1.1 ids, a planted rule)."""
    rng = np.random.default_rng(seed)
    effects = [rng.normal(0.0, 1.0, 1024) for _ in table_sizes]
    for _ in range(num_batches):
        ids = np.stack([np.minimum(rng.zipf(1.1, batch_size) - 1, rows - 1) for rows in table_sizes], axis=1)
        dense = rng.normal(0.0, 1.0, (batch_size, 13)).astype(np.float32)
        logit = dense[:, 0] + sum(effects[t][ids[:, t] % 1024] for t in range(len(table_sizes))) / 3
        label = (rng.random(batch_size) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        yield torch.from_numpy(dense), torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(label)


def mlp(sizes: list[int], *, last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DenseArch(nn.Module):
    """DLRM's dense part: bottom MLP, pairwise dot products of the feature vectors, top MLP."""

    def __init__(self, *, num_tables: int, dim: int) -> None:
        super().__init__()
        self.bottom = mlp([13, 64, dim], last_activation=True)
        pairs = (num_tables + 1) * num_tables // 2
        self.top = mlp([dim + pairs, 64, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
        vectors = torch.stack([self.bottom(dense), *pooled], dim=1)  # [B, 1 + tables, D]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))
        i, j = torch.tril_indices(vectors.shape[1], vectors.shape[1], offset=-1)
        return self.top(torch.cat([vectors[:, 0], dots[:, i, j]], dim=1)).squeeze(1)


def storage(args: argparse.Namespace) -> str | StorageSpec:
    if args.storage == "disk" and args.storage_dir is not None:
        return StorageSpec("disk", args.storage_dir, int(args.storage_budget_mb * 2**20))
    return args.storage  # "memory", or "disk" in the temporary directory with the default budget


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--embeddings", choices=("plain", "cached"), default="cached")
    parser.add_argument("--cache-rows", type=int, default=20_000, help="rows cached, all tables together")
    parser.add_argument("--policy", choices=("lookahead", "lru", "lfu"), default="lookahead")
    parser.add_argument("--optimizer", choices=("sgd", "adagrad", "adam"), default="adagrad")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rows-per-table", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="write the trained state dict here")
    parser.add_argument("--storage", choices=("memory", "disk"), default="memory",
                        help="where the cached tables live in full (--embeddings cached)")
    parser.add_argument("--storage-dir", default=None, help="--storage disk: the tables' files (default: the "
                                                            "system's temporary directory)")
    parser.add_argument("--storage-budget-mb", type=float, default=64.0,
                        help="--storage disk: DRAM for the tables' hottest rows besides the cache")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    table_sizes = [args.rows_per_table] * 26
    generator = torch.Generator().manual_seed(args.seed)
    initial = [torch.randn(rows, args.dim, generator=generator) * 0.1 for rows in table_sizes]
    dense_arch = DenseArch(num_tables=len(table_sizes), dim=args.dim)
    dense_optimizer = torch.optim.Adagrad(dense_arch.parameters(), lr=args.lr)
    batches = synthetic_batches(num_batches=args.iterations, batch_size=args.batch_size, table_sizes=table_sizes,
                                seed=args.seed)

    # The one change: the embedding tables.
    if args.embeddings == "plain":
        tables = nn.Module()
        tables.embedding_bags = nn.ModuleList(nn.EmbeddingBag(rows, args.dim, mode="sum", sparse=True,
                                                              _weight=w.clone())
                                              for rows, w in zip(table_sizes, initial))
        sparse_optimizer = RowWise(tables.parameters(), make_row_optimizer(args.optimizer, lr=args.lr))

        def embed(ids: torch.Tensor) -> list[torch.Tensor]:
            return [table(ids[:, t:t + 1]) for t, table in enumerate(tables.embedding_bags)]
    else:
        tables = CachedEmbeddingBagCollection([(rows, args.dim) for rows in table_sizes], cache_rows=args.cache_rows,
                                              mode="sum", optimizer=args.optimizer, lr=args.lr, weights=initial,
                                              policy="lru" if args.policy == "lookahead" else args.policy,
                                              storage=storage(args))
        sparse_optimizer = None  # fused into the backward

        def embed(ids: torch.Tensor) -> list[torch.Tensor]:
            return tables([ids[:, t:t + 1] for t in range(ids.shape[1])])

        if args.policy == "lookahead":
            batches = Lookahead(batches, tables, ids=lambda batch: [batch[1][:, t:t + 1] for t in range(26)])

    started, losses = time.perf_counter(), []
    for iteration, (dense, ids, label) in enumerate(batches):
        loss = F.binary_cross_entropy_with_logits(dense_arch(dense, embed(ids)), label)
        dense_optimizer.zero_grad()
        if sparse_optimizer is not None:
            sparse_optimizer.zero_grad()
        loss.backward()
        dense_optimizer.step()
        if sparse_optimizer is not None:
            sparse_optimizer.step()
        losses.append(loss.item())
        if (iteration + 1) % 50 == 0:
            print(f"iteration {iteration + 1}: loss {np.mean(losses[-50:]):.4f}", flush=True)
    seconds = time.perf_counter() - started
    result = {"samples_per_s": args.iterations * args.batch_size / seconds, "final_loss": float(np.mean(losses[-20:]))}
    if args.embeddings == "cached":
        result["hit_rate"] = tables.hit_rate()
    print(", ".join(f"{k} {v:,.4f}" for k, v in result.items()))
    if args.save:
        state = {"dense": dense_arch.state_dict(), "embeddings": tables.state_dict()}
        torch.save(state, args.save)
    return result


if __name__ == "__main__":
    main()
