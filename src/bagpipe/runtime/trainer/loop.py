"""The training loop of ``--mode bagpipe``, for any model: the reference step, on the rows of the trainer's cache,
with the gradients summed over trainers."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from bagpipe.train.checkpoints import cloned_state, load_dense, resume_chain
from bagpipe.config import TrainConfig
from bagpipe.device import HostStaging
from bagpipe.faults import inject_fault
from bagpipe.health import LossWatch
from bagpipe.metrics import CounterWindow, share
from bagpipe.opcount import StepCount
from bagpipe.optim import make_row_optimizer
from bagpipe.train.reference import PendingLosses, Timer, build_model, deterministic
from bagpipe.rundir import RunDir
from bagpipe.runtime.names import RESUMED
from bagpipe.runtime.protocol import TrainerStats
from bagpipe.runtime.redo import Recomputer, RedoLog, backward_slice, dense_share
from bagpipe.runtime.trainer.grad_sync import EarlyBucket
from bagpipe.runtime.trainer.recovery import DenseState, ModelHooks
from bagpipe.runtime.trainer.runtime import TrainerRuntime
from bagpipe.timing import PhaseClock, cpu_seconds, peak_rss_bytes


class DenseModel:
    """The dense model a trainer trains (this trainer's ``part`` of the global batch) and its optimizer, with what
    a lost trainer's recovery needs of them (``hooks``): the last iterations' inputs, the shares computed again,
    and the state a replacement takes. ``losses``: those since the last log (a replacement for trainer 0 logs
    with them). ``loss_watch``: the run's divergence, judged on every trainer (the loss is the global batch's), so
    that a replacement for trainer 0, which says what it finds, goes on from a survivor's."""

    def __init__(self, config: TrainConfig, layout, *, part: int, device: torch.device | str = "cpu") -> None:
        deterministic()
        self.config, self.layout, self.part, self.device = config, layout, part, torch.device(device)
        self.model = self.make()
        self.optimizer = make_row_optimizer(config.optimizer, lr=config.lr).dense_optimizer(self.model.parameters())
        self.redo = RedoLog(list(self.model.parameters()))
        self.losses: list[float] = []
        self.loss_watch = LossWatch()
        # the iterations' losses not read yet (on a GPU, reading each at once is a wait every iteration): read and
        # judged by ``settle`` (the loop's) at each log, checkpoint and hand-over
        self.pending = PendingLosses()
        self.settle: Callable[[], None] = lambda: None
        # each step's inputs (dense features, targets) to the device through reused pinned buffers (on a GPU)
        self.staging = HostStaging(self.device, slots=4)

    def make(self) -> torch.nn.Module:
        """A fresh copy of the model, from the run's seed, on the trainer's device."""
        return build_model(self.config, self.layout.schema).to(self.device)

    def hooks(self) -> ModelHooks:
        return ModelHooks(redo=self.redo, recompute=Recomputer(self.make, self.layout, seed=self.config.seed,
                                                               part=self.part), state=self.state)

    def state(self, boundary: int) -> DenseState:
        """What a lost trainer's replacement takes at ``boundary``: the model, its optimizer, the losses logged
        with the next log."""
        self.settle()
        since_log = boundary % self.config.log_every
        return DenseState(model=cloned_state(self.model.state_dict()),
                          optimizer=cloned_state(self.optimizer.state_dict()),
                          losses=self.losses[len(self.losses) - since_log:] if since_log else [],
                          loss_watch=self.loss_watch.state())

    def load(self, model: dict, optimizer: dict) -> None:
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)


def train_loop(runtime: TrainerRuntime, dense: DenseModel) -> None:
    """Train ``dense`` from ``runtime``'s caches to the end of the job (a replacement's from the state it takes
    over, a resumed job's from its checkpoint)."""
    job, config = runtime.job, dense.config
    model, dense_optimizer = dense.model, dense.optimizer
    start = job.start
    if runtime.replacing:  # a lost trainer's replacement: a survivor's state
        handed = runtime.lost.replace_lost(dense.make, runtime.layout)
        dense.load(handed.dense.model, handed.dense.optimizer)
        start, dense.losses = handed.iteration, list(handed.dense.losses)
        dense.loss_watch = LossWatch(**handed.dense.loss_watch)
    elif job.resume:  # the dense state of the checkpoint; the rows come from the servers through the plan
        directory, chain = resume_chain(config.run_dir, job.resume)
        saved = load_dense(directory, chain[-1])
        dense.load(saved["dense"], saved["dense_optimizer"])
        dense.losses = list(chain[-1]["extra"].get("recent_losses", []))
        dense.loss_watch = LossWatch(**chain[-1]["extra"].get("loss_watch", {}))
    losses = dense.losses
    params = list(model.parameters())
    # The parameters the model names as complete first in the backward (DLRM: the top MLP): their
    # all-reduce starts then and runs while the rest of the backward computes (as DDP's buckets do).
    early = EarlyBucket(runtime.grads, model.early_params(), lambda: runtime.step.iteration)
    late_params = [p for p in params if all(p is not q for q in early.params)]
    leader = runtime.index == 0
    alone = runtime.alone  # one trainer: its sums are its own gradients, left on its device
    run = RunDir(config.run_dir, append=True) if leader else None
    timer = Timer(warmup=min(config.warmup_iterations, max(job.iterations - start - 1, 0)))
    clock = PhaseClock(warmup=timer.warmup)
    # the last warm-up iteration's operations (and, on a GPU, waits for it), from its plan step on
    step_ops = StepCount(at=max(timer.warmup - 1, 0), device=dense.device, ops=not config.compile)
    stats = runtime.stats
    loss = float("nan")
    tick = window_start = time.perf_counter()
    started = tick
    cache_figures = cache_window(stats)

    def settle() -> None:
        """The pending losses read (one wait for the device), each judged in order (divergence said by trainer 0)."""
        nonlocal loss
        last = dense.pending.judge(dense.loss_watch, config, losses, run.warn if leader else lambda warning: None)
        loss = loss if last is None else last

    dense.settle = settle
    clock.restart()
    trained = 0  # iterations this loop has trained
    while True:
        step_ops.begin(trained)
        waits = (stats.plan_wait_s, stats.fetch_wait_s, stats.lazy_sync_wait_s)
        message = runtime.advance()
        clock.lap("cache")
        for kind, before in zip(("plan_wait", "fetch_wait", "lazy_sync_wait"), waits):
            clock.carve("cache", kind, getattr(stats, f"{kind}_s") - before)
        if message is None:
            step_ops.close()
            break
        if message.checkpoint and leader:
            settle()  # (the checkpoint keeps the log window's losses, and never a diverged state)
            runtime.send_checkpoint(message.iteration, dense=cloned_state(model.state_dict()),
                                    dense_optimizer=cloned_state(dense_optimizer.state_dict()),
                                    extra={"recent_losses": list(losses), "loss_watch": dense.loss_watch.state()})
            inject_fault(f"checkpoint sent {message.iteration}")
        elif message.checkpoint and runtime.shared is not None:  # partitioned: every trainer's rows are its own
            runtime.send_checkpoint(message.iteration, dense=None, dense_optimizer=None, extra={})
        embeddings, lookups = runtime.lookup()
        clock.lap("lookup")
        early.reset()
        local_loss = backward_slice(model, message, embeddings, seed=config.seed, part=runtime.index, lap=clock.lap,
                                    staging=dense.staging)
        if job.replace_trainers:  # before the step: a lost trainer's replacement may need this slice again (in a
            dense.redo.keep(message.iteration, lookups)  # job that replaces none, a lone or partitioned trainer's)
        inject_fault(f"backward {message.iteration}")
        if alone:  # nothing to sum: every gradient stays where the backward left it
            runtime.grads.apply_alone(message, lookups)
            clock.lap("sync")
            dense_optimizer.step()
            dense.pending.add(message.iteration, local_loss)
        else:
            flat = dense_share(late_params, local_loss)
            sync_before = stats.sync_s
            flat = runtime.sync(lookups, flat)
            early_flat = early.finish()
            clock.lap("sync")
            clock.carve("sync", "sync_wait", stats.sync_s - sync_before)
            for group, values in ((late_params, flat), (early.params, early_flat)):
                set_grads(group, values)
            dense_optimizer.step()
            dense.pending.add(message.iteration, flat[-1].clone())  # (the summed loss, in host memory already)
        clock.lap("optimizer")
        iteration = message.iteration
        step_ops.end(trained)
        trained += 1
        if iteration == start or (iteration + 1) % config.log_every == 0 or iteration + 1 == job.iterations:
            settle()  # (the first at once: a loss that is not finite from the start stops the run there)
        inject_fault(f"iteration {iteration}")
        now = time.perf_counter()
        if iteration == start:
            stats.extra["first_iteration_at"] = time.time()
            if leader and start:  # a resumed job trains again: when, the launcher reports (its restarts)
                run.log_metrics(event=RESUMED, iteration=iteration + 1)
        timer.record(iteration - start, config.batch_size, now - tick)
        tick = now
        if leader and ((iteration + 1) % config.log_every == 0 or iteration + 1 == job.iterations):
            run.log_metrics(iteration=iteration + 1, samples=(iteration + 1) * config.batch_size,
                            train_loss=float(np.mean(losses)), elapsed_s=now - started,
                            samples_per_s=timer.samples_per_s,
                            window_samples_per_s=len(losses) * config.batch_size / (now - window_start),
                            stall_fraction=stats.stall_s / max(now - runtime.started, 1e-9),
                            time_ms=clock.window(), **cache_figures())
            losses.clear()
            window_start = now
        clock.lap("other")
        clock.end_iteration()
    settle()  # (what is left of a run that ended between logs)
    stats.extra["time_breakdown_ms"] = clock.steady_ms()
    stats.extra.update(step_ops.summary())
    stats.extra["peak_rss_bytes"] = peak_rss_bytes()
    stats.extra["cpu_s"] = cpu_seconds()
    # fetched rows' copies to the device (zeros on the CPU): pinned allocations (reused buffers: a few in all)
    stats.extra["copies_to_device"] = {key: sum(cache.copy_stats()[key] for cache in runtime.caches)
                                       for key in ("pinned_allocations", "pinned_bytes", "bytes_to_device")}
    runtime.stats.samples_per_s = timer.samples_per_s
    stats.extra["timed_window"] = timer.window
    runtime.stats.extra["final_train_loss"] = loss
    if run is not None:
        run.close()
    runtime.close(dense_state=cloned_state(model.state_dict()) if leader else None)  # (host copies: sent by RPC)


def set_grads(params: list[torch.nn.Parameter], values: torch.Tensor) -> None:
    """The summed gradients (``values``: flat, in host memory, the parameters' in order, perhaps more after them)
    as ``params``' ``.grad``: one copy to their device and a view each, where a copy each was a kernel each."""
    if not params:
        return
    sizes = [p.numel() for p in params]
    values = values.to(params[0].device)
    for p, part in zip(params, values.split([*sizes, len(values) - sum(sizes)])):
        p.grad = part.view_as(p)


def cache_window(stats: TrainerStats) -> Callable[[], dict]:
    """The cache figures of each metrics window: its hit rate, rows fetched and (this trainer's share of, as
    evicted rows are written back by one trainer each) rows written back per iteration."""
    fields = ("iterations", "rows_fetched", "rows_written_back", "batch_rows", "batch_hits")
    window = CounterWindow(lambda: {name: getattr(stats, name) for name in fields})

    def take() -> dict:
        grown = window.take()
        iterations = max(grown["iterations"], 1)
        return {"cache_hit_rate": share(grown["batch_hits"], grown["batch_rows"]),
                "rows_fetched_per_iteration": grown["rows_fetched"] / iterations,
                "rows_written_back_per_iteration": grown["rows_written_back"] / iterations}
    return take
