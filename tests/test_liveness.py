"""Roles never wait forever and blame the right one: bounded waits, heartbeats, Ctrl-C, duplicate ranks.

Faults are injected deterministically (``BAGPIPE_FAULTS``): a role stops (SIGSTOP) or pauses at a
named point, and the test asserts which role the job names and how soon.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import numpy as np
import pytest
import torch

from bagpipe.runtime.launch import JobFailed, launch_local
from bagpipe.runtime.world import free_port
from bagpipe.storage import RowStore
from bagpipe.optim import make_row_optimizer
from helpers.jobs import BATCH, CACHE, alive, bagpipe_cli, job_config
from helpers.layouts import layout_of

WORLD = ["--world-size", "4", "--world-size-trainers", "2"]


@pytest.fixture
def foreign_listener():
    """A program on the master port that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1], accepted
    listener.close()


@pytest.mark.processes
@pytest.mark.parametrize("role, rank", [("server", "3"), ("trainer", "2")])
def test_a_foreign_listener_on_the_master_port_is_named_within_the_timeout(foreign_listener, role, rank):
    started = time.monotonic()
    port, _ = foreign_listener
    process = bagpipe_cli(role, "--worker-id", rank, *WORLD, "--master-port", str(port), "--timeout", "3")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert "did not answer as the job's store (is another program using that port?)" in err
    assert time.monotonic() - started < 15  # start-up, then the 3 s timeout (once 200 s and more)


@pytest.mark.processes
def test_ctrl_c_ends_a_waiting_role_at_once_with_one_line(foreign_listener):
    port, accepted = foreign_listener
    process = bagpipe_cli("server", "--worker-id", "3", *WORLD, "--master-port", str(port), "--timeout", "60")
    deadline = time.monotonic() + 60
    while not accepted:  # started (however slowly on a busy machine) and connected
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1)  # into the store's handshake, which never returns
    assert process.poll() is None
    interrupted = time.monotonic()
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert time.monotonic() - interrupted < 5
    assert process.returncode == 130
    assert err.strip().endswith("ERROR interrupted (Ctrl-C)") and "Traceback" not in err


@pytest.mark.processes
def test_a_trainer_with_no_oracle_fails_within_its_timeout():
    started = time.monotonic()
    process = bagpipe_cli("trainer", "--worker-id", "2", *WORLD, "--master-port", str(free_port()), "--timeout", "4")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert "cannot reach the oracle's store" in err and "within 4 s" in err
    assert time.monotonic() - started < 12  # once twice the timeout and more


@pytest.mark.processes
def test_a_stopped_trainer_is_named_not_the_healthy_one_that_waits_for_it(small_binary, tmp_path):
    # (replaced instead by default: test_trainer_replacement.py)
    config = job_config(small_binary, tmp_path / "run", iterations=1000, timeout=8.0, replace_trainers=False)
    started = time.monotonic()
    with pytest.raises(JobFailed, match=r"^trainer 1 \(rank 2\) stopped responding .*no heartbeat"):
        launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "trainer1@iteration 20:stop"})
    assert time.monotonic() - started < 40


@pytest.mark.processes
def test_a_stopped_oracle_is_named(small_binary, tmp_path):
    """With its replacement off (a stopped oracle is otherwise killed and replaced: test_oracle_replacement.py)."""
    config = job_config(small_binary, tmp_path / "run", iterations=1000, timeout=8.0, replace_oracle=False)
    with pytest.raises(JobFailed,
                       match=r"^oracle 0 \(rank 0\) stopped responding .*lost oracle \(rank 0\): no heartbeat"):
        launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "oracle@planned 40:stop"})


@pytest.mark.processes
def test_roles_wait_for_an_oracle_that_prepares_its_data_longer_than_the_timeout(small_binary, tmp_path):
    """The oracle converts and checks the data after opening its store; the others wait while it
    is alive (its heartbeat), not for a fixed time: here 10 s of preparation against a 7 s timeout (which every
    RPC of the job then runs under: a fetch parked on a 2-core machine running two jobs once took over 4 s)."""
    config = job_config(small_binary, tmp_path / "run", iterations=20, timeout=7.0)
    summary = launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "oracle@data ready:pause=10"})
    assert summary["iterations"] == 20


@pytest.mark.processes
def test_trainers_wait_for_servers_that_fill_their_tables_longer_than_the_timeout(small_binary, tmp_path):
    """A server on disk fills hundreds of millions of rows before it serves (80 s for 200M rows here): the
    trainers wait while the oracle says so, not for a fixed time; here 10 s of filling against a 7 s timeout."""
    config = job_config(small_binary, tmp_path / "run", iterations=20, timeout=7.0)
    summary = launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "server0@tables filled:pause=10"})
    assert summary["iterations"] == 20


@pytest.mark.processes
def test_two_processes_claiming_one_worker_id_are_told(small_binary, tmp_path):
    port = str(free_port())
    world = ["--world-size", "4", "--world-size-trainers", "2", "--master-port", port, "--timeout", "20"]
    oracle = bagpipe_cli("oracle", "--data", str(small_binary), "--run-dir", str(tmp_path / "run"), "--cache-size",
                         str(CACHE), "--mini-batch-size", str(BATCH), "--worker-id", "0", *world)
    first = bagpipe_cli("trainer", "--worker-id", "1", *world)
    try:
        time.sleep(3)
        second = bagpipe_cli("trainer", "--worker-id", "1", *world)
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2
        assert "--worker-id 1 (trainer 0) is already taken by another process of this job" in err
        assert first.poll() is None  # the first claim stands
    finally:
        for process in (oracle, first):
            process.kill()
            process.wait()


@pytest.mark.processes
def test_the_launcher_quotes_no_unrelated_line_for_a_killed_role(small_binary, tmp_path):
    config = job_config(small_binary, tmp_path / "run", iterations=1000, replace_trainers=False)
    with pytest.raises(JobFailed) as failed:
        launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "trainer0@iteration 5:kill"})
    assert str(failed.value).startswith("trainer 0 (rank 1) failed (killed by SIGKILL): it logged no error; logs in")


@pytest.mark.processes
def test_ctrl_c_ends_a_local_job_with_one_line_and_no_process_left(small_binary, tmp_path):
    run_dir = tmp_path / "run"
    job = bagpipe_cli("train", "--mode", "bagpipe", "--data", str(small_binary), "--run-dir", str(run_dir),
                      "--iterations", "100000", "--batch-size", "128", "--cache-rows", "700", "--emb-dim", "8",
                      "--arch-mlp-bot", "13-16-8", "--arch-mlp-top", "16-1", "--log-every", "5", "--no-progress")
    deadline = time.monotonic() + 180  # start-up on a busy 2-core machine
    while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip()):
        assert job.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    pids = (run_dir / "pids.json").read_text()
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 130
    assert [line for line in err.splitlines() if line.strip()][-1].endswith("ERROR interrupted (Ctrl-C)")
    assert "Traceback" not in err
    assert not [name for name, pid in json.loads(pids).items() if alive(pid)]
    assert not (run_dir / "summary.json").exists()


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
