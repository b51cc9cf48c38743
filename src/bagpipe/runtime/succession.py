"""What a lost oracle's replacement takes over that the data and the configuration do not decide.

The plan is a pure function of the data order and the configuration, so a replacement plans again from the
start; what it cannot compute is kept where it outlives the oracle: the job's record (lost roles, servers ready,
trainers done) in the store the local launcher serves, each trainer's progress (asked of the trainers) and the
checkpoints staged in the run dir. A loss the replacement cannot take over ends the oracle with
``NOT_REPLACEABLE_EXIT_CODE``: the launcher then restarts the job from its newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field

from bagpipe.runtime.names import (BEAT_PREFIX, EPOCH_KEY, EXITED_PREFIX, JOINING_PREFIX, LOST_AT_PREFIX,
                                   REPLACE_PREFIX, STATE_KEY)

NOT_REPLACEABLE_EXIT_CODE = 4  # an oracle's replacement that cannot take the job over: restart it instead
MAX_ORACLE_REPLACEMENTS = 3  # per run of the job: a cause that kills every replacement ends in a restart


class NotReplaceable(RuntimeError):
    """This replacement oracle cannot take the job over (the launcher restarts the job from its checkpoint)."""


@dataclass(kw_only=True)
class Failure:
    """A process the job lost and went on without (summary.json's "failures", the job's record): what it was, when,
    what the oracle did about it and how long recovering took. Fields that do not apply stay None (and out of its
    JSON); ``figures``: what its replacement reported as it became whole (rows copied, seconds taken, ...)."""

    role: str  # "server 1", "trainer 0", "oracle"
    rank: int
    at: float  # when it was lost (wall time)
    planned_iteration: int | None = None  # the last iteration the oracle had planned by then
    trainer: int | None = None  # a trainer's index
    server: int | None = None  # a server's index (data or parity)
    parity_server: int | None = None  # a data server's: the parity server that serves its shard since
    parity_of: list[int] | None = None  # a parity server's: its group's data servers
    moved_in_s: float | None = None  # a data server's: how long moving its shard to the parity server took
    epoch: int | None = None  # the RPC world its replacement joins; None: no replacement was asked for
    replaced: bool | None = None  # True once the replacement is whole; False: that replacement was lost too
    joined_in_s: float | None = None  # from the loss to the replacement in the job's RPC world
    recovered_in_s: float | None = None  # from the loss to the replacement whole
    replayed_iterations: int | None = None  # an oracle's replacement: iterations it planned again
    replay_s: float | None = None
    resumed_in_s: float | None = None
    figures: dict = field(default_factory=dict)

    @property
    def moved_for_good(self) -> bool:
        """A data server whose shard its parity server serves, with no replacement asked for."""
        return self.parity_server is not None and self.epoch is None

    def to_dict(self) -> dict:
        fields = {name: value for name, value in dataclasses.asdict(self).items()
                  if value is not None and name != "figures"}
        return {**fields, **self.figures}

    @classmethod
    def from_dict(cls, values: dict) -> "Failure":
        names = {f.name for f in dataclasses.fields(cls)} - {"figures"}
        return cls(**{k: v for k, v in values.items() if k in names},
                   figures={k: v for k, v in values.items() if k not in names})


@dataclass(kw_only=True)
class JobRecord:
    """The oracle's bookkeeping that no other role keeps: written to the store at every change, read by a
    replacement oracle."""

    started_at: float  # when the job's first oracle started (wall time): start-up and train time count from it
    servers_ready: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)  # lost roles the job went on without (summary.json's)
    replacing: list[int] = field(default_factory=list)  # ranks whose replacement was awaited
    done: list[int] = field(default_factory=list)  # trainers that reported: they left the RPC world
    reformed: list[dict] = field(default_factory=list)  # the re-formations of the RPC world (summary's "epochs")

    def __post_init__(self) -> None:
        self.failures = [f if isinstance(f, Failure) else Failure.from_dict(f) for f in self.failures]

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "failures": [f.to_dict() for f in self.failures]})

    @classmethod
    def from_json(cls, text: str) -> "JobRecord":
        return cls(**json.loads(text))

    def why_not_replaceable(self, world) -> str | None:
        """Why a lost oracle cannot be replaced, as this record stands; None if it can."""
        if self.done:
            return (f"trainer {self.done[0]} had reported done and left the job's RPC world, which cannot be "
                    f"re-formed without it")
        if self.replacing:
            return f"a replacement for {world.label(self.replacing[0])} was under way"
        gone = [f.role for f in self.failures if not f.replaced]
        if gone:  # its rank cannot take part in a new RPC world
            return f"{gone[0]} was lost for good"
        return None


class RecordKeeper:
    """Writes the oracle's JobRecord to the store whenever it changes (``save``)."""

    def __init__(self, record: JobRecord, *, store) -> None:
        self.record, self.store = record, store
        self._lock = threading.Lock()

    def save(self, **changes) -> None:
        """Apply ``changes`` (fields of the record) and write it."""
        with self._lock:
            for name, value in changes.items():
                setattr(self.record, name, value)
            self.store.set(STATE_KEY, self.record.to_json())


def load_record(store) -> JobRecord | None:
    """The job's record as its lost oracle last wrote it; None if it wrote none."""
    if not store.check([STATE_KEY]):
        return None
    return JobRecord.from_json(store.get(STATE_KEY).decode())


def declare_oracle_lost(store, how: str, *, lost_at: float | None = None) -> int:
    """(Whoever serves the store: the local launcher, ``bagpipe store``) The oracle is lost (``how``; ``lost_at``:
    when, wall time, default now): have a replacement awaited (``bagpipe/replace/0``: the epoch of the RPC world it
    will form) and the others told (their heartbeat watches then await it); the same ``bagpipe oracle`` command
    started again joins as the replacement. Returns the epoch."""

    epoch = (int(store.get(EPOCH_KEY)) if store.check([EPOCH_KEY]) else 0) + 1
    store.delete_key(f"{JOINING_PREFIX}0")  # (set by an earlier replacement)
    store.set(f"{LOST_AT_PREFIX}0", repr(time.time() if lost_at is None else lost_at))
    store.set(f"{REPLACE_PREFIX}0", str(epoch))
    store.set(f"{EXITED_PREFIX}0", how)
    return epoch


class OracleWatch:
    """(Whoever serves the store) Whether the oracle's heartbeat has stopped for the liveness window: judged once
    it has beaten, and not while a replacement is awaited (until it says it is ready)."""

    def __init__(self, world, store) -> None:
        self.world, self.store = world, store
        self._beats: tuple[int, float] | None = None  # its beat count, and when it last changed

    def silent_s(self) -> float | None:
        """How long the oracle has been silent, once that is past the liveness window; else None."""

        if self.store.check([f"{REPLACE_PREFIX}0"]) and not self.store.check([f"{JOINING_PREFIX}0"]):
            self._beats = None  # a replacement is awaited
            return None
        count, now = self.store.add(f"{BEAT_PREFIX}0", 0), time.monotonic()
        if self._beats is None or count != self._beats[0]:
            self._beats = (count, now)
            return None
        silent = now - self._beats[1]
        return silent if count and silent > self.world.liveness_s else None


def replayed_from(progress: list[dict], *, start: int, redo_depth: int) -> int:
    """The first iteration whose plan messages a replacement oracle makes again (those before are planned again
    only to know what follows): every trainer's messages from ``redo_depth`` before the last iteration it stepped
    on are kept (a lost trainer's replacement may pull them), the rest are new."""
    return max(start, min(p["finished"] for p in progress) - redo_depth + 1)
