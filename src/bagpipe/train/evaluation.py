"""Evaluation of a model whose rows come from a ``RowSource``: each test batch reads only its own rows, so
no process needs every table (a checkpoint is read lazily); and evaluations in the background.

Every mode evaluates through ``evaluate_splits``: the reference from its tables in memory, ``--mode bagpipe``
from the checkpoint its servers wrote, so equal states give bit-for-bit equal metrics. An evaluation covers the
test split (metrics ``eval_*``, summary.json's headline) and, where the data has one, the validation split
(``valid_*``): the evaluations during training are judged, and ``--keep-best`` chooses, by the validation
split's metric then, so the test split never chooses the model it measures (``watched_metric``).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from bagpipe.train.checkpoints import background_priority
from bagpipe.data.batches import read_batch
from bagpipe.data.binary import BinarySplit
from bagpipe.device import model_device
from bagpipe.embeddings import EmbeddingLayout, Embeddings, gather, positions_in
from bagpipe.embeddings.dynamic import split_as_of
from bagpipe.health import SPLIT_PREFIXES
from bagpipe.metrics import log_loss, roc_auc
from bagpipe.model_dir import RowSource
from bagpipe.ranking import NextItemRanking, metrics_at

log = logging.getLogger(__name__)

METRICS = {"ctr": ("eval_auc", "eval_logloss"), "next-item": ("eval_hr10", "eval_ndcg10")}  # by model.task


def no_evaluation(model: nn.Module) -> dict:
    return {"eval_rows": 0, **{name: float("nan") for name in METRICS[model.task]}}


@dataclass(frozen=True)
class EvaluatedSplit:
    """A split every evaluation of a run covers: its name ("valid" or "test"), its rows and, for a next-item
    model, what its targets are ranked among."""

    name: str
    split: BinarySplit
    ranking: NextItemRanking | None = None

    @property
    def prefix(self) -> str:
        return SPLIT_PREFIXES[self.name]


def evaluated_splits(model: nn.Module, dataset, *, protocol: str) -> list[EvaluatedSplit]:
    """What a run's evaluations cover: the validation split, if the data has one, then the test split (none for
    data with no test split)."""
    if dataset.test is None or dataset.test.rows == 0:
        return []
    names = [name for name in SPLIT_PREFIXES if (split := getattr(dataset, name)) is not None and split.rows > 0]
    next_item = model.task == "next-item"
    return [EvaluatedSplit(name, getattr(dataset, name), NextItemRanking.of_dataset(dataset, protocol=protocol,
                                                                                    split=name) if next_item else None)
            for name in names]


def watched_metric(task: str, splits: list[EvaluatedSplit]) -> str:
    """The metric that judges a run's evaluations (health.EvaluationWatch) and by which --keep-best chooses: the
    task's headline metric (AUC, HR@10) on the validation split if there is one, else on the test split."""
    prefix = splits[0].prefix if splits else SPLIT_PREFIXES["test"]
    return prefix + METRICS[task][0].removeprefix("eval_")


def evaluate_splits(model: nn.Module, layout: EmbeddingLayout, source: RowSource, splits: list[EvaluatedSplit], *,
                    batch_size: int, max_rows: int = 0, iteration: int | None = None) -> dict:
    """Every split's metrics (``evaluate``), each under its prefix, in one dict (a next-item model's item tables
    read once for them all). ``iteration``: the state evaluated is the one after that many iterations (raw ids: a
    key whose row is made later is looked up on its table's default row, ``split_as_of``)."""
    items = (_item_tables(layout, source, device=model_device(model))
             if splits and model.task == "next-item" else None)
    metrics = {}
    for evaluated in splits:
        metrics.update(evaluate(model, layout, source, split_as_of(evaluated.split, iteration), batch_size=batch_size,
                                max_rows=max_rows,
                                ranking=evaluated.ranking, prefix=evaluated.prefix, items=items))
    return metrics


def batch_embeddings(layout: EmbeddingLayout, source: RowSource, ids: torch.Tensor, *,
                     device: torch.device | str = "cpu") -> Embeddings:
    """The embeddings of ids ``[B, K]`` from the rows of their distinct keys alone, on ``device``."""
    blocks = []
    for space, (info, flat) in enumerate(zip(layout.spaces, layout.keys(ids.numpy()))):
        flat = torch.from_numpy(flat)
        distinct = torch.unique(flat[flat >= 0])
        rows = torch.from_numpy(source.rows(space, distinct.numpy()))
        block, _ = gather(rows, torch.arange(len(distinct)), positions_in(flat, distinct), padded=info.padded)
        blocks.append(block.to(device))
    return Embeddings(blocks, layout, ids)


@torch.no_grad()
def evaluate(model: nn.Module, layout: EmbeddingLayout, source: RowSource, split: BinarySplit, *, batch_size: int,
             max_rows: int = 0, ranking: NextItemRanking | None = None, prefix: str = "eval_",
             items: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """AUC and log-loss of a CTR model; HR@K and NDCG@K (K in ranking.CUTOFFS) of a next-item model, its
    target ranked among the candidates ``ranking``'s protocol names, beside the simple baselines ranked
    the same way (bagpipe.ranking); each named ``{prefix}auc`` and so on. ``items``: a next-item model's item
    tables (``_item_tables``), if read already."""
    if model.task == "next-item" and ranking is None:
        raise ValueError("a next-item evaluation needs its NextItemRanking (the users' training items and the "
                         "baselines): see evaluation.evaluated_splits")
    model.eval()
    device = model_device(model)
    rows = min(split.rows, max_rows) if max_rows else split.rows
    outputs, ranks = [], []
    if items is None and model.task == "next-item":
        items = _item_tables(layout, source, device=device)
    for start in range(0, rows, batch_size):
        batch = read_batch(split, slice(start, min(start + batch_size, rows))).to(device)
        embeddings = batch_embeddings(layout, source, batch.ids, device=device)
        source.release()
        if items is not None:
            batch_ranks, spread = _next_item_ranks(model, layout, items, embeddings, batch.ids, ranking)
            ranks.append(batch_ranks)
            outputs.append(spread)
        else:
            outputs.append(torch.sigmoid(model(batch.dense_x, embeddings)).cpu().numpy())
    model.train()
    if model.task == "next-item":
        # the spread of each sample's scores over the items, averaged: about 0 when the model scores every item
        # alike (health.COLLAPSE_STD)
        spread = float(np.concatenate(outputs).mean()) if outputs else float("nan")
        return {f"{prefix}rows": rows, **metrics_at(np.concatenate(ranks) if ranks else np.zeros(0), prefix=prefix),
                **ranking.baselines(split.ids[:rows], prefix=prefix), f"{prefix}pred_std": spread}
    labels = np.asarray(split.labels[:rows])
    scores = np.concatenate(outputs) if outputs else np.zeros(0)
    # the predictions' spread: about 0 when the model predicts one value for every sample (health.COLLAPSE_STD)
    spread = float(np.std(scores, dtype=np.float64)) if len(scores) else float("nan")
    return {f"{prefix}rows": rows, f"{prefix}auc": roc_auc(labels, scores),
            f"{prefix}logloss": log_loss(labels, scores), f"{prefix}pred_std": spread}


def _item_tables(layout: EmbeddingLayout, source: RowSource, *,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A next-item model's output table and item biases, whole, on ``device``: every item is scored against
    every sample."""
    names = [t.name for t in layout.tables]
    tables = []
    for name in ("item.out", "item.bias"):
        index = names.index(name)
        space, offset = layout.place(index)
        keys = np.arange(offset, offset + layout.tables[index].num_rows, dtype=np.int64)
        tables.append(torch.from_numpy(source.rows(space, keys)).to(device))
    source.release()
    return tables[0], tables[1]


def _next_item_ranks(model: nn.Module, layout: EmbeddingLayout, items: tuple[torch.Tensor, torch.Tensor],
                     embeddings: Embeddings, ids: torch.Tensor, ranking: NextItemRanking) -> tuple[np.ndarray, np.ndarray]:
    """The 0-based rank of each sample's first target among its candidates; and the spread (standard deviation)
    of each sample's scores over every item."""
    ids = ids.numpy()
    history, target = ids[:, slice(*layout.schema.columns(1))], ids[:, layout.schema.columns(2)[0]]
    scores = model.score_all(embeddings, *items).cpu()  # ranked on the host, against the users' known items
    return ranking.ranks(scores, ids[:, 0], history, target), scores.double().std(dim=1).numpy()


class BackgroundEvaluations:
    """Evaluations of saved states, one at a time, in order, on a thread of lower priority, while training
    goes on; each result is handed to ``on_result(iteration, metrics, dense, source)`` with the state evaluated
    (e.g. logged as a metrics point, and the state kept if it is the best so far)."""

    def __init__(self, model: nn.Module, layout: EmbeddingLayout, splits: list[EvaluatedSplit], *, batch_size: int,
                 max_rows: int, on_result: Callable[[int, dict, dict, RowSource], None]) -> None:
        self.model, self.layout, self.splits = model, layout, splits
        self.batch_size, self.max_rows, self.on_result = batch_size, max_rows, on_result
        self.results: dict[int, dict] = {}
        self._jobs: queue.Queue = queue.Queue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="evaluation", daemon=True)
        self._thread.start()

    def submit(self, iteration: int, dense: dict[str, torch.Tensor], source: RowSource) -> None:
        """Evaluate the state after ``iteration`` iterations: ``dense`` weights and the rows of ``source``."""
        self._raise_if_failed()
        self._jobs.put((iteration, dense, source))

    def close(self) -> dict[int, dict]:
        """Wait for every evaluation submitted; their metrics by iteration."""
        self._jobs.put(None)
        self._thread.join()
        self._raise_if_failed()
        return self.results

    def _run(self) -> None:
        background_priority()
        while (job := self._jobs.get()) is not None:
            if self._failure is not None:
                continue
            iteration, dense, source = job
            try:
                self.model.load_state_dict(dense)
                metrics = evaluate_splits(self.model, self.layout, source, self.splits, batch_size=self.batch_size,
                                          max_rows=self.max_rows, iteration=iteration)
                self.results[iteration] = metrics
                self.on_result(iteration, metrics, dense, source)
            except BaseException as err:  # noqa: BLE001 - raised on the caller's thread by submit() / close()
                self._failure = err

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"an evaluation failed: {self._failure}") from self._failure
