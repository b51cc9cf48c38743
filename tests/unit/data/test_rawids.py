"""Raw ids (bagpipe preprocess --raw-ids, bagpipe synth --raw-ids): each value a 63-bit key of its own, the same
in every path that reads it; the synthetic ids that keep arriving; what is refused, and why."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bagpipe.cli import main
from bagpipe.data.avazu import COLUMNS
from bagpipe.data.binary import open_dataset
from bagpipe.data.preprocess import preprocess
from bagpipe.data.rawids import KEY_BITS, KEY_SPACE, mix63, raw_keys, raw_keys_padded, unmix63
from bagpipe.data.vocab import stable_hash
from bagpipe.synth import generate


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, KEY_SPACE - 1), min_size=1, max_size=200, unique=True), st.integers(0, 40))
def test_keys_are_a_bijection_of_63_bit_values_and_never_negative(values, table):
    words = np.array(values, dtype=np.uint64)
    np.testing.assert_array_equal(unmix63(mix63(words)), words)
    keys = raw_keys(words, table)
    assert keys.dtype == np.int64 and (keys >= 0).all()
    assert len(np.unique(keys)) == len(values)  # no two values of a table share a key


def test_tables_key_the_same_value_apart_and_every_call_keys_it_alike():
    values = np.arange(1000, dtype=np.uint64)
    a, b = raw_keys(values, 0), raw_keys(values, 1)
    assert len(np.intersect1d(a, b)) == 0
    np.testing.assert_array_equal(a, raw_keys(values.astype(np.int64), 0))
    assert raw_keys(np.array([7], dtype=np.uint64), 3)[0] == 2368875123946531075  # fixed: stored data depends on it
    assert np.bincount(a % 8, minlength=8).min() > 100  # sequential values spread over any split of the keys


def test_64_bit_values_fold_into_63_and_padding_stays_padding():
    keys = raw_keys(np.array([2**64 - 1, 2**63, 5], dtype=np.uint64), 2)
    assert (keys >= 0).all() and keys.max() < KEY_SPACE
    np.testing.assert_array_equal(raw_keys_padded(np.array([[3, -1], [5, 4]]), 1),
                                  [[raw_keys(np.array([3]), 1)[0], -1], raw_keys(np.array([5, 4]), 1)])
    with pytest.raises(ValueError, match="non-negative"):
        raw_keys(np.array([-2]), 0)
    with pytest.raises(ValueError, match="integers"):
        raw_keys(np.array([1.5]), 0)


@pytest.fixture(scope="module")
def arriving(tmp_path_factory):
    """Raw-id synthetic data: 6 tables of 300 active ids, 5 periods, a fifth of each period's ids new."""
    out = tmp_path_factory.mktemp("arriving")
    meta = generate(out / "data", rows=12_000, test_rows=2_000, seed=3, table_sizes=[300, 300, 300, 50, 8, 300],
                    raw_ids=True, periods=5, new_share=0.2, show_progress=False)
    return out, meta


def hex_column(path, table):
    """Table ``table``'s values in a Criteo file, as written (empty fields: 0)."""
    lines = path.read_text().splitlines()
    return np.array([int(field, 16) if field else 0 for field in (line.split("\t")[14 + table] for line in lines)],
                    dtype=np.uint64)


def test_synth_ids_keep_arriving_with_a_known_best(arriving):
    out, meta = arriving
    assert 0.6 < meta["best_auc"] < 1 and meta["raw_ids"]["periods"] == 5
    values = hex_column(out / "data" / "train.tsv", 0)
    assert values.max() < KEY_SPACE and values.max() > 2**56  # ids from a 2**63 space
    periods = np.array_split(values, 5)
    seen = set(periods[0].tolist())
    for period in periods[1:]:
        ids = set(period.tolist()) - {0}
        new = ids - seen
        assert 0.1 < len(new) / len(ids) < 0.35  # a share of each period's ids new (0.2 of its window)
        seen |= ids
    test = set(hex_column(out / "data" / "test.tsv", 0).tolist()) - {0}
    assert len(test - seen) > 0.1 * len(test)  # the test period brings ids training never saw
    assert meta["table_sizes"][0] == len(seen | {0})  # the train rows' distinct values, the empty one included


def test_raw_ids_preprocess_keys_every_value_as_raw_keys_and_apart_as_a_vocabulary_would(arriving, tmp_path):
    out, _ = arriving
    meta = preprocess(out / "data", tmp_path / "raw", raw_ids=True, show_progress=False)
    assert meta["raw_ids"]["key_bits"] == KEY_BITS and meta["table_sizes"] == [KEY_SPACE] * 6
    raw = open_dataset(tmp_path / "raw")
    assert raw.train.ids.dtype == np.int64 and raw.train.rows == 12_000
    for table in (0, 4):
        np.testing.assert_array_equal(raw.train.ids[:, table], raw_keys(hex_column(out / "data" / "train.tsv",
                                                                                   table), table))
    # the same values apart as a vocabulary of every value numbers them: one key per value, none shared
    preprocess(out / "data", tmp_path / "vocab", vocab_min_count=1, show_progress=False)
    vocab = open_dataset(tmp_path / "vocab")
    for table in range(6):
        pairs = np.unique(np.stack([raw.train.ids[:, table], vocab.train.ids[:, table]], axis=1), axis=0)
        assert len(pairs) == len(np.unique(raw.train.ids[:, table])) == len(np.unique(vocab.train.ids[:, table]))
    # where the sizes beside the data hash them into fixed tables, values share rows
    hashed = open_dataset(preprocess(out / "data", tmp_path / "hashed", show_progress=False) and tmp_path / "hashed")
    assert len(np.unique(hashed.train.ids[:, 0])) < len(np.unique(raw.train.ids[:, 0]))


def test_avazu_and_json_lines_values_are_keyed_too(tmp_path):
    features = COLUMNS[2:]
    lines = [",".join(COLUMNS)] + [",".join([str(n), str(n % 2), *(["s" + str(n % 3)] * len(features))])
                                   for n in range(6)]
    (tmp_path / "av").mkdir()
    (tmp_path / "av" / "train.csv").write_text("\n".join(lines) + "\n")
    preprocess(tmp_path / "av" / "train.csv", tmp_path / "av_out", raw_ids=True, holdout=0, show_progress=False)
    ids = open_dataset(tmp_path / "av_out").train.ids
    site = list(features).index("site_id")
    expected = raw_keys(np.array([stable_hash(f"s{n % 3}") % KEY_SPACE for n in range(6)], dtype=np.uint64), site)
    np.testing.assert_array_equal(ids[:, site], expected)

    rows = [json.dumps({"label": n % 2, "dense": [1.0, 2.0], "sparse": [n * 10**15, 7]}) for n in range(5)]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    preprocess(tmp_path / "train.jsonl", tmp_path / "js_out", raw_ids=True, holdout=0, show_progress=False)
    ids = open_dataset(tmp_path / "js_out").train.ids
    np.testing.assert_array_equal(ids[:, 0], raw_keys(np.arange(5) * 10**15, 0))
    np.testing.assert_array_equal(ids[:, 1], raw_keys(np.full(5, 7), 1))


def test_raw_ids_refuse_sizes_vocabularies_logs_and_lists(arriving, tmp_path):
    out, _ = arriving
    with pytest.raises(ValueError, match="without --vocab-min-count, --table-sizes and --meta"):
        preprocess(out / "data", tmp_path / "a", raw_ids=True, table_sizes="5,5,5,5,5,5", show_progress=False)
    with pytest.raises(ValueError, match="without --vocab-min-count"):
        preprocess(out / "data", tmp_path / "b", raw_ids=True, vocab_min_count=2, show_progress=False)
    (tmp_path / "u.data").write_text("".join(f"{u}\t{i}\t5\t{t}\n" for t, (u, i) in enumerate([(1, 1), (1, 2),
                                                                                              (1, 3)])))
    with pytest.raises(ValueError, match="interaction log"):
        preprocess(tmp_path / "u.data", tmp_path / "c", raw_ids=True, show_progress=False)
    (tmp_path / "lists.jsonl").write_text(json.dumps({"label": 1, "dense": [1.0], "sparse": [[1, 2], 3]}) + "\n")
    with pytest.raises(ValueError, match="multi-valued features"):
        preprocess(tmp_path / "lists.jsonl", tmp_path / "d", raw_ids=True, holdout=0, show_progress=False)
    assert not any((tmp_path / name).exists() for name in "abcd")  # a refused conversion leaves nothing


def test_plan_stats_refuses_raw_ids_saying_why(arriving, tmp_path, capsys):
    out, _ = arriving
    preprocess(out / "data", tmp_path / "raw", raw_ids=True, show_progress=False)
    assert main(["plan-stats", "--data", str(tmp_path / "raw"), "--cache-rows", "500", "--batch-size", "64"]) != 0
    assert "plan-stats reads ids as rows of fixed tables" in capsys.readouterr().err
