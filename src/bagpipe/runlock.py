"""A run dir's lock: one run at a time in a directory, for as long as any process of that run lives.

An OS file lock (``flock``) on ``RUN_DIR/.bagpipe-lock``: the kernel releases it when the last
descriptor of it closes, however its holders end, so a killed run never leaves a stale lock. The
local launcher hands its locked descriptor to the roles it starts (``RunLock.fd``), so the lock
lasts until the last of them has ended.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from bagpipe.files import describe_write_error

LOCK = ".bagpipe-lock"


class RunDirBusy(ValueError):
    """Another process holds the run dir's lock: its run is still going."""


@dataclass
class RunLock:
    """A held lock on ``run_dir`` (``created``: this process made the directory)."""

    run_dir: Path
    fd: int
    created: bool

    def release(self, *, keep_dir: bool = True) -> None:
        """Let the run dir go. ``keep_dir`` False: a directory this process created that holds nothing but the
        lock (a run refused before it wrote anything) is removed, as if it had never been asked for."""
        if self.fd < 0:
            return
        if not keep_dir and self.created:
            try:
                if [p.name for p in self.run_dir.iterdir()] == [LOCK]:
                    (self.run_dir / LOCK).unlink()  # locked: another opener sees the file change and retries
                    self.run_dir.rmdir()
            except OSError:
                pass
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.release(keep_dir=kind is None or not _refused(error))


def _refused(error: BaseException | None) -> bool:
    return isinstance(error, ValueError)


def lock_run_dir(run_dir: str | Path) -> RunLock:
    """Lock ``run_dir`` (made if missing) for this process; RunDirBusy, naming the holder, if a run holds it."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--run-dir {run_dir} is a file, not a directory")
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--run-dir {run_dir}: {describe_write_error(err, run_dir)}") from None
    path = run_dir / LOCK
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ValueError(f"--run-dir {run_dir}: {describe_write_error(err, path)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirBusy(f"--run-dir {run_dir} is in use by a run still going ({holder}): wait for it to end, "
                             f"stop it, or choose another --run-dir") from None
        try:  # the file may have been removed (and made again) between the open and the lock: lock the new one
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "command": command if len(command) <= 200 else command[:197] + "..."})
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode() + b"\n", 0)
    return RunLock(run_dir, fd, created)


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {record['pid']} on {record['host']}: {record['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said who it is yet"
