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
import sys
import warnings
import weakref
from typing import ContextManager

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bagpipe.nn.host import host_table, initial_blocks, storage_spec
from bagpipe.nn.rows import CachedRows, accumulating
from bagpipe.nn.slots import CLEANUP_FRACTION
from bagpipe.optim import OPTIMIZER_NAMES, ROW_OPTIMIZERS, RowOptimizer
from bagpipe.storage import StorageSpec

MODES = ("sum", "mean")  # "max" has no sparse gradient, so no row-wise step to fuse
STATE_KEY = "optimizer_state"  # the rows' optimizer state in state_dict(), beside "weight"


class CachedTableModule(nn.Module):
    """What ``CachedEmbeddingBag`` and ``CachedEmbedding`` share: a ``num_embeddings x embedding_dim`` table in
    host memory (or on disk) behind a cache of ``cache_rows`` rows on the module's device, its rows stepped in
    backward by the row optimizer; the table's ``weight``, state dict, freezing, gradient accumulation,
    warm-up and what ``Lookahead`` plans for. (CachedEmbeddingBag's docstring says how each behaves.)"""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, cache_rows: int, optimizer: str | None = None,
                 lr: float | None = None, eps: float | None = None, betas: tuple[float, float] = (0.9, 0.999),
                 policy: str = "lru", cleanup_fraction: float = CLEANUP_FRACTION, _weight: torch.Tensor | None = None,
                 storage: str | StorageSpec = "memory", device: torch.device | str | None = None,
                 sparse: bool = True, scale_grad_by_freq: bool = False, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, dtype: torch.dtype | None = None,
                 _grows: bool = False) -> None:
        super().__init__()
        refuse_unsupported(sparse=sparse, scale_grad_by_freq=scale_grad_by_freq, padding_idx=padding_idx,
                           max_norm=max_norm, dtype=dtype)
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(f"num_embeddings and embedding_dim must be positive, got {num_embeddings} x "
                             f"{embedding_dim}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.requires_grad = True  # False: frozen (requires_grad_), lookups record no gradient
        optimizer = row_optimizer(optimizer, lr=lr, eps=eps, betas=betas)
        storage = storage_spec(storage)
        if _weight is not None and tuple(_weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(f"_weight has shape {tuple(_weight.shape)}, expected ({num_embeddings}, {embedding_dim})")
        host = host_table(storage, num_rows=num_embeddings, dim=embedding_dim,
                          state_width=optimizer.state_width(embedding_dim),
                          blocks=initial_blocks(num_embeddings, embedding_dim, _weight, storage=storage))
        weakref.finalize(self, host.close)  # a table on disk is this module's working copy
        self.rows = CachedRows(host, cache_rows=cache_rows, optimizer=optimizer, policy=policy,
                               cleanup_fraction=cleanup_fraction, device=device, grows=_grows)

    def _looked_up(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``ids`` made resident: the cached rows they use (a leaf whose gradient steps them in
        backward, unless no gradient is recorded) and each id's row in it, shaped as ``ids``."""
        if ids.dtype not in (torch.int64, torch.int32):  # (a float id would be truncated silently)
            raise ValueError(f"input must hold integer ids (torch.int64 or torch.int32), got {ids.dtype}")
        keys, slots, positions = self.rows.resident_positions(ids.cpu().numpy().reshape(-1))
        on_device, at = self.rows.slots.to_device(slots, positions.reshape(ids.shape))  # (at: int32 while copied)
        rows = self.rows.cache_weight.index_select(0, on_device)
        if torch.is_grad_enabled() and self.requires_grad:
            rows.requires_grad_(True)
            rows.register_hook(functools.partial(self.rows.fused_step, keys, slots=slots,
                                                 as_of=self.rows.index.version))
        return rows, at.long()

    @property
    def weight(self) -> torch.Tensor:
        """The full table, with the cached rows written into it: in memory, a host tensor the module keeps
        updating; on disk, a copy read from the file."""
        self.rows.flush()
        return self.rows.host.rows(0, self.num_embeddings)[0]

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        self.rows.flush()
        weights, state = self.rows.host.rows(0, self.num_embeddings)
        destination[prefix + "weight"] = weights
        if state.shape[1]:  # SGD keeps none: the state dict is then nn.EmbeddingBag's
            destination[prefix + STATE_KEY] = state

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        weight_key, state_key = prefix + "weight", prefix + STATE_KEY
        shapes = {weight_key: (self.num_embeddings, self.embedding_dim)}
        if self.rows.host.state_width:
            shapes[state_key] = (self.num_embeddings, self.rows.host.state_width)
        if weight_key not in state_dict:
            missing_keys.append(weight_key)  # the optimizer state may be missing: it then starts afresh
        given = {key: state_dict[key] for key in shapes if key in state_dict}
        mismatched = [key for key, value in given.items() if tuple(value.shape) != shapes[key]]
        for key in mismatched:
            why = f" (the {self.rows.optimizer.name} optimizer's state)" if key == state_key else ""
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(given[key].shape)}, the "
                              f"shape in current model is {shapes[key]}{why}")
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in shapes
                               and k[len(prefix):].split(".")[0] not in self._modules)
        if not given or mismatched:
            return
        weights = given[weight_key] if weight_key in given else self.weight.clone()
        self.rows.flush()
        self.rows.host.load(weights, given.get(state_key))  # no state given: zeros, a fresh optimizer's
        self.rows.reload()

    def requires_grad_(self, requires_grad: bool = True) -> "CachedTableModule":
        """Freeze (False) or unfreeze the table, as ``weight.requires_grad_`` does ``nn.EmbeddingBag``'s: the
        lookups of a frozen table record no gradient, so no backward steps its rows."""
        self.requires_grad = requires_grad
        return super().requires_grad_(requires_grad)

    def accumulate(self) -> ContextManager[None]:
        """``with bag.accumulate(): ...``: the backward passes inside hold their row gradients, and the rows take
        one step on their sum when the block ends (what one ``optimizer.step()`` after accumulating
        ``nn.EmbeddingBag(sparse=True)``'s gradients does); nothing is stepped if the block raises. Blocks do not
        nest."""
        return accumulating([self.rows])

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, {self._pooling_repr()}"
                f"cache_rows={self.rows.index.capacity}, policy={self.rows.index.policy!r}, "
                f"optimizer={self.rows.optimizer.name!r}, lr={self.rows.optimizer.lr}")

    def _pooling_repr(self) -> str:
        return ""  # (a bag's mode)

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


class CachedEmbeddingBag(CachedTableModule):
    """``nn.EmbeddingBag``'s interface (``forward(input, offsets=None, per_sample_weights=None)``, the same
    results) over a ``num_embeddings x embedding_dim`` table in host memory behind a cache of ``cache_rows`` rows
    on the module's device, whose rows are trained inside ``backward()``.

    **The optimizer step happens in backward()**: each backward that reaches a lookup steps its rows, with
    ``optimizer`` ("sgd", "adagrad", "adam"; ``lr``, ``eps`` and ``betas`` defaulted as ``torch.optim`` defaults
    them). So gradient accumulation over micro-batches takes one step per backward unless it runs inside
    ``with bag.accumulate():`` (one step on the summed gradient, at the block's end); ``eval()`` does not stop
    the updates (a backward in eval mode steps the rows, as a plain loop's ``optimizer.step()`` would); lookups
    under ``torch.no_grad()`` record nothing, so no backward steps them; ``bag.requires_grad_(False)`` freezes
    the table (as ``weight.requires_grad_(False)`` freezes ``nn.EmbeddingBag``'s; a parent module's
    ``requires_grad_`` does not reach it, for the table is no parameter). Without ``optimizer`` the rows train
    with SGD at lr 1e-3 and a UserWarning says so. ``bagpipe.nn.FusedOptimizer(model)`` gives the tables' learning
    rates as an optimizer's param groups, for LR schedulers.

    ``policy`` ("lru" or "lfu") picks the rows to evict when a batch's rows do not fit beside the resident ones,
    ``cleanup_fraction`` of the cache more than the batch needs (choosing them is a pass over the cache: paid
    once every many batches). A batch with more distinct rows than the cache is refused with a ValueError naming
    both counts.

    ``storage``: where the full table and its optimizer state live: "memory" (host tensors; ``_weight`` is
    shared, as ``nn.EmbeddingBag`` shares it), "disk" (a file in the system's temporary directory behind 64 MiB
    of DRAM) or a ``bagpipe.storage.StorageSpec("disk", directory, budget_bytes)``. On disk the initial rows
    are drawn block by block (N(0, 1) as in memory, not the same values in the last block), ``weight`` and
    ``state_dict()`` read the whole table into memory, and the file is deleted with the module.

    What differs from ``nn.EmbeddingBag``, and why:

    - the table is no parameter (``parameters()`` is empty): it never fits on the device, and the row
      optimizer runs in backward (above). ``weight`` is a property: the full table, read-only in effect;
    - ``state_dict()`` holds ``weight`` and, for Adagrad and Adam, ``optimizer_state`` (``[num_embeddings, S]``:
      Adagrad's sums of squares; Adam's two moments and each row's step count), so that a reloaded module
      trains on as the saved one would have, bit for bit. ``nn.EmbeddingBag`` loads it with ``strict=True`` once
      ``bagpipe.nn.without_optimizer_state`` has left that state out. A state dict with ``weight`` alone (an ``nn.EmbeddingBag``'s) loads with
      ``strict=True`` and resets the optimizer state to zeros: a fresh optimizer on those weights;
    - float32 only (host tables, optimizer state and cache all are): ``dtype`` other than float32, ``.double()``,
      ``.half()`` and ``.to(dtype)`` are a ValueError; cast the output instead;
    - mode "max" (no sparse gradient to step rows by), ``sparse=False`` (no dense gradient: the rows step
      from their sparse one, as ``nn.EmbeddingBag(sparse=True)`` + ``bagpipe.optim.RowWise``),
      ``scale_grad_by_freq=True`` (PyTorch has no sparse gradient for it), ``padding_idx`` and ``max_norm``
      (not implemented for cached rows) are refused with a ValueError; ``norm_type`` is accepted and, without
      ``max_norm``, unused, as there.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, cache_rows: int, mode: str = "mean",
                 include_last_offset: bool = False, optimizer: str | None = None, lr: float | None = None,
                 eps: float | None = None, betas: tuple[float, float] = (0.9, 0.999), policy: str = "lru",
                 cleanup_fraction: float = CLEANUP_FRACTION, _weight: torch.Tensor | None = None,
                 storage: str | StorageSpec = "memory", device: torch.device | str | None = None,
                 sparse: bool = True, scale_grad_by_freq: bool = False, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, dtype: torch.dtype | None = None,
                 _grows: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, cache_rows=cache_rows, optimizer=optimizer, lr=lr, eps=eps,
                         betas=betas, policy=policy, cleanup_fraction=cleanup_fraction, _weight=_weight,
                         storage=storage, device=device, sparse=sparse, scale_grad_by_freq=scale_grad_by_freq,
                         padding_idx=padding_idx, max_norm=max_norm, dtype=dtype, _grows=_grows)
        self.mode, self.include_last_offset = mode, include_last_offset

    # -- the nn.EmbeddingBag interface ----------------------------------------------------------------------

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if input.dim() == 2 and offsets is not None:
            raise ValueError("offsets must be None when input is 2-D (each row of input is a bag)")
        if input.dim() == 1 and offsets is None:
            raise ValueError("offsets is required when input is 1-D")
        if input.dim() not in (1, 2):
            raise ValueError(f"input must be 1-D (with offsets) or 2-D, got {input.dim()}-D")
        rows, positions = self._looked_up(input)
        # sparse: the gradient nn.EmbeddingBag(sparse=True) gives, summed per row in the same order
        return F.embedding_bag(positions, rows, offsets, mode=self.mode, sparse=True,
                               per_sample_weights=per_sample_weights, include_last_offset=self.include_last_offset)

    def _pooling_repr(self) -> str:
        return f"mode={self.mode!r}, "


class CachedEmbedding(CachedTableModule):
    """``nn.Embedding``'s interface (``forward(input)``: ids of any shape, their rows ``[*input.shape, dim]``)
    over a table behind a cache, as ``CachedEmbeddingBag`` is ``nn.EmbeddingBag``'s: the rows step in
    backward (``optimizer``, ``lr``; ``bagpipe.nn.FusedOptimizer`` for schedulers), equal to
    ``nn.Embedding(sparse=True)`` stepped by ``bagpipe.optim.RowWise``; the same state dict (``weight``, and
    Adagrad's or Adam's ``optimizer_state``), storage tiers and refusals (``padding_idx``, ``max_norm``,
    ``scale_grad_by_freq``, ``sparse=False``, dtypes other than float32) as CachedEmbeddingBag."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows, positions = self._looked_up(input)
        return F.embedding(positions, rows, sparse=True)  # (the sparse gradient nn.Embedding(sparse=True) gives)


def without_optimizer_state(state_dict: dict) -> dict:
    """A state dict of a model with cached tables, less the tables' optimizer state (Adagrad's or Adam's
    ``*.optimizer_state``): what a model with ``nn.EmbeddingBag``/``nn.Embedding`` in their places loads with
    ``strict=True``; the tables' weights are under the same keys (``*.weight``)."""
    return {key: value for key, value in state_dict.items()
            if key != STATE_KEY and not key.endswith("." + STATE_KEY)}


def row_optimizer(name: str | None, *, lr: float | None, eps: float | None,
                  betas: tuple[float, float]) -> RowOptimizer:
    """The fused optimizer, its hyper-parameters defaulted as torch.optim's SGD, Adagrad and Adam default them;
    no ``name``: SGD, with a UserWarning naming it (pointing at the module's constructor call)."""
    if name is None:
        name = OPTIMIZER_NAMES[0]
        warnings.warn(f"no optimizer given: the table's rows are trained with optimizer={name!r}, "
                      f"lr={ROW_OPTIMIZERS[name].torch_lr if lr is None else lr} inside backward(); pass optimizer= "
                      f"({', '.join(map(repr, OPTIMIZER_NAMES))}) and lr= to choose", UserWarning,
                      stacklevel=_outside_nn())
    if name not in ROW_OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_NAMES)}, got {name!r}")
    kind = ROW_OPTIMIZERS[name]
    return kind.with_torch_args(lr=kind.torch_lr if lr is None else lr, eps=eps, betas=betas)


def _outside_nn() -> int:
    """``warnings.warn``'s stacklevel, for its caller, of the first frame outside bagpipe.nn: the user's call, through
    however many of the package's constructors (a subclass's ``__init__``, a collection's)."""
    frame, level = sys._getframe(2), 2  # (1: row_optimizer, which warns; 2: its caller)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("bagpipe.nn"):
        frame, level = frame.f_back, level + 1
    return level


def refuse_unsupported(*, sparse: bool, scale_grad_by_freq: bool, padding_idx: int | None, max_norm: float | None,
                       dtype: torch.dtype | None) -> None:
    """``nn.EmbeddingBag``'s arguments taken only at the values this module implements: a ValueError saying why
    for the others."""
    if not sparse:
        raise ValueError("sparse=False is not supported: the table is no parameter and has no dense gradient; its "
                         "looked-up rows are stepped in backward() from their sparse gradient, as "
                         "nn.EmbeddingBag(sparse=True) + bagpipe.optim.RowWise would (pass sparse=True or leave it)")
    if scale_grad_by_freq:
        raise ValueError("scale_grad_by_freq=True is not supported: PyTorch has no sparse gradient for it, and the "
                         "rows are stepped from their sparse gradient")
    if padding_idx is not None:
        raise ValueError("padding_idx is not supported: leave the padding ids out of input (and offsets), or give "
                         "them per_sample_weights of 0 with mode='sum'")
    if max_norm is not None:
        raise ValueError("max_norm is not supported: renormalising the looked-up rows is not implemented for "
                         "cached rows")
    if dtype not in (None, torch.float32):
        raise ValueError(f"dtype={dtype} is not supported: the table, its optimizer state and the cache are float32; "
                         f"cast the output instead (e.g. bag(ids, offsets).to({dtype}))")
