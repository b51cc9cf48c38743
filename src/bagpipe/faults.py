"""Deterministic fault injection, for tests: a role kills or stops itself at a named point.

``BAGPIPE_FAULTS`` lists faults separated by commas, each ``ROLE@POINT:ACTION``: ``trainer1@iteration
40:stop`` sends trainer 1 SIGSTOP after iteration 40, ``trainer0@done:kill`` SIGKILLs trainer 0 once
it has reported done, ``oracle@data ready:pause=8`` has the oracle sleep 8 s there. The points are where ``inject_fault`` is called, the role is what the process
was named with ``set_role`` (its world name); with the variable unset, nothing happens.
"""

from __future__ import annotations

import os
import signal
import time

ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "pause": None}  # pause=S: sleep S seconds there


def _parse(spec: str) -> dict[tuple[str, str], tuple[str, float]]:
    faults = {}
    for fault in filter(None, (part.strip() for part in spec.split(","))):
        where, _, action = fault.rpartition(":")
        role, _, point = where.partition("@")
        name, _, seconds = action.partition("=")
        if name not in ACTIONS or not role or not point or bool(seconds) != (name == "pause"):
            raise ValueError(f"BAGPIPE_FAULTS: expected ROLE@POINT:kill|stop|pause=SECONDS, got {fault!r}")
        faults[(role, point)] = (name, float(seconds or 0))
    return faults


_FAULTS = _parse(os.environ.get("BAGPIPE_FAULTS", ""))
_ROLE = ""


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
        else:
            os.kill(os.getpid(), ACTIONS[action])
