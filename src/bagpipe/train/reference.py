"""The reference trainer: one process, every table in memory. The correctness oracle.

Every distributed mode must end with the parameters this trainer reaches on the same global
batches, so it is kept plain: one loss, one backward, one row-wise embedding update, one dense
optimizer step per iteration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn

from bagpipe import models
from bagpipe.train.checkpoints import (CheckpointSchedule, CheckpointWriter, TrainState, capture, discard_after,
                                       load_checkpoint, resumable_checkpoint, restore)
from bagpipe.config import TrainConfig, config_to_dict
from bagpipe.data.batches import (Batch, batch_rows, batches_per_epoch, fresh_negatives, iterate_batches,
                                  planned_iterations)
from bagpipe.data.binary import BinarySplit
from bagpipe.data.schema import Schema
from bagpipe.device import resolve_device
from bagpipe.embeddings import EmbeddingLayout, EmbeddingTables, Lookup
from bagpipe.embeddings.dynamic import RowNumbering, keyed_blocks, remade, remade_weights
from bagpipe.train.evaluation import EvaluatedSplit, evaluate_splits, evaluated_splits, no_evaluation, watched_metric
from bagpipe.health import Best, EvaluationWatch, LossWatch, RunWarning
from bagpipe.model_dir import MODEL_DIR, RowSource, TableRows, evaluation_of, write_model_dir
from bagpipe.models.layers import set_dropout_step
from bagpipe.faults import inject_fault
from bagpipe.metrics import CounterWindow, share
from bagpipe.optim import make_row_optimizer
from bagpipe.nn import CLEANUP_FRACTION, CachedTables, Lookahead
from bagpipe.opcount import StepCount
from bagpipe.preflight import (cache_rows_of, check_job, check_same_batches, check_same_data, prepare_data,
                               prepare_job)
from bagpipe.progress import progress
from bagpipe.rundir import RunDir, sweep_working_files
from bagpipe.runlock import lock_run_dir
from bagpipe.storage import StorageSpec
from bagpipe.planner.plan import index_policy, plans_ahead
from bagpipe.storage.tiers import storage_path
from bagpipe.timing import PhaseClock, peak_rss_bytes

log = logging.getLogger(__name__)


@dataclass
class Timer:
    """Steady-state throughput: samples and seconds after the warm-up iterations."""

    warmup: int
    samples: int = 0
    seconds: float = 0.0
    # the steady state's span in wall-clock time (time.time()): the first timed iteration's start and the last's
    # end, so that what a job did meanwhile (e.g. the bytes on its link) can be read over the same span
    window: tuple[float, float] | None = None

    def record(self, iteration: int, samples: int, seconds: float) -> None:
        if iteration >= self.warmup:
            self.samples += samples
            self.seconds += seconds
            now = time.time()
            self.window = (now - seconds if self.window is None else self.window[0], now)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


def deterministic() -> None:
    """Deterministic kernels, without filling every fresh allocation with NaN (deterministic
    mode's default, about 1% of an iteration here): correct code never reads uninitialised memory.
    On a GPU, cuBLAS is deterministic only with a fixed workspace, set before its first use (a value
    given in the environment is kept)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False


def build_model(config: TrainConfig, schema: Schema) -> nn.Module:
    """The configured model's dense part, from the run's seed (its training loss compiled with ``compile``)."""
    model = models.build_model(config.model, schema, seed=config.seed)
    if config.compile:
        model.compile_training()
    return model


def model_row_keys(numbering, layout: EmbeddingLayout, iteration: int) -> list[np.ndarray]:
    """Each model table's key of each row for the state after ``iteration`` iterations (rows made later: -1)."""
    stored = numbering.stored_row_keys(as_of=iteration)
    return [stored[table.features[0]] for table in layout.tables]


def build_run_tables(config: TrainConfig, schema: Schema, *, device: torch.device | str = "cpu",
                     numbering=None) -> EmbeddingTables | CachedTables:
    """The tables a run trains: in memory on ``device`` (--mode reference), or behind a cache on ``device``
    (--mode single), the host tables in memory or, with --storage disk, in files in --storage-dir (default
    RUN_DIR/storage). Raw-id data's tables (``numbering``: the rows the run makes) start from each row's keyed
    initial value (embeddings.dynamic)."""
    layout = EmbeddingLayout(models.model_tables(config.model, schema), schema)
    weights = None if numbering is None else keyed_weights(config, layout, numbering)
    if not config.run_mode.cached:
        return build_tables(config, schema, device=device, weights=weights)
    options = {"cache_rows": cache_rows_of(config, layout), "cleanup_fraction": single_cleanup_fraction(config),
               "policy": index_policy(config.policy), "device": device}
    storage = StorageSpec.of(config.storage, storage_path(config.storage_dir, config.run_dir),
                             config.storage_budget_mb * 2**20)
    if storage.files:
        return CachedTables.on_disk(layout, make_row_optimizer(config.optimizer, lr=config.lr), seed=config.seed,
                                    storage=storage, row_keys=numbering and numbering.model_table_keys(layout),
                                    **options)
    return CachedTables.over(build_tables(config, schema, weights=weights), **options)


def keyed_weights(config: TrainConfig, layout: EmbeddingLayout, numbering) -> list[torch.Tensor]:
    """Each space of ``layout``'s initial rows for raw-id data: table by table, each row's value a function of
    (seed, table, key) (the table's default row first)."""
    keys = numbering.model_table_keys(layout)
    return [torch.cat([block for index in space.tables
                       for block in keyed_blocks(keys[index], table_index=index, table=layout.tables[index],
                                                 seed=config.seed)]) for space in layout.spaces]


def remake_rows(tables: EmbeddingTables | CachedTables, numbering, iteration: int, *, seed: int) -> None:
    """Raw ids with retirement (embeddings.dynamic.RetiringNumbering): the rows whose numbers are reused at
    ``iteration`` made again from their new keys, as a row made then would be, their optimizer state zero."""
    for space, (flat, keys, owners) in enumerate(remade(numbering, tables.layout, iteration)):
        if len(flat):
            tables.remake_rows(space, flat, remade_weights(tables.layout, owners, keys, seed=seed))


def single_cleanup_fraction(config: TrainConfig) -> float:
    return max(config.cleanup_fraction, CLEANUP_FRACTION)  # --mode single frees 5% at least


def build_tables(config: TrainConfig, schema: Schema, *, weights: list[torch.Tensor] | None = None,
                 device: torch.device | str = "cpu") -> EmbeddingTables:
    """The configured model's tables in memory on ``device``: initial rows from the run's seed, or ``weights``
    per space."""
    layout = EmbeddingLayout(models.model_tables(config.model, schema), schema)
    return EmbeddingTables(layout=layout, optimizer=make_row_optimizer(config.optimizer, lr=config.lr),
                           seed=config.seed, weights=weights, device=device)


BEST = ("best_auc", "best_logloss", "best_hr10", "best_ndcg10")  # the planted model's, from synthetic data


def best_metrics(meta: dict) -> dict:
    """The best achievable metrics a synthetic data set's meta.json states, if any."""
    return {name: meta[name] for name in BEST if meta.get(name) is not None}


def train_step(model: nn.Module, tables: EmbeddingTables, dense_optimizer: torch.optim.Optimizer,
               batch: Batch, clock: PhaseClock | None = None, *, slices: int = 1, seed: int = 0,
               iteration: int = 0) -> float:
    """One iteration on a global batch; returns its loss.

    ``slices`` > 1 computes the gradient the way that many trainers of ``--mode bagpipe`` do:
    each slice of the batch has its own forward and backward (mean loss over the slice), and the
    slices' gradients are added in trainer order, then divided by their number. Floating-point
    sums depend on their order, so this, not the one-pass gradient, is what a distributed run
    equals bit for bit. (``seed`` and ``iteration`` key the model's dropout, slice by slice.)
    """
    return step_loss(model, tables, dense_optimizer, batch, clock, slices=slices, seed=seed,
                     iteration=iteration).item()


def step_loss(model: nn.Module, tables: EmbeddingTables, dense_optimizer: torch.optim.Optimizer, batch: Batch,
              clock: PhaseClock | None = None, *, slices: int = 1, seed: int = 0, iteration: int = 0) -> torch.Tensor:
    """``train_step``, its loss left where it was computed (a scalar tensor on the model's device): a loop that
    reads it later (``PendingLosses``) does not make the host wait for the device every iteration."""
    clock = clock or _NO_CLOCK
    if slices > 1:
        return _sliced_step(model, tables, dense_optimizer, batch, clock, slices, seed=seed, iteration=iteration)
    set_dropout_step(model, seed=seed, iteration=iteration, part=0)
    loss, lookup = _forward_backward(model, tables, dense_optimizer, batch, clock)
    dense_optimizer.step()
    tables.apply_gradients(lookup)
    clock.lap("optimizer")
    return loss.detach()


class PendingLosses:
    """Iterations' losses not yet read on the host: kept as they were computed (scalars on the model's device)
    and read all at once (``settle``: one wait for the device where reading each was one every iteration), at
    each log, checkpoint and evaluation and at the end. What is judged of them (divergence, a non-finite loss)
    is judged then, in iteration order, so a run that diverges stops at most a log interval later, before any
    checkpoint or evaluation of the diverged state."""

    def __init__(self) -> None:
        self.iterations: list[int] = []
        self.losses: list[torch.Tensor] = []

    def add(self, iteration: int, loss: torch.Tensor) -> None:
        self.iterations.append(iteration)
        self.losses.append(loss)

    def settle(self) -> list[tuple[int, float]]:
        """Each pending iteration (counting from 0) with its loss read, in order; none pending after."""
        if not self.losses:
            return []
        values = torch.stack(self.losses).tolist()
        settled = list(zip(self.iterations, values))
        self.iterations, self.losses = [], []
        return settled

    def judge(self, watch: LossWatch, config: TrainConfig, losses: list[float],
              warn: Callable[[RunWarning], None]) -> float | None:
        """``settle``, each loss then judged in order as every mode's loop judges it: its divergence warning
        (``warn``), a non-finite loss stopping the run (``check_loss``), and appended to ``losses`` (the log
        window's); the last one read, None if none was pending."""
        last = None
        for done, last in self.settle():
            for warning in watch.loss(done + 1, last):
                warn(warning)
            check_loss(last, done, config)
            losses.append(last)
        return last


def _sliced_step(model: nn.Module, tables: EmbeddingTables, dense_optimizer: torch.optim.Optimizer, batch: Batch,
                 clock: PhaseClock | _NoClock, slices: int, *, seed: int, iteration: int) -> float:
    params = list(model.parameters())
    keys = tables.distinct_keys(batch.ids)  # every slice's leaf holds all the batch's rows, as a trainer's does
    sums: list[torch.Tensor] | None = None
    for index, part in enumerate(batch.slices(slices)):
        set_dropout_step(model, seed=seed, iteration=iteration, part=index)  # as trainer ``index`` draws it
        loss, lookups = _forward_backward(model, tables, dense_optimizer, part, clock, keys=keys)
        with torch.no_grad():
            grads = [*(_row_grads(lookup) for lookup in lookups), *(p.grad for p in params), loss.detach()]
            sums = [g.clone() for g in grads] if sums is None else [s.add_(g) for s, g in zip(sums, grads)]
        clock.lap("sync")
    with torch.no_grad():
        for total in sums:
            total.div_(slices)  # the mean over trainers, as the trainers divide their all-reduced sum
    spaces = len(lookups)
    for p, grad in zip(params, sums[spaces:-1]):
        p.grad = grad
    dense_optimizer.step()
    tables.apply_gradients(lookups, sums[:spaces])
    clock.lap("optimizer")
    return sums[-1]


def _row_grads(lookup: Lookup) -> torch.Tensor:
    """A slice's gradient of every row of the leaf (zeros where the slice did not reach it)."""
    return lookup.rows.grad if lookup.rows.grad is not None else torch.zeros_like(lookup.rows)


def _forward_backward(model: nn.Module, tables: EmbeddingTables, dense_optimizer: torch.optim.Optimizer, batch: Batch,
                      clock: PhaseClock | _NoClock, **lookup_options) -> tuple[torch.Tensor, list[Lookup]]:
    """The loss of ``batch`` (its mean), with every gradient of it in place: dense ``.grad`` and the leaf's."""
    embeddings, lookup = tables.lookup(batch.ids, **lookup_options)
    clock.lap("lookup")
    loss = model.training_loss(batch.dense_x, embeddings, batch.target)
    clock.lap("forward")
    dense_optimizer.zero_grad(set_to_none=True)
    loss.backward()
    clock.lap("backward")
    return loss, lookup


class _NoClock:
    def lap(self, phase: str) -> None:
        pass


_NO_CLOCK = _NoClock()


def train_reference(config: TrainConfig, *, show_progress: bool = True, overwrite: bool = False,
                    resume: bool = False) -> dict:
    """Train in this process; write and return the run's summary (``overwrite``: replace a run in the run
    dir; ``resume``: continue the run in it from its newest valid checkpoint)."""
    # The run dir is this process's until it returns (a second run into it is refused at once); what the run
    # keeps only while it runs (--mode single on disk: the tables' files) goes however it ends.
    with lock_run_dir(config.run_dir), contextlib.ExitStack() as cleanup:
        return _train(config, cleanup, show_progress=show_progress, overwrite=overwrite, resume=resume)


def _train(config: TrainConfig, cleanup: contextlib.ExitStack, *, show_progress: bool, overwrite: bool,
           resume: bool) -> dict:
    started = time.perf_counter()
    # The data, checked against the job, and the run dir: a new one claimed, or a resumed run's own.
    checkpoint = None
    if resume:
        dataset = prepare_data(config, show_progress=show_progress)
        check_same_data(config.run_dir, dataset)
        iterations = planned_iterations(config, dataset.train)
        check_same_batches(config, dataset)
        checkpoint = resumable_checkpoint(config.run_dir, iterations=iterations, every=config.checkpoint_every,
                                          every_s=config.checkpoint_every_s)
        for warning in check_job(config, dataset, show_progress=show_progress):
            log.warning("%s", warning)
        run = RunDir(config.run_dir, append=True)
    else:
        dataset = prepare_job(config, overwrite=overwrite, show_progress=show_progress)
        iterations = planned_iterations(config, dataset.train)
        run = RunDir(config.run_dir)
    cleanup.callback(run.close)  # (a run that fails still lets its metrics log go)
    storage = storage_path(config.storage_dir, config.run_dir)
    if swept := sweep_working_files(run.path, storage):
        log.info("removed what an interrupted run left: %s", ", ".join(str(path) for path in swept))
    cleanup.callback(sweep_working_files, run.path, storage)
    run.write_json("config.json", config_to_dict(config))
    deterministic()

    # The model, its tables and optimizers: initialised from the seed, or restored from a checkpoint.
    # --mode single keeps the same tables in host memory or on disk behind a cache (bagpipe.nn).
    device = resolve_device(config.device)
    model = build_model(config, dataset.schema).to(device)
    tables = build_run_tables(config, dataset.schema, device=device, numbering=dataset.numbering)
    # raw ids: each table's key of each row, written with the model (a model of raw ids is looked up by key)
    row_keys = (None if dataset.numbering is None else
                functools.partial(model_row_keys, dataset.numbering, tables.layout))
    if isinstance(tables, CachedTables):
        cleanup.callback(tables.close)  # (tables on disk: their files are this run's working copies)
    cleanup_fraction = single_cleanup_fraction(config)
    dense_optimizer = tables.optimizer.dense_optimizer(model.parameters())
    progress_state = (_resume(config, run, model, dense_optimizer, tables, checkpoint,
                              before=numbered_before(config, dataset, checkpoint[1][-1]["extra"], iterations))
                      if resume else _Progress())
    start = progress_state.iteration
    # Its health (health.py), as far as an interrupted run had judged it, and its best evaluation.
    loss_watch = LossWatch(**progress_state.loss_watch)
    evaluated = evaluated_splits(model, dataset, protocol=config.eval_protocol)
    watch = evaluation_watch(config, run, task=model.task, train=dataset.train, splits=evaluated)
    writer = None
    if config.checkpoints:
        tables.track_changes()
        writer = CheckpointWriter(config.run_dir, keep=config.keep_checkpoints)
        cleanup.callback(writer.close)
    schedule = CheckpointSchedule(every=config.checkpoint_every, every_s=config.checkpoint_every_s)
    log.info("%s training: %s, %d iterations of %d samples, %d tables (%d rows)%s%s%s", config.mode,
             config.model.name, iterations, config.batch_size, len(tables.layout.tables), tables.layout.num_rows,
             f", on {device}" if device.type != "cpu" else "",
             f", a cache of {sum(cache_rows_of(config, tables.layout))} rows ({config.policy})"
             if config.run_mode.cached else "", f", resumed at iteration {start}" if start else "")

    # The iterations, each logged; a checkpoint written in the background at each one due.
    timer = Timer(warmup=min(config.warmup_iterations, max(iterations - start - 1, 0)))
    clock = PhaseClock(warmup=timer.warmup)
    # the operations of the last warm-up iteration (steady by then; counting slows it, and the timed ones are not)
    # from its batch's fetch on: a plan step's work too
    step_ops = StepCount(at=start + max(timer.warmup - 1, 0), device=device, ops=not config.compile)
    cleanup.callback(step_ops.close)
    setup_s = time.perf_counter() - started
    bar = progress(total=iterations, initial=start, desc="train", unit="it", enabled=show_progress,
                   samples_per_unit=config.batch_size)
    cache_figures = _cache_window(tables) if config.run_mode.cached else None
    loss = float("nan")
    recent_losses = progress_state.recent_losses
    train_started = time.perf_counter()
    tick = window_start = train_started
    first_iteration_s = float("nan")
    testable = bool(evaluated)
    eval_s = 0.0
    batches = iterate_batches(dataset.train, batch_size=config.batch_size, iterations=iterations,
                              shuffle=config.shuffle, shuffle_seed=config.shuffle_seed, start=start,
                              negatives=fresh_negatives(config, dataset.train))
    if dataset.numbering is not None:  # (raw ids: a key not admitted yet looks its table's default row up)
        batches = dataset.numbering.as_made(batches, start=start)
    retiring = dataset.numbering is not None and dataset.numbering.retires
    if config.run_mode.cached and plans_ahead(config.policy):
        batches = Lookahead(batches, tables, ids=lambda batch: batch.ids, lookahead=config.lookahead,
                            cleanup_fraction=cleanup_fraction)
    pending = PendingLosses()  # the losses are read at each log, checkpoint and evaluation, not every iteration

    def settle() -> None:
        nonlocal loss
        last = pending.judge(loss_watch, config, recent_losses, run.warn)
        loss = loss if last is None else last

    clock.restart()
    step_ops.begin(start)
    for iteration, batch in enumerate(batches, start=start):
        clock.lap("data")
        if retiring:  # (raw ids, rows retired: the numbers reused now are made again for their new keys)
            remake_rows(tables, dataset.numbering, iteration, seed=config.seed)
        pending.add(iteration, step_loss(model, tables, dense_optimizer, batch.to(device), clock,
                                         slices=config.slices, seed=config.seed, iteration=iteration))
        step_ops.end(iteration)
        clock.end_iteration()
        inject_fault(f"iteration {iteration}")
        now = time.perf_counter()
        if iteration == start:
            first_iteration_s = now - started
        timer.record(iteration - start, len(batch), now - tick)
        tick = now
        if iteration == start or (iteration + 1) % config.log_every == 0 or iteration + 1 == iterations:
            settle()  # (the first at once: a loss that is not finite from the start stops the run there)
        if (iteration + 1) % config.log_every == 0 or iteration + 1 == iterations:
            mean_loss = float(np.mean(recent_losses))
            run.log_metrics(iteration=iteration + 1, samples=(iteration + 1) * config.batch_size,
                            train_loss=mean_loss, elapsed_s=now - train_started,
                            samples_per_s=timer.samples_per_s,
                            window_samples_per_s=len(recent_losses) * config.batch_size / (now - window_start),
                            time_ms=clock.window(),
                            **(cache_figures(len(recent_losses)) if cache_figures else {}))
            bar.set_postfix(loss=f"{mean_loss:.4f}")
            recent_losses.clear()
            window_start = now
        if writer is not None and iteration + 1 < iterations and schedule.due(iteration + 1):
            settle()  # (a checkpoint keeps the window's losses, and never a diverged state)
            writer.wait()  # one write at a time; its outcome decides whether this one is a full base
            full = writer.wants_full()
            writer.save(capture(iteration + 1, model, dense_optimizer, tables, full=full,
                                extra={"recent_losses": list(recent_losses), "loss_watch": loss_watch.state(),
                                       "torch_threads": torch.get_num_threads(),
                                       **raw_ids_extra(dataset.numbering, iterations)}), full=full)
        if config.eval_every and testable and iteration + 1 < iterations and (iteration + 1) % config.eval_every == 0:
            settle()
            eval_s += _evaluate_at(iteration + 1, model, tables, evaluated, run, config, watch, row_keys=row_keys)[1]
            tick = time.perf_counter()  # the evaluation is not an iteration's time
        bar.update(1)
        step_ops.begin(iteration + 1)
    settle()  # (a run cut short by its data: what is left)
    bar.close()
    if writer is not None:
        writer.wait()
    train_s = time.perf_counter() - train_started - eval_s

    metrics = no_evaluation(model)
    if testable:
        metrics, seconds = _evaluate_at(iterations, model, tables, evaluated, run, config, watch, final=True,
                                        row_keys=row_keys)
        eval_s += seconds
    else:
        log.warning("%s has no test split: skipping evaluation", dataset.directory)

    if keeps_final(config, watch, iterations):
        write_model(run, config, iterations, metrics, dense=model.state_dict(), layout=tables.layout,
                    row_keys=row_keys and row_keys(iterations),
                    source=TableRows(tables))
    summary = {
        "mode": config.mode,
        "model": config.model.name,
        "iterations": iterations,
        "samples": iterations * config.batch_size,
        "samples_per_s": timer.samples_per_s,
        "final_train_loss": loss if iterations > start else run.last_train_loss(),
        **metrics,
        **best_metrics(dataset.meta),
        **({"raw_ids": dataset.numbering.summary(dataset.test)} if dataset.numbering is not None else {}),
        **health_summary(config, run, watch),
        "setup_s": setup_s,
        "startup_s": first_iteration_s,
        "time_breakdown_ms": clock.steady_ms(),
        **step_ops.summary(),
        "peak_rss_bytes": {config.mode: peak_rss_bytes()},
        "train_s": train_s,
        "eval_s": eval_s,
        "wall_s": time.perf_counter() - started,
        "warmup_iterations": timer.warmup,
        "timed_window": timer.window,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        **({"resumed_at": start} if resume else {}),
        **(_cache_summary(tables, iterations - start, policy=config.policy) if config.run_mode.cached else {}),
    }
    run.finish(summary)
    return summary


def _cache_window(tables: CachedTables) -> Callable[[int], dict]:
    """--mode single's cache figures over each metrics window (of so many iterations), as --mode bagpipe logs
    them."""
    window = CounterWindow(lambda: {name: tables.cache_stats()[name] for name in ("rows_looked_up", "rows_fetched")})

    def take(iterations: int) -> dict:
        grown = window.take()
        hits = share(grown["rows_looked_up"] - grown["rows_fetched"], grown["rows_looked_up"])
        return {"cache_hit_rate": hits, "rows_fetched_per_iteration": grown["rows_fetched"] / max(iterations, 1)}
    return take


def _cache_summary(tables: CachedTables, iterations: int, *, policy: str) -> dict:
    """--mode single's cache figures, named as --mode bagpipe's summary names them."""
    stats = tables.cache_stats()
    return {"cache_rows": sum(stats["cache_rows"]), "total_rows": tables.layout.num_rows,
            "cache_hit_rate": stats["hit_rate"], "policy": policy,
            "rows_fetched_per_iteration": stats["rows_fetched"] / max(iterations, 1),
            "rows_moved_per_iteration": (stats["rows_fetched"] + stats["rows_written_back"]) / max(iterations, 1),
            "cache": stats, "storage": tables.storage_stats()}


def _evaluate_at(iteration: int, model: nn.Module, tables: EmbeddingTables, splits: list[EvaluatedSplit],
                 run: RunDir, config: TrainConfig, watch: EvaluationWatch, *, final: bool = False,
                 row_keys: Callable[[int], list[np.ndarray]] | None = None) -> tuple[dict, float]:
    """Evaluate the state after ``iteration`` iterations, logged as a metrics point, judged by ``watch`` and, with
    --keep-best, kept in model/ if it is the best so far (the ``final`` state: by the caller); its metrics and
    seconds."""
    started = time.perf_counter()
    metrics = evaluate_splits(model, tables.layout, TableRows(tables), splits, batch_size=config.eval_batch_size,
                              max_rows=config.max_eval_rows, iteration=iteration)
    record_evaluation(config, run, watch, iteration, metrics, final=final, keep=lambda: write_model(
        run, config, iteration, metrics, dense=model.state_dict(), layout=tables.layout, source=TableRows(tables),
        row_keys=row_keys and row_keys(iteration)))
    return metrics, time.perf_counter() - started


def evaluation_watch(config: TrainConfig, run: RunDir, *, task: str, train: BinarySplit,
                     splits: list[EvaluatedSplit]) -> EvaluationWatch:
    """What judges a run's evaluations (health.py; of ``splits``: by the validation split's metric if they include
    it), with what the run logged so far (a resumed run, a lost oracle's replacement) and, with --keep-best, the
    model it kept in model/."""
    watch = EvaluationWatch(metric=watched_metric(task, splits), keep_best=config.keep_best,
                            batches_per_epoch=batches_per_epoch(train, config.batch_size))
    if config.keep_best and task == "next-item" and splits and splits[0].name != "valid":
        log.warning("--keep-best chooses among the evaluations by the test split's %s: %s has no validation split "
                    "(converted by an older bagpipe; convert it again for one), so the kept model's test figures "
                    "flatter it", watch.metric, train.directory.parent)
    watch.replay(run.records())
    if config.keep_best and (kept := evaluation_of(run.path / MODEL_DIR)) is not None:
        watch.keep(Best(*kept))
    return watch


def record_evaluation(config: TrainConfig, run: RunDir, watch: EvaluationWatch, iteration: int, metrics: dict, *,
                      final: bool, keep: Callable[[], None]) -> None:
    """An evaluation after ``iteration`` iterations judged by ``watch`` (every mode's): with --keep-best, a new best
    but the final state written to model/ (``keep``) first, then its warnings and its metrics point logged; an
    interrupted run's model/ never holds a better model than the log says (a resumed run reads both)."""
    warnings, best = watch.evaluation(iteration, metrics)
    if final:  # judged: the model the run delivers
        warnings += watch.final(iteration, watch.best.metrics if config.keep_best and watch.best else metrics)
    if best and config.keep_best and not final:
        keep()
    for warning in warnings:
        run.warn(warning)
    run.log_metrics(event="eval", iteration=iteration, samples=iteration * config.batch_size, **metrics)


def keeps_final(config: TrainConfig, watch: EvaluationWatch, iterations: int) -> bool:
    """Whether the final state goes to model/: unless --keep-best kept a better one evaluated before."""
    if not config.keep_best or watch.best is None or watch.best.iteration == iterations:
        return True
    log.info("--keep-best: model/ holds the model of iteration %d, the best evaluated (%s %.4f), not the last",
             watch.best.iteration, watch.metric, watch.best.metrics[watch.metric])
    return False


def write_model(run: RunDir, config: TrainConfig, iteration: int, metrics: dict, *, dense: dict, layout: EmbeddingLayout,
                source: RowSource, row_keys: list[np.ndarray] | None = None) -> None:
    """The state after ``iteration`` iterations written to the run's model/, with its evaluation (and, for raw
    ids, each table's key of each row)."""
    write_model_dir(run.path / MODEL_DIR, dense=dense, layout=layout, source=source, row_keys=row_keys,
                    info={"iteration": iteration, "mode": config.mode, "model": config.model.name, "metrics": metrics})


def health_summary(config: TrainConfig, run: RunDir, watch: EvaluationWatch | None) -> dict:
    """summary.json's warnings (every process's, as the run recorded them) and best evaluation (``watch``: None
    for a run not evaluated)."""
    return {"warnings": run.warnings(), "keep_best": config.keep_best, **(watch.summary() if watch else {})}


@dataclass
class _Progress:
    """Where training stands: iterations done, and the losses of the metrics window in progress."""

    iteration: int = 0
    recent_losses: list[float] = field(default_factory=list)
    loss_watch: dict = field(default_factory=dict)  # health.LossWatch's state


def _resume(config: TrainConfig, run: RunDir, model: nn.Module, dense_optimizer: torch.optim.Optimizer,
            tables: EmbeddingTables, checkpoint: tuple, *, before: EmbeddingLayout | None = None) -> _Progress:
    """Restore ``checkpoint`` (the run's newest valid one: its directory and chain), and forget what the run
    logged or checkpointed after it: those iterations are computed again. ``before``: raw ids numbered for another
    number of iterations (``numbered_before``): the checkpoint's tables regrown into this run's."""
    state = load_checkpoint(*checkpoint, num_rows=[space.num_rows for space in (before or tables.layout).spaces])
    if before is not None:
        state = regrown(state, before, tables)
    restore(state, model, dense_optimizer, tables)
    threads = state.extra.get("torch_threads")
    if threads and threads != torch.get_num_threads():
        log.warning("the run computed with %d torch threads, this process has %d: some sums depend on it, so the "
                    "result may differ in the last bits from an uninterrupted run (--threads %d)", threads,
                    torch.get_num_threads(), threads)
    discard_after(config.run_dir, state.iteration)
    run.forget_metrics_after(state.iteration)
    log.info("resuming %s from its checkpoint at iteration %d", config.run_dir, state.iteration)
    return _Progress(iteration=state.iteration, recent_losses=list(state.extra.get("recent_losses", [])),
                     loss_watch=dict(state.extra.get("loss_watch", {})))


def raw_ids_extra(numbering, iterations: int) -> dict:
    """What a checkpoint of raw-id tables records of its numbering: the iterations it planned and each table's rows
    (so that a resume planning another number of iterations regrows its tables: ``numbered_before``)."""
    return {} if numbering is None else {"raw_ids": {"iterations": iterations, "table_rows": numbering.table_rows}}


def numbered_before(config: TrainConfig, dataset, extra: dict, iterations: int) -> EmbeddingLayout | None:
    """The layout a raw-id checkpoint's rows were numbered under, if its run planned another number of iterations
    than this one (``iterations``; None: the same, or fixed tables). The rows a run makes are numbered in the
    order of its batches, and batch i is the same whatever the run's length, so either numbering's rows are the
    other's first ones: checked, row by row, against the numbering made again for the checkpoint's length."""
    numbering, saved = dataset.numbering, extra.get("raw_ids")
    if numbering is None or saved is None or saved["iterations"] == iterations:
        return None
    raw = dataclasses.replace(dataset.train, ids=dataset.train.ids.raw)
    selectors = batch_rows(raw, batch_size=config.batch_size, iterations=saved["iterations"], shuffle=config.shuffle,
                           shuffle_seed=config.shuffle_seed)
    old = RowNumbering.of_run(raw, selectors, min_count=config.row_min_count, retire_after=config.row_retire_after,
                              budget=config.row_budget)
    same = old.table_rows == saved["table_rows"] and all(
        np.array_equal(old.row_keys(f)[:rows], numbering.row_keys(f)[:rows])
        for f, rows in enumerate(map(min, old.table_rows, numbering.table_rows)))
    if not same:
        raise ValueError(f"--resume: the checkpoint's tables in {config.run_dir} are not the first rows of this run's "
                         f"(numbered for {saved['iterations']} iterations, now {iterations}): its data or batches "
                         f"changed")
    log.info("raw ids: the checkpoint's tables (numbered for %d iterations) regrown to this run's %d",
             saved["iterations"], iterations)
    features = dataset.schema.features  # (its table sizes then; the same data otherwise)
    schema = dataclasses.replace(dataset.schema, features=tuple(
        dataclasses.replace(feature, cardinality=rows) for feature, rows in zip(features, old.table_rows)))
    return EmbeddingLayout(models.model_tables(config.model, schema), schema)


def regrown(state: TrainState, before: EmbeddingLayout, tables) -> TrainState:
    """``state``'s rows (of the tables ``before`` lays out) where ``tables``' layout has them: each table's first
    rows, as many as both have; the rest as ``tables`` hold them now (made from their keys, optimizer state zero)."""
    parts = []
    for part in state.parts:
        rows, row_state = tables.read_rows(part.space)
        rows, row_state = rows.copy(), np.zeros_like(row_state)
        for index in before.spaces[part.space].tables:
            _, old = before.place(index)
            _, new = tables.layout.place(index)
            count = min(before.tables[index].num_rows, tables.layout.tables[index].num_rows)
            rows[new:new + count] = part.rows[old:old + count]
            row_state[new:new + count] = part.state[old:old + count]
        parts.append(dataclasses.replace(part, rows=rows, state=row_state))
    return dataclasses.replace(state, parts=parts)


def check_loss(loss: float, iteration: int, config: TrainConfig) -> None:
    """Stop at the first non-finite loss (``iteration`` counts from 0): nothing after it is worth keeping."""
    if not math.isfinite(loss):
        raise RuntimeError(f"the training loss of iteration {iteration + 1} is {loss}: training diverged "
                           f"(--optimizer {config.optimizer} --lr {config.lr}); try a lower --lr")
