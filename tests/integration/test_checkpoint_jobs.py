"""Checkpoints during training: the format (atomic, checksummed, full bases and deltas, pruning) and
exact resume: a run killed at any point and resumed ends bit for bit where it would have."""


import json
import os
import subprocess

import pytest

from bagpipe.train.checkpoints import checkpoints_dir
from bagpipe.rundir import export
from helpers import cli_processes
from helpers.jobs import job_config, same_export
from helpers.checkpoint_runs import ITERATIONS, train_args


# -- exact resume -----------------------------------------------------------------------------------


def run_cli(args: list[str], *, faults: str = "") -> subprocess.CompletedProcess:
    return cli_processes.run_cli(args, env=dict(os.environ, BAGPIPE_FAULTS=faults), timeout=300)


@pytest.mark.parametrize("optimizer, fault", [
    ("sgd", "reference@iteration 20:kill"),  # between checkpoints: resumes from 18
    ("adagrad", "reference@checkpoint parts written:kill"),  # mid-write of the first: resumes from... none
    ("adam", "reference@iteration 29:kill"),
])
def test_a_killed_reference_run_resumes_to_the_same_export_bit_for_bit(small_binary, tmp_path, optimizer, fault):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert run_cli(train_args(small_binary, whole, optimizer)).returncode == 0
    killed = run_cli(train_args(small_binary, broken, optimizer), faults=fault)
    assert killed.returncode != 0 and not (broken / "summary.json").exists()
    resumed = run_cli(["train", "--run-dir", str(broken), "--resume", "--no-progress"])
    if "parts written" in fault:  # killed writing the first checkpoint: nothing valid to resume from
        assert resumed.returncode == 2 and "no valid checkpoint" in resumed.stderr
        assert list(checkpoints_dir(broken).glob("*.tmp"))  # the torn write, never read
        return
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr and "resumed at iteration" in resumed.stdout  # (and in its summary line)
    same_export(export(whole, tmp_path / "a.pt"), export(broken, tmp_path / "b.pt"))
    summaries = [json.loads((d / "summary.json").read_text()) for d in (whole, broken)]
    assert summaries[0]["eval_auc"] == summaries[1]["eval_auc"]
    records = [json.loads(line) for line in (broken / "metrics.jsonl").read_text().splitlines()]
    logged = [r["iteration"] for r in records if "event" not in r]
    assert logged == sorted(logged) and len(logged) == len(set(logged))  # each window logged once


def test_a_kill_mid_checkpoint_write_resumes_from_the_one_before(small_binary, tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert run_cli(train_args(small_binary, whole, "adagrad")).returncode == 0
    # the second write is torn; the first (iteration 6) is whole
    first = run_cli(train_args(small_binary, broken, "adagrad", "--iterations", "13"))
    assert first.returncode == 0
    (broken / "summary.json").unlink()  # as if it had been killed after its checkpoint at 12
    resumed = run_cli(["train", "--run-dir", str(broken), "--resume", "--iterations", str(ITERATIONS), "--no-progress"],
                      faults="reference@checkpoint parts written:kill")
    assert resumed.returncode != 0
    again = run_cli(["train", "--run-dir", str(broken), "--resume", "--iterations", str(ITERATIONS), "--no-progress"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "from its checkpoint at iteration 12" in again.stderr
    same_export(export(whole, tmp_path / "a.pt"), export(broken, tmp_path / "b.pt"))


# -- --mode bagpipe ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sparse_binary(tmp_path_factory):
    """Tables of up to 2000 rows (~14k in all), batches touching a few thousand: rows used in one
    iteration and not the next, whose gradients sync in the background across a checkpoint."""
    from bagpipe.data.preprocess import preprocess
    from bagpipe.synth import generate, resolve_table_sizes

    out = tmp_path_factory.mktemp("sparse")
    sizes = resolve_table_sizes(tables=None, table_sizes=None, max_rows_per_table=2000)
    generate(out / "tsv", rows=12_000, test_rows=2000, seed=5, table_sizes=sizes, show_progress=False)
    preprocess(out / "tsv", out / "bin", show_progress=False)
    return out / "bin"


@pytest.mark.parametrize("optimizer, fault", [
    ("adagrad", "trainer1@iteration 33:kill"),  # mid-run: resumes from 30 (deltas on 10's base)
    ("adam", "server1@checkpoint 20 written:kill"),  # a server killed writing its part of 20: resumes from 10
])
def test_a_killed_bagpipe_job_resumes_to_the_same_export_bit_for_bit(sparse_binary, tmp_path, optimizer, fault,
                                                                     caplog):
    import logging
    from dataclasses import replace

    from bagpipe.runtime.launch import JobFailed, launch_local

    config = job_config(sparse_binary, tmp_path / "whole", iterations=50, optimizer=optimizer, checkpoint_every=10,
                        keep_checkpoints=2, cache_rows=6000, batch_size=128)
    launch_local(config, show_progress=False)
    broken = replace(config, run_dir=str(tmp_path / "broken"), max_restarts=0,  # resumed by hand below
                     replace_trainers=False)
    with pytest.raises(JobFailed):
        launch_local(broken, show_progress=False, env={"BAGPIPE_FAULTS": fault})
    assert not (tmp_path / "broken" / "summary.json").exists()
    with caplog.at_level(logging.INFO, logger="bagpipe.runtime.launch"):
        summary = launch_local(broken, show_progress=False, resume=True)
    assert summary["resumed_at"] in (10, 20, 30) and summary["iterations"] == 50
    assert f"at iteration {summary['resumed_at']} (checkpoint step-" in caplog.text  # said before any role starts
    same_export(export(config.run_dir, tmp_path / "a.pt"), export(broken.run_dir, tmp_path / "b.pt"))
    kinds = [json.loads((d / "manifest.json").read_text())["kind"]
             for d in sorted(checkpoints_dir(broken.run_dir).iterdir())]
    assert "delta" in kinds or summary["resumed_at"] == 10
