"""No process ever holds every table: rows read lazily from checkpoints, the model directory written and
read table by table, and evaluations during training (--eval-every) equal in every mode."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from bagpipe.train.checkpoints import (ChainRows, CheckpointWriter, RowPart, TrainState, read_chain, valid_checkpoints,
                                       write_parts)
from bagpipe.config import TrainConfig
from bagpipe.data.binary import open_dataset
from bagpipe.train.evaluation import evaluate
from bagpipe.model_dir import MODEL_DIR, ModelDir, ModelRows, TableRows, table_blocks, write_model_dir, write_table
from bagpipe.train.reference import build_model, build_tables, train_reference
from bagpipe.report import load_run, write_plots
from bagpipe.runtime.launch import launch_local
from bagpipe.runtime.server.data_server import Server
from helpers.jobs import job_config

ROWS = [50, 7]  # two embedding spaces


def _state(iteration: int, rng: np.random.Generator, parts: list[tuple[int, dict]]) -> TrainState:
    return TrainState(iteration=iteration, dense={}, dense_optimizer={},
                      parts=[RowPart(space=space, rows=rng.standard_normal((n, 3)).astype(np.float32),
                                     state=np.zeros((n, 1), dtype=np.float32), **where)
                             for space, (n, where) in parts], extra={})


def test_chain_rows_answer_each_key_from_the_newest_part_holding_it(tmp_path):
    """Server-like ranges (start::step) as the base, deltas listing keys on top: every key's row is the
    one a full restore would give, in any order of keys, without loading a table."""
    rng = np.random.default_rng(0)
    writer = CheckpointWriter(tmp_path, keep=5, full_every=10)
    base = _state(10, rng, [(0, (25, {"start": 0, "step": 2})), (0, (25, {"start": 1, "step": 2})),
                            (1, (7, {}))])
    deltas = [_state(it, rng, [(0, (4, {"keys": rng.choice(50, 4, replace=False)})),
                               (1, (2, {"keys": rng.choice(7, 2, replace=False)})), (1, (0, {"keys": np.zeros(0, int)}))])
              for it in (20, 30)]
    for state, full in ((base, True), (deltas[0], False), (deltas[1], False)):
        writer.write(state, full=full)
    expected = [np.zeros((n, 3), dtype=np.float32) for n in ROWS]
    for state in (base, *deltas):
        for part in state.parts:
            expected[part.space][part.key_array()] = part.rows
    directory = valid_checkpoints(tmp_path)[0][0]
    rows = ChainRows.of_chain(directory, read_chain(directory))
    for space, num_rows in enumerate(ROWS):
        keys = rng.permutation(num_rows)
        assert np.array_equal(rows.rows(space, keys), expected[space][keys])
        assert np.array_equal(rows.rows(space, keys[:3]), expected[space][keys[:3]])
    rows.release()
    assert np.array_equal(rows.rows(0, np.arange(50)), expected[0])  # read again after the pages were dropped
    with pytest.raises(ValueError, match="no row for key 50 of space 0"):
        rows.rows(0, np.array([3, 50]))


def test_model_dir_round_trip_and_lazy_reads(small_binary, tmp_path):
    """model/ holds every table exactly, readable whole, memory-mapped, or a slice at a time by safetensors."""
    from safetensors import safe_open

    config = TrainConfig(data=str(small_binary), run_dir="-", seed=3)
    dataset = open_dataset(small_binary)
    tables, model = build_tables(config, dataset.schema), build_model(config, dataset.schema)
    path = write_model_dir(tmp_path / MODEL_DIR, dense=model.state_dict(), layout=tables.layout,
                           source=TableRows(tables), info={"iteration": 7, "mode": "reference"})
    saved = ModelDir.open(path)
    assert saved.meta["iteration"] == 7 and saved.num_tables == len(tables.layout.tables)
    loaded = saved.load()
    assert list(loaded["dense"]) == list(model.state_dict())
    assert all(torch.equal(loaded["dense"][k], v) for k, v in model.state_dict().items())
    for t in range(saved.num_tables):
        assert torch.equal(loaded["embeddings"][t], tables.table(t))
        assert not saved.table(t).flags.writeable  # memory-mapped, read-only
        with safe_open(path / saved.meta["tables"][t]["file"], framework="pt") as handle:
            assert torch.equal(handle.get_slice("weight")[1:3], tables.table(t)[1:3])
    rows = ModelRows(saved, tables.layout)
    keys = np.array([0, 5, tables.layout.spaces[0].num_rows - 1])
    assert np.array_equal(rows.rows(0, keys), tables.weights[0][keys].numpy())


def test_writing_a_table_from_a_checkpoint_keeps_memory_flat(tmp_path):
    """A 92 MiB shard streamed from its checkpoint part into a table file, then read at scattered keys:
    this process's resident memory grows by a few blocks, not by the table (pages read are dropped)."""
    num_rows, dim = 1_500_000, 16
    directory = tmp_path / "final"
    directory.mkdir()
    rows = np.ones((num_rows, dim), dtype=np.float32)
    entries = write_parts(directory, [RowPart(space=0, rows=rows, state=np.zeros((num_rows, 0), np.float32))],
                          prefix="server0.")
    del rows
    source = ChainRows([(directory, entries)])
    before = _resident_bytes()
    write_table(tmp_path / "t.safetensors", num_rows=num_rows, dim=dim, metadata={},
                blocks=table_blocks(source, space=0, offset=0, num_rows=num_rows, dim=dim))
    grown = _resident_bytes() - before
    assert grown < 48 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB writing a 92 MiB table"
    assert (tmp_path / "t.safetensors").stat().st_size > num_rows * dim * 4
    # an evaluation's reads: rows scattered over the whole part (each maps the pages around it)
    keys = np.random.default_rng(0).choice(num_rows, 100_000, replace=False)
    before = _resident_bytes()
    got = source.rows(0, keys)
    grown = _resident_bytes() - before - got.nbytes
    assert grown < 48 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB reading 100k scattered rows"
    assert np.array_equal(got, np.ones((len(keys), dim), dtype=np.float32))


def _resident_bytes() -> int:
    """Resident memory held: the heap's free blocks given back first (a conversion earlier in this process leaves
    glibc keeping up to 64 MiB of freed temporaries, which would count here otherwise)."""
    import os

    from bagpipe.heap import trim

    trim()
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_no_server_hands_over_its_shard_and_the_oracle_gathers_nothing():
    """The end of a run reads the servers' shards from disk: neither an RPC that returns a shard nor a
    gather of all tables is left to call."""
    import bagpipe.runtime.oracle as oracle

    assert "weights" not in Server([]).dump()
    source = "".join(path.read_text() for path in Path(oracle.__file__).parent.glob("*.py"))
    assert "def finish(" in source  # (the package's modules are read)
    assert "gather_flat" not in source and "build_tables" not in source


# -- --eval-every: one point per N iterations, equal in both modes and to evaluating the export ---------

EVERY = 50  # of test_runtime's 150 iterations


@pytest.fixture(scope="module")
def eval_runs(small_binary, tmp_path_factory):
    """A bagpipe run with --eval-every (and --keep-best) and its reference (run as its trainers compute), same
    config."""
    root = tmp_path_factory.mktemp("eval_every")
    config = job_config(small_binary, root / "bagpipe", eval_every=EVERY, keep_best=True)
    bagpipe = launch_local(config, show_progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference_config = replace(config, mode="reference", run_dir=str(root / "reference"), slices=config.trainers)
        reference = train_reference(reference_config, show_progress=False)
    finally:
        torch.set_num_threads(threads)
    return config, {"bagpipe": bagpipe, "reference": reference}, root


def _evals(run_dir) -> dict[int, dict]:
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in records if r.get("event") == "eval"}


def test_eval_every_logs_one_point_per_n_iterations_equal_in_both_modes(eval_runs):
    config, summaries, root = eval_runs
    points = {mode: _evals(root / mode) for mode in summaries}
    assert sorted(points["bagpipe"]) == sorted(points["reference"]) == [50, 100, 150]
    for iteration in (50, 100, 150):
        ours, want = points["bagpipe"][iteration], points["reference"][iteration]
        assert ours["samples"] == iteration * config.batch_size
        for key in ("eval_auc", "eval_logloss", "eval_rows"):
            assert ours[key] == want[key], (iteration, key)
    assert len({points["reference"][i]["eval_auc"] for i in (50, 100, 150)}) == 3  # the model changed
    for summary in summaries.values():
        assert summary["eval_auc"] == points["reference"][150]["eval_auc"]
    # --keep-best: model/ holds the best point's model (written from its checkpoint, by the oracle), the reference's
    best = max((50, 100, 150), key=lambda i: points["reference"][i]["eval_auc"])
    kept = {mode: ModelDir.open(root / mode / MODEL_DIR) for mode in summaries}
    assert [s["best_iteration"] for s in summaries.values()] == [best, best] and kept["bagpipe"].meta["iteration"] == best
    assert all(s["warnings"] == [] for s in summaries.values())  # a healthy run
    ours, want = kept["bagpipe"].load(), kept["reference"].load()
    assert all(torch.equal(ours["dense"][k], want["dense"][k]) for k in want["dense"])
    assert all(torch.equal(x, y) for x, y in zip(ours["embeddings"], want["embeddings"], strict=True))
    # the checkpoints taken to evaluate from are not kept: the run asked for none
    assert not (root / "bagpipe" / "checkpoints").exists() and not list((root / "bagpipe").glob("*.tmp"))
    # the report draws every point
    run = load_run(root / "bagpipe")
    assert [run.eval_samples(r) for r in run.evals] == [i * config.batch_size for i in (50, 100, 150)]
    assert (root / "report" / "loss_auc.png") in write_plots([run], root / "report")


def test_each_point_equals_evaluating_the_model_exported_at_that_iteration(eval_runs, small_binary):
    """Ground truth for the point at 50: a 50-iteration run's model/, evaluated lazily from its files."""
    config, _, root = eval_runs
    short = replace(config, mode="reference", run_dir=str(root / "short"), slices=config.trainers, iterations=EVERY,
                    eval_every=0, keep_best=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_reference(short, show_progress=False)
        dataset = open_dataset(small_binary)
        saved = ModelDir.open(root / "short" / MODEL_DIR)
        model = build_model(config, dataset.schema)
        model.load_state_dict(saved.dense())
        layout = build_tables(config, dataset.schema).layout
        got = evaluate(model, layout, ModelRows(saved, layout), dataset.test, batch_size=config.eval_batch_size,
                       max_rows=config.max_eval_rows)
    finally:
        torch.set_num_threads(threads)
    point = _evals(root / "bagpipe")[EVERY]
    assert (got["eval_auc"], got["eval_logloss"]) == (point["eval_auc"], point["eval_logloss"])


def test_eval_every_must_not_be_negative(small_binary):
    with pytest.raises(ValueError, match="eval_every must not be negative"):
        TrainConfig(data=str(small_binary), run_dir="-", eval_every=-1)
