"""Run dirs: a run never overwrites, mixes with or deletes another run by accident."""

from __future__ import annotations

import json

import pytest

from bagpipe.cli import main
from bagpipe.rundir import SUMMARY, export, is_finished
from bagpipe.train.reference import train_reference
from helpers.jobs import small_config


def train_cli(data, run_dir, *extra: str) -> int:
    return main(["train", "--data", str(data), "--run-dir", str(run_dir), "--iterations", "20", "--batch-size", "256",
                 "--emb-dim", "8", "--arch-mlp-bot", "13-16-8", "--arch-mlp-top", "16-1", "--no-progress", *extra])


def snapshot(run_dir) -> dict:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()}


@pytest.fixture
def finished_run(small_binary, tmp_path):
    run_dir = tmp_path / "run"
    assert train_cli(small_binary, run_dir, "--seed", "1") == 0
    assert is_finished(run_dir)
    return run_dir


def test_a_second_run_into_a_run_dir_is_refused_and_the_first_is_kept(small_binary, finished_run, capsys):
    before = snapshot(finished_run)
    assert train_cli(small_binary, finished_run, "--seed", "2") == 2
    assert "already holds a finished run: pass --overwrite to replace it" in capsys.readouterr().err
    assert snapshot(finished_run) == before


@pytest.mark.parametrize("bad", [["--cleanup-fraction", "2"], ["--batch-size", "1000000"], ["--lr", "inf"],
                                 ["--arch-mlp-bot", "7-16-8"]])
def test_a_rerun_refused_at_start_leaves_the_earlier_run_whole(small_binary, finished_run, bad):
    before = snapshot(finished_run)
    assert train_cli(small_binary, finished_run, "--overwrite", *bad) == 2
    assert snapshot(finished_run) == before


def test_overwrite_clears_the_old_run_before_the_new_one_writes(small_binary, finished_run, tmp_path):
    """A new run that fails midway leaves nothing of the old one to be taken for its result."""
    old_records = (finished_run / "metrics.jsonl").read_text()
    assert train_cli(small_binary, finished_run, "--overwrite", "--optimizer", "sgd", "--lr", "1e30") == 1
    assert not is_finished(finished_run)
    assert not (finished_run / "model").exists()
    assert (finished_run / "metrics.jsonl").read_text() != old_records
    config = json.loads((finished_run / "config.json").read_text())
    assert config["lr"] == 1e30
    with pytest.raises(ValueError, match="not a finished run"):
        export(finished_run, tmp_path / "export.pt")
    assert train_cli(small_binary, finished_run, "--overwrite", "--iterations", "10") == 0
    records = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["iteration"] for r in records) == 10  # only the new run's records
    assert not list(finished_run.glob("*.tmp"))


def test_overwrite_refuses_a_directory_that_is_not_a_run(small_binary, tmp_path):
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    assert train_cli(small_binary, precious, "--overwrite") == 2
    assert (precious / "notes.txt").read_text() == "keep me"


def test_a_run_dir_that_is_a_file_is_refused(small_binary, tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        train_reference(small_config(small_binary, path), show_progress=False)


def test_summary_is_the_last_file_a_run_writes(small_binary, tmp_path):
    run_dir = tmp_path / "run"
    train_reference(small_config(small_binary, run_dir, iterations=5), show_progress=False)
    written = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    assert max(written, key=written.get) == SUMMARY
    assert not list(run_dir.glob("*.tmp"))


def test_a_diverging_run_stops_at_its_first_non_finite_loss(small_binary, tmp_path, capsys):
    code = train_cli(small_binary, tmp_path / "run", "--optimizer", "sgd", "--lr", "1e30")
    assert code == 1
    err = capsys.readouterr().err
    assert "the training loss of iteration" in err and "training diverged" in err
    assert not is_finished(tmp_path / "run")
