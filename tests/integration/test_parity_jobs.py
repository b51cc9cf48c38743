"""Erasure-coded shards (storage.parity): the parity is the XOR of its members' bits whatever order deltas arrive
in; a lost shard is rebuilt bit for bit, optimizer state included; training through a loss equals training
without one, bit for bit; a second loss in a group is refused."""

import json

import pytest

from helpers.jobs import alive, assert_same_parameters, job_config, reference_of


@pytest.mark.parametrize("optimizer", ["adam"])  # (Adagrad's parity: in every lost-server case below)
def test_a_job_with_parity_servers_trains_exactly_and_its_parity_matches_its_groups(small_binary, tmp_path,
                                                                                   optimizer):
    """3 data servers and 1 parity server: the same export as the sliced reference, bit for bit, and at the end
    the parity server's XOR equals its group's rows and optimizer state, versions too (--check-parity)."""

    from bagpipe.rundir import export
    from bagpipe.runtime.launch import launch_local

    config = job_config(small_binary, tmp_path / "bagpipe", optimizer=optimizer, servers=4, parity=3,
                        check_parity=True, iterations=60)
    summary = launch_local(config, show_progress=False)
    assert_same_parameters(export(config.run_dir, tmp_path / "ours.pt"), reference_of(config, tmp_path / "ref"))
    (parity,) = summary["parity"]
    assert parity["shards"] == [0, 1, 2] and parity["pending_rows"] == 0
    assert parity["deltas_applied"] == summary["rows_written_back"] > 0  # every write-back's delta, once
    assert parity["check"]["mismatched_rows"] == [0] and parity["check"]["rows"][0] > 0


@pytest.mark.parametrize("optimizer, fault", [("sgd", "server0@write-back 27:kill"),
                                              ("adam", "server2@delta sent 33:kill"),
                                              # the parity server takes 1 s over each delta of iteration 20:
                                              # the group's write-backs of 20 are unacknowledged around the kill
                                              # (the same kill without the pause: test_replacement_jobs' partitioned
                                              # job)
                                              ("adagrad", "server1@write-back 20:kill,server3@delta 20:pause=1")])
def test_a_job_goes_on_through_a_killed_server_and_ends_bit_for_bit_as_without(small_binary, tmp_path, optimizer,
                                                                                 fault):
    """SIGKILL a data server mid-write-back (received, not stored; or stored with its delta sent, never
    acknowledged): its shard moves to the parity server, which serves it rebuilt from the group, and the job
    ends with the export of the sliced reference, bit for bit, its parity still equal to the group."""

    from bagpipe.rundir import export
    from bagpipe.runtime.launch import launch_local

    config = job_config(small_binary, tmp_path / "bagpipe", optimizer=optimizer, servers=4, parity=3,
                        check_parity=True, iterations=60, timeout=20.0)
    summary = launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": fault})
    assert_same_parameters(export(config.run_dir, tmp_path / "ours.pt"), reference_of(config, tmp_path / "ref"))
    lost = int(fault[len("server")])
    (failure,) = summary["failures"]
    assert failure["role"] == f"server {lost}" and failure["parity_server"] == 3
    (parity,) = summary["parity"]
    # the parity server stands in to the end, or until a replacement process takes the shard back (this job
    # is short: one seldom joins in time; test_replacement's jobs are long enough)
    served = parity.get("standing_in") or parity["handed_back"][0]
    assert served["shard"] == lost and served["rebuilt_after_s"] is not None
    assert parity["check"]["mismatched_rows"] == [0] and parity["pending_rows"] == 0


def test_a_second_server_lost_in_a_group_fails_the_job_clearly_and_leaves_no_process(small_binary, tmp_path):
    """Two data servers of one group killed (the second while the first is served by the parity server):
    parity covers one loss per group, so the job fails, saying so and naming the way on."""

    from bagpipe.runtime.launch import JobFailed, launch_local

    config = job_config(small_binary, tmp_path / "bagpipe", servers=4, parity=3, iterations=60, timeout=20.0,
                        replace_data_servers=False)  # the first not replaced before the second
    with pytest.raises(JobFailed, match=r"server 2 is the second server lost in its parity group \(servers 0, 1, "
                                        r"2\): parity covers one loss per group; resume from the newest checkpoint"):
        launch_local(config, show_progress=False,
                     env={"BAGPIPE_FAULTS": "server1@write-back 20:kill,server2@write-back 40:kill"})
    pids = json.loads((tmp_path / "bagpipe" / "pids.json").read_text()).values()
    assert not [pid for pid in pids if alive(pid)]


def test_checkpoints_after_a_server_was_lost_are_taken_from_its_stand_in(small_binary, tmp_path):
    """Checkpoints every 10 iterations, a data server killed at 15: the later snapshots of its shard come from
    the parity server (which counts the shard's write-backs, the lost server's included), and the run ends as
    the reference; a run resumed from such a checkpoint restores its parity from it."""
    from dataclasses import replace


    from bagpipe.rundir import export
    from bagpipe.runtime.launch import launch_local

    config = job_config(small_binary, tmp_path / "lost", optimizer="adagrad", servers=4, parity=3, iterations=50,
                        timeout=20.0, checkpoint_every=10, check_parity=True)
    summary = launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "server1@write-back 15:kill"})
    assert [f["role"] for f in summary["failures"]] == ["server 1"]
    want = reference_of(config, tmp_path / "ref")
    assert_same_parameters(export(config.run_dir, tmp_path / "lost.pt"), want)

    # a trainer lost, not replaced: restarted instead
    broken = replace(config, run_dir=str(tmp_path / "broken"), replace_trainers=False)
    summary = launch_local(broken, show_progress=False, env={"BAGPIPE_FAULTS": "trainer1@iteration 33:kill"})
    # from 30, or from 20 where 30 was not committed yet when the trainer died (the kill races the commit): both
    # were taken after the loss at 15, so either restores its parity from a snapshot the stand-in gave
    assert summary["restarts"][0]["resumed_from"] == summary["resumed_at"] in (20, 30)
    assert summary["parity"][0]["check"]["mismatched_rows"] == [0]
    assert_same_parameters(export(broken.run_dir, tmp_path / "broken.pt"), want)


def test_a_checkpoint_whose_server_is_lost_while_writing_it_is_abandoned_and_the_next_ones_still_restore(
        small_binary, tmp_path):
    """Server 1 killed writing its part of the checkpoint at 20: that checkpoint is given up, training goes on,
    and the next delta holds everything since 10; a trainer killed at 43 (not covered) ends the job, which
    the launcher starts again from 40 (10's base, 30's and 40's deltas), or from 30 if 40 was not committed yet
    (it races the trainers' next 3 iterations): either way across the abandoned one, to the reference's export."""

    from bagpipe.train.checkpoints import checkpoints_dir, step_name
    from bagpipe.rundir import export
    from bagpipe.runtime.launch import launch_local

    config = job_config(small_binary, tmp_path / "run", optimizer="adam", servers=4, parity=3, iterations=50,
                        timeout=20.0, checkpoint_every=10, keep_checkpoints=5, replace_trainers=False)
    summary = launch_local(config, show_progress=False,
                           env={"BAGPIPE_FAULTS": "server1@checkpoint 20 written:kill,trainer1@iteration 43:kill"})
    [restart] = summary["restarts"]
    assert restart["failed"].startswith("trainer 1") and restart["resumed_from"] == summary["resumed_at"]
    assert summary["resumed_at"] in (30, 40)
    kept = {d.name for d in checkpoints_dir(config.run_dir).iterdir()}
    assert {step_name(10), step_name(30)} <= kept and step_name(20) not in kept
    assert_same_parameters(export(config.run_dir, tmp_path / "run.pt"), reference_of(config, tmp_path / "ref"))
