"""Next-item sequences: interaction logs in MovieLens's formats, samples, the planted generator, and
Caser learning and training exactly in every mode."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from bagpipe.cached import gather_tables, train_cached
from bagpipe.config import ModelConfig, TrainConfig
from bagpipe.data.batches import iterate_batches
from bagpipe.data.binary import open_dataset
from bagpipe.data.formats import DataError
from bagpipe.data.preprocess import ensure_preprocessed, guess_format, preprocess
from bagpipe.data.schema import PAD
from bagpipe.data.sequences import SequenceSettings, build_samples, dense_ids, read_interactions
from bagpipe.embeddings import EmbeddingLayout
from bagpipe.metrics import ranking_metrics
from bagpipe.evaluation import evaluate
from bagpipe.model_dir import TableRows
from bagpipe.reference import build_model, build_tables, train_reference, train_step
from bagpipe.rundir import export
from bagpipe.runtime.launch import launch_local
from bagpipe.synth_sequences import generate_sequences
from test_runtime import assert_same_parameters, job_config, reference_of

CASER = ModelConfig(name="caser", emb_dim=16, vertical_filters=4, horizontal_filters=8)
LOG = [(7, 30, 5, 100), (7, 10, 3, 101), (9, 30, 4, 50), (7, 20, 1, 102), (9, 10, 2, 51), (7, 30, 5, 103),
       (7, 40, 4, 104), (9, 20, 3, 52)]  # user, item, rating, timestamp


# LOG in each layout a log comes in: (its header, a row's format from user, item, rating, timestamp)
LAYOUTS = {
    "u.data": ("", "{0}\t{1}\t{2}\t{3}"),
    "ratings.dat": ("", "{0}::{1}::{2}::{3}"),
    "ratings.csv": ("userId,movieId,rating,timestamp\n", "{0},{1},{2}.0,{3}"),
    "csv without a header": ("", "{0},{1},{2},{3}"),
    "RecBole .inter": ("user_id:token\titem_id:token\trating:float\ttimestamp:float\n", "{0}\t{1}\t{2}\t{3}"),
    "RecBole .inter, reordered, an extra column": (
        "timestamp:float\tgenres:token_seq\titem_id:token\tuser_id:token\trating:float\n",
        "{3}.0\tdrama comedy\t{1}\t{0}\t{2}"),
}


def write_log(path, layout, log=LOG):
    header, row = LAYOUTS[layout]
    path.write_text(header + "".join(row.format(*interaction) + "\n" for interaction in log))
    return path


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_log_layout_is_told_by_its_content_and_reads_the_same_interactions(tmp_path, layout):
    path = write_log(tmp_path / "log.txt", layout)  # a name that says nothing (its suffix: Criteo's)
    assert guess_format(path) == "movielens"
    users, items, times = read_interactions(path)
    assert users.tolist() == [r[0] for r in LOG] and items.tolist() == [r[1] for r in LOG]
    assert times.tolist() == [r[3] for r in LOG]


def test_an_inter_file_and_the_same_log_as_u_data_convert_to_the_same_arrays(tmp_path):
    log = [(user, item, 3, 1000 + 7 * user + item) for user in range(1, 9) for item in range(user, user + 9)]
    inter = write_log(tmp_path / "ml.inter", "RecBole .inter, reordered, an extra column", log)
    u_data = write_log(tmp_path / "u.data", "u.data", log)
    metas = [preprocess(path, tmp_path / path.name.replace(".", "_"), show_progress=False) for path in (inter, u_data)]
    assert metas[0]["users"] == 8 and metas[0]["items"] == 16 and metas[0]["rows"] == metas[1]["rows"]
    ours, theirs = open_dataset(tmp_path / "ml_inter"), open_dataset(tmp_path / "u_data")
    for split in ("train", "test"):
        np.testing.assert_array_equal(getattr(ours, split).ids, getattr(theirs, split).ids)
    for vocab in ("user.npy", "item.npy"):
        np.testing.assert_array_equal(np.load(tmp_path / "ml_inter" / "vocab" / vocab),
                                      np.load(tmp_path / "u_data" / "vocab" / vocab))


def test_a_file_that_is_no_log_is_named_and_leaves_no_output(tmp_path):
    users = tmp_path / "ml.user"
    users.write_text("user_id:token\tage:token\tzip_code:token\n1\t24\t85711\n")
    with pytest.raises(DataError, match=r"ml.user:1: a RecBole atomic file without item_id or timestamp"):
        preprocess(users, tmp_path / "out", show_progress=False)  # told as a log by its header
    clicks = tmp_path / "train.tsv"
    clicks.write_text("1\t" + "\t".join(["3"] * 13 + ["a1"] * 26) + "\n")
    with pytest.raises(DataError, match=r"train.tsv:1: not an interaction log"):
        preprocess(clicks, tmp_path / "new" / "out", fmt="movielens", show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ml.user", "train.tsv"]


def test_a_malformed_log_line_is_named(tmp_path):
    path = tmp_path / "u.data"
    path.write_text("1\t2\t3\t4\n1\t2\tthree\n")
    with pytest.raises(DataError, match=r"u.data:2: wrong column count"):
        read_interactions(path)
    path.write_text("1\t2\t3\t4\n1\tx\t3\t4\n")
    with pytest.raises(DataError, match=r"u.data:2: non-integer"):
        read_interactions(path)


def test_ids_are_numbered_by_descending_frequency():
    new, raw = dense_ids(np.array([50, 7, 50, 9, 50, 7]))
    assert raw.tolist() == [50, 7, 9] and new.tolist() == [0, 1, 0, 2, 0, 1]


def test_samples_hold_the_history_before_their_targets_and_the_last_item_for_testing():
    # user 0's items in time order: 3 1 4 1 5 9 2 6; user 1 has one interaction too few to test
    users = np.array([0] * 8 + [1])
    items = np.array([3, 1, 4, 1, 5, 9, 2, 6, 8])
    times = np.array([0, 1, 2, 3, 4, 5, 6, 7, 0])
    train, test, num_users, num_items = build_samples(users, items, times, SequenceSettings(history=3, targets=2,
                                                                                          negatives=2))
    assert (num_users, num_items) == (2, 10)
    user, history, targets, negatives = train[:, 0], train[:, 1:4], train[:, 4:6], train[:, 6:]
    assert history.tolist() == [[PAD, PAD, 3], [PAD, 3, 1], [3, 1, 4], [1, 4, 1], [4, 1, 5]]
    assert targets.tolist() == [[1, 4], [4, 1], [1, 5], [5, 9], [9, 2]]  # never the held-out 6
    assert (user == 0).all() and not np.isin(negatives, [3, 1, 4, 5, 9, 2, 6]).any()
    assert test[0, :4].tolist() == [0, 5, 9, 2] and test[0, 4:6].tolist() == [6, PAD]
    assert len(test) == 1  # user 1: a single interaction


def test_the_generator_is_deterministic_and_states_its_best(tmp_path):
    metas = [generate_sequences(tmp_path / name, users=300, items=60, interactions=12, seed=seed,
                                show_progress=False) for name, seed in (("a", 3), ("b", 3), ("c", 4))]
    assert (tmp_path / "a" / "ratings.csv").read_bytes() == (tmp_path / "b" / "ratings.csv").read_bytes()
    assert (tmp_path / "a" / "ratings.csv").read_bytes() != (tmp_path / "c" / "ratings.csv").read_bytes()
    assert 0.0 < metas[0]["best_ndcg10"] < metas[0]["best_hr10"] < 1.0
    data = open_dataset(ensure_preprocessed(tmp_path / "a", show_progress=False))
    assert data.meta["best_hr10"] == metas[0]["best_hr10"] and data.schema.features[1].width == 5


def test_next_item_metrics_rank_every_item_but_the_history(sequence_data):
    class Fixed(torch.nn.Module):  # scores every item by its id: item 299 first
        task = "next-item"

        def score_all(self, embeddings, item_out, item_bias):
            return torch.arange(item_out.shape[0], dtype=torch.float32).expand(len(embeddings.ids), -1)

    config = TrainConfig(data="-", run_dir="-", model=CASER)
    dataset = open_dataset(sequence_data)
    tables = build_tables(config, dataset.schema)
    got = evaluate(Fixed(), tables.layout, TableRows(tables), dataset.test, batch_size=500, max_rows=500)
    ids = np.asarray(dataset.test.ids[:500])
    history, target = ids[:, 1:6], ids[:, 6]
    ranks = [int(np.sum((np.arange(300) > t) & ~np.isin(np.arange(300), h))) for h, t in zip(history, target)]
    hr, ndcg = ranking_metrics(np.asarray(ranks), k=10)
    assert got["eval_hr10"] == pytest.approx(hr) and got["eval_ndcg10"] == pytest.approx(ndcg)


def test_caser_learns_the_planted_sequences(sequence_data, tmp_path):
    config = TrainConfig(data=str(sequence_data), run_dir=str(tmp_path / "run"), batch_size=256, iterations=0,
                         optimizer="adagrad", lr=0.05, log_every=100, model=CASER)
    summary = train_reference(config, show_progress=False)
    assert summary["best_hr10"] - summary["eval_hr10"] < 0.07, summary  # measured: 0.036 (one pass)
    assert summary["eval_ndcg10"] > 0.25
    layout = EmbeddingLayout(build_tables(config, open_dataset(sequence_data).schema).layout.tables,
                             open_dataset(sequence_data).schema)
    assert [s.dim for s in layout.spaces] == [16, 32, 1]  # users and input items; output items; item biases


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_cached_caser_equals_the_reference(sequence_data, optimizer):
    split = open_dataset(sequence_data).train
    config = TrainConfig(data="-", run_dir="-", optimizer=optimizer, lr=0.01, seed=2, model=replace(CASER, dropout=0.2))
    model, tables = build_model(config, split.schema), build_tables(config, split.schema)
    dense = tables.optimizer.dense_optimizer(model.parameters())
    for iteration, batch in enumerate(iterate_batches(split, batch_size=128, iterations=20)):
        train_step(model, tables, dense, batch, seed=config.seed, iteration=iteration)
    cached = build_model(config, split.schema)
    stores = train_cached(cached, tables.optimizer.dense_optimizer(cached.parameters()), split, layout=tables.layout,
                          row_optimizer=tables.optimizer, seed=config.seed, batch_size=128, iterations=20,
                          cache_rows=2500, lookahead=4, num_shards=2)
    for t, got in enumerate(gather_tables(stores, tables.layout)):
        assert torch.equal(got, tables.table(t)), tables.layout.tables[t].name
    for (key, got), want in zip(cached.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), key


def test_bagpipe_caser_equals_the_sliced_reference(sequence_data, tmp_path):
    config = job_config(sequence_data, tmp_path / "bagpipe", iterations=80, batch_size=256, optimizer="adam", lr=0.005,
                        cache_rows=3000, model=replace(CASER, dropout=0.3))
    summary = launch_local(config, show_progress=False)
    assert summary["model"] == "caser" and "eval_hr10" in summary and summary["rows_fetched"] > 0
    assert_same_parameters(export(config.run_dir, tmp_path / "ours.pt"), reference_of(config, tmp_path / "reference"))
    assert json.loads((tmp_path / "reference" / "summary.json").read_text())["eval_hr10"] == summary["eval_hr10"]


def test_dlrm_refuses_sequences_and_caser_refuses_click_logs(sequence_data, small_binary, tmp_path):
    for data, model, message in ((sequence_data, ModelConfig(name="dlrm"), "0 dense features"),
                                 (small_binary, CASER, "caser trains on next-item sequences")):
        with pytest.raises(ValueError, match=message):
            train_reference(TrainConfig(data=str(data), run_dir=str(tmp_path / model.name), model=model),
                            show_progress=False)


def test_preprocess_takes_the_log_file_itself(tmp_path):
    generate_sequences(tmp_path / "raw", users=50, items=30, interactions=8, seed=1, show_progress=False)
    meta = preprocess(tmp_path / "raw" / "ratings.csv", tmp_path / "bin", show_progress=False,
                      sequence=SequenceSettings(history=3))
    assert meta["source_format"] == "movielens" and meta["sequence"]["history"] == 3
    assert "best_hr10" not in meta  # ranked over another history length: not this data's best
    assert open_dataset(tmp_path / "bin").schema.features[1].width == 3
