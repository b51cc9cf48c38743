"""bagpipe train --mode single: one process, tables behind a cache, the same result as --mode reference."""

import json

import pytest
import torch

from bagpipe.cli import main
from bagpipe.rundir import export
from bagpipe.train.reference import train_reference
from helpers.jobs import exports_equal, small_config


# --storage disk: the tables in files behind 16 KiB of DRAM (about 100 rows of 861, Adam's or Adagrad's records)
ON_DISK = {"storage": "disk", "storage_budget_mb": 1 / 64}


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")


@pytest.mark.parametrize("policy, optimizer, slices, storage, device", [
    ("lookahead", "adagrad", 1, {}, "cpu"), ("lru", "adam", 1, {}, "cpu"), ("lfu", "sgd", 2, {}, "cpu"),
    ("lookahead", "adam", 1, ON_DISK, "cpu"), ("lru", "adagrad", 2, ON_DISK, "cpu"),
    # on a GPU (--device: the reference's tables there, single's cache there and its tables in host memory)
    pytest.param("lookahead", "adagrad", 1, {}, "cuda", marks=CUDA),
    pytest.param("lru", "adam", 2, ON_DISK, "cuda", marks=CUDA)])
def test_single_mode_equals_the_reference_bit_for_bit(small_binary, tmp_path, policy, optimizer, slices, storage,
                                                      device, monkeypatch):
    import bagpipe.nn.tables

    sorts = []  # the batches single's lookups sorted themselves: with a plan, only those it did not place (evaluation)
    unique_inverse = bagpipe.nn.tables.unique_inverse
    monkeypatch.setattr(bagpipe.nn.tables, "unique_inverse", lambda ids: sorts.append(len(ids)) or unique_inverse(ids))
    runs = {}
    for mode in ("reference", "single"):
        # 600 cached rows of 861, batches of 64 x 26 lookups (~440 rows): evictions and re-fetches
        config = small_config(small_binary, tmp_path / mode, mode=mode, device=device, iterations=60, batch_size=64,
                              optimizer=optimizer, policy=policy, cache_rows=600, lookahead=16, slices=slices,
                              eval_every=30, shuffle=True, shuffle_seed=3, **(storage if mode == "single" else {}))
        summary = train_reference(config, show_progress=False)
        runs[mode] = (summary, export(tmp_path / mode, tmp_path / f"{mode}.pt"))
    (reference, want), (single, got) = runs["reference"], runs["single"]
    assert exports_equal(want, got)
    assert single["mode"] == "single" and single["eval_auc"] == reference["eval_auc"]
    assert single["device"].startswith(device) and reference["device"].startswith(device)
    assert single["cache_rows"] == 600 and single["total_rows"] == 861 and single["policy"] == policy
    assert single["cache"]["rows_written_back"] > 600 and 0 < single["cache_hit_rate"] < 1
    if policy == "lookahead" and slices == 1:  # each training batch placed where the planner's sort put it
        assert len(sorts) < 60 // 4, f"{len(sorts)} lookups sorted their ids again"
    if storage:  # the files were read and written past their DRAM cache, and are gone with the run
        assert single["storage"]["disk_rows_written"] > 0 and single["storage"]["disk_rows_read"] > 861
        assert not (tmp_path / "single" / "storage").exists()  # the working files, and their directory
    else:
        assert single["storage"] == {}


def test_single_mode_on_disk_resumes_from_its_checkpoints_as_in_memory(small_binary, tmp_path):
    """Full and incremental checkpoints of tables on disk, restored into new files: the run ends as one that
    never stopped, in memory."""
    common = dict(mode="single", batch_size=64, cache_rows=600, lookahead=8, optimizer="adam")
    whole = small_config(small_binary, tmp_path / "whole", iterations=40, **common)
    train_reference(whole, show_progress=False)
    cut = small_config(small_binary, tmp_path / "cut", iterations=27, checkpoint_every=5, **common, **ON_DISK)
    train_reference(cut, show_progress=False)
    (tmp_path / "cut" / "summary.json").unlink()  # as if stopped after its last checkpoint (25)
    resumed = small_config(small_binary, tmp_path / "cut", iterations=40, checkpoint_every=5, **common, **ON_DISK)
    summary = train_reference(resumed, show_progress=False, resume=True)
    assert summary["resumed_at"] == 25
    assert exports_equal(export(tmp_path / "whole", tmp_path / "whole.pt"), export(tmp_path / "cut", tmp_path / "cut.pt"))


def test_a_failed_run_on_disk_deletes_its_files(small_binary, tmp_path, monkeypatch):
    from bagpipe import faults

    monkeypatch.setattr(faults, "_FAULTS", {("reference", "iteration 5"): ("fail", 0.0)})
    monkeypatch.setattr(faults, "_ROLE", "reference")
    config = small_config(small_binary, tmp_path / "run", mode="single", iterations=20, batch_size=64,
                          cache_rows=600, **ON_DISK)
    with pytest.raises(faults.InjectedFault) as failure:
        train_reference(config, show_progress=False)
    # deleted as the error left the run, not when the tables are collected (the traceback still holds them)
    assert failure.tb is not None and not (tmp_path / "run" / "storage").exists()


def test_single_mode_resumes_from_its_checkpoint_as_if_never_stopped(small_binary, tmp_path):
    whole = small_config(small_binary, tmp_path / "whole", mode="single", iterations=40, batch_size=64,
                         cache_rows=600, lookahead=8)
    train_reference(whole, show_progress=False)
    cut = small_config(small_binary, tmp_path / "cut", mode="single", iterations=20, batch_size=64, cache_rows=600,
                       lookahead=8, checkpoint_every=10)
    train_reference(cut, show_progress=False)
    (tmp_path / "cut" / "summary.json").unlink()  # as if stopped after its last checkpoint (10: none at the end)
    resumed = small_config(small_binary, tmp_path / "cut", mode="single", iterations=40, batch_size=64,
                           cache_rows=600, lookahead=8, checkpoint_every=10)
    summary = train_reference(resumed, show_progress=False, resume=True)
    assert summary["resumed_at"] == 10
    assert exports_equal(export(tmp_path / "whole", tmp_path / "whole.pt"), export(tmp_path / "cut", tmp_path / "cut.pt"))


def test_single_mode_on_the_command_line(small_tsv, tmp_path, capsys):
    args = ["train", "--data", str(small_tsv), "--run-dir", str(tmp_path / "run"), "--mode", "single",
            "--cache-rows", "400", "--policy", "lru", "--iterations", "20", "--batch-size", "32", "--emb-dim", "4",
            "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "mode single" in out and "cache       400 of" in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mode"] == "single" and summary["cache_rows"] == 400
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "train_loss" in r]
    assert all(0 <= r["cache_hit_rate"] <= 1 and r["rows_fetched_per_iteration"] > 0 for r in windows)
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "report")]) == 0
    assert "(single, lru): single mode" in capsys.readouterr().out
    assert main(["train", "--data", str(small_tsv), "--run-dir", str(tmp_path / "none"), "--mode", "single",
                 "--policy", "none", "--no-progress"]) == 2
    assert "--mode single: policy must be one of lookahead, lru, lfu" in capsys.readouterr().err
    assert main(["train", "--data", str(small_tsv), "--run-dir", str(tmp_path / "disk"), "--mode", "single",
                 "--cache-rows", "400", "--iterations", "10", "--batch-size", "32", "--emb-dim", "4",
                 "--storage", "disk", "--storage-dir", str(tmp_path / "tables"), "--storage-budget-mb", "0.05",
                 "--no-progress"]) == 0
    summary = json.loads((tmp_path / "disk" / "summary.json").read_text())
    assert summary["storage"]["disk_rows_read"] > 0 and list((tmp_path / "tables").iterdir()) == []


def test_storage_flags_warn_in_reference_mode(small_tsv, tmp_path, capsys):
    args = ["train", "--data", str(small_tsv), "--run-dir", str(tmp_path / "run"), "--mode", "reference",
            "--iterations", "2", "--batch-size", "32", "--emb-dim", "4", "--storage", "disk", "--no-progress"]
    assert main(args) == 0
    assert "WARNING --storage does nothing in --mode reference" in capsys.readouterr().err


def test_single_mode_refuses_a_cache_smaller_than_a_batch(small_binary, tmp_path):
    config = small_config(small_binary, tmp_path / "run", mode="single", iterations=5, batch_size=64, cache_rows=30)
    with pytest.raises(ValueError, match="the smallest --cache-rows that every batch fits is .*; or lower the batch "
                                         "size"):
        train_reference(config, show_progress=False)
