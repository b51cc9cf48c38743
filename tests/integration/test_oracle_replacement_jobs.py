"""A lost oracle replaced while training goes on: the local launcher serves the job's store, so it outlives the oracle;
the same command started again takes the job over (runtime/succession.py): it re-forms the RPC world around itself,
asks the trainers how far they are, plans again from the start (a pure function of the data and the configuration)
and sends each trainer only what it does not have. The job ends bit for bit as the sliced reference, with no
restart; what it cannot take over restarts the job from its newest checkpoint, as before."""

import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from bagpipe.train.checkpoints import valid_checkpoints
from bagpipe.rundir import export
from helpers.jobs import alive, assert_same_parameters, job_config, reference_of

ITERATIONS = 150  # the faults come by plan 120 (planned ahead: trainers are some 20-30 iterations behind)
PARITY = {"servers": 4, "parity": 3, "check_parity": True}  # the shape: 3 data servers and a parity server


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _no_process_left(run):
    pids = json.loads((run / "pids.json").read_text()).values()
    assert not [pid for pid in pids if alive(pid)]


@pytest.mark.parametrize("optimizer, fault, servers", [
    ("sgd", "oracle@planned 40:kill", PARITY),
    # its replacement is lost too, once it has taken over: a second replacement (epoch 2)
    ("adam", "oracle@planned 40:kill,oracle/1@planned 120:kill", PARITY),
    # stopped, not killed: the launcher sees its heartbeat stop (for 3 s: --liveness-s), kills it and starts its
    # replacement
    ("adagrad", "oracle@planned 60:stop", {"servers": 2, "liveness_s": 3.0}),
    # the partitioned cache: each trainer's own plan messages made again, each sent only what it lacks
    ("adam", "oracle@planned 40:kill", {**PARITY, "cache_mode": "partitioned"})])
def test_a_lost_oracle_is_replaced_while_training_goes_on_and_the_job_ends_bit_for_bit(small_binary, tmp_path,
                                                                                      optimizer, fault, servers):
    from bagpipe.runtime.launch import launch_local

    losses = fault.count(",") + 1
    config = job_config(small_binary, tmp_path / "bagpipe", optimizer=optimizer, iterations=ITERATIONS, timeout=20.0,
                        **servers)
    summary = launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": fault})
    assert_same_parameters(export(config.run_dir, tmp_path / "ours.pt"), reference_of(config, tmp_path / "ref"))
    assert "restarts" not in summary
    assert [f["role"] for f in summary["failures"]] == ["oracle"] * losses
    for epoch, failure in enumerate(summary["failures"], start=1):
        assert failure["replaced"] and failure["epoch"] == epoch
        assert 0 < failure["joined_in_s"] <= failure["resumed_in_s"]
        assert failure["replayed_iterations"] >= 1
    assert [e["epoch"] for e in summary["epochs"]] == list(range(1, losses + 1))
    if servers.get("check_parity"):
        assert summary["parity"][0]["check"]["mismatched_rows"] == [0]
    run = tmp_path / "bagpipe"
    events = [r for r in _records(run) if r.get("event") == "oracle replaced"]
    assert [e["epoch"] for e in events] == list(range(1, losses + 1))
    log = (run / "logs" / "oracle0.log").read_text()
    assert log.count("=== a replacement for the lost process (killed by SIGKILL) ===") == losses
    assert log.count("the lost oracle is replaced: plans served again") == losses
    _no_process_left(run)


@pytest.mark.parametrize("point, outcome", [
    # every part written, trainers past 40: given up once the servers have written their parts (the next
    # checkpoints are deltas from the one at 20)
    ("committing 40", "checkpoint at iteration 40 abandoned: the oracle was lost before it committed it"),
    # begun (the servers keep their snapshots) but no trainer has the plan of 40 yet: begun again and committed
    ("planned 40", "checkpoint at iteration 40 committed")])
def test_checkpoints_the_lost_oracle_had_begun_are_taken_over_and_later_ones_resume_exactly(small_binary, tmp_path,
                                                                                           point, outcome):
    from bagpipe.runtime.launch import launch_local

    config = job_config(small_binary, tmp_path / "bagpipe", optimizer="adagrad", iterations=ITERATIONS, timeout=20.0,
                        servers=2, checkpoint_every=20)
    summary = launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": f"oracle@{point}:kill"})
    reference = reference_of(config, tmp_path / "ref")
    assert_same_parameters(export(config.run_dir, tmp_path / "ours.pt"), reference)
    assert "restarts" not in summary and [f["role"] for f in summary["failures"]] == ["oracle"]
    log = (tmp_path / "bagpipe" / "logs" / "oracle0.log").read_text()
    assert outcome in log.split("=== a replacement for the lost process")[1]
    assert max(chain[-1]["iteration"] for _, chain in valid_checkpoints(tmp_path / "bagpipe")) > 40
    launch_local(replace(config, iterations=ITERATIONS), show_progress=False, resume=True)
    assert_same_parameters(export(config.run_dir, tmp_path / "resumed.pt"), reference)


def test_an_oracle_lost_after_a_trainer_has_left_restarts_the_job_from_its_checkpoint(small_binary, tmp_path):
    """Once a trainer has reported and left, the job's RPC world cannot be re-formed around a replacement: the job
    restarts from its newest checkpoint instead, and still ends bit for bit."""
    from bagpipe.runtime.launch import launch_local

    config = job_config(small_binary, tmp_path / "bagpipe", optimizer="sgd", iterations=60, timeout=20.0,
                        servers=2, checkpoint_every=20)
    summary = launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "oracle@trainers reported:kill"})
    assert_same_parameters(export(config.run_dir, tmp_path / "ours.pt"), reference_of(config, tmp_path / "ref"))
    assert len(summary["restarts"]) == 1 and "oracle" in summary["restarts"][0]["failed"]
    assert "=== a replacement" not in (tmp_path / "bagpipe" / "logs" / "oracle0.log").read_text()


def test_a_hand_started_oracle_lost_is_replaced_by_starting_its_command_again(small_binary, tmp_path):
    """Roles started one by one, the store served by `bagpipe store`: the oracle (--store-served) is SIGKILLed, the
    store sees its heartbeat stop and has a replacement awaited, and the same oracle command started again takes the
    job over; the job ends bit for bit as the sliced reference and the store leaves with the roles."""
    import os

    from bagpipe.runtime.world import free_port
    from helpers.cli_processes import CliProcess

    config = job_config(small_binary, tmp_path / "run", iterations=ITERATIONS, timeout=20.0)
    world = ["--world-size", "5", "--master-port", str(free_port()), "--timeout", "20", "--liveness-s", "4"]
    oracle = ["oracle", "--store-served", "--worker-id", "0", *world, "--world-size-trainers", "2",
                        "--processed-csv", str(small_binary), "--run-dir", config.run_dir, "--mini-batch-size",
                        str(config.batch_size), "--iterations", str(ITERATIONS), "--lookahead-value", "20", "--seed",
                        str(config.seed), "--cache-size", str(config.cache_rows), "--optimizer", config.optimizer,
                        "--lr", str(config.lr), "--max-eval-rows", "2000"]
    model = ["--emb-size", "8", "--arch-mlp-bot", "13-16-8", "--arch-mlp-top", "16-1"]
    env = dict(os.environ, BAGPIPE_FAULTS="oracle@planned 40:kill")
    logs = {}

    def start(name, command):
        logs[name] = tmp_path / f"{name}.log"
        with open(logs[name], "a") as out:
            return CliProcess(command, env=env, cwd=tmp_path, output=out)

    processes = {"store": start("store", ["store", *world])}
    processes["oracle"] = start("oracle", oracle)
    for rank in (1, 2):
        processes[f"trainer{rank}"] = start(f"trainer{rank}", ["trainer", "--worker-id", str(rank), *world, *model])
    for rank in (3, 4):
        processes[f"server{rank}"] = start(f"server{rank}", ["server", "--worker-id", str(rank), *world])
    try:
        assert processes["oracle"].wait(timeout=120) == -9, logs["oracle"].read_text()[-2000:]
        processes["oracle"] = start("oracle", oracle)  # the same command again
        for name, process in processes.items():
            assert process.wait(timeout=180) == 0, f"{name}: {logs[name].read_text()[-3000:]}"
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    assert_same_parameters(export(config.run_dir, tmp_path / "ours.pt"), reference_of(config, tmp_path / "ref"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [f["role"] for f in summary["failures"]] == ["oracle"] and summary["failures"][0]["replaced"]
    assert "start the same `bagpipe oracle` command again" in logs["store"].read_text()
    assert "every role has left: the job's store closes" in logs["store"].read_text()


def _numbering_process(run) -> int | None:
    """The pid of the oracle's numbering process (planner/ahead.py), once the job has started it."""
    try:
        oracle = json.loads((run / "pids.json").read_text())["oracle0"]
    except (OSError, ValueError, KeyError):
        return None
    for proc in Path("/proc").iterdir():
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == oracle and b"bagpipe.planner.ahead" in (proc / "cmdline").read_bytes():
                return int(proc.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


def test_a_killed_numbering_process_loses_the_oracle_which_is_replaced_and_the_job_ends_bit_for_bit(small_binary,
                                                                                                     tmp_path):
    """With --planner-processes 2 the oracle numbers batches in a process of its own: SIGKILLed, it ended the job
    ("failed by its own error, which a restart would meet again"; issue 46's W1). The oracle now ends as a killed
    one ends, and its replacement takes the job over."""
    from bagpipe.runtime.launch import launch_local

    run = tmp_path / "bagpipe"
    config = job_config(small_binary, run, iterations=300, timeout=20.0, planner_processes=2, servers=2)
    killed: list[int] = []

    def kill_the_numbering_process() -> None:
        deadline = time.monotonic() + 120
        while not killed and time.monotonic() < deadline:
            pid = _numbering_process(run)
            if pid is not None:
                time.sleep(1.0)  # (numbering ahead of a trainer held at iteration 10)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_the_numbering_process, daemon=True)
    watcher.start()
    summary = launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "trainer0@iteration 10:pause=6"})
    watcher.join(timeout=5)
    assert killed, "the numbering process was never seen"
    assert "restarts" not in summary
    assert [f["role"] for f in summary["failures"]] == ["oracle"] and summary["failures"][0]["replaced"]
    assert "the oracle's numbering process was lost" in (run / "logs" / "oracle0.log").read_text()
    assert_same_parameters(export(config.run_dir, tmp_path / "ours.pt"), reference_of(config, tmp_path / "ref"))
    _no_process_left(run)
