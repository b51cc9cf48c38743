"""A lost trainer's replacement: what the survivors do again, and what the replacement takes over.

When a trainer is lost, the others' sums over trainers fail. Each survivor waits for the RPC world to be
re-formed around the lost trainer's replacement, sends again the rows the lost trainer may not have written back,
agrees with the other survivors on the sums to do again (with three or more trainers one may have finished a sum
another has not), re-forms the trainers' group and starts those sums again in the order every trainer started
them, its shares computed again from the inputs it kept (runtime/redo.py). The lowest survivor (the donor) tells the
replacement which sums to add its shares to, then hands it its state at its next iteration boundary: the caches,
the updates waiting for their sums, and the dense model. Each trainer's process serves the donor's side
(trainer/handlers.py); ``LostTrainers.replace_lost`` is the replacement's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

import torch

from bagpipe.runtime.endpoints import ORACLE, TRAINER
from bagpipe.runtime.names import REPLACE_PREFIX, STOP_KEY, SUMS_PREFIX
from bagpipe.runtime.protocol import PULL_MAX_STEPS, StepMessage
from bagpipe.runtime.reduce import Mean
from bagpipe.runtime.redo import REDO_DEPTH, Kept, Recomputer, RedoLog, Shares, agree_on_sums, sum_order
from bagpipe.runtime.world import World, trainer_group
from bagpipe.threads import live_threads

if TYPE_CHECKING:
    from bagpipe.runtime.trainer.runtime import TrainerRuntime

log = logging.getLogger(__name__)


@dataclasses.dataclass
class DenseState:
    """The dense part of a trainer's state at an iteration boundary: the model's and its optimizer's state dicts,
    the losses since the last log (a replacement for trainer 0 logs with them) and the run's divergence watch
    (``health.LossWatch.state()``)."""

    model: dict
    optimizer: dict
    losses: list[float]
    loss_watch: dict


@dataclasses.dataclass
class CacheState:
    """One embedding space's cache at an iteration boundary: its slots (``RowCache.state_dict()``: which row each
    holds, the rows, their optimizer state) and the updates waiting for their sums ((iteration, slots, grads)
    each)."""

    slots: dict
    pending: list[tuple]


@dataclasses.dataclass
class HandedOver:
    """What a survivor hands a lost trainer's replacement at its boundary before ``iteration``: the inputs of the
    iterations before (``kept``, for a replacement of its own), each space's cache, the rows evicted that other
    trainers write back (until every trainer's write-backs up to ``written_by_all`` are acknowledged) and the
    dense state."""

    iteration: int
    kept: list[Kept]
    caches: list[CacheState]
    others_evicted: list[tuple]
    written_by_all: int
    dense: DenseState


@dataclasses.dataclass
class ModelHooks:
    """What recovery needs of the model a trainer trains (trainer/loop.py's DenseModel gives them): its last
    iterations' inputs (``redo``), its shares of an iteration computed again (``recompute(kept, message)``) and
    the dense state a replacement takes at a boundary (``state(iteration)``)."""

    redo: RedoLog
    recompute: Callable
    state: Callable[[int], DenseState]


class Recovery:
    """What the lowest surviving trainer gives a lost trainer's replacement: the sums to add its shares to (in the
    order started) and the inputs of their iterations, then its state at its next iteration boundary."""

    def __init__(self, *, trainer: int, epoch: int, sums: list[tuple], kept: dict) -> None:
        self.trainer, self.epoch, self.sums, self.kept = trainer, epoch, sums, kept
        self.state: HandedOver | None = None
        self.handed = threading.Event()


def read_sums(store, key: str, trainers: list[int], *, timeout: float) -> dict[int, dict]:
    """What each of ``trainers`` (survivors of a lost trainer) said under ``key``: its sums not finished and the
    iteration it is in (``agree_on_sums``), once all have said it."""
    deadline = time.monotonic() + timeout
    while not all(store.check([f"{key}{t}"]) for t in trainers):
        if time.monotonic() > deadline:
            missing = [t for t in trainers if not store.check([f"{key}{t}"])]
            raise TimeoutError(f"trainers {missing} did not say which gradient sums they have not finished within "
                               f"{timeout:.0f} s")
        time.sleep(0.02)
    return {t: json.loads(store.get(f"{key}{t}")) for t in trainers}


def shares_part(shares: Shares, what: tuple) -> torch.Tensor:
    """The operand of sum ``what`` (kind, iteration, space) among an iteration's ``shares``."""
    kind, _, space = what
    return shares.early if kind == "early" else shares.main if kind == "main" else shares.later[space]


class LostTrainers:
    """One trainer's side of replacing lost trainers, for its ``runtime``: as a survivor (``recover``, and as the
    donor ``hand_over``) and as a replacement (``replace_lost``). ``model``: the hooks into the model trained (None
    where the job's model is the user's, as in ``init_cache``: a lost trainer then ends the job)."""

    def __init__(self, runtime: TrainerRuntime, model: ModelHooks | None, *, replaceable: bool) -> None:
        self.runtime, self.model = runtime, model
        self.replaceable = replaceable and model is not None
        self.recovery: Recovery | None = None  # what a lost trainer's replacement is given (by the lowest survivor)
        self.group_epoch = runtime.world.epoch  # the RPC world in which the trainers' group now summing was formed

    def recover(self, err: BaseException) -> bool:
        """A sum over trainers failed (``err``): if the job replaces a lost trainer, wait for the RPC world to be
        re-formed around its replacement, send again the rows the lost trainer may not have written back, agree
        with the other survivors on the sums to do again (``agree_on_sums``), tell the replacement which sums to
        add its shares to (``recovery``, if this survivor is the donor), re-form the trainers' group and start those
        sums again in the order every trainer started them, with this trainer's shares computed again (a failed
        reduction may have left its buffer part-summed; one this trainer finished already is done again for the
        others, its result dropped; those of an iteration it has not reached yet it starts when it gets there).
        False if the job cannot go on so."""
        if not self.replaceable:
            return False
        runtime = self.runtime
        world, store, grads, epochs = runtime.world, runtime.store, runtime.grads, runtime.epochs
        started = time.perf_counter()
        log.warning("trainer %d: a gradient sum failed (%s): waiting for a lost trainer's replacement", runtime.index,
                    str(err).splitlines()[0])
        # The group failed is the one formed in ``group_epoch``; the world may have been re-formed around a lost
        # trainer's replacement already (over a link that was down, the loss reaches the sum after the oracle
        # judged it), so the replacement is looked for in any later epoch, not only one still to come.
        deadline = time.monotonic() + 2 * world.timeout  # the loss's detection, then the replacement's start
        while epochs.epoch <= self.group_epoch:
            if time.monotonic() > deadline or store.check([STOP_KEY]) or runtime.stopping.is_set():
                return False
            time.sleep(0.05)
        replaced = {t: int(store.get(f"{REPLACE_PREFIX}{world.trainer_rank(t)}")) for t in range(world.num_trainers)
                    if t != runtime.index and store.check([f"{REPLACE_PREFIX}{world.trainer_rank(t)}"])}
        replaced = {t: epoch for t, epoch in replaced.items() if self.group_epoch < epoch <= epochs.epoch}
        if not replaced:  # the world was re-formed for a server: the sum failed for a reason of its own
            return False
        epoch = max(replaced.values())  # the replacement's: the group the trainers form again meets under it
        lost = [t for t, at in replaced.items() if at == epoch]
        runtime.resend_others_evicted()  # (a repeat is a no-op where it arrived)
        step = runtime.step
        own = {mean.what: mean for mean in grads.sums}
        mine = list(own)
        natural = set()  # the rows not used at once are summed after the main sum, which starts them
        if ("main", step.iteration, None) in own:
            natural = {("later", step.iteration, space) for space, part in enumerate(step.spaces)
                       if part.num_now < len(part.batch_slots)}
            mine += sorted(natural, key=sum_order)
        key = f"{SUMS_PREFIX}{epoch}/"
        store.set(f"{key}{runtime.index}", json.dumps({"sums": mine, "reached": step.iteration}))
        todo, donor = agree_on_sums(read_sums(store, key, [t for t in range(world.num_trainers) if t not in lost],
                                              timeout=world.timeout))
        redo = self.model.redo
        held = redo.iterations()
        if any(what[1] < min(held) for what in todo):
            log.error("trainer %d: the sums to do again reach back to iteration %d, before the inputs it keeps "
                      "(%s)", runtime.index, min(what[1] for what in todo), held)
            return False
        here = [what for what in todo if what[1] in held and what not in natural]
        iterations = sorted({what[1] for what in here})
        if donor == runtime.index:
            self.recovery = Recovery(trainer=lost[0], epoch=epoch, sums=todo,
                                     kept={iteration: redo.kept(iteration).to("cpu")
                                           for iteration in sorted({what[1] for what in todo})})
        grads.regroup(trainer_group(world, store, runtime.index, epoch=epoch))
        self.group_epoch = epoch
        shares = {iteration: self.model.recompute(redo.kept(iteration), self.message(iteration))
                  for iteration in iterations}
        finished_here = []
        for what in here:
            operand = shares_part(shares[what[1]], what)
            if what in own:
                own[what].buffer.view(-1).copy_(operand.view(-1))
                own[what].restart(grads.group)
            else:  # finished here already: its share goes in again for the others, its result is dropped
                finished_here.append(Mean(grads.group, operand.clone(), timeout=world.timeout, what=what))
        for mean in finished_here:
            mean.wait()
        runtime.stats.extra.setdefault("recoveries", []).append(
            {"trainer": lost[0], "epoch": epoch, "sums_again": len(todo), "at_iteration": step.iteration,
             "seconds": round(time.perf_counter() - started, 3), "threads": live_threads()})
        log.warning("trainer %d: the trainers' group is re-formed with trainer %d's replacement (epoch %d); %d sums "
                    "done again", runtime.index, lost[0], epoch, len(todo))
        return True

    def message(self, iteration: int) -> StepMessage:
        """This trainer's plan message of a recent ``iteration``."""
        for message in self.runtime.recent:
            if message.iteration == iteration:
                return message
        raise KeyError(f"trainer {self.runtime.index} no longer has its plan message of iteration {iteration}")

    def hand_over(self) -> None:
        """At an iteration boundary (its write-backs sent): if a lost trainer's replacement awaits this trainer's
        state, complete every sum in flight (the replacement took part in them) and give it the caches, the updates
        waiting to be applied and the model's dense state."""
        recovery, runtime = self.recovery, self.runtime
        if recovery is None or recovery.state is not None or self.model is None:
            return
        runtime.grads.complete_pending()
        # The replacement keeps the rows this trainer writes back only from the next boundary on: those sent so far
        # are acknowledged first, so that this trainer too can be lost from then on.
        boundary = runtime.step.iteration
        runtime.await_written(boundary - 1)
        redo = self.model.redo
        kept = [redo.kept(i).to("cpu")  # copies (the log reuses its own), in host memory (they go by RPC)
                for i in redo.iterations() if i >= boundary - REDO_DEPTH + 1]
        recovery.state = HandedOver(
            iteration=boundary, kept=kept,
            caches=[CacheState(slots=cache.state_dict(),
                               pending=[(iteration, slots.copy(), grads.clone())
                                        for iteration, slots, grads, _ in pending])
                    for cache, pending in zip(runtime.caches, runtime.grads.pending)],
            others_evicted=list(runtime.others_evicted), written_by_all=runtime.written_by_all,
            dense=self.model.state(boundary))
        recovery.handed.set()
        log.info("trainer %d: its state at iteration %d is ready for trainer %d's replacement", runtime.index,
                 boundary, recovery.trainer)

    def replace_lost(self, make_model, layout) -> HandedOver:
        """This process replaces a lost trainer: add its shares to the sums that failed with it (computed again from
        what the lowest survivor kept), then take that survivor's state at its next boundary; returns the state
        (its dense part is the caller's to load)."""
        runtime = self.runtime
        world, store, epochs = runtime.world, runtime.store, runtime.epochs
        started = time.perf_counter()
        survivors = [t for t in range(world.num_trainers) if t != runtime.index]
        _, donor = agree_on_sums(read_sums(store, f"{SUMS_PREFIX}{world.epoch}/", survivors,
                                           timeout=2 * world.timeout))
        donor = World.trainer_name(donor)
        plan = epochs.call(donor, TRAINER.recovery, (runtime.index,), timeout=2 * world.timeout)
        runtime.grads.regroup(trainer_group(world, store, runtime.index, epoch=world.epoch))
        iterations = sorted(plan.kept)
        messages = self._pull_messages(iterations[0] - 1 if iterations else None)
        recompute = Recomputer(make_model, layout, seed=runtime.job.config.seed, part=runtime.index)
        shares = {iteration: recompute(plan.kept[iteration], messages[iteration]) for iteration in iterations}
        means = [Mean(runtime.grads.group, shares_part(shares[what[1]], what).clone(), timeout=world.timeout,
                      what=what) for what in plan.sums]
        for mean in means:
            mean.wait()
        state = epochs.call(donor, TRAINER.handed_over, (runtime.index,), timeout=2 * world.timeout)
        n = state.iteration
        messages.update(self._pull_messages(n - REDO_DEPTH, upto=n))
        # the survivor's inputs of the iterations before: this process can give them to a replacement of its own
        for kept in state.kept:
            self.model.redo.adopt(kept)
        runtime.take_over(state, first=messages[n], recent=[messages[kept.iteration] for kept in state.kept])
        seconds = time.perf_counter() - started
        runtime.stats.extra["replaced_at_iteration"] = n
        epochs.call("oracle", ORACLE.replaced, (world.rank, {"sums_again": len(plan.sums), "caught_up_in_s": seconds,
                                                             "at_iteration": n}))
        log.warning("trainer %d's replacement: %d sums done again, state of iteration %d taken over in %.2f s",
                    runtime.index, len(plan.sums), n, seconds)
        return state

    def _pull_messages(self, after: int | None, *, upto: int | None = None) -> dict[int, StepMessage]:
        """This trainer's plan messages after iteration ``after`` (the oracle keeps a lost trainer's), up to ``upto``
        at least if given."""
        if after is None:
            return {}
        runtime = self.runtime
        found: dict[int, StepMessage] = {}
        deadline = time.monotonic() + runtime.world.timeout
        while True:
            pulled = runtime.epochs.call("oracle", ORACLE.pull, (runtime.index, after, PULL_MAX_STEPS))
            for message in pulled.messages:
                found[message.iteration] = message
            if upto is None or upto in found or any(m.final for m in pulled.messages):
                return found
            if pulled.messages:
                after = pulled.messages[-1].iteration
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer {runtime.index}'s replacement: no plan message of iteration {upto}")
