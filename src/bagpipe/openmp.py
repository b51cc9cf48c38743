"""How torch's OpenMP threads wait for work, chosen before torch loads: by what else the machine is running.

OpenMP's idle workers spin by default, which is the fastest on an idle machine and collapses beside any other busy
process (the spinning workers take the cores it needs and wait on each other): measured on 2 cores, the default
spin ran ``--mode reference`` at 0.24x of its idle speed beside one busy process, ``OMP_WAIT_POLICY=PASSIVE`` at
0.73x of the spin's idle speed when idle and 2.1x the spin's speed beside the busy process; short spins
(``GOMP_SPINCOUNT`` 10,000 to 200,000) collapsed as the default did (docs/performance.md, "Threads on a busy
machine"). So a run that starts beside busy processes waits passively, and one on an idle machine keeps the spin.
The choice is made once (OpenMP reads it as torch loads): a machine that becomes busy later keeps the spin, and a
user's own OMP_WAIT_POLICY always stands.
"""

from __future__ import annotations

import os
import time
from typing import Callable, MutableMapping

BUSY_CORES = 0.5  # others' use of the cores, over the sample, from which a run waits passively
SAMPLE_S = 0.1  # the sample's length (the kernel counts CPU time in 10 ms ticks: 10 per core)


def cpu_ticks(path: str = "/proc/stat") -> tuple[int, int] | None:
    """All cores' (busy, total) CPU ticks since boot; None where the system does not say (not Linux)."""
    try:
        with open(path) as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - idle, total


def busy_cores(*, window_s: float = SAMPLE_S, ticks: Callable[[], tuple[int, int] | None] = cpu_ticks,
               sleep: Callable[[float], None] = time.sleep) -> float | None:
    """How many cores other processes kept busy over ``window_s`` (this process sleeps through it); None where
    it cannot be measured."""
    before = ticks()
    sleep(window_s)
    after = ticks()
    if before is None or after is None or after[1] <= before[1]:
        return None
    cores = os.cpu_count() or 1
    return cores * (after[0] - before[0]) / (after[1] - before[1])


def choose_wait_policy(environ: MutableMapping[str, str] = os.environ, *,
                       measure: Callable[[], float | None] = busy_cores) -> str | None:
    """Set OMP_WAIT_POLICY=PASSIVE in ``environ`` when other processes keep at least BUSY_CORES cores busy, unless
    the user set it; the policy set (None: the user's, or OpenMP's default spin, is left)."""
    if "OMP_WAIT_POLICY" in environ:
        return None
    busy = measure()
    if busy is not None and busy >= BUSY_CORES:
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
        return "PASSIVE"
    return None
