"""Where an iteration's wall time goes: a lap clock over named phases of the training loop.

The loop calls ``lap(phase)`` after each phase; the time since the previous lap is charged to
that phase, so the phases of an iteration add up to its wall time with nothing counted twice.
A phase that contains a measured wait (a fetch, an all-reduce) is split with ``carve``. Every
``log_every`` iterations ``window()`` returns milliseconds per iteration by phase, for the
metrics log; ``steady_ms()`` the same over every iteration after the warm-up, for the summary.
"""

from __future__ import annotations

import resource
import sys
import time
from collections import defaultdict

# Phases in the order a report stacks them; a loop may use any subset.
PHASES = ("data", "plan_wait", "fetch_wait", "lazy_sync_wait", "cache", "lookup", "forward", "backward",
          "sync_wait", "sync", "optimizer", "other")


class PhaseClock:
    def __init__(self, *, warmup: int = 0) -> None:
        self.warmup = warmup
        self.iteration = 0
        self._current: dict[str, float] = defaultdict(float)  # the iteration under way
        self._window: dict[str, float] = defaultdict(float)
        self._window_iterations = 0
        self._steady: dict[str, float] = defaultdict(float)
        self._steady_iterations = 0
        self._mark = time.perf_counter()

    def restart(self) -> None:
        """Start timing from now (e.g. at the top of the loop, after set-up)."""
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self._current[phase] += now - self._mark
        self._mark = now

    def carve(self, phase: str, part: str, seconds: float) -> None:
        """Move ``seconds`` of what this iteration charged to ``phase`` over to ``part``."""
        seconds = min(max(seconds, 0.0), self._current[phase])
        self._current[phase] -= seconds
        self._current[part] += seconds

    def end_iteration(self) -> None:
        steady = self.iteration >= self.warmup
        for phase, seconds in self._current.items():
            self._window[phase] += seconds
            if steady:
                self._steady[phase] += seconds
        self._current = defaultdict(float)
        self.iteration += 1
        self._window_iterations += 1
        self._steady_iterations += steady

    def window(self) -> dict[str, float]:
        """Milliseconds per iteration by phase since the last call; starts a new window."""
        out = _per_iteration_ms(self._window, self._window_iterations)
        self._window = defaultdict(float)
        self._window_iterations = 0
        return out

    def steady_ms(self) -> dict[str, float]:
        """Milliseconds per iteration by phase over the iterations after the warm-up."""
        return _per_iteration_ms(self._steady, self._steady_iterations)


def _per_iteration_ms(times: dict[str, float], iterations: int) -> dict[str, float]:
    if not iterations:
        return {}
    return {phase: round(1000.0 * seconds / iterations, 4) for phase, seconds in _ordered(times)}


def _ordered(times: dict[str, float]) -> list[tuple[str, float]]:
    rank = {phase: i for i, phase in enumerate(PHASES)}
    return sorted(times.items(), key=lambda item: (rank.get(item[0], len(PHASES)), item[0]))


def peak_rss_bytes() -> int:
    """This process's peak resident set size: Linux's VmHWM (the peak of its memory as it is now: a process started
    by fork and exec does not count the pages it had before its exec, which ru_maxrss does), else ru_maxrss (KiB
    on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def cpu_seconds() -> float:
    """CPU time this process has used so far (user + system, every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
