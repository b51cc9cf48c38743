"""One-command local job: start the oracle, the servers and the trainers; supervise them.

Each role is a ``bagpipe oracle|server|trainer`` process writing its log to RUN_DIR/logs. The
launcher shows one progress bar (from the metrics trainer 0 appends), and when any role exits
with an error it stops every other role by pid (SIGTERM, then SIGKILL) and reports the failing
role, its rank and its error. Whom to blame is decided from exit codes and the status each role
writes as it exits (runtime/exit_status.py: its cause, the peer whose loss ended it, when), never
from log text; whom to replace, and which exits the job goes on without, from what the oracle writes to the
job's store, which the launcher serves (``_JobState``: the job's record, the replacements it awaits, whether
training has ended), never from metrics.jsonl, which only feeds the progress bar and a restart's timings.
Roles (and their replacements) are forked from a fork server that imported torch and bagpipe once for the job
(runtime/forkserver.py), so a role starts in milliseconds, not seconds. Children die with the launcher
(PR_SET_PDEATHSIG, through the fork server), so no role outlives the job.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bagpipe.train.checkpoints import after_a_full_disk, resumable_checkpoint, valid_checkpoints
from bagpipe.config import TrainConfig, dump_toml
from bagpipe.data.batches import planned_iterations
from bagpipe.preflight import check_job, check_same_batches, check_same_data, prepare_data, prepare_job
from bagpipe.progress import progress
from bagpipe.rundir import SUMMARY, WARNING, forget_metrics_after, sweep_working_files, write_json_atomic
from bagpipe.runlock import lock_run_dir
from bagpipe.runtime.exit_status import STATUS_FILE_ENV, ExitStatus, Terminated, read_exit
from bagpipe.runtime.forkserver import ForkedProcess, ForkServer
from bagpipe.runtime.names import EXITED_PREFIX, REPLACE_PREFIX, RESUMED, STOP_KEY
from bagpipe.runtime.liveness import LOST_EXIT_CODE
from bagpipe.runtime.succession import (MAX_ORACLE_REPLACEMENTS, NOT_REPLACEABLE_EXIT_CODE, JobRecord, OracleWatch,
                                        declare_oracle_lost, load_record)
from bagpipe.runtime.world import LOOPBACK, STORE_SERVED, JobStore, World, free_port
from bagpipe.storage.tiers import storage_path

log = logging.getLogger(__name__)

GRACE_S = 5.0


class JobFailed(RuntimeError):
    """A role failed: the job ended. ``restartable``: the cause was a process lost (killed, or hung), not an
    error of its own; ``no_space``: a role met a full disk (freeing space and resuming goes on); ``iteration``: the
    last iteration the job logged before; ``seen_at``: when the launcher saw it (wall time)."""

    def __init__(self, message: str, *, restartable: bool = False, no_space: bool = False,
                 iteration: int = 0) -> None:
        super().__init__(message)
        self.restartable, self.no_space, self.iteration = restartable, no_space, iteration
        self.seen_at = time.time()


@dataclass
class Child:
    role: str
    index: int
    rank: int
    process: ForkedProcess
    log_path: Path
    ended_at: float | None = None  # when the launcher saw the process end (wall time)

    @property
    def label(self) -> str:
        return f"{self.role} {self.index} (rank {self.rank})"

    @property
    def status_path(self) -> Path:
        """Where the role writes its exit status (runtime/exit_status.py)."""
        return status_path(self.log_path)

    def status(self) -> ExitStatus | None:
        return read_exit(self.status_path)


def status_path(log_path: Path) -> Path:
    return log_path.with_name(log_path.stem + ".status.json")


def launch_local(config: TrainConfig, *, show_progress: bool = True, threads: int = 1, overwrite: bool = False,
                 resume: bool = False, extra_trainer_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> dict:
    """Run a whole bagpipe job on this machine; return its summary.json.

    Everything is checked and the data converted before any role starts (so a refused job leaves
    an earlier run in the run dir as it was); ``resume``: continue the run in the run dir from its
    newest valid checkpoint (the roles' logs are appended to); ``env`` adds variables for the roles (tests).
    A job that loses a process parity does not cover (killed, or hung; not one that failed by its own error,
    which would fail again the same way) is started again from its newest checkpoint, at most
    ``config.max_restarts`` times; summary.json's "restarts" says what failed, when, and how long the job
    took to train again and to get back to where it was.
    """
    # The run dir is the job's from here until its last process has ended (the roles inherit the lock).
    with lock_run_dir(config.run_dir) as lock:
        child_env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **(env or {}))
        forks = ForkServer(env=child_env)  # (it imports torch and bagpipe while the data is prepared)
        run_dir = Path(config.run_dir)
        storage = storage_path(config.storage_dir, config.run_dir)
        restarts: list[dict] = []
        prepared = False
        try:
            iterations = _prepare(config, overwrite=overwrite, resume=resume, show_progress=show_progress)
            prepared = True
            if swept := sweep_working_files(run_dir, storage):
                log.info("removed what an interrupted run left: %s", ", ".join(str(path) for path in swept))
            (run_dir / "logs").mkdir(exist_ok=resume)
            job_file = run_dir / "job.toml"
            job_file.write_text(dump_toml(config))
            while True:
                child_env["BAGPIPE_ATTEMPT"] = str(len(restarts))  # faults meant for this attempt (faults.py)
                try:
                    _run_once(config, job_file, total=iterations, resume=resume, env=child_env, forks=forks,
                              show_progress=show_progress, trainer_args=list(extra_trainer_args or []),
                              restart=restarts[-1] if restarts else None, lock_fd=lock.fd)
                    break
                except JobFailed as failed:
                    restart = _restart(config, failed, done=len(restarts))
                    restarts.append(restart)
                    resume = True
        finally:  # every role has ended: what they kept only while running goes (a failure, Ctrl-C, SIGTERM too)
            forks.close()
            if prepared:
                sweep_working_files(run_dir, storage)
        summary = json.loads((run_dir / SUMMARY).read_text())
        if restarts:
            summary["restarts"] = restarts
            write_json_atomic(run_dir / SUMMARY, summary)
    return summary


def _prepare(config: TrainConfig, *, overwrite: bool, resume: bool, show_progress: bool) -> int:
    """Everything checked before any role starts, so that a job that cannot run is refused in one line (and an
    earlier run in the run dir stays as it was): the data (converted if its sources changed), the job against it,
    and a resumed run's checkpoint against its iterations. The iterations to train."""
    if not resume:
        dataset = prepare_job(config, overwrite=overwrite, show_progress=show_progress)
        iterations = planned_iterations(config, dataset.train)
        log.info("bagpipe job: %s, %d iterations of %d samples, %d trainers, %d servers (each role's log in %s)",
                 config.model.name, iterations, config.batch_size, config.trainers, config.servers,
                 Path(config.run_dir) / "logs")
        return iterations
    dataset = prepare_data(config, show_progress=show_progress)
    check_same_data(config.run_dir, dataset)
    check_same_batches(config, dataset)
    iterations = planned_iterations(config, dataset.train)
    directory, chain = resumable_checkpoint(config.run_dir, iterations=iterations, every=config.checkpoint_every,
                                            every_s=config.checkpoint_every_s)
    log.info("resuming %s at iteration %d (checkpoint %s) of %d", config.run_dir, chain[-1]["iteration"],
             directory.name, iterations)
    for warning in check_job(config, dataset, show_progress=show_progress):
        log.warning("%s", warning)
    return iterations


def _run_once(config: TrainConfig, job_file: Path, *, total: int, resume: bool, env: dict[str, str],
              forks: ForkServer, show_progress: bool, trainer_args: list[str], restart: dict | None, lock_fd: int = -1) -> None:
    """Start every role of the job (``resume``: from the newest checkpoint) and supervise them to the end;
    JobFailed if one fails. ``forks``: what starts them; ``restart``: the record of the restart this run is, completed as it trains;
    ``lock_fd``: the run dir's lock, which every role holds too."""
    run_dir = Path(config.run_dir)
    read_from, boundary = 0, None  # where in metrics.jsonl this run's records start; the iteration it starts at
    if resume and (boundary := _newest_boundary(run_dir)) is not None:
        # What was logged past the checkpoint is forgotten (the oracle does the same, finding the same lines),
        # and what is kept is an earlier run's: the launcher reads only what this one logs.
        forget_metrics_after(run_dir, boundary)
        read_from = (run_dir / "metrics.jsonl").stat().st_size
    port = config.master_port or free_port()
    world_size = 1 + config.servers + config.trainers
    world = ["--world-size", str(world_size), "--world-size-trainers", str(config.trainers),
             "--master-ip", LOOPBACK, "--master-port", str(port), "--timeout", repr(config.timeout),
             "--liveness-s", repr(config.liveness_s)]  # (the RPC transports: every role takes the job's)
    job_world = World(rank=0, world_size=world_size, num_trainers=config.trainers, master_port=port,
                      timeout=config.timeout, liveness=config.liveness_s, parity=config.parity)
    # The launcher serves the job's store, so that it outlives the oracle: a lost oracle's replacement meets the
    # others there (runtime/succession.py).
    job_store = JobStore(job_world)
    env = {**env, STORE_SERVED: "1"}
    roles = [("oracle", 0, ["--config", str(job_file), "--prepared", *(["--resume"] if resume else [])])]
    roles += [("trainer", t, trainer_args) for t in range(config.trainers)]
    roles += [("server", s, []) for s in range(config.servers)]
    children: list[Child] = []

    def start(rank: int, *, append: bool, note: str | None) -> Child:
        role, index, args = roles[rank]
        log_path = run_dir / "logs" / f"{role}{index}.log"
        with open(log_path, "a" if append else "w") as out:
            if note is not None:
                out.write(f"=== {note} ===\n")
                out.flush()
            command = [role, "--worker-id", str(rank), *world, *args]  # as `bagpipe ...` takes it
            status = status_path(log_path)
            status.unlink(missing_ok=True)  # (a lost process's, which its replacement's would be taken for)
            process = forks.start(command, stdout=out.fileno(), env={**env, STATUS_FILE_ENV: str(status)},
                                  pass_fds=(lock_fd,) if lock_fd >= 0 else (), name=f"bagpipe-{role}{index}")
        return Child(role, index, rank, process, log_path)

    def replace(lost: Child) -> Child:
        """The same command started again for a lost process, which joins the job as its replacement."""
        child = start(lost.rank, append=True, note=f"a replacement for the lost process ({_describe(lost.process.returncode)})")
        children[children.index(lost)] = child
        write_pids()
        return child

    def write_pids() -> None:
        (run_dir / "pids.json").write_text(json.dumps({f"{c.role}{c.index}": c.process.pid for c in children}))

    try:
        note = (None if restart is None else f"restart {restart['attempt']}: the job starts again from its "
                                             f"checkpoint at iteration {restart['resumed_from']}")
        for rank in range(len(roles)):
            children.append(start(rank, append=resume, note=note))
        write_pids()
        # the ranks whose loss the job may go on through: servers with parity, trainers when they are replaced
        covered = {job_world.server_rank(s) for s in range(job_world.num_servers)} if config.parity else set()
        if config.replace_trainers and config.trainers >= 2:
            covered |= {job_world.trainer_rank(t) for t in range(config.trainers)}
        metrics = _MetricsTail(run_dir / "metrics.jsonl", offset=read_from, iteration=boundary or 0)
        state = _JobState(job_store.store)
        succession = _Succession(job_world, job_store, replace=replace, enabled=config.replace_oracle)
        _supervise(children, metrics, state, total=total, show_progress=show_progress, covered=covered,
                   batch_size=config.batch_size,
                   grace_s=job_world.takeover_s, tell=_Teller(job_store), restart=restart, replace=replace,
                   succession=succession)
    except BaseException:
        _stop_all(children)
        job_store.close()
        raise
    _stop_all(children)
    job_store.close()


def _restart(config: TrainConfig, failed: JobFailed, *, done: int) -> dict:
    """The record of the restart that follows ``failed`` (``done`` restarts before it), its checkpoint's
    metrics kept and the later ones forgotten; ``failed`` raised again, saying why, if the job cannot go on."""
    why, boundary = None, None
    if failed.no_space:  # not the job's own error: it goes on once there is room
        raise JobFailed(f"{failed}; the disk is full: {after_a_full_disk(config.run_dir)}", no_space=True) from None
    if not failed.restartable:
        why = "it failed by its own error, which a restart would meet again"
    elif done >= config.max_restarts:
        why = f"--max-restarts {config.max_restarts}" + (" reached" if config.max_restarts else "")
    elif not config.checkpoints:
        why = "the run writes no checkpoints (--checkpoint-every, --checkpoint-every-s)"
    elif (boundary := _newest_boundary(config.run_dir)) is None:
        why = "no checkpoint written yet"
    if why is not None:
        if config.checkpoints and config.max_restarts:
            raise JobFailed(f"{failed}; not restarted: {why}") from None
        raise failed
    restart = {"attempt": done + 1, "failed": str(failed), "failed_at": round(failed.seen_at, 3),
               "stopped_in_s": round(time.time() - failed.seen_at, 3),  # every other role stopped
               "iteration_reached": failed.iteration, "resumed_from": boundary,
               "iterations_redone": max(failed.iteration - boundary, 0)}
    log.warning("%s; starting the job again from its checkpoint at iteration %d (restart %d of at most %d)",
                failed, boundary, done + 1, config.max_restarts)
    return restart


def _newest_boundary(run_dir: Path) -> int | None:
    """The iteration boundary of the run's newest intact checkpoint (the one a resumed job starts from)."""
    found = valid_checkpoints(run_dir, newest_only=True)
    return found[0][1][-1]["iteration"] if found else None


class _MetricsTail:
    """What trainer 0 has appended to metrics.jsonl so far, read incrementally: the iterations done and the loss
    (the progress bar), when they were reached and when a resumed job trained again (a restart's timings); the
    warnings about the run's health that its roles recorded are said here as they come (their logs are files)."""

    def __init__(self, path: Path, *, offset: int = 0, iteration: int = 0) -> None:
        self.path, self.offset = path, offset
        self.iteration, self.loss = iteration, None
        self.resumed_at: float | None = None  # when a resumed job's first iteration ended (wall time)
        self.reached: dict[int, float] = {}  # iteration logged -> when (wall time)

    def read(self) -> None:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") == RESUMED:
                self.resumed_at = record["time"]
            elif record.get("event") == WARNING:
                log.warning("%s", record["message"])
            elif "train_loss" in record and record["iteration"] > self.iteration:
                self.iteration, self.loss = record["iteration"], record["train_loss"]
                self.reached[self.iteration] = record["time"]

    def caught_up_at(self, iteration: int) -> float | None:
        """When the job first logged an iteration at or past ``iteration`` (wall time), if it has."""
        return min((at for logged, at in self.reached.items() if logged >= iteration), default=None)


class _JobState:
    """What the oracle has decided about the job's processes, as it wrote it to the job's store (which the launcher
    serves): whether training has ended, which trainers have reported, the replacements it awaits, the data servers
    whose shards their parity servers serve for good. ``read`` refreshes the first two and the job's record once per
    round of the launcher's loop; the rest is read when a decision needs it."""

    def __init__(self, store) -> None:
        self.store = store
        self.trained = False  # every row is gathered: a role lost from here on costs nothing (STOP_KEY)
        self.record: JobRecord | None = None  # the oracle's record (runtime/succession.py), once it wrote one

    def read(self) -> None:
        self.trained = self.store.check([STOP_KEY])
        self.record = load_record(self.store)

    @property
    def trainers_done(self) -> set[int]:
        """Trainers whose report the oracle has: the job no longer needs them."""
        return set(self.record.done) if self.record is not None else set()

    def awaited(self, rank: int) -> int:
        """The RPC world (epoch) whose replacement for ``rank`` the oracle awaits, the latest it asked for; 0 if none.
        Read from the key the replacement meets the job by (set once the oracle is ready for it), not from the
        record (written a moment before)."""
        key = f"{REPLACE_PREFIX}{rank}"
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def awaits_newer(self, rank: int, than: int) -> bool:
        """Whether the oracle awaits a replacement for ``rank`` of a later epoch than ``than``: asked of the store only
        for a rank whose replacement the record has under way (the loop asks it of running and excused processes)."""
        return self.record is not None and rank in self.record.replacing and self.awaited(rank) > than

    def moved_for_good(self, rank: int) -> bool:
        """Whether the oracle's latest word on lost ``rank`` (a data server) is that its parity server serves its
        shard from now on, with no replacement asked for."""
        if self.record is None:
            return False
        latest = next((f for f in reversed(self.record.failures) if f.rank == rank), None)
        return latest is not None and latest.moved_for_good


class _Teller:
    """Tells the job's store (the launcher serves it) that a process has ended: the heartbeat watches take it as
    lost at once, instead of after their liveness window."""

    def __init__(self, job_store: JobStore) -> None:
        self.job_store = job_store

    def exited(self, child: Child) -> None:
        self.job_store.store.set(f"{EXITED_PREFIX}{child.rank}", _describe(child.process.returncode))


class _Succession:
    """A lost oracle replaced while the job goes on (runtime/succession.py): the same command started again, which
    takes the job over, at most MAX_ORACLE_REPLACEMENTS times. An oracle whose heartbeat stops while its process is
    still there (stopped, hung) is killed first, so that it can be replaced."""

    def __init__(self, world: World, job_store: JobStore, *, replace, enabled: bool) -> None:
        self.world, self.job_store, self.replace, self.enabled = world, job_store, replace, enabled
        self.count = 0
        self._watch = OracleWatch(world, job_store.store)

    def take_over(self, lost: Child, state: _JobState) -> bool:
        """``lost`` (the oracle, killed) is replaced: True if the job goes on (a replacement was started)."""
        if (not self.enabled or lost.process.returncode >= 0 or state.trained or state.trainers_done
                or self.count >= MAX_ORACLE_REPLACEMENTS):
            return False
        declare_oracle_lost(self.job_store.store, _describe(lost.process.returncode))
        self.count += 1
        log.warning("the oracle exited (%s); starting its replacement, which takes the job over (training goes on "
                    "meanwhile)", _describe(lost.process.returncode))
        self.replace(lost)
        return True

    def watch(self, oracle: Child, state: _JobState) -> None:
        """Kill the oracle (by pid) if its heartbeat has stopped for the liveness window while its process is there
        (stopped, or hung): its replacement then starts as for a killed one."""
        if not self.enabled or state.trained or oracle.process.poll() is not None:
            return
        silent = self._watch.silent_s()
        if silent is not None:
            log.warning("the oracle has not beaten for %.0f s but its process is still there: killing it (pid %d) so "
                        "that its replacement can start", silent, oracle.process.pid)
            oracle.process.kill()
            oracle.process.wait()


def _supervise(children: list[Child], metrics: _MetricsTail, state: _JobState, *, total: int, show_progress: bool,
               batch_size: int = 0, covered: set[int] = frozenset(), grace_s: float = 0.0, tell: _Teller | None = None,
               restart: dict | None = None, replace=None, succession: _Succession | None = None) -> None:
    """Until every role has exited (``state``: what the oracle decided, ``metrics``: the progress trainer 0 logs):
    fail on the first that fails, except a non-oracle role lost after training ended or a trainer lost after its
    report reached the oracle (the run no longer needs them: a warning), and a ``covered`` role that the oracle
    has taken care of within ``grace_s`` of its exit (training goes on): a replacement it awaits, which
    ``replace(child)`` starts, or a data server whose shard its parity server serves from now on. ``restart``:
    the record of the restart this run is, given when it trained again and when it got back to where it failed."""
    bar = progress(total=total, desc="train (bagpipe)", unit="it", enabled=show_progress, initial=metrics.iteration,
                   samples_per_unit=batch_size)
    excused: set[int] = set()
    takeover_due: dict[int, float] = {}  # rank of a covered role that ended -> until when the oracle may take over
    started: dict[int, int] = {}  # rank -> the epoch of the last replacement started for it
    try:
        while True:
            # Exit codes first, then the store: what the oracle decided before a role ended is read with its end.
            codes = {c.rank: c.process.poll() for c in children}
            for child in children:
                if codes[child.rank] is not None and child.ended_at is None:
                    child.ended_at = time.time()
            state.read()
            metrics.read()
            if metrics.iteration > bar.n:
                bar.update(metrics.iteration - bar.n)
                bar.set_postfix(loss=f"{metrics.loss:.4f}")
            bar.refresh()  # (off a terminal, a line every few seconds while the count stands still too)
            if restart is not None:
                _timed(restart, metrics)
            for child in children:  # declared lost (no heartbeat: stopped, hung) and awaited again: its process
                # would hold the rank, so the replacement could not start
                if (codes[child.rank] is None and child.rank in covered and replace is not None
                        and state.awaits_newer(child.rank, than=started.get(child.rank, 0))):
                    log.warning("%s was taken as lost but its process is still there: killing it (pid %d) so that "
                                "its replacement can start", child.label, child.process.pid)
                    child.process.kill()
            if succession is not None and codes[0] is None:
                succession.watch(children[0], state)
            # (an exit excused as needing no replacement is not, once the oracle asks for one after all)
            failed = [c for c in children if codes[c.rank] not in (None, 0) and (
                c.rank not in excused or state.awaits_newer(c.rank, than=started.get(c.rank, 0)))]
            for child in failed:
                if child.role == "oracle" and succession is not None:
                    if child.process.returncode == NOT_REPLACEABLE_EXIT_CODE:  # a replacement that cannot take over
                        raise JobFailed(f"{child.label} failed: {_last_error(child)}", restartable=True,
                                        iteration=metrics.iteration)
                    succession.take_over(child, state)
                    continue
                # (a trainer is replaced only when its process was lost: one that failed by its own error would
                # fail again)
                if (child.rank in covered and not _done_with(child, state)
                        and (child.role == "server" or child.process.returncode < 0)):
                    awaited = state.awaited(child.rank)
                    if awaited > started.get(child.rank, 0) and replace is not None:
                        started[child.rank] = awaited
                        excused.discard(child.rank)
                        log.warning("%s exited (%s); starting its replacement (training goes on meanwhile)",
                                    child.label, _describe(child.process.returncode))
                        takeover_due.pop(child.rank, None)
                        replace(child)
                    elif child.role == "server" and state.moved_for_good(child.rank):
                        log.warning("%s exited (%s); its shard is served by its parity server from now on",
                                    child.label, _describe(child.process.returncode))
                        excused.add(child.rank)
                    elif child.rank not in takeover_due:
                        takeover_due[child.rank] = time.monotonic() + grace_s
                        if tell is not None:
                            tell.exited(child)
            now = time.monotonic()
            failed = [c for c in failed if c in children  # not one replaced just now
                      and c.rank not in excused and takeover_due.get(c.rank, 0.0) <= now]
            needed = [c for c in failed if not _done_with(c, state)]
            for child in failed:
                if child not in needed:
                    log.warning("%s exited (%s) after its part of the training ended; the run does not need it",
                                child.label, _describe(child.process.returncode))
                    excused.add(child.rank)
            failed = needed
            if failed:
                _raise_if_interrupted(failed)
                message, restartable = _blame(children, failed)
                no_space = any((status := c.status()) is not None and status.cause == "no_space" for c in failed)
                raise JobFailed(f"{message}; logs in {failed[0].log_path.parent}", restartable=restartable,
                                no_space=no_space, iteration=metrics.iteration)
            if all(code is not None for code in codes.values()):
                break
            time.sleep(0.1)
    finally:
        bar.close()


def _timed(restart: dict, metrics: _MetricsTail) -> None:
    """Note in a restart's record how long after the failure the job trained again, and got back to the
    iteration it had reached."""
    if "resumed_in_s" not in restart and metrics.resumed_at is not None:
        restart["resumed_in_s"] = round(metrics.resumed_at - restart["failed_at"], 3)
    if "caught_up_in_s" not in restart:
        if restart["iterations_redone"] == 0:  # nothing to train again: back where it was once it trains
            caught_up = metrics.resumed_at
        else:
            caught_up = metrics.caught_up_at(restart["iteration_reached"])
        if caught_up is not None:
            restart["caught_up_in_s"] = round(caught_up - restart["failed_at"], 3)


def _done_with(child: Child, state: _JobState) -> bool:
    """Whether the run no longer needs ``child``: training has ended (not the oracle: it writes the run's
    results), or it is a trainer whose report the oracle has."""
    if child.role == "oracle":
        return False
    return state.trained or (child.role == "trainer" and child.index in state.trainers_done)


def _raise_if_interrupted(failed: list[Child]) -> None:
    """The job interrupted, as by the launcher's own Ctrl-C or SIGTERM, where a role ended by one itself (its exit
    status says so): a terminal's Ctrl-C and a scheduler's SIGTERM reach every process of the job, and a role's end
    can be seen before the launcher's own signal is. No role failed, and none is blamed."""
    for child in failed:
        status = child.status()
        if status is not None and status.cause == "interrupted":
            raise KeyboardInterrupt if child.process.returncode == 130 else Terminated()


def _blame(children: list[Child], failed: list[Child]) -> tuple[str, bool]:
    """The failure to report, and whether it was a process lost (killed, or hung: a restart may go on) rather
    than a role's own error: a role that failed by itself, before one that ended because it lost a peer; that
    one names the peer in its exit status, which may have ended the same way (the chain is followed) or still
    be there: stopped, or hung."""
    own = [c for c in failed if c.process.returncode != LOST_EXIT_CODE]
    if own:
        first = min(own, key=_exit_time)
        return (f"{first.label} failed ({_describe(first.process.returncode)}): {_last_error(first)}",
                first.process.returncode < 0)
    # the first to end that names the peer it lost (one that could not tell comes last)
    witness = min(failed, key=lambda c: (_lost_peer(c) is None, _exit_time(c)))
    by_rank = {c.rank: c for c in children}
    seen = {witness.rank}
    while True:
        error = _last_error(witness)
        peer = _lost_peer(witness)
        culprit = by_rank.get(peer) if peer is not None else None
        if culprit is None or culprit.rank in seen:
            return f"{witness.label} failed: {error}", True
        if culprit.process.poll() is None:
            return (f"{culprit.label} stopped responding (its process is still there: stopped, or hung); "
                    f"{witness.label} reported: {error}", True)
        if culprit.process.returncode != LOST_EXIT_CODE:
            status = witness.status()
            why_fatal = f"; {witness.label}: {error}" if status and status.not_recovered else ""  # e.g. a second loss
            return (f"{culprit.label} failed ({_describe(culprit.process.returncode)}): {_last_error(culprit)}"
                    f"{why_fatal}", culprit.process.returncode < 0)
        seen.add(culprit.rank)
        witness = culprit


def _lost_peer(child: Child) -> int | None:
    """The rank of the peer whose loss ended ``child``, as its exit status says (None: it could not tell)."""
    status = child.status()
    return status.peer if status is not None and status.cause == "lost_peer" else None


def _exit_time(child: Child) -> float:
    """When ``child`` ended: as it recorded, else (killed) as the launcher saw it. The first to end is usually
    the cause."""
    status = child.status()
    if status is not None:
        return status.at
    return child.ended_at if child.ended_at is not None else time.time()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _last_error(child: Child) -> str:
    """The role's error as its exit status states it. A process that wrote none (killed, aborted) may still
    have logged an error first: its last ERROR line, else a traceback's exception line, never another line
    (for the people reading the message only: nothing is decided from it)."""
    status = child.status()
    if status is not None:
        return status.message
    try:
        lines = child.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    for number in range(len(lines) - 1, -1, -1):
        if " ERROR " in lines[number]:
            return lines[number].split(" ERROR ", 1)[1].strip()
        if lines[number].startswith("Traceback (most recent call last)"):
            exception = next((line for line in lines[number + 1:] if line and not line[0].isspace()), None)
            if exception:
                return exception.strip()
    return "it logged no error" + ("" if child.process.returncode < 0 else "; see its log")


def _stop_all(children: list[Child]) -> None:
    """Stop every child still running: SIGTERM, then SIGKILL after a grace period; reap all."""
    alive = [c for c in children if c.process.poll() is None]
    for child in alive:
        child.process.send_signal(signal.SIGTERM)
        child.process.send_signal(signal.SIGCONT)  # a stopped process takes its SIGTERM once continued
    deadline = time.monotonic() + GRACE_S
    for child in alive:
        try:
            child.process.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()
