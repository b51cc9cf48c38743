"""The distributed runtime (oracle, servers, trainers as processes) against the reference trainer."""


import json
import os
import signal
import time
from pathlib import Path

import pytest

from bagpipe.rundir import export
from bagpipe.runtime.launch import JobFailed, launch_local
from bagpipe.runtime.world import free_port
from helpers.jobs import BATCH, CACHE, CUDA, ITERATIONS, alive, assert_same_parameters, bagpipe_cli, job_config, reference_of


# The reference computes each batch's gradient as the trainers do (--slices T: per-slice backward,
# slice sums added in trainer order), so every optimizer must match bit for bit, across evictions
# and re-fetches, with two trainers (gloo's all-reduce: one sum of two operands) and with three
# (the ordered all-to-all reduction). On a GPU (where there is one: --device, the trainers' models and caches there,
# every trainer on the same GPU) against the reference on it.
# (the SGD job plans with --planner-processes 2: its batches numbered in a process of their own, the same plan)
# (Adagrad with lookahead and 2 trainers, the defaults, is in its LRU and 3-trainer cases, and in test_models_jobs)
@pytest.mark.parametrize("optimizer, policy, trainers, device", [
    ("sgd", "lookahead", 2, "cpu"), ("adagrad", "lru", 2, "cpu"),
    ("adam", "lookahead", 2, "cpu"), ("adam", "lookahead", 1, "cpu"), ("adagrad", "lookahead", 3, "cpu"),
    pytest.param("adam", "lookahead", 2, "cuda", marks=CUDA), pytest.param("adagrad", "lru", 1, "cuda", marks=CUDA)])
def test_bagpipe_mode_equals_reference(small_binary, tmp_path, optimizer, policy, trainers, device):
    batch = BATCH - BATCH % trainers
    # (the 3-trainer job names TensorPipe's channel too: the setting reaches every role's RPC agent)
    rpc = {"rpc_channels": "basic"} if trainers == 3 else {}
    processes = 2 if optimizer == "sgd" else 1
    config = job_config(small_binary, tmp_path / "bagpipe", optimizer=optimizer, policy=policy, trainers=trainers,
                        batch_size=batch, device=device, planner_processes=processes, **rpc)
    summary = launch_local(config, show_progress=False)
    assert summary["planner_processes"] == processes
    if rpc:
        for log_file in (tmp_path / "bagpipe" / "logs").glob("*.log"):
            assert "RPC over TensorPipe: transports uv, channels basic" in log_file.read_text(), log_file.name
    ours = export(config.run_dir, tmp_path / "ours.pt")
    assert_same_parameters(ours, reference_of(config, tmp_path / "reference"))
    # The cache really was too small: rows were evicted, written back and fetched again.
    assert summary["rows_written_back"] > 10 * CACHE
    assert summary["rows_fetched"] > 10 * CACHE
    assert 0.0 < summary["cache_hit_rate"] < 1.0
    assert summary["iterations"] == ITERATIONS and summary["bytes_sent"] > 0 and summary["device"].startswith(device)
    assert 0.0 <= summary["embedding_stall_fraction"] < 1.0
    # each trainer held the rows the others write back until all were acknowledged, not all of them to the end
    if trainers > 1:
        assert 0 < summary["others_evicted_peak_rows"] < summary["rows_written_back"] / 4
    else:
        assert summary["others_evicted_peak_rows"] == 0
    # fetched rows reach a GPU through a few reused pinned buffers (per cache: 2 ring slots x 2 dtypes x growth
    # steps), never one per batch; on the CPU nothing is copied
    copies = summary["copies_to_device"]
    assert sorted(copies) == [f"trainer{t}" for t in range(trainers)]
    for figures in copies.values():
        if device == "cuda":
            assert 0 < figures["pinned_allocations"] <= 2 * 2 * 8 and figures["bytes_to_device"] > 0
        else:
            assert figures == {"pinned_allocations": 0, "pinned_bytes": 0, "bytes_to_device": 0}


def test_default_settings_equal_the_sliced_reference_bit_for_bit(wide_tsv, tmp_path):
    """The defaults (the default model, DLRM, at its own: Adam at lr 1e-3; 2 trainers, 1 server, a 5% cache), where
    a one-pass reference drifts: a gradient whose terms cancel rounds to either sign, and Adam's first step
    turns that sign into a full step of lr."""
    runs = {}
    for mode, extra in (("bagpipe", []), ("reference", ["--slices", "2"])):
        run_dir = tmp_path / mode
        job = bagpipe_cli("train", "--data", str(wide_tsv), "--run-dir", str(run_dir), "--mode", mode,
                          "--iterations", "100", "--batch-size", "256", "--no-progress", *extra)
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, err[-3000:]
        runs[mode] = export(run_dir, tmp_path / f"{mode}.pt")
    assert_same_parameters(runs["bagpipe"], runs["reference"])
    summaries = [json.loads((tmp_path / mode / "summary.json").read_text()) for mode in runs]
    assert summaries[0]["eval_auc"] == summaries[1]["eval_auc"]


def test_delayed_write_backs_are_still_observed(small_binary, tmp_path):
    """Write-backs held back on purpose: fetches wait at the server for them, and the result is exact."""
    config = job_config(small_binary, tmp_path / "bagpipe", iterations=60, lookahead=4, prefetch_depth=4)
    summary = launch_local(config, show_progress=False, extra_trainer_args=["--writeback-delay", "0.02"])
    assert summary["server_fetches_waited"] > 0
    ours = export(config.run_dir, tmp_path / "ours.pt")
    assert_same_parameters(ours, reference_of(config, tmp_path / "reference"))


def test_killing_a_role_fails_the_job_fast_and_leaves_no_process(small_binary, tmp_path):
    run_dir = tmp_path / "run"
    job = bagpipe_cli("train", "--mode", "bagpipe", "--data", str(small_binary), "--run-dir", str(run_dir),
                      "--iterations", "100000", "--batch-size", "128", "--cache-rows", "700", "--lookahead", "20",
                      "--emb-dim", "8", "--arch-mlp-bot", "13-16-8", "--arch-mlp-top", "16-1", "--log-every", "5",
                      "--timeout", "30", "--no-progress", "--no-replace-trainers")  # (else trainer 1 is replaced)
    try:
        deadline = time.monotonic() + 60
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "the job never started training"
            time.sleep(0.2)
        pids = json.loads((run_dir / "pids.json").read_text())
        killed = time.monotonic()
        os.kill(pids["trainer1"], signal.SIGKILL)
        _, err = job.communicate(timeout=30)
        elapsed = time.monotonic() - killed
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 1
    assert "trainer 1 (rank 2) failed (killed by SIGKILL)" in err
    assert elapsed < 15
    assert not [name for name, pid in pids.items() if alive(pid)]


@pytest.mark.parametrize("faults", ["trainer1@done:kill",
                                    # the oracle gathers the results slowly: the killed trainer's heartbeats
                                    # stop for longer than the liveness window (4 s) before training ends
                                    "trainer1@done:kill,oracle@trainers reported:pause=6"])
def test_a_role_lost_after_training_ended_does_not_fail_the_run(small_binary, tmp_path, faults):
    """Trainer 1 is SIGKILLed right after reporting done (every row is back on the servers by then):
    the run is finished and exact, with a warning, not a failure."""
    config = job_config(small_binary, tmp_path / "bagpipe", iterations=30, timeout=8.0)
    summary = launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": faults})
    assert summary["iterations"] == 30
    ours = export(config.run_dir, tmp_path / "ours.pt")
    assert_same_parameters(ours, reference_of(config, tmp_path / "reference"))


def test_an_oracle_killed_while_writing_the_model_leaves_no_partial_file(small_binary, tmp_path):
    config = job_config(small_binary, tmp_path / "bagpipe", iterations=10)
    with pytest.raises(JobFailed, match=r"oracle 0 \(rank 0\) failed \(killed by SIGKILL\): it logged no error"):
        launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "oracle@model written:kill"})
    run_dir = Path(config.run_dir)
    assert not list(run_dir.glob("*.tmp")) and not (run_dir / "model").exists()
    assert not (run_dir / "summary.json").exists()


def test_a_hand_started_oracle_refuses_a_cache_smaller_than_a_batch(small_binary, tmp_path):
    """The oracle judges the job once every role has stated its settings (a trainer's model decides the
    tables), then refuses it, and the roles waiting on it are told why."""
    world = ["--world-size", "4", "--master-port", str(free_port()), "--timeout", "30"]
    oracle = bagpipe_cli("oracle", "--data", str(small_binary), "--run-dir", str(tmp_path / "run"),
                         "--cache-size", "50", "--mini-batch-size", "128", "--worker-id", "0",
                         "--world-size-trainers", "2", *world)
    others = [bagpipe_cli(role, "--worker-id", str(rank), *world)
              for role, rank in (("trainer", 1), ("trainer", 2), ("server", 3))]
    try:
        _, err = oracle.communicate(timeout=60)
        assert oracle.returncode == 2, err
        assert "more than the cache's 50" in err
        for process in others:
            _, other_err = process.communicate(timeout=30)
            assert process.returncode == 2 and "the oracle refused the job" in other_err
            assert "more than the cache's 50" in other_err
    finally:
        for process in (oracle, *others):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert not (tmp_path / "run" / "summary.json").exists()


def test_world_size_mismatch_is_refused_within_seconds(small_binary, tmp_path):
    port = str(free_port())
    oracle = bagpipe_cli("oracle", "--data", str(small_binary), "--run-dir", str(tmp_path / "run"),
                         "--cache-size", str(CACHE), "--mini-batch-size", str(BATCH), "--worker-id", "0",
                         "--world-size", "4", "--world-size-trainers", "2", "--master-port", port, "--timeout", "30")
    try:
        started = time.monotonic()
        server = bagpipe_cli("server", "--worker-id", "3", "--world-size", "5", "--world-size-trainers", "2",
                             "--master-port", port, "--timeout", "30")
        _, err = server.communicate(timeout=60)
        assert server.returncode == 2, err
        assert "world mismatch: this server has world_size=5" in err and "the oracle has world_size=4" in err
        assert time.monotonic() - started < 20
    finally:
        oracle.kill()
        oracle.wait()


def test_unreachable_master_is_a_clear_error(tmp_path):
    started = time.monotonic()
    trainer = bagpipe_cli("trainer", "--worker-id", "2", "--world-size", "4", "--world-size-trainers", "2",
                          "--master-port", str(free_port()), "--timeout", "3")
    _, err = trainer.communicate(timeout=60)
    assert trainer.returncode == 1
    assert "cannot reach the oracle's store" in err
    assert time.monotonic() - started < 30


def test_missing_data_is_refused_before_any_role_starts(tmp_path):
    job = bagpipe_cli("train", "--mode", "bagpipe", "--data", str(tmp_path / "nowhere"), "--run-dir",
                      str(tmp_path / "run"), "--no-progress")
    _, err = job.communicate(timeout=60)
    assert job.returncode == 2
    assert "nowhere" in err
    assert not (tmp_path / "run" / "pids.json").exists()


def test_an_id_outside_its_table_is_refused_naming_the_row(small_binary, tmp_path):
    import shutil

    import numpy as np

    data = tmp_path / "data"
    shutil.copytree(small_binary, data)
    split = data / "train"
    ids_file = next(split.glob("ids.*"))
    header = json.loads((split / "header.json").read_text())
    ids = np.memmap(ids_file, dtype=ids_file.suffix[1:], mode="r+").reshape(header["rows"], -1)
    ids[300, 2] = header["table_sizes"][2]  # one past the end of table 2: a row of table 3 if unchecked
    ids.flush()
    del ids
    from bagpipe.data.binary import file_checksum, write_record

    header["checksums"][ids_file.name] = file_checksum(ids_file)  # planted on purpose: sealed again
    write_record(split / "header.json", header)
    # A cache smaller than a batch's ids has the launcher scan the batches before starting anything;
    # with a larger one the oracle meets the row while planning.
    config = job_config(data, tmp_path / "before", iterations=10)
    with pytest.raises(ValueError, match=r"row 300 has id \d+ for table 2, outside"):
        launch_local(config, show_progress=False)
    config = job_config(data, tmp_path / "during", iterations=30, batch_size=16)
    with pytest.raises(JobFailed, match=r"oracle 0 \(rank 0\) failed.*row 300 has id \d+ for table 2, outside"):
        launch_local(config, show_progress=False)


# The partitioned cache (planner/partitioned.py): each trainer holds only its slices' rows, shared rows' gradients
# summed among their users; the same sliced reference, bit for bit, through hand-offs, drops and re-fetches.
@pytest.mark.parametrize("optimizer, trainers, servers, keep_within, device", [
    ("sgd", 2, 1, 0, "cpu"), ("adagrad", 3, 2, 4, "cpu"), ("adam", 4, 2, 0, "cpu"),
    pytest.param("adam", 2, 1, 0, "cuda", marks=CUDA)])
def test_partitioned_cache_equals_reference(small_binary, tmp_path, optimizer, trainers, servers, keep_within,
                                            device):
    batch = BATCH - BATCH % trainers
    config = job_config(small_binary, tmp_path / "bagpipe", optimizer=optimizer, trainers=trainers, servers=servers,
                        batch_size=batch, cache_mode="partitioned", cache_rows=560, keep_within=keep_within,
                        device=device)
    summary = launch_local(config, show_progress=False)
    ours = export(config.run_dir, tmp_path / "ours.pt")
    assert_same_parameters(ours, reference_of(config, tmp_path / "reference"))
    assert summary["cache_mode"] == "partitioned" and summary["iterations"] == ITERATIONS
    # each trainer's cache was too small for its rows: they were let go, written back and fetched again
    assert summary["rows_written_back"] > 10 * CACHE and summary["rows_fetched"] > 10 * CACHE
    assert 0.0 < summary["cache_hit_rate"] < 1.0
    assert summary["rows_exchanged_per_iteration"] > 0


def test_a_trainer_reads_its_loss_at_each_log_and_a_diverging_job_stops_naming_the_iteration(small_binary, tmp_path):
    """A trainer leaves its loss on its device (on a GPU a read every iteration is a wait every iteration) and
    reads the pending ones at each log, checkpoint and hand-over: with SGD a lone trainer's counted iteration reads
    no value back; a loss that is not finite still stops the job, naming its own iteration, at the next log."""

    config = job_config(small_binary, tmp_path / "sgd", optimizer="sgd", trainers=1, servers=1, iterations=20)
    summary = launch_local(config, show_progress=False)
    assert summary["host_reads_per_iteration"] == {"trainer0": 0}
    logged = [json.loads(line) for line in (tmp_path / "sgd" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in logged if "train_loss" in r] == [10, 20]
    diverging = job_config(small_binary, tmp_path / "diverging", optimizer="sgd", lr=1e30, trainers=1, servers=1,
                           iterations=30)
    with pytest.raises(JobFailed, match=r"the training loss of iteration 2 is nan: training diverged"):
        launch_local(diverging, show_progress=False)
