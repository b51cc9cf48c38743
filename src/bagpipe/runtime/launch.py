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
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bagpipe.config import TrainConfig, dump_toml
from bagpipe.data.batches import batches_per_epoch
from bagpipe.data.binary import open_dataset
from bagpipe.data.preprocess import ensure_preprocessed
from bagpipe.progress import progress
from bagpipe.runtime.world import LOOPBACK, free_port

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


def launch_local(config: TrainConfig, *, show_progress: bool = True, threads: int = 1,
                 extra_trainer_args: list[str] | None = None) -> dict:
    """Run a whole bagpipe job on this machine; return its summary.json."""
    data = ensure_preprocessed(config.data, show_progress=show_progress)  # once, before any role reads it
    dataset = open_dataset(data)
    iterations = config.iterations or batches_per_epoch(dataset.train, config.batch_size)
    run_dir = Path(config.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "checkpoint.pt"):
        (run_dir / stale).unlink(missing_ok=True)
    job_file = run_dir / "job.toml"
    job_file.write_text(dump_toml(config))
    port = config.master_port or free_port()
    world_size = 1 + config.servers + config.trainers
    world = ["--world-size", str(world_size), "--world-size-trainers", str(config.trainers),
             "--master-ip", LOOPBACK, "--master-port", str(port)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    roles = [("oracle", 0, ["--config", str(job_file)])]
    roles += [("server", s, []) for s in range(config.servers)]
    roles += [("trainer", t, list(extra_trainer_args or [])) for t in range(config.trainers)]
    children: list[Child] = []
    try:
        for rank, (role, index, args) in enumerate(roles):
            log_path = run_dir / "logs" / f"{role}{index}.log"
            with open(log_path, "w") as out:
                command = [sys.executable, "-m", "bagpipe.cli", role, "--worker-id", str(rank), *world, *args]
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                           preexec_fn=_die_with_parent)
            children.append(Child(role, index, rank, process, log_path))
        (run_dir / "pids.json").write_text(json.dumps({f"{c.role}{c.index}": c.process.pid for c in children}))
        _supervise(children, run_dir, total=iterations, show_progress=show_progress)
    finally:
        _stop_all(children)
    return json.loads((run_dir / "summary.json").read_text())


def _supervise(children: list[Child], run_dir: Path, *, total: int, show_progress: bool) -> None:
    bar = progress(total=total, desc="train (bagpipe)", unit="it", enabled=show_progress)
    metrics = run_dir / "metrics.jsonl"
    seen = 0
    try:
        while True:
            codes = [c.process.poll() for c in children]
            failed = [c for c, code in zip(children, codes) if code not in (None, 0)]
            if failed:
                first = min(failed, key=lambda c: _exit_time(c))
                raise JobFailed(f"{first.label} failed ({_describe(first.process.returncode)}): "
                                f"{_last_error(first.log_path)}; logs in {first.log_path.parent}")
            if all(code == 0 for code in codes):
                break
            seen = _advance_bar(bar, metrics, seen)
            time.sleep(0.1)
        _advance_bar(bar, metrics, seen)
    finally:
        bar.close()


def _exit_time(child: Child) -> float:
    # The role that failed first is usually the cause; a log's mtime is a fair proxy for when it ended.
    try:
        return child.log_path.stat().st_mtime
    except OSError:
        return 0.0


def _advance_bar(bar, metrics: Path, seen: int) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return seen
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "iteration" in record and "train_loss" in record and record["iteration"] > seen:
            bar.update(record["iteration"] - seen)
            bar.set_postfix(loss=f"{record['train_loss']:.4f}")
            seen = record["iteration"]
    return seen


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _last_error(log_path: Path) -> str:
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if " ERROR " in line:
            return line.split(" ERROR ", 1)[1]
        if "Error:" in line:
            return line
    return lines[-1] if lines else "empty log"


def _stop_all(children: list[Child]) -> None:
    """Stop every child still running: SIGTERM, then SIGKILL after a grace period; reap all."""
    alive = [c for c in children if c.process.poll() is None]
    for child in alive:
        child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for child in alive:
        try:
            child.process.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()
