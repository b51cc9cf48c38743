"""The local launcher starts a job that lost a process parity does not cover again from its newest checkpoint.

Faults are injected deterministically (``BAGPIPE_FAULTS``; ``ROLE#1@...`` is meant for the first restart): a
role is SIGKILLed at an iteration the test chooses, the launcher restarts the job, and the export equals
the reference's (so the job's with no failure) bit for bit. What a restart cannot help (a role's own error,
which the deterministic job would meet again; the bound on restarts; no checkpoint yet) fails clearly.
"""


import json
from pathlib import Path

import pytest

from bagpipe.rundir import export
from bagpipe.runtime.launch import JobFailed, launch_local
from helpers.jobs import alive, assert_same_parameters, job_config, reference_of


@pytest.mark.parametrize("optimizer, parity, fault, cache_mode", [
    ("sgd", 3, "trainer1@iteration 33:kill", "replicated"),  # a trainer: parity does not cover it
    ("adam", 3, "oracle@planned 45:kill", "replicated"),  # the oracle, with its replacement off (replace_oracle)
    ("adagrad", 0, "server1@write-back 40:kill", "replicated"),  # a server, with no parity
    # the parity server, standing in for a lost data server: the group has lost two, and the RPC world cannot be
    # re-formed around a replacement while server 1's rank is gone for good
    ("adagrad", 3, "server1@write-back 20:kill,server3@delta 40:kill", "replicated"),
    # the partitioned cache: every trainer's part of each checkpoint (its own rows), and the plan replayed to it
    ("adam", 0, "trainer1@iteration 33:kill", "partitioned"),
    ("adagrad", 3, "server1@write-back 20:kill,server3@delta 40:kill", "partitioned"),
])
def test_a_job_that_loses_a_process_restarts_from_its_checkpoint_to_the_same_export(small_binary, tmp_path,
                                                                                   optimizer, parity, fault,
                                                                                   cache_mode):
    # (a data server's replacement that took its shard back before the second loss would cover that loss too)
    config = job_config(small_binary, tmp_path / "run", optimizer=optimizer, servers=4, parity=parity,
                        iterations=50, timeout=10.0, checkpoint_every=10, replace_data_servers=False,
                        replace_oracle=False, replace_trainers=False, cache_mode=cache_mode)
    summary = launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": fault})
    [restart] = summary["restarts"]
    assert restart["attempt"] == 1 and fault.split("@")[0].rstrip("0123456789") in restart["failed"]
    assert restart["resumed_from"] in (10, 20, 30, 40) and summary["resumed_at"] == restart["resumed_from"]
    assert restart["iterations_redone"] == max(restart["iteration_reached"] - restart["resumed_from"], 0)
    assert 0 < restart["resumed_in_s"] <= restart["caught_up_in_s"]
    assert summary["iterations"] == 50
    assert_same_parameters(export(config.run_dir, tmp_path / "run.pt"), reference_of(config, tmp_path / "ref"))
    trainer_log = (Path(config.run_dir) / "logs" / "trainer0.log").read_text()
    assert "=== restart 1: the job starts again from its checkpoint" in trainer_log
    pids = json.loads((Path(config.run_dir) / "pids.json").read_text())
    assert not [name for name, pid in pids.items() if alive(pid)]


@pytest.mark.parametrize("fault, overrides, why", [
    ("trainer1@iteration 23:fail", {}, "it failed by its own error, which a restart would meet again"),
    ("trainer1@iteration 23:kill,trainer1#1@iteration 33:kill", {"max_restarts": 1}, "--max-restarts 1 reached"),
    ("trainer1@iteration 5:kill", {}, "no checkpoint written yet"),
])
def test_a_failure_a_restart_cannot_help_ends_the_job_saying_why(small_binary, tmp_path, fault, overrides, why):
    config = job_config(small_binary, tmp_path / "run", iterations=50, timeout=10.0, checkpoint_every=10,
                        replace_trainers=False, **overrides)
    with pytest.raises(JobFailed, match=r"^trainer 1 \(rank 2\) failed .*; not restarted: " + why.replace(
            "-", r"\-")) as failed:
        launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": fault})
    assert ("a fault injected at 'iteration 23'" in str(failed.value)) == fault.endswith(":fail")
    assert not (Path(config.run_dir) / "summary.json").exists()
    restarted = "=== restart 1" in (Path(config.run_dir) / "logs" / "oracle0.log").read_text()
    assert restarted == ("max-restarts" in why)
    pids = json.loads((Path(config.run_dir) / "pids.json").read_text())
    assert not [name for name, pid in pids.items() if alive(pid)]


def test_a_job_without_checkpoints_fails_as_before(small_binary, tmp_path):
    config = job_config(small_binary, tmp_path / "run", iterations=30, timeout=10.0, replace_trainers=False)
    with pytest.raises(JobFailed) as failed:
        launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "trainer1@iteration 13:kill"})
    assert str(failed.value).startswith("trainer 1 (rank 2) failed (killed by SIGKILL)")
    assert "not restarted" not in str(failed.value)
