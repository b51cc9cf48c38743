"""A run's health (bagpipe/health.py): divergence, collapsed predictions and a metric that falls once the data repeats
are each said once, at their iteration, and a healthy run says nothing; --keep-best keeps the best evaluated model,
also across a resume."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from bagpipe import faults
from bagpipe.cli import main
from bagpipe.config import ModelConfig, TrainConfig
from bagpipe.data.preprocess import preprocess
from bagpipe.health import (COLLAPSE_STD, DIVERGENCE_FACTOR, FALL_TOLERANCE, Best, EvaluationWatch, LossWatch)
from bagpipe.model_dir import MODEL_DIR, ModelDir
from bagpipe.train.reference import train_reference
from bagpipe.report import load_run, summarize
from bagpipe.synth import generate, resolve_table_sizes

SMALL = ModelConfig(emb_dim=8, arch_mlp_bot="13-32-8", arch_mlp_top="32-1")


# -- the component, fed directly ----------------------------------------------------------------------------------

def test_a_loss_that_only_falls_or_wobbles_is_silent_and_one_far_above_its_start_is_said_once():
    watch = LossWatch()
    healthy = [0.93, 2.04, 0.89, 0.73, 1.32, 0.82, 0.77, 0.72] + [0.6] * 50  # Adam, lr 0.1: a bumpy start
    assert [w for i, loss in enumerate(healthy, 1) for w in watch.loss(i, loss)] == []
    watch = LossWatch()
    said = [w for i, loss in enumerate([0.69, 0.7, 25.0, 3e4, 100.0, 0.7, 5e4], 1) for w in watch.loss(i, loss)]
    assert [(w.kind, w.iteration) for w in said] == [("diverged", 3)]  # 0.9 * 0.69 + 0.1 * 25 > 3 * 0.69
    assert f"over {DIVERGENCE_FACTOR:g} times the first iteration's (0.69)" in said[0].message
    # a non-finite loss is said at once; a watch restored from its state goes on (and says nothing twice)
    watch = LossWatch()
    watch.loss(1, 0.7)
    restored = LossWatch(**watch.state())
    assert [(w.kind, w.iteration) for w in restored.loss(2, math.nan)] == [("diverged", 2)]
    assert LossWatch(**restored.state()).loss(3, math.inf) == []


def _metrics(auc: float, spread: float = 0.2) -> dict:
    return {"eval_rows": 100, "eval_auc": auc, "eval_logloss": 0.5, "eval_pred_std": spread}


def test_collapse_falls_on_repeated_data_and_the_best_are_judged_from_evaluations():
    watch = EvaluationWatch(metric="eval_auc", batches_per_epoch=100)
    # the first pass: a fall is no warning (the data has not repeated); the best is tracked
    assert watch.evaluation(50, _metrics(0.70)) == ([], True)
    assert watch.evaluation(100, _metrics(0.65)) == ([], False)
    # the second pass: within the tolerance, silent; beyond it, said once, naming the best so far
    assert watch.evaluation(150, _metrics(0.70 - FALL_TOLERANCE / 2)) == ([], False)
    warnings, best = watch.evaluation(200, _metrics(0.66))
    assert not best and [(w.kind, w.iteration) for w in warnings] == [("overfitting", 200)]
    assert "pass 2" in warnings[0].message and "0.7000 at iteration 50" in warnings[0].message
    assert watch.evaluation(250, _metrics(0.60)) == ([], False)
    assert watch.evaluation(300, _metrics(0.75)) == ([], True)
    assert watch.summary() == {"best_iteration": 300, "best_metrics": _metrics(0.75)}
    # predictions of one value: said once; an ordinary spread is not
    warnings, _ = watch.evaluation(350, _metrics(0.5, spread=COLLAPSE_STD / 10))
    assert [(w.kind, w.iteration) for w in warnings] == [("collapsed", 350)]
    assert watch.evaluation(400, _metrics(0.5, spread=0.0))[0] == []


def test_a_watch_takes_up_what_a_run_logged_and_the_model_it_kept():
    logged = [{"event": "eval", "iteration": 100, **_metrics(0.70)}, {"iteration": 110, "train_loss": 0.5},
              {"event": "warning", "kind": "collapsed", "iteration": 100, "message": "..."}]
    watch = EvaluationWatch(metric="eval_auc", batches_per_epoch=100)
    watch.replay(logged)
    watch.keep(Best(180, _metrics(0.72)))  # kept after the checkpoint the run resumes from
    assert watch.best.iteration == 180
    # the evaluations at and before 180 are computed again: the fall is judged against the ones before them only
    assert watch.evaluation(140, _metrics(0.71)) == ([], False)
    assert watch.evaluation(180, _metrics(0.72)) == ([], False)  # equal to the kept one: it stays
    assert watch.evaluation(190, _metrics(0.5, spread=0.0))[0][0].kind == "overfitting"  # (collapse: said before)


# -- runs ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def repeating_data(tmp_path_factory):
    """2000 training rows and tables of up to 1000 rows: with Adam at 0.01 and batches of 100 (20 per pass), AUC
    peaks in the second pass (0.681 at iteration 40) and falls in the third (0.660 at 60)."""
    out = tmp_path_factory.mktemp("repeating")
    sizes = resolve_table_sizes(tables=None, table_sizes=None, max_rows_per_table=1000)
    generate(out / "text", rows=2000, test_rows=2000, seed=3, table_sizes=sizes, show_progress=False)
    preprocess(out / "text", out / "bin", show_progress=False)
    return out / "bin"


def repeating_config(data, run_dir, **overrides) -> TrainConfig:
    values = dict(data=str(data), run_dir=str(run_dir), batch_size=100, iterations=80, optimizer="adam", lr=0.01,
                  eval_every=20, keep_best=True, log_every=10, warmup_iterations=1, model=SMALL)
    values.update(overrides)
    return TrainConfig(**values)


@pytest.fixture(scope="module")
def state_at_40(repeating_data, tmp_path_factory):
    """The model after 40 iterations (the best evaluated of the runs below)."""
    run_dir = tmp_path_factory.mktemp("at40") / "run"
    train_reference(repeating_config(repeating_data, run_dir, iterations=40, keep_best=False), show_progress=False)
    return ModelDir.open(run_dir / MODEL_DIR).load()


def same_model(run_dir, want: dict) -> bool:
    got = ModelDir.open(run_dir / MODEL_DIR).load()
    return (got["dense"].keys() == want["dense"].keys()
            and all(torch.equal(got["dense"][k], want["dense"][k]) for k in got["dense"])
            and all(torch.equal(x, y) for x, y in zip(got["embeddings"], want["embeddings"], strict=True)))


@pytest.mark.parametrize("mode", ["reference", "single"])
def test_keep_best_keeps_the_best_evaluated_model_and_a_fall_on_repeated_data_is_said(repeating_data, state_at_40,
                                                                                       tmp_path, mode, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        summary = train_reference(repeating_config(repeating_data, run_dir, mode=mode, cache_rows=2000),
                                  show_progress=False)
    assert summary["best_iteration"] == 40 and summary["best_metrics"]["eval_auc"] > summary["eval_auc"] + 0.02
    assert same_model(run_dir, state_at_40)
    assert ModelDir.open(run_dir / MODEL_DIR).meta["metrics"] == summary["best_metrics"]
    assert [(w["kind"], w["iteration"]) for w in summary["warnings"]] == [("overfitting", 60)]
    assert "eval_auc fell at iteration 60, in pass 3" in caplog.text
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["iteration"]) for r in records if r.get("event") == "warning"] == [("overfitting", 60)]
    shown = summarize(load_run(run_dir))
    assert "best eval    AUC" in shown and "at iteration 40: model/ holds it" in shown and "WARNING      eval_auc" in shown


def test_a_resumed_run_keeps_the_best_it_had_kept_and_says_nothing_twice(repeating_data, state_at_40, tmp_path,
                                                                         monkeypatch):
    run_dir = tmp_path / "run"
    config = repeating_config(repeating_data, run_dir, checkpoint_every=20)
    monkeypatch.setattr(faults, "_FAULTS", {("reference", "iteration 69"): ("fail", 0.0)})
    monkeypatch.setattr(faults, "_ROLE", "reference")
    with pytest.raises(faults.InjectedFault):  # after its checkpoint at 60 and its warning there
        train_reference(config, show_progress=False)
    monkeypatch.setattr(faults, "_FAULTS", {})
    summary = train_reference(config, show_progress=False, resume=True)
    assert summary["resumed_at"] == 60
    # without the evaluations logged and the model kept, the final one (80) would be the best
    assert summary["best_iteration"] == 40 and same_model(run_dir, state_at_40)
    assert [(w["kind"], w["iteration"]) for w in summary["warnings"]] == [("overfitting", 60)]


def test_a_diverging_run_is_said_to_diverge_and_collapse_at_their_iterations(small_binary, tmp_path):
    config = TrainConfig(data=str(small_binary), run_dir=str(tmp_path / "run"), batch_size=256, iterations=20,
                         optimizer="adam", lr=1.0, max_eval_rows=2000, log_every=10, model=SMALL)
    summary = train_reference(config, show_progress=False)
    # its loss went from 0.93 to thousands at once; its predictions ended within 1e-7 of one value
    assert [(w["kind"], w["iteration"]) for w in summary["warnings"]] == [("diverged", 2), ("collapsed", 20)]
    assert summary["eval_pred_std"] < COLLAPSE_STD and abs(summary["eval_auc"] - 0.5) < 0.01


def test_a_healthy_run_over_three_passes_says_nothing_and_keeps_its_last_model(repeating_data, tmp_path, capsys):
    """SGD at 0.3 on the same data: AUC and log-loss better at every evaluation (0.513, 0.563, 0.593)."""
    run_dir = tmp_path / "run"
    assert main(["train", "--data", str(repeating_data), "--run-dir", str(run_dir), "--iterations", "60",
                 "--batch-size", "100", "--optimizer", "sgd", "--lr", "0.3", "--emb-dim", "8", "--arch-mlp-bot",
                 "13-32-8", "--arch-mlp-top", "32-1", "--eval-every", "20", "--keep-best", "--no-progress"]) == 0
    assert "WARNING" not in capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["warnings"] == [] and summary["keep_best"] and summary["best_iteration"] == 60
    assert ModelDir.open(run_dir / MODEL_DIR).meta["iteration"] == 60


def test_keep_best_without_evaluations_during_training_is_refused(small_binary, tmp_path, capsys):
    assert main(["train", "--data", str(small_binary), "--run-dir", str(tmp_path / "run"), "--keep-best"]) == 2
    assert "keep_best keeps the best of the evaluations during training: it needs eval_every" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_final_next_item_evaluation_not_above_a_baseline_is_warned_once_naming_it():
    from bagpipe.health import NOT_ABOVE_BASELINES

    watch = EvaluationWatch(metric="eval_hr10", batches_per_epoch=100)
    above = {"eval_hr10": 0.30, "eval_popular_hr10": 0.10, "eval_cooccurrence_hr10": 0.25}
    assert watch.final(200, above) == []
    level = {"eval_hr10": 0.25, "eval_popular_hr10": 0.10, "eval_cooccurrence_hr10": 0.25}  # level is not above
    (warning,) = watch.final(300, level)
    assert warning.kind == NOT_ABOVE_BASELINES and warning.iteration == 300
    assert "eval_hr10 0.2500 is not above the co-occurrence baseline's 0.2500" in warning.message
    assert "most-popular" not in warning.message
    assert watch.final(300, level) == []  # said once per run
    clicks = EvaluationWatch(metric="eval_auc", batches_per_epoch=100)  # no baselines beside a click model's AUC
    assert clicks.final(100, {"eval_auc": 0.5}) == []


def test_with_a_validation_split_the_watch_judges_and_keeps_by_it_and_never_by_the_test_split():
    """Evaluations cover both splits (eval_*: test, valid_*: validation); falls, collapse and the best kept are
    judged on the validation split alone, the model delivered is then judged against the test split's baselines."""
    def point(valid: float, test: float, spread: float = 0.1) -> dict:
        return {"valid_hr10": valid, "valid_pred_std": spread, "valid_popular_hr10": 0.10,
                "eval_hr10": test, "eval_pred_std": 0.1, "eval_popular_hr10": 0.10, "eval_cooccurrence_hr10": 0.30}

    watch = EvaluationWatch(metric="valid_hr10", batches_per_epoch=10)
    assert watch.prefix == "valid_"
    assert watch.evaluation(10, point(0.30, 0.50)) == ([], True)
    assert watch.evaluation(20, point(0.40, 0.20)) == ([], True)  # better on validation, worse on test: kept
    warnings, best = watch.evaluation(30, point(0.35, 0.60))  # the test split rises; validation fell past pass 1
    assert not best and [w.kind for w in warnings] == ["overfitting"] and "valid_hr10 fell" in warnings[0].message
    assert watch.best.iteration == 20 and watch.best.metrics == point(0.40, 0.20)  # both splits' figures kept
    # a collapse is read from the watched split's spread
    assert [w.kind for w in watch.evaluation(40, point(0.1, 0.1, spread=0.0))[0]] == ["collapsed"]
    # the model delivered (iteration 20's) is judged on the test split: 0.20 is below co-occurrence's 0.30
    (warning,) = watch.final(40, watch.best.metrics)
    assert "the final eval_hr10 0.2000 is not above the co-occurrence baseline's 0.3000" in warning.message


def test_a_hit_rate_fall_within_its_sampling_noise_is_not_said_to_be_overfitting():
    """A validation split of 943 users (MovieLens-100k's) measures HR@10 near 0.2 to a standard error of about 0.013:
    a 0.005 dip is noise there, but not on 100,000 samples (standard error 0.0013, so the 0.002 floor applies)."""
    def point(hr: float, rows: int) -> dict:
        return {"valid_hr10": hr, "valid_rows": rows, "valid_pred_std": 0.1}

    for rows, said in ((943, []), (100_000, ["overfitting"])):
        watch = EvaluationWatch(metric="valid_hr10", batches_per_epoch=10)
        watch.evaluation(10, point(0.200, rows))
        warnings, _ = watch.evaluation(20, point(0.195, rows))
        assert [w.kind for w in warnings] == said, rows
    watch = EvaluationWatch(metric="valid_hr10", batches_per_epoch=10)  # a real fall on the small split: said
    watch.evaluation(10, point(0.200, 943))
    assert [w.kind for w in watch.evaluation(20, point(0.160, 943))[0]] == ["overfitting"]
