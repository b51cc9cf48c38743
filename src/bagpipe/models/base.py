"""What every model has: a loss over its output, the parameters its backward completes first, and
helpers to read its embeddings as fields."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bagpipe.data.schema import Schema
from bagpipe.embeddings import Embeddings


class RecModel(nn.Module):
    """A click-through-rate model by default: ``forward`` gives one logit per sample."""

    task = "ctr"  # what evaluation measures: ctr (AUC, log-loss) or next-item (HR@10, NDCG@10)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean loss of a batch (or a trainer's slice of one)."""
        return F.binary_cross_entropy_with_logits(output, target)

    def early_params(self) -> list[nn.Parameter]:
        """Parameters whose gradients the backward completes first (their all-reduce starts early)."""
        return []

    def training_loss(self, dense_x: torch.Tensor, embeddings: torch.Tensor | Embeddings,
                      target: torch.Tensor) -> torch.Tensor:
        """The mean loss of a training batch (or a trainer's slice of one), ``loss(self(dense_x, embeddings),
        target)``: through the compiled graph where ``compile_training`` made one. Every mode's training step
        computes its loss here (train/reference.py, runtime/redo.py, train/single.py), so that every mode computes
        it alike."""
        compiled = self.__dict__.get("_compiled_loss")
        if compiled is not None:
            return compiled(dense_x, embeddings, target)
        return self.loss(self(dense_x, embeddings), target)

    def compile_training(self) -> None:
        """``training_loss`` through ``torch.compile`` from now on: forward, loss and their backward as one graph
        of fused kernels (fewer launches on a GPU), shapes static (a batch of another shape compiles again). The
        same graph gives the same values in every mode and process; evaluation stays uncompiled (its batches are
        of other shapes)."""
        self.__dict__["_compiled_loss"] = torch.compile(lambda x, e, y: self.loss(self(x, e), y), dynamic=False)


def fields(embeddings: Embeddings, lookups: range) -> torch.Tensor:
    """``[B, len(lookups), D]``: those lookups, each pooled by sum if it is multi-valued."""
    if all(embeddings[i].dim() == 2 for i in lookups):
        return embeddings.stack(lookups)
    return torch.stack([embeddings.pooled(i, "sum") for i in lookups], dim=1)


def check_ctr_data(name: str, schema: Schema) -> None:
    if not schema.features:
        raise ValueError(f"{name} needs sparse features; the data has none")
