"""Checkpoints during training: the format (atomic, checksummed, full bases and deltas, pruning) and
exact resume: a run killed at any point and resumed ends bit for bit where it would have."""


import json
import signal
import threading
import time

import numpy as np
import pytest
import torch

from bagpipe.train.checkpoints import (CheckpointWriter, RowPart, TrainState, checkpoints_dir, load_latest,
                                       valid_checkpoints)
from bagpipe.cli import main
from bagpipe.rundir import export
from helpers.jobs import assert_same_parameters
from helpers.checkpoint_runs import train_args
from helpers.paths import TEST_DATA

ROWS = [50, 7]  # two embedding spaces


def state_at(iteration: int, rng: np.random.Generator, *, keys: list[np.ndarray] | None) -> TrainState:
    parts = []
    for space, num_rows in enumerate(ROWS):
        chosen = np.arange(num_rows) if keys is None else keys[space]
        parts.append(RowPart(space=space, keys=None if keys is None else chosen,
                             rows=rng.standard_normal((len(chosen), 3)).astype(np.float32),
                             state=rng.standard_normal((len(chosen), 1)).astype(np.float32)))
    return TrainState(iteration=iteration, dense={"w": torch.full((2,), float(iteration))},
                      dense_optimizer={"state": {}, "param_groups": []}, parts=parts, extra={"at": iteration})


def expected_rows(states: list[TrainState]) -> list[np.ndarray]:
    rows = [np.zeros((n, 3), dtype=np.float32) for n in ROWS]
    for state in states:
        for part in state.parts:
            rows[part.space][part.key_array()] = part.rows
    return rows


def test_a_chain_of_deltas_restores_every_row_and_pruning_keeps_what_it_needs(tmp_path):
    rng = np.random.default_rng(0)
    writer = CheckpointWriter(tmp_path, keep=2, full_every=3)
    states = []
    for iteration in (10, 20, 30, 40):
        full = writer.wants_full()
        keys = None if full else [rng.choice(n, size=4, replace=False) for n in ROWS]
        states.append(state_at(iteration, rng, keys=keys))
        writer.write(states[-1], full=full)
    # 10 full, 20 and 30 deltas, 40 full again (full_every 3): keep 2 means 30 and 40, and 30's chain
    assert [json.loads((d / "manifest.json").read_text())["kind"] for d in sorted(checkpoints_dir(tmp_path).iterdir())] \
        == ["full", "delta", "delta", "full"]
    loaded = load_latest(tmp_path, num_rows=ROWS)
    assert loaded.iteration == 40 and loaded.extra == {"at": 40}
    for got, want in zip(loaded.parts, expected_rows(states)):
        assert np.array_equal(got.rows, want)
    writer.write(state_at(50, rng, keys=[np.array([1]), np.array([2])]), full=False)
    names = sorted(p.name for p in checkpoints_dir(tmp_path).iterdir())
    assert names == ["step-00000040", "step-00000050"]  # 50's chain is 40 + itself


def test_a_corrupted_newest_checkpoint_is_skipped_naming_it(tmp_path, caplog):
    rng = np.random.default_rng(1)
    writer = CheckpointWriter(tmp_path, keep=3)
    first = state_at(10, rng, keys=None)
    writer.write(first, full=True)
    writer.write(state_at(20, rng, keys=None), full=True)
    victim = checkpoints_dir(tmp_path) / "step-00000020" / "part1.space1.rows.npy"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    loaded = load_latest(tmp_path, num_rows=ROWS)
    assert loaded.iteration == 10
    assert np.array_equal(loaded.parts[1].rows, first.parts[1].rows)
    assert "skipping checkpoint" in caplog.text and "step-00000020" in caplog.text and "fails its checksum" in caplog.text


def test_an_unfinished_write_is_never_read_and_is_cleared(tmp_path):
    rng = np.random.default_rng(2)
    CheckpointWriter(tmp_path, keep=2).write(state_at(10, rng, keys=None), full=True)
    torn = checkpoints_dir(tmp_path) / "step-00000020.tmp"
    torn.mkdir()
    (torn / "dense.pt").write_bytes(b"half")
    assert [d.name for d, _ in valid_checkpoints(tmp_path)] == ["step-00000010"]
    missing_manifest = checkpoints_dir(tmp_path) / "step-00000030"
    missing_manifest.mkdir()
    assert load_latest(tmp_path, num_rows=ROWS).iteration == 10
    CheckpointWriter(tmp_path, keep=2)  # a new writer clears the torn write
    assert not torn.exists()


def test_a_wait_cut_short_by_a_signal_still_lets_close_finish_the_write_in_flight(tmp_path, monkeypatch):
    """SIGTERM while the run waits for the previous checkpoint (a slow disk, a loaded machine): the clean-up's
    close() must still wait for that write, or the run is left with nothing to resume from."""
    rng = np.random.default_rng(3)
    writer = CheckpointWriter(tmp_path, keep=2)
    release = threading.Event()
    write = writer.write

    def slow_write(state, *, full):
        release.wait(10)
        time.sleep(0.3)  # still writing well after the wait was cut short
        return write(state, full=full)
    monkeypatch.setattr(writer, "write", slow_write)

    class Stop(Exception):
        pass

    def stop(signum, frame):
        release.set()  # the write goes on while the wait is cut short
        raise Stop
    previous = signal.signal(signal.SIGALRM, stop)
    try:
        writer.save(state_at(10, rng, keys=None), full=True)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Stop):
            writer.wait()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    writer.close()
    assert [d.name for d, _ in valid_checkpoints(tmp_path)] == ["step-00000010"]


# -- exact resume -----------------------------------------------------------------------------------


def test_resume_refuses_what_it_cannot_continue(small_binary, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(train_args(small_binary, run_dir, "sgd", "--iterations", "8")) == 0
    assert main(["train", "--run-dir", str(run_dir), "--resume"]) == 2
    assert "has finished" in capsys.readouterr().err
    (run_dir / "summary.json").unlink()
    # data other than the run's (converted again since): the run would not go on as it was
    recorded = (run_dir / "data.json").read_text()
    changed = json.loads(recorded)
    changed["train"]["checksums"]["labels.f32"] = "xxh3_128:0"
    (run_dir / "data.json").write_text(json.dumps(changed))
    assert main(["train", "--run-dir", str(run_dir), "--resume"]) == 2
    assert "is not what the run in" in (err := capsys.readouterr().err) and "its train split changed" in err
    (run_dir / "data.json").write_text(recorded)
    assert main(["train", "--run-dir", str(run_dir), "--resume", "--lr", "0.5"]) == 2
    assert "started with lr=0.05, not 0.5" in capsys.readouterr().err
    assert main(["train", "--run-dir", str(run_dir), "--resume", "--overwrite"]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert main(["train", "--run-dir", str(tmp_path / "none"), "--resume"]) == 2
    assert "no run to resume" in capsys.readouterr().err
    from bagpipe.config import ModelConfig, TrainConfig
    from bagpipe.models import EXTERNAL
    from bagpipe.data.binary import open_dataset
    from bagpipe.preflight import check_job

    scripts = TrainConfig(data=str(small_binary), run_dir="-", mode="bagpipe", checkpoint_every=5,
                          model=ModelConfig(name=EXTERNAL, emb_dim=8))
    with pytest.raises(ValueError, match="need bagpipe's trainers"):
        check_job(scripts, open_dataset(small_binary))


def test_a_run_dir_from_before_settings_had_sections_resumes_bit_for_bit(tmp_path, monkeypatch):
    """A run dir an earlier bagpipe wrote and a kill interrupted (tests/data/README.md: a flat config.json, no
    data.json) resumes with today's code to the export of an uninterrupted run of today's code."""
    import shutil
    from pathlib import Path

    from bagpipe.synth import generate, resolve_table_sizes

    stored = TEST_DATA / "run_before_sections"
    monkeypatch.chdir(tmp_path)  # its config.json names its data and itself relative to where it ran
    shutil.copytree(stored, "run")
    generate("data", rows=3000, test_rows=500, seed=7, show_progress=False,
             table_sizes=resolve_table_sizes(tables=None, table_sizes=None, max_rows_per_table=100))
    assert main(["train", "--run-dir", "run", "--resume", "--no-progress"]) == 0
    assert json.loads(Path("run/summary.json").read_text())["resumed_at"] == 20
    settings = json.loads(Path("run/config.json").read_text())
    assert main(["train", "--data", "data", "--run-dir", "whole", "--iterations", "40", "--batch-size", "100",
                 "--emb-dim", "4", "--arch-mlp-bot", "13-8-4", "--arch-mlp-top", "8-1", "--optimizer", "adagrad",
                 "--lr", "0.05", "--no-progress"]) == 0
    assert json.loads(Path("whole/config.json").read_text()) == {**settings, "run_dir": "whole",
                                                                 "checkpoint_every": 0}
    resumed, whole = export("run", tmp_path / "resumed.pt"), export("whole", tmp_path / "whole.pt")
    assert len(whole["embeddings"]) == 26
    assert_same_parameters(resumed, whole)


# -- --mode bagpipe ---------------------------------------------------------------------------------


def make_store(num_rows: int = 12, *, num_shards: int = 1):
    from bagpipe.embeddings import EmbeddingLayout, TableConfig
    from bagpipe.data.schema import Schema
    from bagpipe.optim import make_row_optimizer
    from bagpipe.storage import RowStore

    schema = Schema.one_hot([num_rows], num_dense=0)
    layout = EmbeddingLayout([TableConfig(name="t", num_rows=num_rows, dim=2, features=(0,))], schema)
    return RowStore(layout=layout, space=0, optimizer=make_row_optimizer("adagrad", lr=0.1), seed=0,
                    num_shards=num_shards)


def snapshot_rows(store, **options) -> tuple[np.ndarray, np.ndarray]:
    chunks = list(store.snapshot_chunks(timeout=2.0, **options))
    return np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])


def test_a_server_snapshot_keeps_the_rows_as_of_its_boundary_while_later_write_backs_land():
    store = make_store()
    ones = torch.ones(3, 2)
    store.write_back(np.array([0, 1, 2]), ones, torch.zeros(3, 2), version=3)  # before the boundary
    store.begin_snapshot(5, expected_rows=3 + 2, since=None)  # 2 more rows of versions < 5 are on their way
    store.write_back(np.array([1, 7]), 9 * torch.ones(2, 2), torch.zeros(2, 2), version=6)  # after it: copied first
    store.write_back(np.array([4, 5]), 2 * torch.ones(2, 2), torch.zeros(2, 2), version=4)  # late, but before it
    store.write_back(np.array([5]), 8 * torch.ones(1, 2), torch.zeros(1, 2), version=5)  # after it
    initial = make_store().all_weights().numpy()
    chunks = store.snapshot_chunks(timeout=2.0, chunk_rows=5)
    first = next(chunks)  # rows 0-4 read; then rows on both sides of that are overwritten
    store.write_back(np.array([2, 8]), 7 * torch.ones(2, 2), torch.zeros(2, 2), version=7)
    rest = list(chunks)
    local = np.concatenate([first[0], *(c[0] for c in rest)])
    rows = np.concatenate([first[1], *(c[1] for c in rest)])
    assert local.tolist() == list(range(12))
    assert (rows[[0, 1, 2]] == 1).all() and (rows[[4, 5]] == 2).all()  # as of the boundary, not 9 or 8
    assert np.array_equal(rows[7], initial[7]) and np.array_equal(rows[8], initial[8])
    assert store.all_weights()[1, 0] == 9 and store.all_weights()[5, 0] == 8  # training goes on with the newer rows


def test_a_snapshot_waits_for_the_planned_write_backs_and_a_delta_holds_only_the_rows_written_since():
    store = make_store()
    store.write_back(np.array([3]), torch.ones(1, 2), torch.zeros(1, 2), version=1)
    store.begin_snapshot(4, expected_rows=2, since=None)
    with pytest.raises(TimeoutError, match="1 rows written back before iteration 4 had not arrived"):
        list(store.snapshot_chunks(timeout=0.2))
    store.write_back(np.array([6]), torch.ones(1, 2), torch.zeros(1, 2), version=3)
    store.begin_snapshot(4, expected_rows=2, since=2)  # rows written back from version 2 on
    local, rows = snapshot_rows(store)
    assert local.tolist() == [6]


@pytest.mark.parametrize("dim", [1, 16, 100])
def test_mapped_rows_read_in_chunks_are_the_rows_asked_for(tmp_path, dim):
    """A checkpoint part's rows read in chunks of a few windows of the file, each chunk's pages dropped after it:
    scattered, dense, repeated and empty reads give exactly the rows asked for, in the order asked for."""
    from bagpipe.train.checkpoints import _MappedRows

    rows = np.random.default_rng(dim).standard_normal((200_000, dim)).astype(np.float32)
    np.save(tmp_path / "rows.npy", rows)
    mapped = _MappedRows(tmp_path / "rows.npy")
    rng = np.random.default_rng(1)
    for local in (rng.integers(0, len(rows), 30_000), np.arange(50_000, 120_000), rng.permutation(len(rows)),
                  np.array([7, 7, 199_999, 0, 7]), np.zeros(0, dtype=np.int64)):
        assert np.array_equal(mapped.take(local), rows[local])
    mapped.release()
    assert np.array_equal(mapped.take(np.array([3, 1])), rows[[3, 1]])  # (read again after a release)


def test_a_run_killed_before_its_first_checkpoint_is_refused_saying_when_that_was_due(tmp_path):
    from bagpipe.train.checkpoints import resumable_checkpoint

    (tmp_path / "run").mkdir()
    with pytest.raises(ValueError, match=r"it wrote none: it stopped before its first checkpoint, due at iteration "
                                         r"20 or after 30 s; start the run again with --overwrite"):
        resumable_checkpoint(tmp_path / "run", iterations=100, every=20, every_s=30.0)
    with pytest.raises(ValueError, match=r"it wrote none \(a run checkpoints with --checkpoint-every N"):
        resumable_checkpoint(tmp_path / "run", iterations=100)


def test_a_run_that_met_a_full_disk_is_told_to_resume_from_its_newest_checkpoint_or_start_again(small_binary,
                                                                                                tmp_path):
    from bagpipe.train.checkpoints import after_a_full_disk
    from bagpipe.train.reference import train_reference
    from helpers.jobs import small_config

    run_dir = tmp_path / "run"
    assert "start the run again" in after_a_full_disk(run_dir) and "--overwrite" in after_a_full_disk(run_dir)
    train_reference(small_config(small_binary, run_dir, iterations=12, checkpoint_every=5), show_progress=False)
    assert after_a_full_disk(run_dir) == (f"free space there, then `bagpipe train --run-dir {run_dir} --resume` "
                                          f"continues the run from its checkpoint at iteration 10")
