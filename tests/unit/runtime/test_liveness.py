"""Roles never wait forever and blame the right one: bounded waits, heartbeats, Ctrl-C, duplicate ranks.

Faults are injected deterministically (``BAGPIPE_FAULTS``): a role stops (SIGSTOP) or pauses at a
named point, and the test asserts which role the job names and how soon.
"""


import dataclasses
import json
import time

import numpy as np
import pytest
import torch

from bagpipe.storage import RowStore
from bagpipe.optim import make_row_optimizer
from helpers.layouts import layout_of


def test_a_parked_fetch_whose_caller_gave_up_is_failed_not_kept():
    store = RowStore(layout=layout_of([10], 4), space=0, optimizer=make_row_optimizer("sgd", lr=0.1), seed=0)
    future = store.fetch_async(np.array([3]), np.array([5]))  # version 5 is never written back
    assert store.expire_waiting(timeout=60.0) == 0 and not future.done()
    time.sleep(0.05)
    assert store.expire_waiting(timeout=0.01) == 1
    with pytest.raises(TimeoutError, match="key 3 still lacks write-back version 5"):
        future.wait()
    store.write_back(np.array([3]), torch.zeros(1, 4), torch.zeros(1, 0), version=5)  # nothing left parked
    assert store.expire_waiting(timeout=0.0) == 0


class _Exited:
    def __init__(self, code):
        self.returncode = code

    def poll(self):
        return self.returncode


def _child(tmp_path, role, index, rank, code, status=None):
    """A role that ended with ``code`` (None: still there), having written ``status`` (ExitStatus fields) and a log
    whose text says otherwise: the launcher must decide from the status alone."""
    import dataclasses

    from bagpipe.runtime.exit_status import ExitStatus
    from bagpipe.runtime.launch import Child

    log = tmp_path / f"{role}{index}.log"
    log.write_text(f"12:00:00 {role}[{rank}] INFO started\n" + (
        f"12:00:01 {role}[{rank}] ERROR lost trainer 7 (rank 99): a line the launcher must not read\n" if status else ""))
    child = Child(role, index, rank, _Exited(code), log)
    if status is not None:
        child.status_path.write_text(json.dumps(dataclasses.asdict(ExitStatus(**status))))
    return child


def test_the_launcher_follows_who_lost_whom_to_the_role_that_stopped(tmp_path):
    """The server lost the oracle, which lost trainer 1, which is still there: trainer 1 is named,
    whichever of the others ended first."""
    from bagpipe.runtime.launch import _blame

    lost_trainer1 = "lost trainer 1 (rank 2): no heartbeat for 5 s: it is stopped, hung or gone"
    oracle = _child(tmp_path, "oracle", 0, 0, 3, dict(cause="lost_peer", message=lost_trainer1, peer=2))
    trainer0 = _child(tmp_path, "trainer", 0, 1, 3, dict(cause="lost_peer", message=lost_trainer1, peer=2))
    trainer1 = _child(tmp_path, "trainer", 1, 2, None)
    server = _child(tmp_path, "server", 0, 3, 3, dict(cause="lost_peer", message="lost the oracle (rank 0): the "
                                                      "job's store at 127.0.0.1:1 failed: reset", peer=0))
    children = [oracle, trainer0, trainer1, server]
    for first in (server, oracle, trainer0):  # whoever ended first is the first witness
        for c in (oracle, trainer0, server):
            status = json.loads(c.status_path.read_text())
            c.status_path.write_text(json.dumps({**status, "at": 1000.0 if c is first else 2000.0}))
        message, restartable = _blame(children, [oracle, trainer0, server])
        assert message.startswith("trainer 1 (rank 2) stopped responding") and restartable, message
    trainer1.process.returncode = -9  # gone rather than stopped: named with how it ended
    message, restartable = _blame(children, [oracle, server])
    assert message.startswith("trainer 1 (rank 2) failed (killed by SIGKILL)") and restartable
    trainer1.process.returncode = 1  # its own error: a restart would meet it again
    trainer1.status_path.write_text(json.dumps({"cause": "error", "message": "shape mismatch", "at": 900.0}))
    message, restartable = _blame(children, [oracle, server])
    assert message == "trainer 1 (rank 2) failed (exit code 1): shape mismatch" and not restartable, message


def test_a_trainer_that_lost_its_gradient_group_defers_to_the_one_that_names_the_stopped_role(tmp_path):
    """The oracle stopped; trainer 0 named it and ended; trainer 1's all-reduce then failed on the
    closed connection (a gloo error, no rank). Trainer 1 ended as a lost peer first, yet the
    oracle is named, not trainer 1 nor trainer 0."""
    from bagpipe.runtime.launch import _blame
    from bagpipe.runtime.liveness import LOST_EXIT_CODE
    from bagpipe.runtime.transport import peer_gone

    gloo = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:54493"
    assert peer_gone(RuntimeError(gloo)) and not peer_gone(RuntimeError("shape mismatch"))
    oracle = _child(tmp_path, "oracle", 0, 0, None)
    trainer0 = _child(tmp_path, "trainer", 0, 1, LOST_EXIT_CODE, dict(
        cause="lost_peer", peer=0, at=2000.0, message="lost the oracle (rank 0): the job's store it serves at "
                                                      "127.0.0.1:1 has not answered for 9 s: it is stopped, hung or gone"))
    trainer1 = _child(tmp_path, "trainer", 1, 2, LOST_EXIT_CODE, dict(cause="lost_peer", message=f"lost a peer: {gloo}",
                                                                      at=1000.0))  # ended first
    message, restartable = _blame([oracle, trainer0, trainer1], [trainer0, trainer1])
    assert message.startswith("oracle 0 (rank 0) stopped responding") and restartable, message


def test_a_second_loss_that_could_not_be_recovered_from_says_why(tmp_path):
    """The oracle could have gone on without a lost server, but its recovery failed: the server is blamed, and
    the oracle's reason is quoted because its status says so, whatever its message's words."""
    from bagpipe.runtime.launch import _blame
    from bagpipe.runtime.liveness import LOST_EXIT_CODE

    oracle = _child(tmp_path, "oracle", 0, 0, LOST_EXIT_CODE, dict(cause="lost_peer", peer=3, not_recovered=True,
                                                                   message="server 0 gone; a second loss in a group"))
    server = _child(tmp_path, "server", 0, 3, -9)
    message, restartable = _blame([oracle, server], [oracle])  # (the server, covered by parity, was excused)
    assert message == ("server 0 (rank 3) failed (killed by SIGKILL): it logged no error; oracle 0 (rank 0): server 0 "
                       "gone; a second loss in a group") and restartable, message


def test_every_process_judges_silence_by_the_jobs_liveness_window():
    from bagpipe.config import TrainConfig
    from bagpipe.runtime.world import World, job_world

    trainer = World(rank=1, world_size=4, num_trainers=2)  # a trainer's command line gives no --liveness-s
    assert trainer.liveness_s == 10.0  # from its own --timeout (60 s)
    config = TrainConfig(data="d", run_dir="r", timeout=20.0, liveness_s=3.0)
    assert job_world(trainer, config).liveness_s == 3.0
    assert job_world(trainer, dataclasses.replace(config, liveness_s=0.0)).liveness_s == 10.0  # half of 20 s
    with pytest.raises(ValueError, match=r"--liveness-s 5: the job runs with 3 s"):
        job_world(dataclasses.replace(trainer, liveness=5.0), config)


def test_a_process_taken_for_lost_ends_itself_once_it_sees_its_replacement_asked_for(monkeypatch):
    from datetime import timedelta

    from bagpipe.runtime import liveness as liveness_module
    from bagpipe.runtime.names import REPLACE_PREFIX
    from bagpipe.runtime.world import World, _host_store, free_port

    ended = []
    monkeypatch.setattr(liveness_module, "end_as_lost", ended.append)
    port = free_port()
    store = _host_store(World(rank=0, world_size=4, num_trainers=2, master_port=port), timedelta(seconds=5))
    world = World(rank=2, world_size=4, num_trainers=2, master_port=port, liveness=1.0)
    watching = liveness_module.Liveness(world, watch=[])
    try:
        time.sleep(0.6)
        assert ended == []
        store.set(f"{REPLACE_PREFIX}2", "1")  # the oracle took rank 2 for lost: RPC world 1 awaits its replacement
        deadline = time.monotonic() + 3.0
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ended and "trainer 1 (rank 2) was taken for lost" in ended[0]
    finally:
        watching.stop()
    # the replacement itself (joined in RPC world 1) goes on
    ended.clear()
    replacement = liveness_module.Liveness(dataclasses.replace(world, epoch=1), watch=[])
    time.sleep(0.8)
    replacement.stop()
    assert ended == []
