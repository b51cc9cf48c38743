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

ORACLE_HOST = "oracle"  # also the store's, unless JobShape.store_apart
STORE_HOST = "store"


@dataclass(frozen=True)
class JobShape:
    """What the job is: its trainers, servers (with ``parity``, the last of each group the parity server) and the
    oracle's other flags (data size, cache, liveness)."""
    trainers: int = 2
    servers: int = 1
    parity: int = 0
    options: tuple[str, ...] = ()
    store_apart: bool = False  # the store on a host of its own ("store"), so that the oracle's host may be lost

    @property
    def world_size(self) -> int:
        return 1 + self.trainers + self.servers

    @property
    def store_host(self) -> str:
        return STORE_HOST if self.store_apart else ORACLE_HOST

    def hosts(self) -> list[str]:
        return ([self.store_host] + ([ORACLE_HOST] if self.store_apart else [])
                + [f"trainer{t}" for t in range(self.trainers)] + [f"server{s}" for s in range(self.servers)])


@dataclass
class Role:
    name: str  # "store", "oracle", "trainer0", "server1"
    host: str
    args: list[str]  # its command: `bagpipe ARGS`
    process: subprocess.Popen | None = None
    starts: int = 0
    exits: list[int] = field(default_factory=list)  # the exit codes of the processes it had, in order


Starter = Callable[..., "subprocess.Popen"]  # (hosts, host, args, *, cwd, env, output) -> a process


def fresh_interpreter(hosts: Hosts, host: str, args: list[str], *, cwd: Path, env: dict[str, str], output):
    """`bagpipe ARGS` started on ``host`` as a user would start it there: a fresh interpreter."""
    return hosts.popen(host, [sys.executable, "-m", "bagpipe.cli", *args], cwd=cwd, env=env, stdout=output,
                       stderr=subprocess.STDOUT)


class HostJob:
    """``shape`` as a job across ``hosts`` (made with ``shape.hosts()``), training ``data`` into ``cwd``/run. Roles'
    logs in ``cwd``/logs/ (a role started again appends). ``start``: how a role's command is started on its host
    (the tests start it from their fork server, in the host's namespace)."""

    def __init__(self, hosts: Hosts, shape: JobShape, *, data: str | Path, cwd: Path,
                 env: dict[str, str] | None = None, start: Starter = fresh_interpreter) -> None:
        self.hosts, self.shape, self.cwd, self._starter = hosts, shape, Path(cwd), start
        self.run_dir = self.cwd / "run"
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("OMP_NUM_THREADS", "1")
        (self.cwd / "logs").mkdir(parents=True, exist_ok=True)
        master = hosts.address(shape.store_host)
        world = ["--world-size", str(shape.world_size), "--master-ip", master]
        store_flags = [flag for pair in zip(shape.options[::2], shape.options[1::2])
                       if pair[0] in ("--timeout", "--liveness-s") for flag in pair]
        self.roles = [Role("store", shape.store_host, ["store", *world, *store_flags]),
                      Role("oracle", ORACLE_HOST, ["oracle", "--worker-id", "0", *world, "--store-served",
                                                   "--world-size-trainers", str(shape.trainers), "--data", str(data),
                                                   "--run-dir", str(self.run_dir),
                                                   *(["--parity", str(shape.parity)] if shape.parity else []),
                                                   *shape.options])]
        self.roles += [Role(f"trainer{t}", f"trainer{t}", ["trainer", "--worker-id", str(1 + t), *world])
                       for t in range(shape.trainers)]
        self.roles += [Role(f"server{s}", f"server{s}",
                            ["server", "--worker-id", str(1 + shape.trainers + s), *world])
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
            role.process = self._starter(self.hosts, role.host, role.args, cwd=self.cwd, env=self.env, output=log)
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


# -- the scenarios -----------------------------------------------------------------------------------------------------

# 80 iterations of 256 samples on small data (tests/conftest.py's: 26 tables of <= 40 rows, 861 rows); a cache
# short of the rows, so that rows move every iteration; a liveness window of 5 s
OPTIONS = ("--mini-batch-size", "256", "--iterations", "80", "--cache-size", "800", "--liveness-s", "5",
           "--timeout", "20", "--log-every", "5")
FAULT_AT = 20  # the iteration after which a scenario's fault is injected
# against the 5 s window: an outage of T s silences a TCP connection for up to about 2T (its retransmissions back
# off, doubling: 0.2, 0.4, 0.8, 1.6 s), so "shorter than the window" means at most half of it
DOWN_SHORT_S, DOWN_LONG_S = 1.5, 10.0
EXACT, RESUMED = "exact", "failed, resumed exact"


@dataclass(frozen=True)
class Scenario:
    """A fault injected from outside a running job (``fault(hosts)``), and what it must give: ``EXACT`` (the job
    ends by itself, bit for bit the reference, the roles on the ``faulted`` hosts started again by the operator
    where they end) or ``RESUMED`` (the job ends with an error naming the loss; resumed from its newest
    checkpoint, it ends bit for bit)."""
    name: str
    what: str
    fault: Callable[[Hosts], None]
    faulted: tuple[str, ...]
    shape: JobShape = JobShape(options=OPTIONS)
    expect: str = EXACT
    needs: str | None = None  # a tool the fault needs beyond iproute2 (iptables, ethtool)


def _down(host: str, seconds: float) -> Callable[[Hosts], None]:
    def fault(hosts: Hosts) -> None:
        hosts.link_down(host)
        time.sleep(seconds)
        hosts.link_up(host)
    return fault


def _loss(host: str, probability: float) -> Callable[[Hosts], None]:
    return lambda hosts: hosts.drop(host, probability)


def _partition(host: str, others: tuple[str, ...], seconds: float) -> Callable[[Hosts], None]:
    def fault(hosts: Hosts) -> None:
        hosts.isolate(host, others)
        time.sleep(seconds)
        hosts.isolate(host, ())
    return fault


PARITY = JobShape(servers=2, parity=1, options=OPTIONS)
PARTITIONED = JobShape(options=(*OPTIONS, "--cache-mode", "partitioned", "--checkpoint-every", "10"))
CHECKPOINTED = JobShape(options=(*OPTIONS, "--checkpoint-every", "10"))
APART = JobShape(options=OPTIONS, store_apart=True)

SCENARIOS = [
    Scenario("trainer link down 1.5 s", "a trainer's link down for half the liveness window, then up",
             _down("trainer1", DOWN_SHORT_S), ()),
    Scenario("server link down 1.5 s", "the server's link down for half the liveness window, then up",
             _down("server0", DOWN_SHORT_S), ()),
    Scenario("trainer link down 10 s", "a trainer's link down past the window: it ends itself, started again",
             _down("trainer1", DOWN_LONG_S), ("trainer1",)),
    Scenario("server link down 10 s, parity", "a data server's link down past the window under --parity 1",
             _down("server0", DOWN_LONG_S), ("server0",), shape=PARITY),
    Scenario("server link down 10 s, no parity", "the only server cut off past the window, checkpoints every 10",
             _down("server0", DOWN_LONG_S), (), shape=CHECKPOINTED, expect=RESUMED),
    Scenario("trainer host lost", "every process of a trainer's host killed at once",
             lambda hosts: hosts.lose("trainer1"), ("trainer1",)),
    Scenario("trainer host lost, partitioned", "a trainer's host lost under --cache-mode partitioned",
             lambda hosts: hosts.lose("trainer1"), (), shape=PARTITIONED, expect=RESUMED),
    Scenario("server host lost, parity", "a data server's host lost, its parity server on another host",
             lambda hosts: hosts.lose("server0"), ("server0",), shape=PARITY),
    Scenario("oracle host lost, store apart", "the oracle's host lost, the job's store on a host of its own",
             lambda hosts: hosts.lose(ORACLE_HOST), (ORACLE_HOST,), shape=APART),
    Scenario("oracle link down 10 s, store apart", "the oracle cut off from the job and its store past the window: "
             "it ends itself, started again; never two oracles", _down(ORACLE_HOST, DOWN_LONG_S), (ORACLE_HOST,),
             shape=APART),
    Scenario("1% loss, trainer", "1% of the packets in and out of a trainer's host lost",
             _loss("trainer1", 0.01), (), needs="iptables"),
    Scenario("5% loss, trainer", "5% of the packets in and out of a trainer's host lost",
             _loss("trainer1", 0.05), (), needs="iptables"),
    Scenario("5% loss, trainer, partitioned", "5% loss on a trainer's link under --cache-mode partitioned",
             _loss("trainer1", 0.05), (), shape=PARTITIONED, needs="iptables"),
    Scenario("5% loss, server", "5% of the packets in and out of the server's host lost",
             _loss("server0", 0.05), (), needs="iptables"),
    Scenario("50 +- 20 ms delay, trainer", "every frame in and out of a trainer's host held 30-70 ms (a relay)",
             lambda hosts: hosts.delay("trainer1", 50, 20), (), needs="ethtool"),
    Scenario("50 +- 20 ms delay, server", "every frame in and out of the server's host held 30-70 ms (a relay)",
             lambda hosts: hosts.delay("server0", 50, 20), (), needs="ethtool"),
    Scenario("partition oracle / trainers 10 s", "the oracle (and store) cut off from every trainer past the window",
             _partition(ORACLE_HOST, ("trainer0", "trainer1"), DOWN_LONG_S), (), shape=CHECKPOINTED, expect=RESUMED,
             needs="iptables"),
]
SHORTEST = ("trainer link down 1.5 s", "trainer host lost", "server host lost, parity")  # run by the tests


def scenario(name: str) -> Scenario:
    return next(s for s in SCENARIOS if s.name == name)


@dataclass
class Outcome:
    scenario: str
    outcome: str  # EXACT, RESUMED, or what went wrong
    passed: bool
    wall_s: float  # the job's, from its start to its end (with a resume: both runs')
    samples_per_s: float | None  # summary.json's steady state
    recovered_s: float | None  # summary.json's failures: the longest recovered_in_s / joined_in_s
    restarts: int  # roles started again by the operator
    detail: str = ""


def run_scenario(item: Scenario | None, *, data: str | Path, cwd: Path, same_as: Callable[[Path], bool],
                 timeout: float = 240.0, start: Starter = fresh_interpreter) -> Outcome:
    """``item`` (None: the job unfaulted) run across fresh hosts in ``cwd``; ``same_as(run_dir)``: whether the run's
    model is bit for bit the reference's; ``start``: as HostJob's."""
    shape = item.shape if item is not None else JobShape(options=OPTIONS)
    name = item.name if item is not None else "no fault"
    faulted = set(item.faulted) if item is not None else set()
    Path(cwd).mkdir(parents=True, exist_ok=True)
    with Hosts(shape.hosts()) as hosts:
        job = HostJob(hosts, shape, data=data, cwd=cwd, start=start)
        job.start_all()
        if item is not None:
            job.wait_for_iteration(FAULT_AT, timeout=timeout)
            item.fault(hosts)

        def replace(role: Role, code: int) -> bool:
            return role.host in faulted and role.name != "store" and role.starts < 3

        ended = job.supervise(replace=replace, timeout=timeout)
        wall = time.monotonic() - job.started_at
    restarts = sum(role.starts - 1 for role in job.roles)
    failed_roles = {role.name: role.exits for role in job.roles if role.exits and role.exits[-1] != 0}
    expect = item.expect if item is not None else EXACT
    if ended:
        summary = json.loads((job.run_dir / "summary.json").read_text())
        exact = same_as(job.run_dir)
        outcome = EXACT if exact else "ended, not exact"
        return Outcome(name, outcome, outcome == expect, wall, summary.get("samples_per_s"), _recovered(summary),
                       restarts)
    errors = [line for role in job.roles for line in job.log(role.name).splitlines() if " ERROR " in line]
    if expect != RESUMED:
        return Outcome(name, "failed", False, wall, None, None, restarts, detail=f"{failed_roles}: {errors[:3]}")
    started = time.monotonic()
    resumed = subprocess.run([sys.executable, "-m", "bagpipe.cli", "train", "--run-dir", str(job.run_dir), "--resume",
                              "--no-progress"], capture_output=True, text=True, cwd=cwd,
                             env={**job.env, "OMP_NUM_THREADS": "1"})
    wall += time.monotonic() - started
    if resumed.returncode:
        return Outcome(name, "failed, resume failed", False, wall, None, None, restarts,
                       detail=resumed.stderr[-500:])
    summary = json.loads((job.run_dir / "summary.json").read_text())
    exact = same_as(job.run_dir)
    return Outcome(name, RESUMED if exact else "failed, resumed not exact", exact, wall, summary.get("samples_per_s"),
                   _recovered(summary), restarts, detail=errors[0] if errors else "")


def _recovered(summary: dict) -> float | None:
    times = [failure.get(key) for failure in summary.get("failures", [])
             for key in ("recovered_in_s", "joined_in_s") if failure.get(key) is not None]
    return max(times) if times else None
