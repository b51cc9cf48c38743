"""A trainer's share of an iteration's gradient sums, and how another process computes a lost trainer's again.

Every trainer holds the same rows and the same dense weights (the plan is global) and computes its slice's
gradients from them. So what trainer k adds to iteration j's sums over trainers is a function of the dense
parameters before j's step, the batch's rows as gathered for j (before j's updates), k's slice of the batch (its
plan message) and (seed, j, k), which key the model's dropout. Any trainer can keep the first two (``RedoLog``, for
the iterations whose sums may still be in flight when a peer is lost), and a replacement for trainer k, given them
and k's message, computes k's share again bit for bit (``recompute``): the same code as the training loop's
(``slice_shares``) on the same values.

No process knowledge here: the trainer (runtime/trainer/recovery.py) keeps the log and sums the shares; a
replacement sums the shares it recomputes in the sums that failed with the lost trainer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from bagpipe.embeddings import EmbeddingLayout, Embeddings, Lookup, gather
from bagpipe.device import HostStaging, model_device
from bagpipe.models.layers import set_dropout_step
from bagpipe.runtime.protocol import StepMessage

# The iterations a trainer keeps the inputs of: the one it computes and the one before, whose background sums (the
# rows not used again at once) may still be in flight (the sums of any earlier one were waited for at a boundary),
# and one more: with three or more trainers a survivor may be one iteration past another when a peer is lost, and the
# one further on gives the replacement the inputs of every sum either has not finished (``agree_on_sums``).
REDO_DEPTH = 3
KINDS = ("early", "main", "later")  # an iteration's sums, in the order every trainer starts them


def sum_order(what: tuple) -> tuple:
    """The place of sum ``what`` (kind, iteration, space) in the order every trainer starts its sums."""
    kind, iteration, space = what
    return iteration, KINDS.index(kind), -1 if space is None else space


def agree_on_sums(entries: dict[int, dict]) -> tuple[list[tuple], int]:
    """What the survivors of a lost trainer do again with its replacement, from each survivor's ``entries``
    (``{"sums": the sums it has not finished, "reached": the iteration it is in}``): the union of their sums, in the
    order every trainer starts them (one a survivor has finished already is done again by it too, its result
    dropped: a sum needs every trainer's share), and the survivor that gives the replacement the inputs and its
    state (the one furthest on, which holds the inputs of every iteration among them; the lowest of those)."""
    union = sorted({tuple(what) for entry in entries.values() for what in entry["sums"]}, key=sum_order)
    donor = min(entries, key=lambda trainer: (-entries[trainer]["reached"], trainer))
    return union, donor


@dataclass
class Shares:
    """One trainer's operands of one iteration's sums over trainers, as it sends them."""

    early: torch.Tensor  # the gradients of the model's early parameters (DLRM: the top MLP), summed first
    main: torch.Tensor  # the other parameters' gradients, the loss, then per space the rows used next iteration's
    later: list[torch.Tensor]  # per space, the gradients of the batch's other rows (summed in the background)


def backward_slice(model: nn.Module, message: StepMessage, embeddings: Embeddings, *, seed: int, part: int,
                   lap=None, staging: HostStaging | None = None) -> torch.Tensor:
    """Trainer ``part``'s forward and backward of its slice: every gradient in place (the model's ``.grad``, each
    lookup's leaf); returns the slice's loss (detached). ``lap(phase)`` is called after each (the loop's clock).
    The plan message arrives in host memory: its inputs go to the model's device through ``staging`` where given
    (reused pinned buffers: the host does not wait for the device), else by a plain copy."""
    set_dropout_step(model, seed=seed, iteration=message.iteration, part=part)
    device = model_device(model)
    dense_x, target = (staging.to_device(message.dense_x, message.target) if staging is not None
                       else (message.dense_x.to(device), message.target.to(device)))
    loss = model.training_loss(dense_x, embeddings, target)
    if lap is not None:
        lap("forward")
    for p in model.parameters():
        p.grad = None
    loss.backward()
    if lap is not None:
        lap("backward")
    return loss.detach()


def dense_share(params: list[nn.Parameter], loss: torch.Tensor) -> torch.Tensor:
    """``params``' gradients and the loss, flat, in host memory: the dense part of a trainer's blocking sum (the
    trainers sum on the host, over gloo, whatever their device)."""
    return torch.cat([p.grad.reshape(-1) for p in params] + [loss.reshape(1)]).cpu()


def row_shares(lookups: list[Lookup], message: StepMessage) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per space, the gradients of the batch's rows used next iteration (synced at once) and of the others."""
    grads = [(lookup.rows.grad if lookup.rows.grad is not None else torch.zeros_like(lookup.rows)).cpu()
             for lookup in lookups]
    now = [g[:step.num_now] for g, step in zip(grads, message.spaces)]
    later = [g[step.num_now:] for g, step in zip(grads, message.spaces)]  # contiguous views: no copy
    return now, later


def main_share(dense: torch.Tensor | None, now: list[torch.Tensor]) -> torch.Tensor:
    """The operand of the blocking sum: ``dense`` (``dense_share``, if any), then each space's rows used next."""
    return torch.cat([torch.zeros(0) if dense is None else dense.reshape(-1)] + [g.reshape(-1) for g in now])


def slice_shares(model: nn.Module, message: StepMessage, embeddings: Embeddings, lookups: list[Lookup], *,
                 seed: int, part: int, early: list[nn.Parameter], late: list[nn.Parameter]) -> Shares:
    """Trainer ``part``'s shares of the sums of ``message``'s iteration (``early`` and ``late``: the model's
    parameters summed first and the rest, as the training loop splits them)."""
    loss = backward_slice(model, message, embeddings, seed=seed, part=part)
    now, later = row_shares(lookups, message)
    early_share = torch.cat([p.grad.reshape(-1) for p in early]).cpu() if early else torch.zeros(0)
    return Shares(early=early_share, main=main_share(dense_share(late, loss), now), later=later)


@dataclass
class Kept:
    """What a trainer's iteration computed from, as any trainer had it."""

    iteration: int
    params: list[torch.Tensor]  # the model's parameters before the iteration's step (copies)
    rows: list[torch.Tensor]  # per space, the batch's distinct rows as gathered for it (before its updates)

    def to(self, device: torch.device | str) -> "Kept":
        """A copy on ``device`` (host memory, to go to another trainer: RPC carries host tensors)."""
        return Kept(self.iteration, [p.to(device, copy=True) for p in self.params],
                    [rows.to(device, copy=True) for rows in self.rows])


class RedoLog:
    """The inputs of a trainer's last ``depth`` iterations (``keep`` each before its dense step)."""

    def __init__(self, params: list[nn.Parameter], depth: int = REDO_DEPTH) -> None:
        self.params = list(params)
        self._kept: deque[Kept] = deque()
        self.depth = depth

    def keep(self, iteration: int, lookups: list[Lookup]) -> None:
        """``iteration``'s inputs: the parameters as they are now (before its step) and its lookups' rows (leaves
        the loop never writes to: held, not copied)."""
        reused = self._kept.popleft() if len(self._kept) == self.depth else None
        with torch.no_grad():
            params = [p.detach().clone() for p in self.params] if reused is None else \
                [copy.copy_(p) for copy, p in zip(reused.params, self.params)]
        self._kept.append(Kept(iteration, params, [lookup.rows.detach() for lookup in lookups]))

    def adopt(self, kept: Kept) -> None:
        """Inputs another trainer kept (a replacement takes its survivor's of the iterations before it starts)."""
        if len(self._kept) == self.depth:
            self._kept.popleft()
        self._kept.append(kept)

    def kept(self, iteration: int) -> Kept:
        for entry in self._kept:
            if entry.iteration == iteration:
                return entry
        held = ", ".join(str(entry.iteration) for entry in self._kept) or "none"
        raise KeyError(f"iteration {iteration}'s inputs are not kept (kept: {held})")

    def iterations(self) -> list[int]:
        return [entry.iteration for entry in self._kept]


def recompute(model: nn.Module, kept: Kept, message: StepMessage, layout: EmbeddingLayout, *, seed: int,
              part: int, early: list[nn.Parameter], late: list[nn.Parameter]) -> Shares:
    """Trainer ``part``'s shares of ``kept``'s iteration, computed again on ``model`` (any model of the job's shape:
    its parameters are overwritten with the kept ones; ``early`` and ``late`` split them as the loop does) from
    ``message``, that trainer's plan message of the iteration."""
    if message.iteration != kept.iteration:
        raise ValueError(f"the message of iteration {message.iteration} with the inputs of {kept.iteration}")
    with torch.no_grad():
        for p, value in zip(model.parameters(), kept.params):
            p.copy_(value)
    blocks, lookups = [], []
    for space, rows, step in zip(layout.spaces, kept.rows, message.spaces):
        rows = rows.to(model_device(model))  # (kept by another trainer: in host memory)
        everything = torch.arange(len(rows), device=rows.device)
        block, lookup = gather(rows, everything, torch.as_tensor(step.positions, dtype=torch.int64).to(rows.device),
                               padded=space.padded)
        blocks.append(block)
        lookups.append(lookup)
    return slice_shares(model, message, Embeddings(blocks, layout, message.ids), lookups, seed=seed, part=part,
                        early=early, late=late)


class Recomputer:
    """Trainer ``part``'s shares computed again (``recompute``) on a model of its own, made when first needed."""

    def __init__(self, make_model, layout: EmbeddingLayout, *, seed: int, part: int) -> None:
        self.make_model, self.layout, self.seed, self.part = make_model, layout, seed, part
        self.model = self.early = self.late = None

    def __call__(self, kept: Kept, message: StepMessage) -> Shares:
        if self.model is None:
            self.model = self.make_model()
            self.early = list(self.model.early_params())
            self.late = [p for p in self.model.parameters() if all(p is not q for q in self.early)]
        return recompute(self.model, kept, message, self.layout, seed=self.seed, part=self.part, early=self.early,
                         late=self.late)
