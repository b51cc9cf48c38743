"""The original system's command lines as a user types them, run as that user's terminals would: every role at once,
each forked from the session's fork server where it is a ``bagpipe`` line or a script (helpers/cli_processes.py)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from bagpipe.runtime.world import free_port
from helpers.cli_processes import CliProcess

ROOT = Path(__file__).resolve().parents[2]  # the repository


class BagpipeLine(list):
    """The arguments of a ``bagpipe ...`` command line: run as `python -m bagpipe.cli` would, forked from the
    session's fork server (cli_processes.py)."""


def bagpipe_line(line: str) -> BagpipeLine:
    return BagpipeLine(shlex.split(line))


class ScriptLine(list):
    """``python SCRIPT ARGS...``: the script's arguments, run as that command would, forked from the session's fork
    server (cli_processes.py)."""

    def __init__(self, script: Path, args: list[str]) -> None:
        super().__init__(args)
        self.script = script


def script_line(script: Path, *args: str) -> ScriptLine:
    return ScriptLine(script, list(args))


def start(command: list[str], *, cwd: Path, env: dict[str, str], output) -> CliProcess | subprocess.Popen:
    """``command`` started, its streams to ``output``: forked from the session's fork server where it is a
    BagpipeLine or a ScriptLine, else a fresh process (torchrun, which starts its own)."""
    if isinstance(command, (BagpipeLine, ScriptLine)):
        return CliProcess(command, cwd=cwd, env=env, output=output, script=getattr(command, "script", None))
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT)


def run_job(commands: list[list[str]], *, cwd: Path, timeout: float = 240, env: dict[str, str] | None = None) -> list[str]:
    """Start every command at once (as one would in separate terminals); all must exit 0 by themselves.
    ``env``: their environment (by default this process's, with a free $MASTER_PORT)."""
    env = dict(os.environ, MASTER_PORT=str(free_port())) if env is None else dict(env)
    env["PYTHONUNBUFFERED"] = "1"
    logs = [cwd / f"role{i}.log" for i in range(len(commands))]
    handles = [open(log, "w") for log in logs]
    processes = [start(c, cwd=cwd, env=env, output=h) for c, h in zip(commands, handles)]
    try:
        for process in processes:
            process.wait(timeout=timeout)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for handle in handles:
            handle.close()
    texts = [log.read_text() for log in logs]
    codes = [p.returncode for p in processes]
    assert codes == [0] * len(commands), "\n".join(f"--- {getattr(c, 'script', '')} {' '.join(c[:3])}... exit {code}\n{text[-2500:]}"
                                                   for c, code, text in zip(commands, codes, texts) if code)
    return texts
