"""A bagpipe job across hosts (``bagpipe.hosts``), every role started by its own command on a host of its own as on
machines (docs/distributed.md's recipe: the store and the oracle on one host, each server and each trainer on
one), an operator that starts a lost role's command again, and the network's faults injected from outside while
it trains: ``SCENARIOS``, run by benchmarks/network_faults.py and, the shortest, by
tests/integration/test_network_faults.py.

Each scenario ends in one of two outcomes, checked against the one-process reference of the job's config:
"exact" (the job ended by itself, its model bit for bit the reference's) or "failed, resumed exact" (the job ended
with an error naming what was lost, and ``bagpipe train --resume`` from its newest checkpoint ended bit for bit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bagpipe.hosts import Hosts

ORACLE_HOST = "oracle"  # also the store's


@dataclass(frozen=True)
class JobShape:
    """What the job is: its trainers, servers (with ``parity``, the last of each group the parity server) and the
    oracle's other flags (data size, cache, liveness)."""
    trainers: int = 2
    servers: int = 1
    parity: int = 0
    options: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return 1 + self.trainers + self.servers

    def hosts(self) -> list[str]:
        return ([ORACLE_HOST] + [f"trainer{t}" for t in range(self.trainers)]
                + [f"server{s}" for s in range(self.servers)])


@dataclass
class Role:
    name: str  # "store", "oracle", "trainer0", "server1"
    host: str
    argv: list[str]
    process: subprocess.Popen | None = None
    starts: int = 0
    exits: list[int] = field(default_factory=list)  # the exit codes of the processes it had, in order


class HostJob:
    """``shape`` as a job across ``hosts`` (made with ``shape.hosts()``), training ``data`` into ``cwd``/run. Roles'
    logs in ``cwd``/logs/ (a role started again appends)."""

    def __init__(self, hosts: Hosts, shape: JobShape, *, data: str | Path, cwd: Path,
                 env: dict[str, str] | None = None) -> None:
        self.hosts, self.shape, self.cwd = hosts, shape, Path(cwd)
        self.run_dir = self.cwd / "run"
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("OMP_NUM_THREADS", "1")
        (self.cwd / "logs").mkdir(parents=True, exist_ok=True)
        master = hosts.address(ORACLE_HOST)
        world = ["--world-size", str(shape.world_size), "--master-ip", master]
        bagpipe = [sys.executable, "-m", "bagpipe.cli"]
        self.roles = [Role("store", ORACLE_HOST, [*bagpipe, "store", *world]),
                      Role("oracle", ORACLE_HOST, [*bagpipe, "oracle", "--worker-id", "0", *world, "--store-served",
                                                   "--world-size-trainers", str(shape.trainers), "--data", str(data),
                                                   "--run-dir", str(self.run_dir),
                                                   *(["--parity", str(shape.parity)] if shape.parity else []),
                                                   *shape.options])]
        self.roles += [Role(f"trainer{t}", f"trainer{t}", [*bagpipe, "trainer", "--worker-id", str(1 + t), *world])
                       for t in range(shape.trainers)]
        self.roles += [Role(f"server{s}", f"server{s}",
                            [*bagpipe, "server", "--worker-id", str(1 + shape.trainers + s), *world])
                       for s in range(shape.servers)]
        self.started_at = 0.0

    def role(self, name: str) -> Role:
        return next(role for role in self.roles if role.name == name)

    def start(self, role: Role) -> None:
        """``role``'s command started (again) on its host."""
        with open(self.cwd / "logs" / f"{role.name}.log", "a") as log:
            if role.starts:
                log.write(f"=== started again ({role.starts + 1}) ===\n")
                log.flush()
            role.process = self.hosts.popen(role.host, role.argv, cwd=self.cwd, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT)
        role.starts += 1

    def start_all(self) -> None:
        self.started_at = time.monotonic()
        for role in self.roles:
            self.start(role)

    def iteration(self) -> int:
        """The newest iteration the oracle has logged (0 before any)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0
        lines = [line for line in path.read_text().splitlines() if line.startswith('{"iteration"')]
        try:
            return json.loads(lines[-1])["iteration"] if lines else 0
        except (json.JSONDecodeError, KeyError):
            return 0

    def wait_for_iteration(self, iteration: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.iteration() < iteration:
            if any(role.process.poll() not in (None, 0) for role in self.roles):
                raise RuntimeError(f"a role failed before iteration {iteration}: {self.ended()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"iteration {iteration} not reached within {timeout:.0f} s")
            time.sleep(0.05)

    def ended(self) -> dict[str, int | None]:
        return {role.name: role.process.poll() for role in self.roles}

    def supervise(self, *, replace: Callable[[Role, int], bool], timeout: float) -> bool:
        """Watch the job to its end, as an operator would: a role whose process exits non-zero is started again where
        ``replace(role, code)`` says so. True if every role ended by itself with 0; False when one failed and was
        not started again (every other role is then stopped); TimeoutError past ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            codes = {role.name: role.process.poll() for role in self.roles}
            for role in self.roles:
                code = codes[role.name]
                if code not in (None, 0):
                    role.exits.append(code)
                    if replace(role, code):
                        self.start(role)
                        codes[role.name] = None
                    else:
                        self.stop()
                        return False
            if all(code == 0 for code in codes.values()):
                for role in self.roles:
                    role.exits.append(0)
                return True
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the job did not end within {timeout:.0f} s: {codes}")
            time.sleep(0.1)

    def stop(self) -> None:
        for role in self.roles:
            if role.process is not None and role.process.poll() is None:
                role.process.kill()
                role.process.wait()

    def log(self, name: str, tail: int = 3000) -> str:
        path = self.cwd / "logs" / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""
