"""One-command local job: start the oracle, the servers and the trainers; supervise them.

Each role is a ``bagpipe oracle|server|trainer`` process writing its log to RUN_DIR/logs. The
launcher shows one progress bar (from the metrics trainer 0 appends), and when any role exits
with an error it stops every other role by pid (SIGTERM, then SIGKILL) and reports the failing
role, its rank and its error. Whom to blame is decided from exit codes and the status each role
writes as it exits (runtime/exit_status.py: its cause, the peer whose loss ended it, when), never
from log text. Roles (and their replacements) are forked from a fork server that imported torch and bagpipe
once for the job (runtime/forkserver.py), so a role starts in milliseconds, not seconds. Children die with
the launcher (PR_SET_PDEATHSIG, through the fork server), so no role outlives the job.
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

from bagpipe.checkpoint import resumable_checkpoint, valid_checkpoints
from bagpipe.config import TrainConfig, dump_toml
from bagpipe.data.batches import batches_per_epoch
from bagpipe.preflight import check_job, prepare_data, prepare_job
from bagpipe.progress import progress
from bagpipe.rundir import SUMMARY, forget_metrics_after, sweep_working_files, write_json_atomic
from bagpipe.runlock import lock_run_dir
from bagpipe.runtime.exit_status import STATUS_FILE_ENV, ExitStatus, read_exit
from bagpipe.runtime.forkserver import ForkedProcess, ForkServer
from bagpipe.runtime.keys import EXITED_PREFIX, RESUMED, SERVER_LOST, TRAINED, TRAINER_DONE, TRAINER_LOST
from bagpipe.runtime.liveness import LOST_EXIT_CODE
from bagpipe.runtime.succession import (MAX_ORACLE_REPLACEMENTS, NOT_REPLACEABLE_EXIT_CODE, OracleWatch,
                                        declare_oracle_lost)
from bagpipe.runtime.world import LOOPBACK, STORE_SERVED, JobStore, World, free_port
from bagpipe.storage.disk import storage_path

log = logging.getLogger(__name__)

GRACE_S = 5.0


class JobFailed(RuntimeError):
    """A role failed: the job ended. ``restartable``: the cause was a process lost (killed, or hung), not an
    error of its own; ``iteration``: the last iteration the job logged before; ``seen_at``: when the launcher
    saw it (wall time)."""

    def __init__(self, message: str, *, restartable: bool = False, iteration: int = 0) -> None:
        super().__init__(message)
        self.restartable, self.iteration = restartable, iteration
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
        return config.iterations or batches_per_epoch(dataset.train, config.batch_size)
    dataset = prepare_data(config, show_progress=show_progress)
    iterations = config.iterations or batches_per_epoch(dataset.train, config.batch_size)
    resumable_checkpoint(config.run_dir, iterations=iterations)
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
             "--liveness-s", repr(config.liveness_s)]
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
        succession = _Succession(job_world, job_store, replace=replace, enabled=config.replace_oracle)
        _supervise(children, metrics, total=total, show_progress=show_progress, covered=covered,
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
    """What the roles have appended to metrics.jsonl so far: the iterations done, and whether
    training has ended (every row gathered by the oracle), read incrementally."""

    def __init__(self, path: Path, *, offset: int = 0, iteration: int = 0) -> None:
        self.path, self.offset = path, offset
        self.iteration, self.loss, self.trained = iteration, None, False
        self.resumed_at: float | None = None  # when a resumed job's first iteration ended (wall time)
        self.reached: dict[int, float] = {}  # iteration logged -> when (wall time)
        self.servers_lost: set[int] = set()  # data servers the oracle moved to their parity servers
        self.servers_replaced: set[int] = set()  # lost servers the oracle awaits a replacement process for
        self.trainers_replaced: set[int] = set()  # lost trainers the oracle awaits a replacement process for
        self.trainers_done: set[int] = set()  # trainers whose report the oracle has: the job no longer needs them

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
            if record.get("event") == TRAINED:
                self.trained = True
            elif record.get("event") == SERVER_LOST:
                self.servers_lost.add(record["server"])
                if record.get("replaced"):
                    self.servers_replaced.add(record["server"])
            elif record.get("event") == TRAINER_LOST:
                self.trainers_replaced.add(record["trainer"])
            elif record.get("event") == TRAINER_DONE:
                self.trainers_done.add(record["trainer"])
            elif record.get("event") == RESUMED:
                self.resumed_at = record["time"]
            elif "train_loss" in record and record["iteration"] > self.iteration:
                self.iteration, self.loss = record["iteration"], record["train_loss"]
                self.reached[self.iteration] = record["time"]

    def caught_up_at(self, iteration: int) -> float | None:
        """When the job first logged an iteration at or past ``iteration`` (wall time), if it has."""
        return min((at for logged, at in self.reached.items() if logged >= iteration), default=None)


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

    def take_over(self, lost: Child, metrics: "_MetricsTail") -> bool:
        """``lost`` (the oracle, killed) is replaced: True if the job goes on (a replacement was started)."""
        if (not self.enabled or lost.process.returncode >= 0 or metrics.trained or metrics.trainers_done
                or self.count >= MAX_ORACLE_REPLACEMENTS):
            return False
        declare_oracle_lost(self.job_store.store, _describe(lost.process.returncode))
        self.count += 1
        log.warning("the oracle exited (%s); starting its replacement, which takes the job over (training goes on "
                    "meanwhile)", _describe(lost.process.returncode))
        self.replace(lost)
        return True

    def watch(self, oracle: Child, metrics: "_MetricsTail") -> None:
        """Kill the oracle (by pid) if its heartbeat has stopped for the liveness window while its process is there
        (stopped, or hung): its replacement then starts as for a killed one."""
        if not self.enabled or metrics.trained or oracle.process.poll() is not None:
            return
        silent = self._watch.silent_s()
        if silent is not None:
            log.warning("the oracle has not beaten for %.0f s but its process is still there: killing it (pid %d) so "
                        "that its replacement can start", silent, oracle.process.pid)
            oracle.process.kill()
            oracle.process.wait()


def _supervise(children: list[Child], metrics: _MetricsTail, *, total: int, show_progress: bool,
               covered: set[int] = frozenset(), grace_s: float = 0.0, tell: _Teller | None = None,
               restart: dict | None = None, replace=None, succession: _Succession | None = None) -> None:
    """Until every role has exited (``metrics``: what they log): fail on the first that fails, except a
    non-oracle role lost after training ended or a trainer lost after its report reached the oracle (the run
    no longer needs them: a warning), and a ``covered`` server (with --parity) that the oracle has taken care
    of within ``grace_s`` of its exit (training goes on): a data server's shard moved to its parity server, or
    a parity server to be replaced, which ``replace(child)`` starts. ``restart``: the record of the restart
    this run is, given when it trained again and when it got back to where it failed."""
    bar = progress(total=total, desc="train (bagpipe)", unit="it", enabled=show_progress, initial=metrics.iteration)
    excused: set[int] = set()
    takeover_due: dict[int, float] = {}  # rank of a covered server that ended -> until when the oracle may take over
    try:
        while True:
            # Exit codes first, then the log: what a role's peers logged before it ended is read with its end.
            codes = {c.rank: c.process.poll() for c in children}
            for child in children:
                if codes[child.rank] is not None and child.ended_at is None:
                    child.ended_at = time.time()
            metrics.read()
            if metrics.iteration > bar.n:
                bar.update(metrics.iteration - bar.n)
                bar.set_postfix(loss=f"{metrics.loss:.4f}")
            if restart is not None:
                _timed(restart, metrics)
            for child in children:  # declared lost (no heartbeat: stopped, hung) and awaited again: its process
                # would hold the rank, so the replacement could not start
                if codes[child.rank] is None and child.rank in covered and replace is not None and child.index in (
                        metrics.servers_replaced if child.role == "server" else metrics.trainers_replaced):
                    log.warning("%s was taken as lost but its process is still there: killing it (pid %d) so that "
                                "its replacement can start", child.label, child.process.pid)
                    child.process.kill()
            if succession is not None and codes[0] is None:
                succession.watch(children[0], metrics)
            failed = [c for c in children if codes[c.rank] not in (None, 0) and c.rank not in excused]
            for child in failed:
                if child.role == "oracle" and succession is not None:
                    if child.process.returncode == NOT_REPLACEABLE_EXIT_CODE:  # a replacement that cannot take over
                        raise JobFailed(f"{child.label} failed: {_last_error(child)}", restartable=True,
                                        iteration=metrics.iteration)
                    succession.take_over(child, metrics)
                    continue
                # (a trainer is replaced only when its process was lost: one that failed by its own error would
                # fail again)
                if (child.rank in covered and not _done_with(child, metrics)
                        and (child.role == "server" or child.process.returncode < 0)):
                    replaced = metrics.servers_replaced if child.role == "server" else metrics.trainers_replaced
                    if child.index in replaced and replace is not None:
                        replaced.discard(child.index)
                        if child.role == "server":
                            metrics.servers_lost.discard(child.index)
                        log.warning("%s exited (%s); starting its replacement (training goes on meanwhile)",
                                    child.label, _describe(child.process.returncode))
                        takeover_due.pop(child.rank, None)
                        replace(child)
                    elif child.role == "server" and child.index in metrics.servers_lost:
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
            needed = [c for c in failed if not _done_with(c, metrics)]
            for child in failed:
                if child not in needed:
                    log.warning("%s exited (%s) after its part of the training ended; the run does not need it",
                                child.label, _describe(child.process.returncode))
                    excused.add(child.rank)
            failed = needed
            if failed:
                message, restartable = _blame(children, failed)
                raise JobFailed(f"{message}; logs in {failed[0].log_path.parent}", restartable=restartable,
                                iteration=metrics.iteration)
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


def _done_with(child: Child, metrics: _MetricsTail) -> bool:
    """Whether the run no longer needs ``child``: training has ended (not the oracle: it writes the run's
    results), or it is a trainer whose report the oracle has."""
    if child.role == "oracle":
        return False
    return metrics.trained or (child.role == "trainer" and child.index in metrics.trainers_done)


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
