"""Next-item sequences: interaction logs in MovieLens's formats, samples, the planted generator, and
Caser learning and training exactly in every mode."""


from dataclasses import replace

import numpy as np
import pytest
import torch

from bagpipe.train.single import gather_tables, train_cached
from bagpipe.config import ModelConfig, TrainConfig
from bagpipe.data.batches import iterate_batches, read_batch
from bagpipe.data.binary import open_dataset
from bagpipe.data.formats import DataError
from bagpipe.data.negatives import FreshNegatives
from bagpipe.data.prepare import ensure_preprocessed
from bagpipe.data.preprocess import preprocess
from bagpipe.data.sources import guess_format
from bagpipe.data.schema import PAD
from bagpipe.data.sequences import SequenceSettings, build_samples, dense_ids, read_interactions
from bagpipe.embeddings import EmbeddingLayout
from bagpipe.metrics import ranking_metrics
from bagpipe.train.evaluation import evaluate
from bagpipe.health import COLLAPSED, EvaluationWatch
from bagpipe.model_dir import MODEL_DIR, TableRows, evaluation_of
from bagpipe.ranking import NextItemRanking
from bagpipe.report import load_run
from bagpipe.train.reference import build_model, build_tables, train_reference, train_step
from bagpipe.synth_sequences import generate_sequences
from helpers.small_models import CASER

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


def test_samples_hold_the_history_before_their_targets_and_the_last_two_items_for_validation_and_testing():
    # user 0's items in time order: 3 1 4 1 5 9 2 6; user 1 has one interaction too few to test; user 2 has two:
    # a test sample and no validation one
    users = np.array([0] * 8 + [1] + [2] * 2)
    items = np.array([3, 1, 4, 1, 5, 9, 2, 6, 8, 7, 0])
    times = np.array([0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 1])
    samples, num_users, num_items = build_samples(users, items, times, SequenceSettings(history=3, targets=2,
                                                                                       negatives=2))
    train, valid, test = samples["train"], samples["valid"], samples["test"]
    assert (num_users, num_items) == (3, 10)
    user, history, targets, negatives = train[:, 0], train[:, 1:4], train[:, 4:6], train[:, 6:]
    assert history.tolist() == [[PAD, PAD, 3], [PAD, 3, 1], [3, 1, 4], [1, 4, 1]]
    assert targets.tolist() == [[1, 4], [4, 1], [1, 5], [5, 9]]  # never the held-out 2 (validation) or 6 (test)
    assert (user == 0).all() and not np.isin(negatives, [3, 1, 4, 5, 9, 2, 6]).any()
    assert valid.tolist()[0][:6] == [0, 1, 5, 9, 2, PAD] and len(valid) == 1  # users 1 and 2: too short
    # the test history holds the validation item: known at test time, though never trained on
    assert test[0, :4].tolist() == [0, 5, 9, 2] and test[0, 4:6].tolist() == [6, PAD]
    assert test[1, :6].tolist() == [2, PAD, PAD, 7, 0, PAD] and len(test) == 2  # user 1: a single interaction


def test_the_generator_is_deterministic_and_states_its_best(tmp_path):
    metas = [generate_sequences(tmp_path / name, users=300, items=60, interactions=12, seed=seed,
                                show_progress=False) for name, seed in (("a", 3), ("b", 3), ("c", 4))]
    assert (tmp_path / "a" / "ratings.csv").read_bytes() == (tmp_path / "b" / "ratings.csv").read_bytes()
    assert (tmp_path / "a" / "ratings.csv").read_bytes() != (tmp_path / "c" / "ratings.csv").read_bytes()
    assert 0.0 < metas[0]["best_ndcg10"] < metas[0]["best_hr10"] < 1.0
    data = open_dataset(ensure_preprocessed(tmp_path / "a", show_progress=False))
    assert data.meta["best_hr10"] == metas[0]["best_hr10"] and data.schema.features[1].width == 5


@pytest.mark.parametrize("protocol", ["unseen", "history"])
def test_next_item_metrics_rank_the_protocols_candidates(sequence_data, protocol):
    class Fixed(torch.nn.Module):  # scores every item by its id: item 299 first
        task = "next-item"

        def score_all(self, embeddings, item_out, item_bias):
            return torch.arange(item_out.shape[0], dtype=torch.float32).expand(len(embeddings.ids), -1)

    config = TrainConfig(data="-", run_dir="-", model=CASER)
    dataset = open_dataset(sequence_data)
    tables = build_tables(config, dataset.schema)
    ranking = NextItemRanking.of_dataset(dataset, protocol=protocol)
    got = evaluate(Fixed(), tables.layout, TableRows(tables), dataset.test, batch_size=200, max_rows=500,
                   ranking=ranking)
    ids, train = np.asarray(dataset.test.ids[:500]), np.asarray(dataset.train.ids)
    ranks = []
    for user, history, target in zip(ids[:, 0], ids[:, 1:6], ids[:, 6]):
        excluded = history
        if protocol == "unseen":  # every item of the user's training samples, and of its test history
            excluded = np.concatenate([train[train[:, 0] == user, 1:9].ravel(), history])
        ranks.append(int(np.sum((np.arange(300) > target) & ~np.isin(np.arange(300), excluded))))
    for k in (1, 5, 10, 20):
        hr, ndcg = ranking_metrics(np.asarray(ranks), k=k)
        assert got[f"eval_hr{k}"] == pytest.approx(hr) and got[f"eval_ndcg{k}"] == pytest.approx(ndcg)
    assert got["eval_popular_hr10"] < got["eval_cooccurrence_hr10"]  # the planted data follows its last item


def test_a_collapsed_next_item_model_ranks_last_and_is_told(sequence_data):
    class Constant(torch.nn.Module):  # the same score for every item: what a collapsed model gives
        task = "next-item"

        def score_all(self, embeddings, item_out, item_bias):
            return torch.zeros(len(embeddings.ids), item_out.shape[0])

    dataset = open_dataset(sequence_data)
    tables = build_tables(TrainConfig(data="-", run_dir="-", model=CASER), dataset.schema)
    got = evaluate(Constant(), tables.layout, TableRows(tables), dataset.test, batch_size=200, max_rows=400,
                   ranking=NextItemRanking.of_dataset(dataset))
    assert got["eval_pred_std"] == 0.0 and got["eval_hr20"] == 0.0  # every target behind ~280 candidates
    warnings, _ = EvaluationWatch(metric="eval_hr10", batches_per_epoch=100).evaluation(50, got)
    assert [w.kind for w in warnings] == [COLLAPSED]


def test_baselines_count_each_training_pair_once():
    # two users: 0 has items 1 2 3 4 (4 held out), 1 has 2 3 1 (1 held out); L = 2, T = 1, N = 1
    train = np.array([[0, -1, 1, 2, 0], [0, 1, 2, 3, 0],      # user 0: windows (-, 1) -> 2, (1, 2) -> 3
                      [1, -1, 2, 3, 0]])                      # user 1: (-, 2) -> 3
    test = np.array([[0, 2, 3, 4, 0], [1, 2, 3, 1, 0]])
    ranking = NextItemRanking(train, test, num_users=2, num_items=5, history=2, targets=1)
    assert ranking.popularity.tolist() == [0, 1, 2, 2, 0]  # users who had each item in training
    follows = {(int(a), int(b)): v for a, starts in enumerate(zip(ranking.follows.starts[:-1],
                                                                 ranking.follows.starts[1:]))
               for b, v in zip(ranking.follows.columns[slice(*starts)], ranking.follows.values[slice(*starts)])}
    assert follows == {(1, 2): 1.0, (2, 3): 2.0}
    excluded = ranking.excluded(np.array([0, 1]), test[:, 1:3]).numpy()
    assert excluded.tolist() == [[False, True, True, True, False], [False, False, True, True, False]]
    figures = ranking.baselines(test)
    # user 0 (history 2 3): item 3 (2 -> 3) scores highest but is excluded; candidates 0 and 4 tie (no count, no
    # popularity), the smaller id first: target 4 at rank 1. user 1 (history 2 3): candidates 0, 1, 4 have no
    # count; popularity breaks the tie: target 1 (had by one user) at rank 0
    assert figures["eval_cooccurrence_hr1"] == 0.5 and figures["eval_cooccurrence_hr5"] == 1.0
    assert figures["eval_popular_hr1"] == 0.5  # the same order here: popularity alone
    # a model whose scores collapsed to one value ranks each target behind every other candidate, not first
    collapsed = ranking.ranks(torch.zeros(2, 5), np.array([0, 1]), test[:, 1:3], test[:, 3])
    assert collapsed.tolist() == [1, 2]


def test_caser_learns_the_planted_sequences_and_keeps_the_model_best_on_the_validation_split(sequence_data, tmp_path):
    config = TrainConfig(data=str(sequence_data), run_dir=str(tmp_path / "run"), batch_size=256, iterations=0,
                         optimizer="adagrad", lr=0.05, log_every=100, eval_every=100, keep_best=True, model=CASER)
    summary = train_reference(config, show_progress=False)
    # every evaluation covers both splits; the one kept is the best on validation, whatever the test split says
    evals = load_run(config.run_dir).evals
    assert len(evals) == summary["iterations"] // 100 + 1 and all("valid_hr10" in r and "eval_hr10" in r for r in evals)
    best = max(evals, key=lambda r: (r["valid_hr10"], -r["iteration"]))
    assert summary["best_iteration"] == best["iteration"]
    assert summary["best_metrics"]["eval_hr10"] == best["eval_hr10"] and summary["valid_rows"] == 8000
    assert evaluation_of(tmp_path / "run" / MODEL_DIR)[0] == best["iteration"]
    assert summary["best_hr10"] - summary["eval_hr10"] < 0.08, summary  # measured: 0.063 (one pass)
    assert summary["eval_ndcg10"] > 0.25
    for baseline in ("popular", "cooccurrence"):  # measured HR@10 0.454 against 0.236 and 0.411
        for metric in ("hr10", "ndcg10"):
            assert summary[f"eval_{metric}"] > summary[f"eval_{baseline}_{metric}"] + 0.02, (baseline, summary)
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


def test_dlrm_refuses_sequences_and_caser_refuses_click_logs(sequence_data, small_binary, tmp_path):
    for data, model, message in ((sequence_data, ModelConfig(name="dlrm"),
                                  "next-item sequences .*, which --model dlrm cannot read: train --model caser"),
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


def test_fresh_negatives_are_drawn_per_pass_outside_the_users_items(sequence_data):
    split = open_dataset(sequence_data).train
    negatives = FreshNegatives(split.ids, split.schema, seed=4)
    ids = np.asarray(split.ids, dtype=np.int64)
    assert np.array_equal(negatives.for_epoch(0), ids[:, 9:12])  # the first pass keeps the split's own
    first, second = negatives.for_epoch(1).copy(), negatives.for_epoch(2)
    assert first.shape == (split.rows, 3) and (first != second).mean() > 0.9 and (first != ids[:, 9:12]).mean() > 0.9
    assert np.array_equal(FreshNegatives(split.ids, split.schema, seed=4).for_epoch(1), first)  # (seed, pass) alone
    assert not np.array_equal(FreshNegatives(split.ids, split.schema, seed=5).for_epoch(1), first)
    had = {(u, i) for u, items in zip(ids[:, 0], ids[:, 1:9]) for i in items if i >= 0}
    assert not any((u, i) in had for u, row in zip(ids[:, 0], first) for i in row)  # never an item the user had
    assert np.bincount(first.ravel(), minlength=300).min() > 0  # uniform over the items, not only the popular
    rows = np.array([3, 17, 4000])  # a batch reads its rows' draws, whichever rows it holds
    batch = read_batch(split, rows, epoch=1, negatives=negatives)
    assert np.array_equal(batch.ids[:, 9:12].numpy(), first[rows])
    assert np.array_equal(batch.ids[:, :9].numpy(), ids[rows, :9])
    assert np.array_equal(read_batch(split, slice(10, 20), epoch=1, negatives=negatives).ids[:, 9:12].numpy(),
                          first[10:20])


@pytest.mark.parametrize("model", ["dlrm", "dcn", "wide-deep", "deepfm", "fgcnn"])
def test_a_click_model_on_sequence_data_is_pointed_at_caser(model):
    """Not "arch_mlp_bot starts with 13 inputs, but the data has 0 dense features": what the data is, and the
    model that reads it."""
    from bagpipe.data.sequences import schema_of
    from bagpipe.models import check_model, model_tables

    schema = schema_of(num_users=10, num_items=20, settings=SequenceSettings())
    for call in (check_model, model_tables):
        with pytest.raises(ValueError, match=f"next-item sequences.*--model {model} cannot read: train --model "
                                             "caser"):
            call(ModelConfig(name=model), schema)
    check_model(ModelConfig(name="caser"), schema)  # (and the model that reads it takes it)
