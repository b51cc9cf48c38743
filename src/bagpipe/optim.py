"""Row-wise embedding optimizers: update only the rows a batch touched, with their own state.

The state of a row is a flat float32 vector stored beside it, so that it can travel with the
row (to a cache, a server, a checkpoint). Each update equals what the matching ``torch.optim``
class does to those rows alone: SGD, Adagrad (per element sum of squares) and Adam (per-row
step count, so bias correction counts the row's own updates, as lazy/sparse Adam does). One class
each (``RowSGD``, ``RowAdagrad``, ``RowAdam``), found by name in ``ROW_OPTIMIZERS``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from bagpipe.config import OPTIMIZERS
from bagpipe.embeddings.tables import Lookup, sparse_row_sums, update_rows


@dataclass(frozen=True, kw_only=True)
class RowOptimizer:
    """A row optimizer: its per-row state's width, its step on a batch's gathered rows, and its one update of a
    space's rows in place (``update``: every cache, table and server applies it through ``update_rows``, so that
    the reference and every cached path step alike). Each is a class of its own, registered by ``name``
    (``ROW_OPTIMIZERS``): adding one is a subclass here, with its torch.optim counterpart for the dense
    parameters, and its name in ``config.OPTIMIZERS`` (which the flags read without importing torch)."""

    name = ""  # (a class attribute: the registry's key, the config's --optimizer)
    torch_class: type[torch.optim.Optimizer] | None = None  # its torch.optim counterpart (what a script passes)
    torch_lr = 1e-3  # torch.optim's default learning rate for it (bagpipe.nn's when none is given)
    lr: float
    eps: float = 0.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")

    def state_width(self, dim: int) -> int:
        """Floats of optimizer state per row."""
        raise NotImplementedError

    @classmethod
    def with_torch_args(cls, *, lr: float, eps: float | None = None, betas: tuple[float, float] | None = None
                        ) -> "RowOptimizer":
        """The optimizer from torch.optim's form of its arguments (``eps``, Adam's ``betas``), defaults where
        None."""
        return cls(lr=lr, **({} if eps is None else {"eps": eps}))

    def step(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        """Update ``rows`` [U, D] and ``state`` [U, S] in place from ``grads`` [U, D]."""
        raise NotImplementedError

    def update(self, weights: torch.Tensor, state: torch.Tensor, index: torch.Tensor, rows: torch.Tensor,
               grads: torch.Tensor) -> None:
        """One step of a space's rows ``index`` (distinct; ``rows``: their values, gathered) in ``weights`` and
        ``state``, in place: the rows and their state stepped together and written back, one operation each."""
        rows, row_state = rows.detach().clone(), state.index_select(0, index)
        self.step(rows, row_state, grads)
        weights.index_copy_(0, index, rows)
        if row_state.shape[1]:
            state.index_copy_(0, index, row_state)

    def dense_optimizer(self, params) -> torch.optim.Optimizer:
        """The torch.optim counterpart for dense parameters, in torch's default form: foreach on CUDA (a few
        operations for all the parameters), one tensor at a time on the CPU, where foreach steps bit for bit alike
        but gained nothing here (docs/history/benchmarks.md). A user's script with a plain optimizer equals it."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class RowSGD(RowOptimizer):
    name = "sgd"
    torch_class = torch.optim.SGD

    def state_width(self, dim: int) -> int:
        return 0

    def step(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        rows.add_(grads, alpha=-self.lr)

    def update(self, weights: torch.Tensor, state: torch.Tensor, index: torch.Tensor, rows: torch.Tensor,
               grads: torch.Tensor) -> None:
        # fused: one scatter-add into the weights (the rows are distinct); grads * -lr first: index_add_ with
        # alpha= takes a slow path (2.3 ms against 0.28 ms for 12k rows of 16 into 130k, 1 thread)
        weights.index_add_(0, index, grads.mul(-self.lr))

    def dense_optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr)


@dataclass(frozen=True, kw_only=True)
class RowAdagrad(RowOptimizer):
    """Adagrad: a per-element sum of squared gradients as the row's state."""

    name = "adagrad"
    torch_class = torch.optim.Adagrad
    torch_lr = 1e-2
    eps: float = 1e-10

    def state_width(self, dim: int) -> int:
        return dim

    def step(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        state.addcmul_(grads, grads)
        rows.addcdiv_(grads, state.sqrt().add_(self.eps), value=-self.lr)

    def dense_optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(params, lr=self.lr, eps=self.eps)


@dataclass(frozen=True, kw_only=True)
class RowAdam(RowOptimizer):
    """Adam with a per-row step count: bias correction counts the row's own updates, as lazy/sparse Adam does.
    State: the first and second moments and the step count, ``2 * dim + 1`` floats."""

    name = "adam"
    torch_class = torch.optim.Adam
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999

    def state_width(self, dim: int) -> int:
        return 2 * dim + 1

    @classmethod
    def with_torch_args(cls, *, lr: float, eps: float | None = None, betas: tuple[float, float] | None = None
                        ) -> "RowAdam":
        return cls(lr=lr, **({} if eps is None else {"eps": eps}),
                   **({} if betas is None else {"beta1": betas[0], "beta2": betas[1]}))

    def step(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        dim = rows.shape[1]
        exp_avg, exp_avg_sq, steps = state[:, :dim], state[:, dim:2 * dim], state[:, 2 * dim:]
        steps.add_(1.0)
        exp_avg.lerp_(grads, 1.0 - self.beta1)
        exp_avg_sq.mul_(self.beta2).addcmul_(grads, grads, value=1.0 - self.beta2)
        bias1 = 1.0 - torch.pow(self.beta1, steps)
        bias2_sqrt = (1.0 - torch.pow(self.beta2, steps)).sqrt()
        denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(self.eps)
        rows.addcdiv_(exp_avg, denom * (bias1 / self.lr), value=-1.0)

    def dense_optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps)


ROW_OPTIMIZERS: dict[str, type[RowOptimizer]] = {cls.name: cls for cls in (RowSGD, RowAdagrad, RowAdam)}
OPTIMIZER_NAMES = tuple(ROW_OPTIMIZERS)
assert OPTIMIZER_NAMES == OPTIMIZERS, "config.OPTIMIZERS lists the registered row optimizers"
# a script's torch.optim class -> the row optimizer of the same rule (the original API's emb_optim)
BY_TORCH_CLASS: dict[type, str] = {cls.torch_class: name for name, cls in ROW_OPTIMIZERS.items()}


def make_row_optimizer(name: str, *, lr: float, **hyper) -> RowOptimizer:
    """The row optimizer ``name`` (``ROW_OPTIMIZERS``) at ``lr``, its other hyper-parameters (``eps``, Adam's
    ``beta1``/``beta2``) at their defaults unless given."""
    if name not in ROW_OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_NAMES)}, got {name!r}")
    return ROW_OPTIMIZERS[name](lr=lr, **hyper)


def with_lr(optimizer: RowOptimizer, lr: float) -> RowOptimizer:
    """``optimizer`` with learning rate ``lr`` (itself if it has it already; a row optimizer is a value)."""
    return optimizer if optimizer.lr == lr else replace(optimizer, lr=float(lr))


class RowWise(torch.optim.Optimizer):
    """A RowOptimizer as a ``torch.optim`` optimizer for sparse gradients (``nn.EmbeddingBag(sparse=True)``):
    each step updates only the rows the gradient names, with per-row state (Adam counts each row's own
    steps). The reference that ``bagpipe.nn.CachedEmbeddingBag``'s fused optimizer equals."""

    def __init__(self, params, optimizer: RowOptimizer) -> None:
        super().__init__(params, {"lr": optimizer.lr})  # (a group's "lr" is live: LR schedulers set it)
        self.row_optimizer = optimizer

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            row_optimizer = with_lr(self.row_optimizer, group["lr"])
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not param.grad.is_sparse:
                    raise ValueError("RowWise needs sparse gradients (e.g. nn.EmbeddingBag(sparse=True)): a dense "
                                     "gradient does not say which rows a batch touched")
                state = self.state[param]
                if "rows" not in state:
                    state["rows"] = param.new_zeros(param.shape[0], self.row_optimizer.state_width(param.shape[1]))
                index, grads = sparse_row_sums(param.grad)  # (each row's contributions in the order they came)
                update_rows(row_optimizer, param.data, state["rows"],
                            Lookup(index, param.data.index_select(0, index)), grads)
        return loss
