"""The oracle: the job's components, whole once constructed, and what the oracle answers (runtime/endpoints.py's
``ORACLE``).

``Oracle`` holds the job's settings and data, its feed (oracle/feed.py: the plan, pulled by the trainers), its
checkpoints (runtime/oracle/checkpointing.py), its background evaluations, its losses and replacements
(oracle/failures.py) and its record (``succession.JobRecord``: what a replacement of this oracle and the launcher
read), in the RPC world and with its store. oracle/main.py builds one (a job's first oracle, or a lost one's
replacement) and runs it.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from bagpipe.config import TrainConfig
from bagpipe.data.binary import BinaryDataset
from bagpipe.train.evaluation import BackgroundEvaluations, evaluated_splits
from bagpipe.train.checkpoints import ChainRows
from bagpipe.model_dir import RowSource
from bagpipe.train.reference import build_model, evaluation_watch, model_row_keys, record_evaluation, write_model
from bagpipe.rundir import RunDir
from bagpipe.runtime.oracle.checkpointing import JobCheckpoints
from bagpipe.runtime.names import ORACLE_REPLACED, TRAINER_DONE
from bagpipe.runtime.liveness import Liveness
from bagpipe.runtime.oracle.failures import Replacements
from bagpipe.runtime.oracle.feed import Feed, Sent
from bagpipe.runtime.oracle.state import JobState
from bagpipe.runtime.protocol import JobInfo, Pulled, TrainerStats
from bagpipe.runtime.succession import Failure, RecordKeeper
from bagpipe.storage.rowstore import shard_keys
from bagpipe.runtime.world import Epochs, Routes, World

log = logging.getLogger(__name__)


class Oracle:
    """The job (``job``: as every role agreed on it) over ``dataset``, planned and fed from this process, which is
    in the RPC world (``epochs``) and holds the job's store and ``run`` dir. ``keeper`` writes the job's record. A
    lost oracle's replacement is given its own failure record (``takeover``), what the trainers have (``sent``) and
    the RPC world's re-formations before its own (``reformed_before``)."""

    def __init__(self, config: TrainConfig, world: World, dataset: BinaryDataset, job: JobInfo, *, store,
                 run: RunDir, liveness: Liveness, epochs: Epochs, keeper: RecordKeeper, takeover: Failure | None = None,
                 sent: Sent | None = None, reformed_before: list[dict] | None = None) -> None:
        self.config, self.world, self.dataset, self.job = config, world, dataset, job
        self.layout, self.iterations, self.start = job.layout, job.iterations, job.start
        self.store, self.run, self.liveness, self.epochs, self.keeper = store, run, liveness, epochs, keeper
        self.state = JobState(world)
        self.state.servers_ready.update(keeper.record.servers_ready)
        self.takeover = takeover  # this replacement's failure record, until it serves new plans
        self.reformed_before = list(reformed_before or [])  # the RPC world's re-formations before this oracle's
        self.routes = Routes(world)
        self._table_keys, self._keys_made = None, threading.Lock()  # raw ids: each table's row keys (row_keys)
        if takeover is not None:
            self.routes.load(store)
        # Evaluations (of checkpoints during training with --eval-every, of the final state) run in the background,
        # each judged (health.py: collapse, falls, the best kept with --keep-best) with what the run logged so far.
        self.evaluations = self.watch = None
        if config.model.card.built and dataset.test is not None and dataset.test.rows > 0:
            model = build_model(config, dataset.schema)
            evaluated = evaluated_splits(model, dataset, protocol=config.eval_protocol)
            self.watch = evaluation_watch(config, run, task=model.task, train=dataset.train, splits=evaluated)
            self.evaluations = BackgroundEvaluations(model, self.layout, evaluated, batch_size=config.eval_batch_size,
                                                     max_rows=config.max_eval_rows, on_result=self._evaluated)
        self.checkpoints = JobCheckpoints(config, world, num_spaces=len(self.layout.spaces),
                                          resumed_at=job.start if job.resume else None, routes=self.routes,
                                          on_evaluable=self._evaluable if self.evaluations is not None else None,
                                          keep_staged=takeover is not None, epochs=epochs)
        if sent is not None:
            sent.checkpoints = self.checkpoints.take_over(sent_through=max(sent.before))
        self.feed = Feed(config, dataset, job, checkpoints=self.checkpoints, state=self.state, sent=sent,
                         on_resumed=self._resumed if takeover is not None else None)
        self.replacements = Replacements(self)
        if takeover is not None and self.evaluations is not None:
            self.checkpoints.evaluate_missing(evaluated=run.evaluated_iterations())

    def save_record(self) -> None:
        """Write the job's record (``succession.JobRecord``) as it stands now, for a replacement of this oracle."""
        state = self.state
        with state.changed:
            self.keeper.save(servers_ready=sorted(state.servers_ready), replacing=sorted(self.replacements.replacing),
                             done=sorted(state.done), reformed=self.reformed())

    def reformed(self) -> list[dict]:
        """Every re-formation of the job's RPC world: (epoch, seconds) each."""
        return self.reformed_before + self.epochs.reformed

    def _evaluable(self, boundary: int, dense: dict, rows: ChainRows) -> None:
        self.evaluations.submit(boundary, dense, rows)

    def _evaluated(self, iteration: int, metrics: dict, dense: dict, source: RowSource) -> None:
        """(The evaluations' thread) The state after ``iteration`` iterations evaluated: logged, judged, kept in
        model/ if it is the best so far with --keep-best (the final state: by ``summary.finish``)."""
        record_evaluation(self.config, self.run, self.watch, iteration, metrics, final=iteration == self.iterations,
                          keep=lambda: write_model(self.run, self.config, iteration, metrics, dense=dense,
                                                   layout=self.layout, source=source,
                                                   row_keys=self.model_row_keys(iteration)))

    def _resumed(self, replay_s: float) -> None:
        """This replacement has planned again what its trainers had (in ``replay_s``): its next plans are new."""
        with self.state.changed:
            failure, self.takeover = self.takeover, None
            failure.replay_s = round(replay_s, 3)
            failure.resumed_in_s = failure.recovered_in_s = round(time.time() - failure.at, 3)
            self.save_record()
        self.run.log_metrics(event=ORACLE_REPLACED, rank=0, epoch=failure.epoch, joined_in_s=failure.joined_in_s,
                             resumed_in_s=failure.resumed_in_s, replayed_iterations=failure.replayed_iterations)
        log.warning("the lost oracle is replaced: plans served again %.2f s after it was lost (%d iterations planned "
                    "again in %.2f s)", failure.resumed_in_s, failure.replayed_iterations, failure.replay_s)

    # -- what the oracle answers (runtime/endpoints.py's ORACLE) --------------------------------------------------
    def server_ready(self, name: str) -> None:
        state = self.state
        with state.changed:  # recorded before anyone acts on it (a replacement of this oracle reads the record)
            state.servers_ready.add(name)
            self.save_record()
            state.changed.notify_all()

    def pull(self, trainer: int, after: int, max_steps: int, finished: int | None = None,
             written: int | None = None) -> Pulled:
        """``Feed.pull``."""
        return self.feed.pull(trainer, after, max_steps, finished, written)

    def checkpoint_cache(self, boundary: int, trainer: int, dense: dict | None, dense_optimizer: dict | None,
                         parts: list, extra: dict) -> None:
        self.checkpoints.receive_cache(boundary, trainer, dense, dense_optimizer, parts, extra)

    def ready_to_take_over(self, rank: int) -> None:
        """``Replacements.ready_to_take_over``."""
        self.replacements.ready_to_take_over(rank)

    def replaced(self, rank: int, info: dict) -> None:
        """``Replacements.replaced``."""
        self.replacements.replaced(rank, info)

    def row_keys(self, space: int, shard: int) -> list[np.ndarray]:
        """Raw ids: the keys of the rows data shard ``shard`` of ``space`` holds, per table (its rows are made from
        them: storage.rowstore.shard_keys), from this oracle's numbering of the run's batches."""
        with self._keys_made:
            if self._table_keys is None:
                if self.dataset.numbering is None:
                    raise ValueError("row keys asked of a job whose tables have a fixed size (not raw ids)")
                self._table_keys = self.dataset.numbering.model_table_keys(self.layout)
        return shard_keys(self.layout, self._table_keys, space, shard, self.world.num_shards)

    def model_row_keys(self, iteration: int) -> list[np.ndarray] | None:
        """Raw ids: what model/ keeps of the state after ``iteration`` iterations, each table's key of each row."""
        numbering = self.dataset.numbering
        return None if numbering is None else model_row_keys(numbering, self.layout, iteration)

    def trainer_done(self, trainer: int, stats: TrainerStats, dense_state: dict | None) -> None:
        state = self.state
        with state.changed:
            state.done[trainer] = (stats, dense_state)
            self.feed.trainer_done(trainer)  # the final flush's write-backs are acknowledged
            self.save_record()  # (a replacement of this oracle cannot take over once a trainer has left)
            # Recorded before the trainer has its answer (so before it can end): the launcher reads the record's
            # "done" as the trainer's part of the job done, whatever becomes of its process after. Recorded before
            # the main thread is woken too: an oracle lost past wait_for_trainers has every report in its record,
            # so the launcher restarts the job rather than start a replacement that cannot take it over. (The
            # event is for the run's readers, logged at the last iteration: a resumed run forgets it with the
            # iterations it trains again.)
            self.run.log_metrics(event=TRAINER_DONE, trainer=trainer, iteration=self.iterations)
            state.changed.notify_all()
