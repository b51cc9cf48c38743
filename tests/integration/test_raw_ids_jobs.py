"""Tables that grow with the data (embeddings.dynamic) in a bagpipe job: the oracle numbers the raw ids the run's
batches look up, each server makes its shard's rows from their keys (asked of the oracle), and the job ends bit for
bit as the reference does, replicated and partitioned, with admission and evaluations during training."""

import json

import pytest
import torch

from bagpipe.rundir import export
from bagpipe.runtime.launch import launch_local
from helpers.jobs import assert_same_parameters, job_config, reference_of
from helpers.raw_ids import arriving_raw_data


@pytest.fixture(scope="module")
def raw_data(tmp_path_factory):
    return arriving_raw_data(tmp_path_factory.mktemp("raw_ids"), rows=3_000, test_rows=600)


def evaluations(run_dir) -> list[tuple[int, float]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(m["iteration"], m["eval_auc"]) for m in lines if "eval_auc" in m]


# Replicated with admission (a key's row made at its second look-up), two trainers, Adam and a row budget of 100 a
# table (the least frequently used retired past it); partitioned with three trainers, Adagrad, admission at the third
# look-up (each trainer's slice cut from the admitted batch) and rows retired after 4 iterations unused (each reused
# number made again by every trainer holding it), the servers' shards on disk (files of records made from the keys,
# a small DRAM budget). Each evicts and fetches again rows made during the run.
@pytest.mark.parametrize("cache_mode, optimizer, trainers, min_count, storage, retire_after, budget", [
    ("replicated", "adam", 2, 2, "memory", 0, 100), ("partitioned", "adagrad", 3, 3, "disk", 4, 0)])
def test_a_bagpipe_job_on_raw_ids_equals_the_reference_bit_for_bit(raw_data, tmp_path, cache_mode, optimizer,
                                                                   trainers, min_count, storage, retire_after, budget):
    config = job_config(raw_data, tmp_path / "bagpipe", optimizer=optimizer, trainers=trainers, batch_size=60,
                        iterations=40, cache_rows=900, cache_mode=cache_mode, row_min_count=min_count, eval_every=20,
                        shuffle=True, shuffle_seed=3, storage=storage, storage_budget_mb=0.05,
                        row_retire_after=retire_after, row_budget=budget)
    summary = launch_local(config, show_progress=False)
    want = reference_of(config, tmp_path / "reference")
    ours = export(config.run_dir, tmp_path / "ours.pt")
    assert_same_parameters(ours, want)
    # the model holds each row's key, as the reference's does
    assert len(ours["row_keys"]) == 26 and all(torch.equal(a, b) for a, b in zip(ours["row_keys"], want["row_keys"]))
    reference = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert summary["raw_ids"] == reference["raw_ids"]
    raw = summary["raw_ids"]
    held = raw.get("rows_held_per_table", [rows + 1 for rows in raw["rows_made_per_table"]])
    assert summary["total_rows"] == sum(held)  # the rows made (alive at once, if retired) and a default row each
    assert (raw.get("rows_retired", 0) > 0) == (retire_after > 0 or budget > 0)
    assert evaluations(tmp_path / "bagpipe") == evaluations(tmp_path / "reference") and len(evaluations(
        tmp_path / "reference")) == 2  # the one during training sees the rows made by then, as the reference's
    assert summary["rows_written_back"] > 0 and summary["rows_fetched"] > summary["raw_ids"]["rows_made"]
    assert (summary["raw_ids"]["training_lookups_on_the_default_row"] > 0) == (min_count > 1)
    assert (summary["storage"].get("disk_rows_read", 0) > 0) == (storage == "disk")


def test_a_bagpipe_job_on_raw_ids_goes_on_through_a_killed_data_server_and_ends_bit_for_bit(raw_data, tmp_path):
    """The parity server makes its group's parity from the keyed rows (its members' keys asked of the oracle), so
    it stands in for a killed data server with the rows the reference has."""
    # --parity 1: each data server has a parity server of its own (2 data servers, 2 parity servers); SGD
    config = job_config(raw_data, tmp_path / "bagpipe", optimizer="sgd", servers=4, parity=1, check_parity=True,
                        batch_size=60, iterations=40, cache_rows=900, timeout=20.0)
    summary = launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "server1@write-back 20:kill"})
    assert_same_parameters(export(config.run_dir, tmp_path / "ours.pt"), reference_of(config, tmp_path / "ref"))
    (failure,) = summary["failures"]
    assert failure["role"] == "server 1" and failure["parity_server"] == 3
    assert len(summary["parity"]) == 2  # (a parity server a data server: each checked against its one member)
    for parity in summary["parity"]:
        assert parity["check"]["mismatched_rows"] == [0] and parity["pending_rows"] == 0


def test_a_bagpipe_job_on_raw_ids_restarts_from_its_checkpoint_to_the_same_export(raw_data, tmp_path):
    """A lost trainer restarts the job from its checkpoint: the restarted oracle numbers the same rows again (the
    same batches), the servers restore their shards, and the job ends as the reference does, admission and rows
    retired (their numbers made again for new keys, before and after the restart) included."""
    config = job_config(raw_data, tmp_path / "run", optimizer="adam", batch_size=60, iterations=40, cache_rows=900,
                        row_min_count=2, row_retire_after=3, timeout=10.0, checkpoint_every=10,
                        replace_trainers=False, replace_oracle=False)
    summary = launch_local(config, show_progress=False, env={"BAGPIPE_FAULTS": "trainer1@iteration 23:kill"})
    [restart] = summary["restarts"]
    assert restart["resumed_from"] == 20 and summary["resumed_at"] == 20
    from bagpipe.preflight import prepare_data  # (rows are made again at the very boundary it resumed from)
    assert any(len(rows) for rows, _ in prepare_data(config).numbering.resets(20))
    assert_same_parameters(export(config.run_dir, tmp_path / "run.pt"), reference_of(config, tmp_path / "ref"))
    reference = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert summary["raw_ids"] == reference["raw_ids"]
