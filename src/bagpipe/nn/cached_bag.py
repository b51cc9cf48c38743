"""``CachedEmbeddingBag``: ``nn.EmbeddingBag``'s interface over a table in host memory and a small cache on
the module's device, with the row optimizer fused into the backward.

The full table and its optimizer state stay on the host; ``cache_rows`` rows (and their state) live in the
cache. Before a lookup every row of the batch is made resident (rows evicted by the policy are written back
with their state, missing ones fetched with theirs), so the state travels with its row and training equals
``nn.EmbeddingBag(sparse=True)`` stepped by ``bagpipe.optim.RowWise`` over the whole table, whatever is
evicted. The gradient of a lookup's rows is applied to them as soon as the backward reaches it (the way
TorchRec's fused optimizers work): the table takes no part in the caller's own optimizer.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bagpipe.embeddings import Lookup, update_rows
from bagpipe.nn.slots import SlotIndex
from bagpipe.optim import RowOptimizer, make_row_optimizer

MODES = ("sum", "mean")  # "max" has no sparse gradient, so no row-wise step to fuse


class CachedEmbeddingBag(nn.Module):
    """A drop-in ``nn.EmbeddingBag`` (``forward(input, offsets=None, per_sample_weights=None)``, the same
    results) whose ``num_embeddings x embedding_dim`` table lives in host memory behind a cache of
    ``cache_rows`` rows on the module's device.

    ``optimizer`` ("sgd", "adagrad", "adam") with ``lr``, ``eps`` and ``betas`` defaulted as ``torch.optim``
    defaults them updates the rows of each lookup during its backward. ``policy`` ("lru" or "lfu") picks
    the rows to evict when a batch's rows do not fit beside the resident ones. A batch with more distinct
    rows than the cache is refused with a ValueError naming both counts.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, cache_rows: int, mode: str = "mean",
                 include_last_offset: bool = False, optimizer: str = "sgd", lr: float | None = None,
                 eps: float | None = None, betas: tuple[float, float] = (0.9, 0.999), policy: str = "lru",
                 _weight: torch.Tensor | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(f"num_embeddings and embedding_dim must be positive, got {num_embeddings} x "
                             f"{embedding_dim}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.num_embeddings, self.embedding_dim, self.mode = num_embeddings, embedding_dim, mode
        self.include_last_offset = include_last_offset
        self.optimizer = _row_optimizer(optimizer, lr=lr, eps=eps, betas=betas)
        self.index = SlotIndex(min(cache_rows, num_embeddings), policy=policy)
        if _weight is None:
            host_weight = torch.empty(num_embeddings, embedding_dim)
            nn.init.normal_(host_weight)  # as nn.EmbeddingBag.reset_parameters
        else:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError(f"_weight has shape {tuple(_weight.shape)}, expected "
                                 f"({num_embeddings}, {embedding_dim})")
            host_weight = _weight.detach().to("cpu", torch.float32)  # shared, as nn.EmbeddingBag shares it
        self.host_weight = host_weight
        self.host_state = torch.zeros(num_embeddings, self.optimizer.state_width(embedding_dim))
        capacity = self.index.capacity
        self.register_buffer("cache_weight", torch.zeros(capacity, embedding_dim, device=device), persistent=False)
        self.register_buffer("cache_state", torch.zeros(capacity, self.host_state.shape[1], device=device),
                             persistent=False)
        self.stats = {"batches": 0, "rows_looked_up": 0, "rows_fetched": 0, "rows_written_back": 0}

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
        if len(keys) and (keys[0] < 0 or keys[-1] >= self.num_embeddings):
            bad = keys[0] if keys[0] < 0 else keys[-1]
            raise IndexError(f"id {int(bad)} out of range for a table of {self.num_embeddings} rows")
        slots = self.make_resident(keys)
        device = self.cache_weight.device
        rows = self.cache_weight.index_select(0, torch.from_numpy(slots).to(device))
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            rows.register_hook(functools.partial(self._step, torch.from_numpy(keys)))
        positions = torch.from_numpy(positions.reshape(input.shape)).to(device)
        # sparse: the gradient nn.EmbeddingBag(sparse=True) gives, summed per row in the same order
        return F.embedding_bag(positions, rows, offsets, mode=self.mode, sparse=True,
                               per_sample_weights=per_sample_weights, include_last_offset=self.include_last_offset)

    @property
    def weight(self) -> torch.Tensor:
        """The full table, with the cached rows written into it (a host tensor the module keeps updating)."""
        self.flush()
        return self.host_weight

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        self.flush()
        destination[prefix + "weight"] = self.host_weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
        elif tuple(state_dict[key].shape) != tuple(self.host_weight.shape):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(state_dict[key].shape)}, "
                              f"the shape in current model is {tuple(self.host_weight.shape)}")
        else:
            self.flush()  # the cached rows' optimizer state is kept; their weights are replaced below
            self.host_weight.copy_(state_dict[key])
            keys, slots = self.index.resident()
            self._install(keys, slots)
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k != key and "." not in k[len(prefix):])

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, cache_rows={self.index.capacity}, "
                f"policy={self.index.policy!r}, optimizer={self.optimizer.name!r}, lr={self.optimizer.lr}")

    # -- the cache ------------------------------------------------------------------------------------------

    def make_resident(self, keys: np.ndarray) -> np.ndarray:
        """Make the distinct sorted ``keys`` resident (evicting by the policy); their slots."""
        admission = self.index.admit(keys)
        self._write_back(admission.evict_keys, admission.evict_slots)
        self._install(admission.fetch_keys, admission.fetch_slots)
        self.stats["batches"] += 1
        self.stats["rows_looked_up"] += len(keys)
        return admission.batch_slots

    def flush(self) -> None:
        """Write every cached row (and its state) into the host table; the rows stay cached."""
        self._write_back(*self.index.resident(), count=False)

    def hit_rate(self) -> float:
        """The share of looked-up rows that were already resident."""
        looked_up = self.stats["rows_looked_up"]
        return 1.0 - self.stats["rows_fetched"] / looked_up if looked_up else 0.0

    def _write_back(self, keys: np.ndarray, slots: np.ndarray, *, count: bool = True) -> None:
        if not len(keys):
            return
        index = torch.from_numpy(slots).to(self.cache_weight.device)
        host_keys = torch.from_numpy(keys)
        self.host_weight.index_copy_(0, host_keys, self.cache_weight.index_select(0, index).cpu())
        if self.host_state.shape[1]:
            self.host_state.index_copy_(0, host_keys, self.cache_state.index_select(0, index).cpu())
        if count:
            self.stats["rows_written_back"] += len(keys)

    def _install(self, keys: np.ndarray, slots: np.ndarray, rows: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> None:
        """Put the host rows of ``keys`` (``rows``: already read from the host, as ``read_host`` reads them) and
        their state into ``slots``."""
        if not len(keys):
            return
        weights, state = self.read_host(keys) if rows is None else rows
        device = self.cache_weight.device
        index = torch.from_numpy(slots).to(device)
        self.cache_weight.index_copy_(0, index, weights.to(device, non_blocking=True))
        if state.shape[1]:
            self.cache_state.index_copy_(0, index, state.to(device, non_blocking=True))
        self.stats["rows_fetched"] += len(keys)

    def read_host(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The host rows of ``keys`` and their state, in pinned memory when the cache is on a GPU (so that the
        copy to it is asynchronous). Safe on another thread while the cache trains, for rows not cached."""
        host_keys = torch.from_numpy(keys)
        weights, state = self.host_weight.index_select(0, host_keys), self.host_state.index_select(0, host_keys)
        if self.cache_weight.device.type != "cpu":
            weights, state = weights.pin_memory(), state.pin_memory()
        return weights, state

    def carry_out(self, *, evict_keys: np.ndarray, evict_slots: np.ndarray, fetch_keys: np.ndarray,
                  fetch_slots: np.ndarray, rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """One step of a plan made elsewhere (``bagpipe.nn.Lookahead``): write the evicted rows back, then
        install the fetched ones in the slots it names."""
        self.index.move(evict_keys=evict_keys, evict_slots=evict_slots, fetch_keys=fetch_keys,
                        fetch_slots=fetch_slots)
        self._write_back(evict_keys, evict_slots)
        self._install(fetch_keys, fetch_slots, rows)

    def empty_cache(self) -> None:
        """Write every cached row back and free its slot (a plan starts from an empty cache)."""
        self.flush()
        self.index.clear()

    # -- the fused row optimizer ----------------------------------------------------------------------------

    def _step(self, keys: torch.Tensor, grad: torch.Tensor) -> None:
        """The backward reached a lookup's rows: step them (wherever they are now) with their summed gradients."""
        grads = _dense_rows(grad, len(keys))
        slots = torch.from_numpy(self.index.locate(keys.numpy()))
        cached = slots >= 0
        if bool(cached.all()):
            self._step_rows(self.cache_weight, self.cache_state, slots.to(grads.device), grads)
            return
        # Some rows were evicted between the forward and this backward (another lookup came in between):
        # their update goes to the host table, where they now are.
        self._step_rows(self.cache_weight, self.cache_state, slots[cached].to(grads.device),
                        grads[cached.to(grads.device)])
        self._step_rows(self.host_weight, self.host_state, keys[~cached], grads[(~cached).to(grads.device)].cpu())

    def _step_rows(self, weights: torch.Tensor, state: torch.Tensor, index: torch.Tensor, grads: torch.Tensor) -> None:
        if len(index):
            update_rows(self.optimizer, weights, state, Lookup(index, weights.index_select(0, index)), grads)


def _row_optimizer(name: str, *, lr: float | None, eps: float | None, betas: tuple[float, float]) -> RowOptimizer:
    """The fused optimizer, its hyper-parameters defaulted as torch.optim's SGD, Adagrad and Adam default them."""
    defaults = {"sgd": 1e-3, "adagrad": 1e-2, "adam": 1e-3}
    if name not in defaults:
        raise ValueError(f"optimizer must be one of {', '.join(defaults)}, got {name!r}")
    optimizer = make_row_optimizer(name, lr=defaults[name] if lr is None else lr)
    return RowOptimizer(name=name, lr=optimizer.lr, eps=optimizer.eps if eps is None else eps,
                        beta1=betas[0], beta2=betas[1])


def _dense_rows(grad: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A lookup's gradient as ``[num_rows, D]``: embedding_bag's sparse gradient coalesced (each row's
    contributions summed in the order nn.EmbeddingBag(sparse=True) sums them), rows it lacks zero."""
    if not grad.is_sparse:
        return grad
    grad = grad.coalesce()
    indices, values = grad.indices()[0], grad.values()
    if len(indices) == num_rows:
        return values
    return values.new_zeros(num_rows, values.shape[1]).index_copy_(0, indices, values)

