"""Deterministic fault injection, for tests: a role kills or stops itself at a named point.

``BAGPIPE_FAULTS`` lists faults separated by commas, each ``ROLE@POINT:ACTION``: ``trainer1@iteration
40:stop`` sends trainer 1 SIGSTOP after iteration 40, ``trainer0@done:kill`` SIGKILLs trainer 0 once
it has reported done, ``oracle@data ready:pause=8`` has the oracle sleep 8 s there, ``trainer0@iteration
5:fail`` has trainer 0 raise an error there. The points are where ``inject_fault`` is called, the role
is what the process was named with ``set_role`` (its world name); with the variable unset, nothing happens.
A fault happens in the job's first attempt only; ``trainer1#1@iteration 40:kill`` names the launcher's
first restart instead (``BAGPIPE_ATTEMPT``, which the launcher sets). Every point is declared in ``POINTS``
(a fault at any other is refused, naming them; tests/unit/test_faults.py checks that every ``inject_fault`` call
names a declared point and every declared point is called).
"""

from __future__ import annotations

import os
import re
import signal
import time

# pause=S: sleep S seconds there; fail: raise an error there (a role's own error, not a process lost)
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "pause": None, "fail": None}
# Where faults can be injected, N standing for a number (an iteration, a checkpoint boundary, a version), by role:
POINTS = (
    # a trainer (and the reference's loop: "iteration N")
    "iteration N", "backward N", "sending checkpoint N", "checkpoint sent N", "done",
    # the oracle
    "data ready", "planned N", "trainers reported", "committing N", "model written",
    # a server
    "tables filled", "parity made", "shard copied", "take over", "write-back N", "delta sent N", "delta N",
    "checkpoint N written", "checkpoint parts written",
    # any role joining a re-formed world
    "joining",
)


def point_form(point: str) -> str:
    """A point with its numbers as N: the form POINTS declares it in."""
    return re.sub(r"\d+", "N", point)


class InjectedFault(RuntimeError):
    pass


def _parse(spec: str, attempt: int = 0) -> dict[tuple[str, str], tuple[str, float]]:
    """The faults of ``spec`` meant for the job's attempt ``attempt`` (0: the first run, 1: its first restart)."""
    faults = {}
    for fault in filter(None, (part.strip() for part in spec.split(","))):
        where, _, action = fault.rpartition(":")
        role, _, point = where.partition("@")
        role, _, meant_for = role.partition("#")
        name, _, seconds = action.partition("=")
        if (name not in ACTIONS or not role or not point or bool(seconds) != (name == "pause")
                or not (meant_for or "0").isdigit()):
            raise ValueError(f"BAGPIPE_FAULTS: expected ROLE[#ATTEMPT]@POINT:kill|stop|fail|pause=SECONDS, "
                             f"got {fault!r}")
        if point_form(point) not in POINTS:
            raise ValueError(f"BAGPIPE_FAULTS: no fault point {point!r} (in {fault!r}); the points are "
                             f"{', '.join(POINTS)} (N: a number)")
        if int(meant_for or 0) == attempt:
            faults[(role, point)] = (name, float(seconds or 0))
    return faults


_FAULTS: dict[tuple[str, str], tuple[str, float]] = {}
_ROLE = ""


def load() -> None:
    """Read the faults meant for this process from its environment (done on import; again by a process forked
    from one that imported this module, runtime/forkserver.py)."""
    global _FAULTS
    _FAULTS = _parse(os.environ.get("BAGPIPE_FAULTS", ""), int(os.environ.get("BAGPIPE_ATTEMPT", "0")))


load()


def set_role(name: str) -> None:
    """Name this process (``oracle``, ``server0``, ``trainer1``, ...) for the faults meant for it."""
    global _ROLE
    _ROLE = name


def inject_fault(point: str) -> None:
    """Carry out the fault set for this process's role at ``point``, if any."""
    if _FAULTS and (_ROLE, point) in _FAULTS:
        action, seconds = _FAULTS[(_ROLE, point)]
        if action == "pause":
            time.sleep(seconds)
        elif action == "fail":
            raise InjectedFault(f"a fault injected at {point!r} (BAGPIPE_FAULTS)")
        else:
            os.kill(os.getpid(), ACTIONS[action])
