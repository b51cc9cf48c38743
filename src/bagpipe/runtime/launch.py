"""One-command local job: start the oracle, the servers and the trainers; supervise them.

Each role is a ``bagpipe oracle|server|trainer`` process writing its log to RUN_DIR/logs. The
launcher shows one progress bar (from the metrics trainer 0 appends), and when any role exits
with an error it stops every other role by pid (SIGTERM, then SIGKILL) and reports the failing
role, its rank and the last error it logged. Children also die with the launcher
(PR_SET_PDEATHSIG), so no role outlives the job.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bagpipe.config import TrainConfig, dump_toml
from bagpipe.data.batches import batches_per_epoch
from bagpipe.preflight import check_job, prepare_data, prepare_job
from bagpipe.progress import progress
from bagpipe.rundir import SUMMARY
from bagpipe.runtime.liveness import EXITED_PREFIX, LOST_EXIT_CODE, NOT_RECOVERED
from bagpipe.runtime.protocol import SERVER_LOST, TRAINED, TRAINER_DONE
from bagpipe.runtime.world import LOOPBACK, World, connect_store, free_port

log = logging.getLogger(__name__)

GRACE_S = 5.0


class JobFailed(RuntimeError):
    pass


@dataclass
class Child:
    role: str
    index: int
    rank: int
    process: subprocess.Popen
    log_path: Path

    @property
    def label(self) -> str:
        return f"{self.role} {self.index} (rank {self.rank})"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def launch_local(config: TrainConfig, *, show_progress: bool = True, threads: int = 1, overwrite: bool = False,
                 resume: bool = False, extra_trainer_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> dict:
    """Run a whole bagpipe job on this machine; return its summary.json.

    Everything is checked and the data converted before any role starts (so a refused job leaves
    an earlier run in the run dir as it was); ``resume``: continue the run in the run dir from its
    newest valid checkpoint (the roles' logs are appended to); ``env`` adds variables for the roles (tests).
    """
    if resume:
        dataset = prepare_data(config, show_progress=show_progress)
        for warning in check_job(config, dataset, show_progress=show_progress):
            log.warning("%s", warning)
    else:
        dataset = prepare_job(config, overwrite=overwrite, show_progress=show_progress)
    iterations = config.iterations or batches_per_epoch(dataset.train, config.batch_size)
    run_dir = Path(config.run_dir)
    (run_dir / "logs").mkdir(exist_ok=resume)
    job_file = run_dir / "job.toml"
    job_file.write_text(dump_toml(config))
    port = config.master_port or free_port()
    world_size = 1 + config.servers + config.trainers
    world = ["--world-size", str(world_size), "--world-size-trainers", str(config.trainers),
             "--master-ip", LOOPBACK, "--master-port", str(port), "--timeout", repr(config.timeout)]
    child_env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **(env or {}))
    roles = [("oracle", 0, ["--config", str(job_file), "--prepared", *(["--resume"] if resume else [])])]
    roles += [("trainer", t, list(extra_trainer_args or [])) for t in range(config.trainers)]
    roles += [("server", s, []) for s in range(config.servers)]
    children: list[Child] = []
    try:
        for rank, (role, index, args) in enumerate(roles):
            log_path = run_dir / "logs" / f"{role}{index}.log"
            with open(log_path, "a" if resume else "w") as out:
                command = [sys.executable, "-m", "bagpipe.cli", role, "--worker-id", str(rank), *world, *args]
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=child_env,
                                           preexec_fn=_die_with_parent)
            children.append(Child(role, index, rank, process, log_path))
        (run_dir / "pids.json").write_text(json.dumps({f"{c.role}{c.index}": c.process.pid for c in children}))
        job_world = World(rank=0, world_size=world_size, num_trainers=config.trainers, master_port=port,
                          timeout=config.timeout, parity=config.parity)
        covered = set(range(job_world.num_shards)) if config.parity else set()  # losses parity covers
        _supervise(children, run_dir, total=iterations, show_progress=show_progress, covered=covered,
                   grace_s=job_world.takeover_s, tell=_Teller(job_world))
    except BaseException:
        _stop_all(children)
        for partial in run_dir.glob("*.tmp"):  # what the oracle was writing when it was stopped
            shutil.rmtree(partial) if partial.is_dir() else partial.unlink()
        raise
    _stop_all(children)
    return json.loads((run_dir / SUMMARY).read_text())


class _MetricsTail:
    """What the roles have appended to metrics.jsonl so far: the iterations done, and whether
    training has ended (every row gathered by the oracle), read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0
        self.iteration, self.loss, self.trained = 0, None, False
        self.servers_lost: set[int] = set()  # data servers the oracle moved to their parity servers
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
            elif record.get("event") == TRAINER_DONE:
                self.trainers_done.add(record["trainer"])
            elif "train_loss" in record and record["iteration"] > self.iteration:
                self.iteration, self.loss = record["iteration"], record["train_loss"]


class _Teller:
    """Tells the job's store that a process has ended (the oracle's heartbeat watch takes it as lost at once,
    instead of after its liveness window): a client opened when first needed."""

    def __init__(self, world: World) -> None:
        self.world, self._store = world, None

    def exited(self, child: Child) -> None:
        try:
            if self._store is None:
                self._store = connect_store(self.world, timeout=self.world.timeout)
            self._store.set(f"{EXITED_PREFIX}{child.rank}", _describe(child.process.returncode))
        except (RuntimeError, OSError, TimeoutError) as err:  # the heartbeats will tell, later
            log.warning("could not tell the job that %s ended: %s", child.label, err)


def _supervise(children: list[Child], run_dir: Path, *, total: int, show_progress: bool,
               covered: set[int] = frozenset(), grace_s: float = 0.0, tell: _Teller | None = None) -> None:
    """Until every role has exited: fail on the first that fails, except a non-oracle role lost after
    training ended or a trainer lost after its report reached the oracle (the run no longer needs them: a
    warning), and a ``covered`` server (with --parity) that the
    oracle has moved to its parity server within ``grace_s`` of its exit (training goes on)."""
    bar = progress(total=total, desc="train (bagpipe)", unit="it", enabled=show_progress)
    metrics = _MetricsTail(run_dir / "metrics.jsonl")
    excused: set[int] = set()
    takeover_due: dict[int, float] = {}  # rank of a covered server that ended -> until when the oracle may take over
    try:
        while True:
            # Exit codes first, then the log: what a role's peers logged before it ended is read with its end.
            codes = {c.rank: c.process.poll() for c in children}
            metrics.read()
            if metrics.iteration > bar.n:
                bar.update(metrics.iteration - bar.n)
                bar.set_postfix(loss=f"{metrics.loss:.4f}")
            failed = [c for c in children if codes[c.rank] not in (None, 0) and c.rank not in excused]
            for child in failed:
                if child.role == "server" and child.index in covered and not metrics.trained:
                    if child.index in metrics.servers_lost:
                        log.warning("%s exited (%s); its shard is served by its parity server from now on",
                                    child.label, _describe(child.process.returncode))
                        excused.add(child.rank)
                    elif child.rank not in takeover_due:
                        takeover_due[child.rank] = time.monotonic() + grace_s
                        if tell is not None:
                            tell.exited(child)
            now = time.monotonic()
            failed = [c for c in failed if c.rank not in excused and takeover_due.get(c.rank, 0.0) <= now]
            needed = [c for c in failed if not _done_with(c, metrics)]
            for child in failed:
                if child not in needed:
                    log.warning("%s exited (%s) after its part of the training ended; the run does not need it",
                                child.label, _describe(child.process.returncode))
                    excused.add(child.rank)
            failed = needed
            if failed:
                raise JobFailed(_blame(children, failed) + f"; logs in {failed[0].log_path.parent}")
            if all(code is not None for code in codes.values()):
                break
            time.sleep(0.1)
    finally:
        bar.close()


def _done_with(child: Child, metrics: _MetricsTail) -> bool:
    """Whether the run no longer needs ``child``: training has ended (not the oracle: it writes the run's
    results), or it is a trainer whose report the oracle has."""
    if child.role == "oracle":
        return False
    return metrics.trained or (child.role == "trainer" and child.index in metrics.trainers_done)


_LOST_PEER = re.compile(r"^lost .*?\(rank (\d+)\)")


def _blame(children: list[Child], failed: list[Child]) -> str:
    """The failure to report: a role that failed by itself, before one that ended because it lost
    a peer; that one names the peer, which may have ended the same way (the chain is followed) or
    still be there: stopped, or hung."""
    own = [c for c in failed if c.process.returncode != LOST_EXIT_CODE]
    if own:
        first = min(own, key=_exit_time)
        return f"{first.label} failed ({_describe(first.process.returncode)}): {_last_error(first)}"
    # the first to end that names the peer it lost (one that could not tell comes last)
    witness = min(failed, key=lambda c: (_LOST_PEER.search(_last_error(c)) is None, _exit_time(c)))
    by_rank = {c.rank: c for c in children}
    seen = {witness.rank}
    while True:
        error = _last_error(witness)
        named = _LOST_PEER.search(error)
        culprit = by_rank.get(int(named.group(1))) if named else None
        if culprit is None or culprit.rank in seen:
            return f"{witness.label} failed: {error}"
        if culprit.process.poll() is None:
            return (f"{culprit.label} stopped responding (its process is still there: stopped, or hung); "
                    f"{witness.label} reported: {error}")
        if culprit.process.returncode != LOST_EXIT_CODE:
            why_fatal = f"; {witness.label}: {error}" if NOT_RECOVERED in error else ""  # e.g. a second loss
            return (f"{culprit.label} failed ({_describe(culprit.process.returncode)}): {_last_error(culprit)}"
                    f"{why_fatal}")
        seen.add(culprit.rank)
        witness = culprit


def _exit_time(child: Child) -> float:
    # The role that failed first is usually the cause; a log's mtime is a fair proxy for when it ended.
    try:
        return child.log_path.stat().st_mtime
    except OSError:
        return 0.0


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _last_error(child: Child) -> str:
    """The error the role logged last (an ERROR line, else a traceback's exception line), never another line."""
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
