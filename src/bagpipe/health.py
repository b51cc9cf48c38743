"""Whether a run is going well, judged from what it computes: a training loss far above its start, predictions
collapsed to one value, an evaluation that falls once the data repeats; and the best evaluation (``--keep-best``).

No I/O and no knowledge of processes: every mode's loop feeds a ``LossWatch`` its losses and an ``EvaluationWatch``
its evaluations (``--mode bagpipe``: the trainers the first, the oracle the second), and reports the ``RunWarning``
they return. Each kind of warning is said once per run, at the iteration it was first seen.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable

# Divergence: the loss smoothed over about the last 1 / LOSS_SMOOTHING iterations exceeds DIVERGENCE_FACTOR times
# the first iteration's (the model as initialised, before any step: the one loss the learning rate has not touched
# yet), or a loss is not finite. Measured on synthetic Criteo data: a healthy run's smoothed loss stays within 1.1
# times it (the bumpiest, Adam at 0.1 on a small DLRM); DLRM with Adam at 0.1 (the default sizes) or 1.0 (a small
# one) reaches 700 to 3,000 times it at iteration 2, and ends predicting one value (AUC 0.50).
DIVERGENCE_FACTOR = 3.0
LOSS_SMOOTHING = 0.1
# Collapse: the predicted probabilities' standard deviation over an evaluation is below this (an untrained DLRM's
# measured about 1e-2, a trained one's 0.2; one diverged to a constant, 1e-8). For a next-item model, the spread of
# each sample's scores over the items, averaged (evaluation.evaluate): 0 when it scores every item alike.
COLLAPSE_STD = 1e-4
# A fall: once the data repeats (a pass over the training split after the first), the headline metric is more than
# this below the best of the evaluations before it (AUC or HR@10; 0.001 of AUC counts as a real difference on
# Criteo, so a drop twice that is more than rounding of the metric).
FALL_TOLERANCE = 0.002
# A hit rate (HR@K: a share of the evaluated samples) measured on n samples wobbles by its standard error,
# sqrt(p (1 - p) / n): a fall counts only beyond FALL_STANDARD_ERRORS of them as well (a validation split of 943
# users, MovieLens-100k's, has a standard error of about 0.013 at HR@10 0.2; the 0.005 dips seen there recovered).
FALL_STANDARD_ERRORS = 2.0

DIVERGED, COLLAPSED, OVERFITTING, NOT_ABOVE_BASELINES = "diverged", "collapsed", "overfitting", "not-above-baselines"
# the baselines a next-item model is ranked beside (ranking.BASELINES), as its metrics name them after the split's
# prefix, and as a warning names them
BASELINE_NAMES = {"popular_": "most-popular", "cooccurrence_": "co-occurrence"}
# an evaluation's metrics, by split: the validation split's (valid_auc, ...), the test split's (eval_auc, ...: their
# names before validation splits existed); evaluation.evaluated_splits evaluates them in this order
SPLIT_PREFIXES = {"valid": "valid_", "test": "eval_"}
TEST_PREFIX = SPLIT_PREFIXES["test"]


@dataclass(frozen=True)
class RunWarning:
    kind: str  # DIVERGED, COLLAPSED, OVERFITTING or NOT_ABOVE_BASELINES
    iteration: int  # iterations done when it was seen
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Best:
    """The best evaluation so far: after ``iteration`` iterations, its ``metrics``."""

    iteration: int
    metrics: dict


@dataclass
class LossWatch:
    """Divergence, from each iteration's training loss. ``state()`` is what a checkpoint keeps of it."""

    first_loss: float | None = None
    smoothed_loss: float | None = None
    warned: bool = False

    def loss(self, iteration: int, loss: float) -> list[RunWarning]:
        """Take the loss of the iteration ending at ``iteration`` iterations done; the warning it raises, if any."""
        if not math.isfinite(loss):
            return self._warn(iteration, f"the training loss of iteration {iteration} is {loss}: training diverged")
        if self.first_loss is None:
            self.first_loss = self.smoothed_loss = loss
            return []
        self.smoothed_loss += LOSS_SMOOTHING * (loss - self.smoothed_loss)
        if self.smoothed_loss > DIVERGENCE_FACTOR * self.first_loss:
            return self._warn(iteration, f"training is diverging at iteration {iteration}: the smoothed training loss "
                                         f"{self.smoothed_loss:.4g} is over {DIVERGENCE_FACTOR:g} times the first "
                                         f"iteration's ({self.first_loss:.4g}); the learning rate may be too high")
        return []

    def _warn(self, iteration: int, message: str) -> list[RunWarning]:
        if self.warned:
            return []
        self.warned = True
        return [RunWarning(DIVERGED, iteration, message)]

    def state(self) -> dict:
        """What a checkpoint keeps: ``LossWatch(**state)`` goes on from there."""
        return asdict(self)


@dataclass
class EvaluationWatch:
    """Collapsed predictions and falls, from each evaluation, and the best one by ``metric`` (higher is better:
    ``eval_auc``, ``eval_hr10``, or the validation split's ``valid_auc``, ``valid_hr10``: evaluation.watched_metric).
    ``batches_per_epoch``: iterations in a pass over the training split."""

    metric: str
    batches_per_epoch: int
    keep_best: bool = False  # the run keeps its best evaluated model (--keep-best): a fall costs it nothing
    best: Best | None = None
    values: dict[int, float] = field(default_factory=dict)  # each evaluation's metric, by iteration
    warned: set[str] = field(default_factory=set)

    def evaluation(self, iteration: int, metrics: dict) -> tuple[list[RunWarning], bool]:
        """Take the evaluation after ``iteration`` iterations; the warnings it raises, and whether it is the best so
        far (strictly better than every one before, and than the model kept: ``keep``)."""
        warnings = []
        spread = metrics.get(self.prefix + "pred_std")
        if spread is not None and math.isfinite(spread) and spread < COLLAPSE_STD:
            warnings += self._warn(COLLAPSED, iteration, (
                f"predictions collapsed at iteration {iteration}: their standard deviation over the evaluation is "
                f"{spread:.2g}, below {COLLAPSE_STD:g}, so the model predicts about one value for every sample"))
        value = metrics.get(self.metric, math.nan)
        if not math.isfinite(value):
            return warnings, False
        before = [(v, i) for i, v in self.values.items() if i < iteration]
        if before and iteration > self.batches_per_epoch:
            best_value, best_at = max(before, key=lambda vi: (vi[0], -vi[1]))
            if value < best_value - self.fall_tolerance(best_value, metrics):
                passes = (iteration - 1) // self.batches_per_epoch + 1
                warnings += self._warn(OVERFITTING, iteration, (
                    f"{self.metric} fell at iteration {iteration}, in pass {passes} over the training data: "
                    f"{value:.4f}, below its best so far ({best_value:.4f} at iteration {best_at}); the run may be "
                    + ("overfitting (model/ will hold the best evaluated model: --keep-best)" if self.keep_best
                       else "overfitting (--keep-best keeps the best evaluated model)")))
        self.values[iteration] = value
        improved = self.best is None or value > self.best.metrics[self.metric]
        if improved:
            self.best = Best(iteration, {name: v for name, v in metrics.items() if name.startswith(tuple(SPLIT_PREFIXES.values()))})
        return warnings, improved

    def fall_tolerance(self, best: float, metrics: dict) -> float:
        """How far below ``best`` the metric must fall to count: FALL_TOLERANCE, or for a hit rate measured on
        ``{prefix}rows`` samples, FALL_STANDARD_ERRORS of its standard error if that is more."""
        rows = metrics.get(self.prefix + "rows") or 0
        if "_hr" not in self.metric or rows <= 0:
            return FALL_TOLERANCE
        return max(FALL_TOLERANCE, FALL_STANDARD_ERRORS * math.sqrt(best * (1.0 - best) / rows))

    @property
    def prefix(self) -> str:
        """The prefix of the watched split's metrics: ``eval_`` (test) or ``valid_``."""
        return self.metric[:self.metric.index("_") + 1]

    def final(self, iteration: int, metrics: dict) -> list[RunWarning]:
        """The test metrics of the model a run delivers (its final state's, or with --keep-best the kept one's)
        against the baselines ranked beside them (a next-item model's most-popular and co-occurrence): a warning
        when the metric is not above one of them, for then the model has learnt nothing that counting does not."""
        measure = self.metric.removeprefix(self.prefix)
        value = metrics.get(TEST_PREFIX + measure, math.nan)
        baselines = [(name, metrics[key]) for baseline, name in BASELINE_NAMES.items()
                     if math.isfinite(metrics.get(key := TEST_PREFIX + baseline + measure, math.nan))]
        beaten_by = [(name, baseline) for name, baseline in baselines if not value > baseline]
        if not math.isfinite(value) or not beaten_by:
            return []
        return self._warn(NOT_ABOVE_BASELINES, iteration, (
            f"the final {TEST_PREFIX + measure} {value:.4f} is not above the " + " and the ".join(
                f"{name} baseline's {baseline:.4f}" for name, baseline in beaten_by)
            + ": the model has learnt nothing that counting items does not (train longer, or another learning "
              "rate; docs/models.md)"))

    def keep(self, best: Best) -> None:
        """The model kept so far (by an interrupted run, ``--keep-best``) was evaluated as ``best``."""
        value = best.metrics.get(self.metric, math.nan)
        if math.isfinite(value) and (self.best is None or value > self.best.metrics[self.metric]):
            self.best = best

    def replay(self, records: Iterable[dict]) -> None:
        """Take what a run logged before it was resumed or its oracle replaced (metrics.jsonl's ``eval`` records
        and warnings), saying nothing again."""
        for record in records:
            if record.get("event") == "eval":
                self.evaluation(record["iteration"], record)
            elif record.get("event") == "warning":
                self.warned.add(record["kind"])

    def summary(self) -> dict:
        """The best evaluation, as summary.json gives it."""
        if self.best is None:
            return {}
        return {"best_iteration": self.best.iteration, "best_metrics": self.best.metrics}

    def _warn(self, kind: str, iteration: int, message: str) -> list[RunWarning]:
        if kind in self.warned:
            return []
        self.warned.add(kind)
        return [RunWarning(kind, iteration, message)]
