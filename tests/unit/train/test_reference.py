import json

import pytest
import torch

from bagpipe.cli import main
from bagpipe.train.reference import train_reference
from bagpipe.rundir import export
from bagpipe.synth import CRITEO_KAGGLE_TABLE_SIZES
from helpers.jobs import small_config


def test_reference_trainer_learns_the_planted_model(small_binary, tmp_path):
    summary = train_reference(small_config(small_binary, tmp_path / "run"), show_progress=False)
    assert summary["iterations"] == 300 and summary["samples"] == 300 * 256
    assert summary["best_auc"] - summary["eval_auc"] < 0.03, summary
    assert summary["samples_per_s"] > 0 and summary["final_train_loss"] < 0.6
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in ("iterations", "samples", "samples_per_s", "final_train_loss", "eval_auc", "eval_logloss", "wall_s"):
        assert key in written
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "train_loss" in r] == [50, 100, 150, 200, 250, 300]
    assert records[-1]["event"] == "eval"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_same_seed_gives_bitwise_identical_exports(small_binary, tmp_path, optimizer):
    exports = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        config = small_config(small_binary, tmp_path / name, iterations=30, optimizer=optimizer, seed=seed,
                              shuffle=True, shuffle_seed=4)
        train_reference(config, show_progress=False)
        exports.append(export(tmp_path / name, tmp_path / f"{name}.pt"))
    a, b, c = exports
    assert a["dense"].keys() == b["dense"].keys()
    assert all(torch.equal(a["dense"][k], b["dense"][k]) for k in a["dense"])
    assert all(torch.equal(x, y) for x, y in zip(a["embeddings"], b["embeddings"]))
    assert not all(torch.equal(x, y) for x, y in zip(a["embeddings"], c["embeddings"]))
    assert [t.shape[0] for t in a["embeddings"]] == [min(n, 40) for n in CRITEO_KAGGLE_TABLE_SIZES]


def test_training_moves_embeddings_and_dense_parameters(small_binary, tmp_path):
    train_reference(small_config(small_binary, tmp_path / "zero", iterations=1, lr=1e-30), show_progress=False)
    train_reference(small_config(small_binary, tmp_path / "some", iterations=20), show_progress=False)
    start, trained = export(tmp_path / "zero", tmp_path / "0.pt"), export(tmp_path / "some", tmp_path / "1.pt")
    assert any(not torch.equal(x, y) for x, y in zip(start["embeddings"], trained["embeddings"]))
    assert any(not torch.equal(start["dense"][k], trained["dense"][k]) for k in start["dense"])


def test_cli_trains_from_tsv_and_exports(small_tsv, tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text('batch_size = 512\noptimizer = "sgd"\nlr = 0.1\n[model]\nemb_dim = 4\n'
                      'arch_mlp_bot = "13-8-4"\narch_mlp_top = "8-1"\n')
    code = main(["train", "--config", str(config), "--data", str(small_tsv), "--run-dir", str(tmp_path / "run"),
                 "--iterations", "10", "--no-progress"])
    assert code == 0
    assert "eval AUC" in capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == 10 and summary["samples"] == 5120  # the flag overrode the file
    assert main(["export", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "model.pt")]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert len(exported["embeddings"]) == 26 and exported["embeddings"][0].shape == (40, 4)


def test_cli_refuses_impossible_settings_before_training(small_tsv, tmp_path, capsys):
    assert main(["train", "--data", str(small_tsv), "--run-dir", str(tmp_path / "r"), "--emb-dim", "8",
                 "--arch-mlp-bot", "13-512-256-16"]) == 2
    assert "arch_mlp_bot must end in the embedding dimension" in capsys.readouterr().err
    assert main(["train", "--data", str(small_tsv), "--run-dir", str(tmp_path / "r"), "--batch-size",
                 "1000000", "--no-progress"]) == 2
    assert "exceeds the 40000 training rows" in capsys.readouterr().err
    assert not (tmp_path / "r" / "summary.json").exists()


def test_sliced_gradients_differ_from_one_pass_only_by_rounding(small_binary, tmp_path):
    """--slices 2 computes the same gradient as two halves: with SGD (no sign-amplifying first step)
    the result stays within float32 rounding of the one-pass reference."""
    runs = {}
    for slices in (1, 2):
        train_reference(small_config(small_binary, tmp_path / str(slices), iterations=30, optimizer="sgd",
                                     lr=0.1, slices=slices), show_progress=False)
        runs[slices] = export(tmp_path / str(slices), tmp_path / f"{slices}.pt")
    for name, want in runs[1]["dense"].items():
        torch.testing.assert_close(runs[2]["dense"][name], want, rtol=1e-5, atol=1e-6)
    for got, want in zip(runs[2]["embeddings"], runs[1]["embeddings"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_slices_must_divide_the_batch(small_binary, tmp_path):
    with pytest.raises(ValueError, match="multiple of slices"):
        small_config(small_binary, tmp_path / "run", batch_size=256, slices=3)


def test_a_run_reads_its_losses_at_each_log_not_every_iteration(small_binary, tmp_path, monkeypatch):
    """The step leaves its loss on the device (on a GPU, reading it every iteration is a wait every iteration):
    with SGD nothing in a steady iteration reads a value back, and the losses read at the logs are the losses of
    the iterations, in order (the same log as the step's own float loss gives: train_step)."""
    from bagpipe.train import reference

    summary = train_reference(small_config(small_binary, tmp_path / "run", iterations=20, optimizer="sgd",
                                           log_every=5), show_progress=False)
    assert summary["host_reads_per_iteration"] == 0
    settled = []
    original = reference.PendingLosses.settle
    monkeypatch.setattr(reference.PendingLosses, "settle", lambda self: settled.append(original(self)) or settled[-1])
    again = train_reference(small_config(small_binary, tmp_path / "again", iterations=20, optimizer="sgd",
                                         log_every=5), show_progress=False)
    settled = [part for part in settled if part]
    assert [[i for i, _ in part] for part in settled] == [[0], [1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14],
                                                          [15, 16, 17, 18, 19]]
    assert again["final_train_loss"] == summary["final_train_loss"] == settled[-1][-1][1]


def test_a_loss_that_is_not_finite_inside_a_log_window_stops_the_run_naming_its_iteration(small_binary, tmp_path,
                                                                                          monkeypatch):
    from bagpipe.train import reference

    step = reference.step_loss

    def poisoned(*args, iteration, **kwargs):
        loss = step(*args, iteration=iteration, **kwargs)
        return loss * float("nan") if iteration == 6 else loss

    monkeypatch.setattr(reference, "step_loss", poisoned)
    with pytest.raises(RuntimeError, match="the training loss of iteration 7 is nan"):
        train_reference(small_config(small_binary, tmp_path / "run", iterations=20, log_every=10,
                                     checkpoint_every=8), show_progress=False)
    assert not list((tmp_path / "run").rglob("step-*"))  # settled before the checkpoint at 8: never kept
