"""How a role process ended, in its own words, for the local launcher to decide from: a small JSON file
the launcher names for each process it starts (``BAGPIPE_STATUS_FILE``), written once as the role exits.

The role's log is for people; this record is for decisions (whom to blame, whether a restart can help):
the cause, the message, the rank of the peer whose loss ended the role, and when. A process killed by a
signal writes none; the launcher then knows it from the exit code and from when it saw the process end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

STATUS_FILE_ENV = "BAGPIPE_STATUS_FILE"

# no_space: a write met a full disk (or quota): freeing space and resuming goes on, as a restart alone would not
Cause = Literal["error", "lost_peer", "interrupted", "no_space"]


class Terminated(BaseException):
    """SIGTERM, the way schedulers, systemd, ``timeout`` and Kubernetes stop a job: raised in the main thread as
    Ctrl-C's KeyboardInterrupt is, so that the same clean-up runs (roles stopped, working files removed)."""


@dataclass(frozen=True, kw_only=True)
class PeerLost:
    """A peer this role needs is lost: which (its rank; None when the failure could not tell), and why.
    ``not_recovered``: the job could have gone on without it, but that failed (the message says why)."""

    message: str
    peer: int | None = None
    not_recovered: bool = False

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True, kw_only=True)
class ExitStatus:
    """A role's own account of its end."""

    cause: Cause
    message: str
    peer: int | None = None  # cause "lost_peer": the rank of the peer it lost, if it knew
    not_recovered: bool = False  # cause "lost_peer": the job could have gone on without the peer, but that failed
    at: float = field(default_factory=time.time)  # wall time of the exit

    @classmethod
    def lost(cls, lost: PeerLost) -> "ExitStatus":
        return cls(cause="lost_peer", message=lost.message, peer=lost.peer, not_recovered=lost.not_recovered)


def record_exit(status: ExitStatus) -> None:
    """Write ``status`` where this process's launcher asked (nowhere if it did not); never raises: the
    process is ending, and its exit code still says the essential."""
    path = os.environ.get(STATUS_FILE_ENV)
    if not path:
        return
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as handle:
            handle.write(json.dumps(dataclasses.asdict(status)) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


def read_exit(path: Path) -> ExitStatus | None:
    """The status a role wrote at ``path``, or None if it wrote none (killed by a signal) or it is unreadable."""
    try:
        return ExitStatus(**json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return None
