"""Roles never wait forever and blame the right one: bounded waits, heartbeats, Ctrl-C, duplicate ranks.

Faults are injected deterministically (``BAGPIPE_FAULTS``): a role stops (SIGSTOP) or pauses at a
named point, and the test asserts which role the job names and how soon.
"""


import json
import signal
import socket
import threading
import time

import pytest

from bagpipe.runtime.launch import JobFailed, launch_local
from bagpipe.runtime.world import free_port
from helpers.jobs import BATCH, CACHE, alive, bagpipe_cli, job_config

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


@pytest.mark.parametrize("role, rank", [("trainer", "2")])  # (a server meets the store's listener alike)
def test_a_foreign_listener_on_the_master_port_is_named_within_the_timeout(foreign_listener, role, rank):
    started = time.monotonic()
    port, _ = foreign_listener
    process = bagpipe_cli(role, "--worker-id", rank, *WORLD, "--master-port", str(port), "--timeout", "3")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert "did not answer as the job's store (is another program using that port?)" in err
    assert time.monotonic() - started < 15  # start-up, then the 3 s timeout (once 200 s and more)


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


def test_a_trainer_with_no_oracle_fails_within_its_timeout():
    started = time.monotonic()
    process = bagpipe_cli("trainer", "--worker-id", "2", *WORLD, "--master-port", str(free_port()), "--timeout", "4")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert "cannot reach the oracle's store" in err and "within 4 s" in err
    assert time.monotonic() - started < 12  # once twice the timeout and more


def test_a_stopped_trainer_is_named_not_the_healthy_one_that_waits_for_it(small_binary, tmp_path):
    # (replaced instead by default: test_trainer_replacement.py)
    config = job_config(small_binary, tmp_path / "run", iterations=1000, timeout=8.0, replace_trainers=False)
    started = time.monotonic()
    with pytest.raises(JobFailed, match=r"^trainer 1 \(rank 2\) stopped responding .*no heartbeat"):
        launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "trainer1@iteration 20:stop"})
    assert time.monotonic() - started < 40


def test_a_stopped_oracle_is_named(small_binary, tmp_path):
    """With its replacement off (a stopped oracle is otherwise killed and replaced: test_oracle_replacement.py)."""
    config = job_config(small_binary, tmp_path / "run", iterations=1000, timeout=8.0, replace_oracle=False)
    with pytest.raises(JobFailed,
                       match=r"^oracle 0 \(rank 0\) stopped responding .*lost oracle \(rank 0\): no heartbeat"):
        launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "oracle@planned 40:stop"})


def test_roles_wait_for_an_oracle_that_prepares_its_data_longer_than_the_timeout(small_binary, tmp_path):
    """The oracle converts and checks the data after opening its store; the others wait while it
    is alive (its heartbeat), not for a fixed time: here 10 s of preparation against a 7 s timeout (which every
    RPC of the job then runs under: a fetch parked on a 2-core machine running two jobs once took over 4 s)."""
    config = job_config(small_binary, tmp_path / "run", iterations=20, timeout=7.0)
    summary = launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "oracle@data ready:pause=10"})
    assert summary["iterations"] == 20


def test_trainers_wait_for_servers_that_fill_their_tables_longer_than_the_timeout(small_binary, tmp_path):
    """A server on disk fills hundreds of millions of rows before it serves (80 s for 200M rows here): the
    trainers wait while the oracle says so, not for a fixed time; here 10 s of filling against a 7 s timeout."""
    config = job_config(small_binary, tmp_path / "run", iterations=20, timeout=7.0)
    summary = launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "server0@tables filled:pause=10"})
    assert summary["iterations"] == 20


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


def test_the_launcher_quotes_no_unrelated_line_for_a_killed_role(small_binary, tmp_path):
    config = job_config(small_binary, tmp_path / "run", iterations=1000, replace_trainers=False)
    with pytest.raises(JobFailed) as failed:
        launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "trainer0@iteration 5:kill"})
    assert str(failed.value).startswith("trainer 0 (rank 1) failed (killed by SIGKILL): it logged no error; logs in")


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
