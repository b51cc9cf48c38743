"""``FusedOptimizer``: the row optimizer that cached tables run inside backward, as a ``torch.optim.Optimizer``,
so that what works on an optimizer's param groups (LR schedulers, warm-up, logging the learning rate, saving it
with the optimizers) works on the tables' too."""

from __future__ import annotations

import functools
from typing import Iterable

import torch
from torch import nn

__all__ = ["FusedOptimizer"]


def _cached_modules(modules: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    from bagpipe.nn.cached_bag import CachedTableModule
    from bagpipe.nn.collection import CachedEmbeddingBagCollection

    kinds = (CachedTableModule, CachedEmbeddingBagCollection)
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    found = [m for root in roots for m in root.modules() if isinstance(m, kinds)]
    return list(dict.fromkeys(found))  # (each once, in the order the model lists them)


class FusedOptimizer(torch.optim.Optimizer):
    """The cached tables of ``modules`` (a model, or modules; every ``CachedEmbeddingBag``, ``CachedEmbedding``
    and ``CachedEmbeddingBagCollection`` in them) as an optimizer: one param group per cached module, whose ``"lr"``
    the module's rows are stepped with from the next backward on. An LR scheduler drives it as any optimizer::

        tables = bagpipe.nn.FusedOptimizer(model)
        schedule = torch.optim.lr_scheduler.StepLR(tables, step_size=1000, gamma=0.5)
        for batch in batches:
            loss(model, batch).backward()   # the tables' rows step here, at the group's lr
            dense.step(); tables.step()     # tables.step(): nothing left to do (torch's schedulers expect it)
            schedule.step()

    Only ``"lr"`` is live (the group also says the optimizer's ``name``; its other settings are the module's
    own). A group's params are the module's cache tensors, for what reads them (a group's size); no gradient
    reaches them and ``step``/``zero_grad`` have nothing to do. A later FusedOptimizer over the same module takes
    over its learning rate. ``state_dict()`` holds the groups' learning rates; the rows' own optimizer state is
    saved with the module (its ``state_dict()``)."""

    def __init__(self, modules: nn.Module | Iterable[nn.Module]) -> None:
        cached = _cached_modules(modules)
        if not cached:
            raise ValueError("no cached tables (CachedEmbeddingBag, CachedEmbeddingBagCollection) in what was given")
        groups = []
        for module in cached:
            spaces = module.cached_spaces()
            optimizer = spaces[0].optimizer
            groups.append({"params": [space.cache_weight for space in spaces], "lr": optimizer.lr,
                           "name": optimizer.name})
        super().__init__(groups, {})
        for g, module in enumerate(cached):
            for space in module.cached_spaces():
                space.lr_of = functools.partial(self._lr, g)

    def _lr(self, group: int) -> float:
        lr = self.param_groups[group]["lr"]
        return float(lr.item() if isinstance(lr, torch.Tensor) else lr)

    @torch.no_grad()
    def step(self, closure=None):
        """Nothing to step: the rows were stepped in backward. ``closure`` is called, as torch's optimizers do."""
        return None if closure is None else closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: the tables hold no gradients between backwards."""
