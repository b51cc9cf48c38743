"""The local launcher's decisions, in one process: whom to replace and which exits the job goes on without come from
what the oracle wrote to the job's store (its record, the epoch a replacement joins, the end of training), never from
metrics.jsonl. Processes are stand-ins that report the exit codes a job's would; the store is an in-process one."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch.distributed as dist

from bagpipe.runtime.names import REPLACE_PREFIX, SERVER_LOST, STATE_KEY, STOP_KEY
from bagpipe.runtime.launch import Child, JobFailed, _JobState, _MetricsTail, _supervise
from bagpipe.runtime.succession import JobRecord

# oracle 0, trainers 1-2, data servers 3-4 (shards 0-1), the parity server 5
ROLES = [("oracle", 0), ("trainer", 0), ("trainer", 1), ("server", 0), ("server", 1), ("server", 2)]
SERVERS = {3, 4, 5}
GUARD_S = 8.0


class Stand:
    """A process that has ended with ``code`` (None: still running)."""

    def __init__(self, code: int | None = None) -> None:
        self.returncode, self.pid = code, 0

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self.returncode = -9

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


class Job:
    """Children standing in for a job's roles, the store the oracle writes to, an empty metrics.jsonl (in ``folder``).
    ``replacements``: how each replacement started ends (None: it runs the job to its end with the rest; -9: it is
    killed at once)."""

    def __init__(self, folder, codes: dict[int, int], *, replacements: tuple = (None,)) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.replacements = folder, list(replacements)
        self.store = dist.HashStore()
        self.metrics_path = folder / "metrics.jsonl"
        self.metrics_path.write_text("")
        self.replaced: list[int] = []
        self.children = [self.child(rank, codes.get(rank)) for rank in range(len(ROLES))]

    def child(self, rank: int, code: int | None) -> Child:
        role, index = ROLES[rank]
        log_path = self.folder / f"{role}{index}.{len(self.replaced)}.log"
        log_path.write_text("")
        return Child(role, index, rank, Stand(code), log_path)

    def record(self, **fields) -> None:
        self.store.set(STATE_KEY, JobRecord(started_at=0.0, **fields).to_json())

    def replace(self, lost: Child) -> Child:
        """The launcher's replace: a new process for the rank, ending as ``replacements`` says."""
        self.replaced.append(lost.rank)
        ends = self.replacements.pop(0)
        child = self.child(lost.rank, ends)
        self.children[self.children.index(lost)] = child
        if ends is None:
            self.end_all()
        return child

    def end_all(self) -> None:
        for child in self.children:
            if child.process.returncode is None:
                child.process.returncode = 0

    def end_after(self, seconds: float) -> None:
        """Every process still running ends (as the job does) ``seconds`` from now: a launcher that failed the job
        on an exit it should have let go does so first."""
        threading.Timer(seconds, self.end_all).start()

    def supervise(self, *, grace_s: float = 0.5) -> None:
        """The launcher's loop over these children, until they have all ended (after GUARD_S, whatever the launcher
        waited for, the job ends: a launcher that would wait for ever fails the test instead of hanging it)."""
        guard = threading.Timer(GUARD_S, self.end_all)
        guard.start()
        try:
            _supervise(self.children, _MetricsTail(self.metrics_path), _JobState(self.store), total=10,
                       show_progress=False, covered=SERVERS | {1, 2}, grace_s=grace_s, replace=self.replace)
        finally:
            guard.cancel()


LOST = {"role": "server 1", "server": 1, "rank": 4, "parity_server": 5, "at": 1.0}


def test_a_lost_server_is_replaced_once_the_store_names_the_world_its_replacement_joins(tmp_path):
    job = Job(tmp_path, {4: -9})
    job.record(failures=[{**LOST, "epoch": 1}], replacing=[4])
    job.store.set(f"{REPLACE_PREFIX}4", "1")
    job.supervise()
    assert job.replaced == [4]


def test_no_replacement_starts_before_its_epoch_is_set_and_none_from_the_log(tmp_path):
    """The record says a replacement is under way but the key it joins by is not set yet (the oracle writes the
    record a moment before): nothing starts, and a "server lost" event in metrics.jsonl changes nothing either;
    the job fails once the grace is over. Set within the grace, the replacement starts then."""
    job = Job(tmp_path / "never", {4: -9})
    job.record(failures=[{**LOST, "epoch": 1}], replacing=[4])
    job.metrics_path.write_text(json.dumps({"event": SERVER_LOST, "server": 1, "replaced": True}) + "\n")
    state = _JobState(job.store)
    state.read()
    assert state.awaited(4) == 0 and not state.awaits_newer(4, than=0)
    with pytest.raises(JobFailed, match=r"server 1 \(rank 4\) failed \(killed by SIGKILL\)"):
        job.supervise(grace_s=0.3)
    assert job.replaced == []

    later = Job(tmp_path / "later", {4: -9})
    later.record(failures=[{**LOST, "epoch": 1}], replacing=[4])
    threading.Timer(0.3, later.store.set, (f"{REPLACE_PREFIX}4", "1")).start()
    later.supervise(grace_s=5.0)
    assert later.replaced == [4]


def test_a_data_server_whose_shard_moved_for_good_is_excused(tmp_path):
    """No replacement asked for (the record's latest failure of the rank has no epoch): the job goes on without it."""
    job = Job(tmp_path, {4: -9})
    job.record(failures=[LOST])
    state = _JobState(job.store)
    state.read()
    assert state.moved_for_good(4) and not state.moved_for_good(3)
    job.end_after(1.0)
    job.supervise(grace_s=0.3)  # returns: the exit was excused (else JobFailed after the grace)
    assert job.replaced == []


def test_a_replacement_lost_before_it_took_its_shard_back_waits_for_the_oracles_next_epoch(tmp_path):
    """The first replacement dies at once: the stand-in still serves the shard (as when none is asked for), but the
    record's latest failure of the rank asked for a replacement, so the launcher waits for the oracle's word and
    starts the second replacement once the next epoch is set, not before."""
    job = Job(tmp_path, {4: -9}, replacements=(-9, None))
    job.record(failures=[{**LOST, "epoch": 1}], replacing=[4])
    job.store.set(f"{REPLACE_PREFIX}4", "1")

    before_the_second: list[int] = []

    def oracle_asks_again():
        before_the_second.extend(job.replaced)  # one replacement only, until the oracle asks for the next
        job.record(failures=[{**LOST, "epoch": 1}, {**LOST, "epoch": 2}], replacing=[4])
        job.store.set(f"{REPLACE_PREFIX}4", "2")

    threading.Timer(0.5, oracle_asks_again).start()
    job.supervise(grace_s=5.0)
    assert before_the_second == [4] and job.replaced == [4, 4]


def test_a_trainer_that_reported_and_any_role_after_training_ended_are_not_needed(tmp_path):
    """Neither fails the job (each would, after the grace, if the launcher thought the job needed it)."""
    job = Job(tmp_path / "reported", {2: -9})
    job.record(done=[1])  # trainer 1 (rank 2) has reported
    job.end_after(1.0)
    job.supervise(grace_s=0.3)

    ended = Job(tmp_path / "ended", {1: -9, 3: 1})  # (server 0's own error too)
    ended.store.set(STOP_KEY, "1")
    ended.end_after(1.0)
    ended.supervise(grace_s=0.3)


def test_a_killed_trainer_the_oracle_does_not_replace_fails_the_job_after_the_grace(tmp_path):
    job = Job(tmp_path, {2: -9})
    job.record()
    started = time.monotonic()
    with pytest.raises(JobFailed, match=r"trainer 1 \(rank 2\) failed \(killed by SIGKILL\)"):
        job.supervise(grace_s=0.4)
    assert time.monotonic() - started >= 0.4 and job.replaced == []


@pytest.mark.parametrize("checkpoints", [True, False])
def test_a_full_disk_is_named_as_resumable_not_as_an_error_a_restart_would_meet_again(tmp_path, checkpoints):
    """(Issue 46's W3: a full disk ended the job "not restarted: it failed by its own error, which a restart would
    meet again", though freeing space and resuming goes on.)"""
    from bagpipe.config import TrainConfig
    from bagpipe.runtime.launch import _restart

    config = TrainConfig(data="d", run_dir=str(tmp_path / "run"), mode="bagpipe", max_restarts=2,
                         checkpoint_every=10 if checkpoints else 0)
    full = JobFailed("oracle 0 (rank 0) failed (exit code 1): no space left on /dev/x while writing f", no_space=True)
    with pytest.raises(JobFailed) as ended:
        _restart(config, full, done=0)
    assert "the disk is full: free space there, then" in str(ended.value)
    assert "start the run again (`bagpipe train ... --run-dir" in str(ended.value)  # (no checkpoint written here)
    assert "would meet again" not in str(ended.value) and ended.value.no_space
    with pytest.raises(JobFailed, match="would meet again" if checkpoints else "exit code 1"):  # its own error
        _restart(config, JobFailed("trainer 0 (rank 1) failed (exit code 1): ValueError: x"), done=0)
