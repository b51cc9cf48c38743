"""``CachedEmbeddingBag``: ``nn.EmbeddingBag``'s interface over a table in host memory (or on disk) and a small
cache on the module's device, with the row optimizer fused into the backward.

The full table and its optimizer state stay on the host (``storage="memory"``) or in a file behind a bounded
DRAM cache (``storage="disk"``, bagpipe.nn.host); ``cache_rows`` rows (and their state) live in the
cache. Before a lookup every row of the batch is made resident (rows evicted by the policy are written back
with their state, missing ones fetched with theirs), so the state travels with its row and training equals
``nn.EmbeddingBag(sparse=True)`` stepped by ``bagpipe.optim.RowWise`` over the whole table, whatever is
evicted. The gradient of a lookup's rows is applied to them as soon as the backward reaches it (the way
TorchRec's fused optimizers work): the table takes no part in the caller's own optimizer.
"""

from __future__ import annotations

import functools
import weakref

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bagpipe.nn.host import host_table, initial_blocks, storage_spec
from bagpipe.nn.rows import CachedRows
from bagpipe.nn.slots import CLEANUP_FRACTION
from bagpipe.optim import RowOptimizer, make_row_optimizer
from bagpipe.storage import StorageSpec

MODES = ("sum", "mean")  # "max" has no sparse gradient, so no row-wise step to fuse


class CachedEmbeddingBag(nn.Module):
    """A drop-in ``nn.EmbeddingBag`` (``forward(input, offsets=None, per_sample_weights=None)``, the same
    results) whose ``num_embeddings x embedding_dim`` table lives in host memory behind a cache of
    ``cache_rows`` rows on the module's device.

    ``optimizer`` ("sgd", "adagrad", "adam") with ``lr``, ``eps`` and ``betas`` defaulted as ``torch.optim``
    defaults them updates the rows of each lookup during its backward. ``policy`` ("lru" or "lfu") picks
    the rows to evict when a batch's rows do not fit beside the resident ones, ``cleanup_fraction`` of the
    cache at least (choosing them is a pass over the cache: paid once every many batches). A batch with more distinct
    rows than the cache is refused with a ValueError naming both counts.

    ``storage``: where the full table and its optimizer state live: "memory" (host tensors; ``_weight`` is
    shared, as ``nn.EmbeddingBag`` shares it), "disk" (a file in the system's temporary directory behind 64 MiB
    of DRAM) or a ``bagpipe.storage.StorageSpec("disk", directory, budget_bytes)``. On disk the initial rows
    are drawn block by block (N(0, 1) as in memory, not the same values in the last block), ``weight`` and
    ``state_dict()`` read the whole table into memory, and the file is deleted with the module.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, cache_rows: int, mode: str = "mean",
                 include_last_offset: bool = False, optimizer: str = "sgd", lr: float | None = None,
                 eps: float | None = None, betas: tuple[float, float] = (0.9, 0.999), policy: str = "lru",
                 cleanup_fraction: float = CLEANUP_FRACTION, _weight: torch.Tensor | None = None,
                 storage: str | StorageSpec = "memory", device: torch.device | str | None = None) -> None:
        super().__init__()
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(f"num_embeddings and embedding_dim must be positive, got {num_embeddings} x "
                             f"{embedding_dim}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.num_embeddings, self.embedding_dim, self.mode = num_embeddings, embedding_dim, mode
        self.include_last_offset = include_last_offset
        optimizer = row_optimizer(optimizer, lr=lr, eps=eps, betas=betas)
        storage = storage_spec(storage)
        if _weight is not None and tuple(_weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(f"_weight has shape {tuple(_weight.shape)}, expected ({num_embeddings}, {embedding_dim})")
        host = host_table(storage, num_rows=num_embeddings, dim=embedding_dim,
                          state_width=optimizer.state_width(embedding_dim),
                          blocks=initial_blocks(num_embeddings, embedding_dim, _weight, storage=storage))
        weakref.finalize(self, host.close)  # a table on disk is this module's working copy
        self.rows = CachedRows(host, cache_rows=cache_rows, optimizer=optimizer, policy=policy,
                               cleanup_fraction=cleanup_fraction, device=device)

    # -- the nn.EmbeddingBag interface ----------------------------------------------------------------------

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if input.dim() == 2 and offsets is not None:
            raise ValueError("offsets must be None when input is 2-D (each row of input is a bag)")
        if input.dim() == 1 and offsets is None:
            raise ValueError("offsets is required when input is 1-D")
        if input.dim() not in (1, 2):
            raise ValueError(f"input must be 1-D (with offsets) or 2-D, got {input.dim()}-D")
        keys, positions = np.unique(input.detach().cpu().numpy().reshape(-1), return_inverse=True)
        slots = self.rows.make_resident(keys)
        device = self.rows.cache_weight.device
        rows = self.rows.cache_weight.index_select(0, torch.from_numpy(slots).to(device))
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            rows.register_hook(functools.partial(self.rows.fused_step, keys))
        positions = torch.from_numpy(positions.reshape(input.shape)).to(device)
        # sparse: the gradient nn.EmbeddingBag(sparse=True) gives, summed per row in the same order
        return F.embedding_bag(positions, rows, offsets, mode=self.mode, sparse=True,
                               per_sample_weights=per_sample_weights, include_last_offset=self.include_last_offset)

    @property
    def weight(self) -> torch.Tensor:
        """The full table, with the cached rows written into it: in memory, a host tensor the module keeps
        updating; on disk, a copy read from the file."""
        self.rows.flush()
        return self.rows.host.rows(0, self.num_embeddings)[0]

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
        elif tuple(state_dict[key].shape) != (self.num_embeddings, self.embedding_dim):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(state_dict[key].shape)}, "
                              f"the shape in current model is {(self.num_embeddings, self.embedding_dim)}")
        else:  # the weights replaced, cached or not; the rows' optimizer state kept
            self.rows.flush()
            self.rows.host.set_rows(0, state_dict[key].detach())
            self.rows.reload()
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k != key
                               and k[len(prefix):].split(".")[0] not in self._modules)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, cache_rows={self.rows.index.capacity}, "
                f"policy={self.rows.index.policy!r}, optimizer={self.rows.optimizer.name!r}, lr={self.rows.optimizer.lr}")

    def warm_up(self, sample: torch.Tensor, *, fraction: float = 0.7) -> int:
        """Preload the rows ``sample`` (ids from some of the data) names most often, up to ``fraction`` of the
        cache (as CachedEmbedding preloads the hottest 70%); the number preloaded."""
        return self.rows.warm_up(sample.detach().cpu().numpy(), fraction=fraction)

    # -- what bagpipe.nn.Lookahead plans for --------------------------------------------------------------

    def cached_spaces(self) -> list[CachedRows]:
        return [self.rows]

    def plan_keys(self, ids: torch.Tensor) -> list[np.ndarray]:
        """The rows a lookup of ``ids`` touches (repeats allowed), as the planner reads them."""
        return [np.asarray(ids.detach().cpu().numpy(), dtype=np.int64).reshape(-1)]


def row_optimizer(name: str, *, lr: float | None, eps: float | None, betas: tuple[float, float]) -> RowOptimizer:
    """The fused optimizer, its hyper-parameters defaulted as torch.optim's SGD, Adagrad and Adam default them."""
    defaults = {"sgd": 1e-3, "adagrad": 1e-2, "adam": 1e-3}
    if name not in defaults:
        raise ValueError(f"optimizer must be one of {', '.join(defaults)}, got {name!r}")
    optimizer = make_row_optimizer(name, lr=defaults[name] if lr is None else lr)
    return RowOptimizer(name=name, lr=optimizer.lr, eps=optimizer.eps if eps is None else eps,
                        beta1=betas[0], beta2=betas[1])
