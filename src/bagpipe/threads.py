"""Work on a daemon thread whose result (or error) the caller collects: a thread that never holds up
the exit of a failing process, unlike a ThreadPoolExecutor's."""

from __future__ import annotations

import os
import threading
from typing import Callable, Generic, TypeVar

Result = TypeVar("Result")


class Background(Generic[Result]):
    """``call()`` started on a daemon thread named ``name``."""

    def __init__(self, call: Callable[[], Result], *, name: str) -> None:
        self._outcome: dict = {}
        # The end is an Event of its own, not Thread.join/is_alive: on Python 3.11 a join cut short by a signal
        # handler's exception (Ctrl-C, SIGTERM) marks the thread stopped while it still runs (the bpo-45274
        # clean-up releases the lock the running thread holds), and every later join returns at once.
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(call,), name=name, daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], Result]) -> None:
        try:
            self._outcome["value"] = call()
        except BaseException as err:  # handed to the caller
            self._outcome["error"] = err
        finally:
            self._ended.set()

    def done(self) -> bool:
        return self._ended.is_set()

    def join(self, *, failed: str) -> None:
        """Wait for the call to end; its error raised here as a RuntimeError that starts with ``failed``. (What
        interrupts the wait itself, Ctrl-C or SIGTERM, is raised as it is: it is not the work's error, and a later
        join waits again.)"""
        self._ended.wait()
        if "error" in self._outcome:
            err = self._outcome["error"]
            raise RuntimeError(f"{failed}: {err}") from err

    def result(self, timeout: float | None = None) -> Result:
        """The call's value, or its error raised here; a TimeoutError if it has not ended within ``timeout``."""
        if not self._ended.wait(timeout):
            raise TimeoutError(f"{self._thread.name} still running after {timeout} s")
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]


def live_threads() -> int:
    """This process's threads, native ones (torch's, gloo's, TensorPipe's) included where the system says
    (/proc/self/task), else the Python ones."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()
