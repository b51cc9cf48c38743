"""Row-wise embedding optimizers: update only the rows a batch touched, with their own state.

The state of a row is a flat float32 vector stored beside it, so that it can travel with the
row (to a cache, a server, a checkpoint). Each update equals what the matching ``torch.optim``
class does to those rows alone: SGD, Adagrad (per element sum of squares) and Adam (per-row
step count, so bias correction counts the row's own updates, as lazy/sparse Adam does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bagpipe.embeddings.tables import Lookup, sparse_row_sums, update_rows

OPTIMIZER_NAMES = ("sgd", "adagrad", "adam")


@dataclass(frozen=True, kw_only=True)
class RowOptimizer:
    name: str
    lr: float
    eps: float = 0.0  # set per optimizer by make_row_optimizer
    beta1: float = 0.9
    beta2: float = 0.999

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_NAMES:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_NAMES)}, got {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")

    def state_width(self, dim: int) -> int:
        """Floats of optimizer state per row."""
        return {"sgd": 0, "adagrad": dim, "adam": 2 * dim + 1}[self.name]

    def step(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        """Update ``rows`` [U, D] and ``state`` [U, S] in place from ``grads`` [U, D]."""
        if self.name == "sgd":
            rows.add_(grads, alpha=-self.lr)
        elif self.name == "adagrad":
            state.addcmul_(grads, grads)
            rows.addcdiv_(grads, state.sqrt().add_(self.eps), value=-self.lr)
        else:
            dim = rows.shape[1]
            exp_avg, exp_avg_sq, steps = state[:, :dim], state[:, dim:2 * dim], state[:, 2 * dim:]
            steps.add_(1.0)
            exp_avg.lerp_(grads, 1.0 - self.beta1)
            exp_avg_sq.mul_(self.beta2).addcmul_(grads, grads, value=1.0 - self.beta2)
            bias1 = 1.0 - torch.pow(self.beta1, steps)
            bias2_sqrt = (1.0 - torch.pow(self.beta2, steps)).sqrt()
            denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(self.eps)
            rows.addcdiv_(exp_avg, denom * (bias1 / self.lr), value=-1.0)
        # Writing back through an index (rows = table[ids]) is the caller's job.

    def dense_optimizer(self, params) -> torch.optim.Optimizer:
        """The torch.optim counterpart for dense parameters, in torch's default form: foreach on CUDA (a few
        operations for all the parameters), one tensor at a time on the CPU, where foreach steps bit for bit alike
        but was slower here (bench_single, docs/benchmarks.md). A user's script with a plain optimizer equals it."""
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr)
        if self.name == "adagrad":
            return torch.optim.Adagrad(params, lr=self.lr, eps=self.eps)
        return torch.optim.Adam(params, lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps)


def make_row_optimizer(name: str, *, lr: float) -> RowOptimizer:
    eps = {"sgd": 0.0, "adagrad": 1e-10, "adam": 1e-8}.get(name, 0.0)
    return RowOptimizer(name=name, lr=lr, eps=eps)


class RowWise(torch.optim.Optimizer):
    """A RowOptimizer as a ``torch.optim`` optimizer for sparse gradients (``nn.EmbeddingBag(sparse=True)``):
    each step updates only the rows the gradient names, with per-row state (Adam counts each row's own
    steps). The reference that ``bagpipe.nn.CachedEmbeddingBag``'s fused optimizer equals."""

    def __init__(self, params, optimizer: RowOptimizer) -> None:
        super().__init__(params, {})
        self.row_optimizer = optimizer

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
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
                update_rows(self.row_optimizer, param.data, state["rows"],
                            Lookup(index, param.data.index_select(0, index)), grads)
        return loss
