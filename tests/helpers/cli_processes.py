"""``python -m bagpipe.cli ARGS`` (and ``python SCRIPT ARGS``) processes for tests, forked from the session's fork
server (tests/conftest.py).

Each is the process a fresh interpreter running that command would be (its own argv, environment, directory,
streams, signal dispositions and faults: runtime/forkserver.py), without the 1.5-2 s of CPU a fresh interpreter
spends importing torch and bagpipe. ``CliProcess`` is seen as ``subprocess.Popen(..., stdout=PIPE, stderr=PIPE,
text=True)`` is; ``run_cli`` as ``subprocess.run(..., capture_output=True, text=True)``.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import IO

import torch

from bagpipe.runtime.forkserver import ForkServer

# The torch threads of a fresh interpreter here (this process was started without OMP_NUM_THREADS; read before
# any test sets its own): what a forked command gets unless its environment says otherwise, as a fresh one would.
FRESH_THREADS = torch.get_num_threads()
_SESSION: dict[str, ForkServer] = {}


def use(forks: ForkServer) -> None:
    """The fork server every command of this session is forked from."""
    _SESSION["forks"] = forks


class CliProcess:
    """``bagpipe.cli`` run with ``args`` in a forked child (``script``: that Python file instead, as
    ``python SCRIPT ARGS...`` runs it). ``output``: a file both streams go to (as ``stdout=f, stderr=STDOUT``);
    by default they are captured for ``communicate``. ``netns``: in that network namespace (a host of
    bagpipe.hosts), as ``ip netns exec NAME`` would run it."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 output: IO | None = None, script: str | Path | None = None, netns: str | None = None) -> None:
        env = dict(os.environ if env is None else env)
        env.setdefault("OMP_NUM_THREADS", str(FRESH_THREADS))
        if output is None:
            self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            streams = {"stdout": self._out.fileno(), "stderr": self._err.fileno()}
        else:
            self._out = self._err = None
            streams = {"stdout": output.fileno(), "stderr": None}
        self.args = list(args)
        self._process = _SESSION["forks"].start(self.args, env=env, cwd=None if cwd is None else str(cwd),
                                                script=None if script is None else str(script), netns=netns,
                                                **streams)
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    def poll(self) -> int | None:
        return self._process.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._process.wait(timeout)

    def send_signal(self, sig: int) -> None:
        self._process.send_signal(sig)

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """(stdout, stderr) once the process has ended (empty where ``output`` took them); TimeoutExpired if it
        has not within ``timeout`` (it goes on, as with Popen)."""
        self.wait(timeout)
        return _read(self._out), _read(self._err)


def _read(stream: IO | None) -> str:
    if stream is None:
        return ""
    stream.seek(0)
    text = stream.read().decode("utf-8", errors="backslashreplace")
    stream.close()
    return text


def run_cli(args: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run ``bagpipe.cli`` with ``args`` to its end: its exit code and what it printed."""
    process = CliProcess(args, env=env, cwd=cwd)
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def in_host(hosts, host: str, args: list[str], *, cwd, env: dict[str, str], output: IO) -> CliProcess:
    """``bagpipe ARGS`` in ``host`` of ``hosts`` (bagpipe.hosts), forked from the session's fork server into the
    host's network namespace: bagpipe.hostjobs's starter for the tests."""
    return CliProcess(args, env=env, cwd=cwd, output=output, netns=hosts[host].namespace)
