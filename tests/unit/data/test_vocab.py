"""Avazu CSV and vocabularies: ids by descending train frequency, rare and unseen values at the OOV id,
hashing with fixed table sizes, and conversions redone when the min count changes."""

import collections
import hashlib
import json
import re

import numpy as np
import pytest

import bagpipe.data.prepare as prepare
import bagpipe.data.preprocess as pre
import bagpipe.data.vocab as vocab
from bagpipe.cli import main
from bagpipe.config import TrainConfig
from bagpipe.data.avazu import COLUMNS
from bagpipe.data.binary import open_dataset
from bagpipe.data.formats import DataError
from bagpipe.data.prepare import ensure_preprocessed
from bagpipe.data.preprocess import preprocess
from bagpipe.data.vocab import OOV_ID, ValueCounts, Vocabulary

FEATURES = COLUMNS[2:]  # all but id and click


def avazu_line(number, click, **values):
    """One Avazu row: ``values`` by column name, the others a constant ``x``."""
    return ",".join([str(10**18 + number), str(click), *(str(values.get(name, "x")) for name in FEATURES)])


def write_csv(path, lines, *, header=",".join(COLUMNS)):
    path.write_text("".join(f"{line}\n" for line in [header, *lines]))
    return path


def site_rows(sites, *, clicks=None, start=0):
    clicks = clicks or [number % 2 for number in range(len(sites))]
    return [avazu_line(start + number, click, site_id=site) for number, (site, click) in enumerate(zip(sites, clicks))]


def vocab_lines(out, column):
    return (out / "vocab" / f"{column}.tsv").read_text().splitlines()


def test_avazu_rows_convert_with_their_schema_and_labels(tmp_path):
    clicks = [1, 0, 0, 1, 0]
    write_csv(tmp_path / "train.csv", site_rows(["a", "b", "a", "c", "a"], clicks=clicks))
    write_csv(tmp_path / "test.csv", site_rows(["b", "a"], clicks=[0, 1]))
    meta = preprocess(tmp_path, tmp_path / "bin", vocab_min_count=1, show_progress=False)  # format: the header's
    data = open_dataset(tmp_path / "bin")
    assert meta["source_format"] == "avazu"
    assert data.schema.num_dense == 0 and len(data.schema.features) == 22
    assert [f.name for f in data.schema.features] == list(FEATURES) and data.schema.one_hot_only
    np.testing.assert_array_equal(data.train.labels, clicks)
    np.testing.assert_array_equal(data.test.labels, [0, 1])
    assert data.train.dense.shape == (5, 0)
    site = FEATURES.index("site_id")
    np.testing.assert_array_equal(data.train.ids[:, site], [1, 2, 1, 3, 1])  # a: 3 times, b and c once
    np.testing.assert_array_equal(data.test.ids[:, site], [2, 1])
    assert data.table_sizes[site] == 4 and data.table_sizes[FEATURES.index("hour")] == 2  # "x" and the OOV id


def test_ids_by_descending_count_and_rare_unseen_or_empty_values_at_the_oov_id(tmp_path):
    train = ["a"] * 3 + ["b"] * 5 + ["c"] + ["d"] * 3 + [""] * 4
    order = np.random.default_rng(0).permutation(len(train))
    write_csv(tmp_path / "train.csv", site_rows([train[i] for i in order]))
    write_csv(tmp_path / "test.csv", site_rows(["c", "e", "b", "d", "a", ""]))
    meta = preprocess(tmp_path, tmp_path / "bin", vocab_min_count=2, show_progress=False)
    data = open_dataset(tmp_path / "bin")
    site = FEATURES.index("site_id")
    ids = {"b": 1, "a": 2, "d": 3, "c": OOV_ID, "": OOV_ID}  # a and d tie: by value
    np.testing.assert_array_equal(data.train.ids[:, site], [ids[train[i]] for i in order])
    np.testing.assert_array_equal(data.test.ids[:, site], [OOV_ID, OOV_ID, 1, 3, 2, OOV_ID])  # e: never in train
    assert data.table_sizes[site] == 4 and meta["table_sizes"][site] == 4
    assert vocab_lines(tmp_path / "bin", "site_id") == ["b\t5", "a\t3", "d\t3"]  # line i: id i
    assert meta["vocabulary"]["min_count"] == 2 and meta["vocabulary"]["oov_id"] == OOV_ID
    assert meta["made_from"]["vocab_min_count"] == 2 and meta["made_from"]["table_sizes_from"] == "vocabulary"


def test_held_out_lines_are_not_counted_and_use_the_train_vocabulary(tmp_path, monkeypatch):
    monkeypatch.setattr(pre, "LINES_PER_CHUNK", 3)  # the header, the holdout cut and the rows across chunks
    sites = ["a", "b", "b", "c", "b", "a", "c", "z", "z", "a"]  # lines 2..11; the last 3 held out
    write_csv(tmp_path / "train.csv", site_rows(sites))
    meta = preprocess(tmp_path / "train.csv", tmp_path / "bin", vocab_min_count=1, holdout=0.3,
                      show_progress=False)
    assert meta["held_out"]["from_line"] == 9
    data = open_dataset(tmp_path / "bin")
    site = FEATURES.index("site_id")
    np.testing.assert_array_equal(data.train.ids[:, site], [2, 1, 1, 3, 1, 2, 3])
    np.testing.assert_array_equal(data.test.ids[:, site], [OOV_ID, OOV_ID, 2])  # z: held out only
    assert vocab_lines(tmp_path / "bin", "site_id") == ["b\t3", "a\t2", "c\t2"]


def test_vocabulary_matches_a_plain_count_across_merges(monkeypatch):
    monkeypatch.setattr(vocab, "_MERGE_AT", 5)
    rng = np.random.default_rng(1)
    chunks = [[f"v{x}" for x in rng.zipf(1.5, 40) % 60] + [""] for _ in range(30)]
    counts = ValueCounts()
    for chunk in chunks:
        counts.add(chunk)
    vocabulary = Vocabulary.from_counts("c", counts, min_count=3)
    reference = collections.Counter(v for chunk in chunks for v in chunk if v)
    expected = sorted(((v, n) for v, n in reference.items() if n >= 3), key=lambda item: (-item[1], item[0]))
    assert list(zip(vocabulary.values.tolist(), vocabulary.counts.tolist())) == expected
    column = [v for v, _ in expected] + ["unseen", ""] + [v for v, n in reference.items() if n < 3]
    np.testing.assert_array_equal(vocabulary.encode(column), list(range(1, len(expected) + 1))
                                  + [OOV_ID] * (len(column) - len(expected)))


def test_a_changed_min_count_converts_again(tmp_path):
    write_csv(tmp_path / "train.csv", site_rows(["a", "b", "b", "c"] * 3 + ["d"]))
    write_csv(tmp_path / "test.csv", site_rows(["d", "c"]))
    site = FEATURES.index("site_id")
    cached = ensure_preprocessed(tmp_path, show_progress=False)  # Avazu with no table sizes: min count 1
    made = (cached / "meta.json").stat().st_mtime_ns
    assert open_dataset(cached).table_sizes[site] == 5
    assert ensure_preprocessed(tmp_path, show_progress=False, vocab_min_count=1) == cached
    assert (cached / "meta.json").stat().st_mtime_ns == made  # the same settings: reused
    ensure_preprocessed(tmp_path, show_progress=False, vocab_min_count=2)
    data = open_dataset(cached)
    assert data.meta["made_from"]["vocab_min_count"] == 2 and data.table_sizes[site] == 4  # d, once, left out
    np.testing.assert_array_equal(data.test.ids[:, site], [OOV_ID, 3])


def test_hashing_with_table_sizes_is_stable_and_in_range(tmp_path):
    sites = [f"site{i}" for i in range(200)] + [""]
    write_csv(tmp_path / "train.csv", site_rows(sites))
    sizes = [7] * 22
    meta = preprocess(tmp_path / "train.csv", tmp_path / "bin", table_sizes=sizes, holdout=0, show_progress=False)
    ids = open_dataset(tmp_path / "bin").train.ids[:, FEATURES.index("site_id")]
    expected = [int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") % 7 if s else 0
                for s in sites]  # the same in every process: not Python's salted hash
    np.testing.assert_array_equal(ids, expected)
    assert set(ids.tolist()) == set(range(7)) and meta["table_sizes"] == sizes and meta["vocabulary"] is None
    with pytest.raises(ValueError, match="3 table sizes given, but .* has 22 categorical columns"):
        preprocess(tmp_path / "train.csv", tmp_path / "bad", table_sizes=[7, 7, 7], show_progress=False)


def test_avazu_needs_a_vocabulary_or_table_sizes(tmp_path):
    write_csv(tmp_path / "train.csv", site_rows(["a"]))
    with pytest.raises(ValueError, match="--vocab-min-count N .* or --table-sizes"):
        preprocess(tmp_path / "train.csv", tmp_path / "bin", show_progress=False)
    with pytest.raises(ValueError, match="not both"):
        preprocess(tmp_path / "train.csv", tmp_path / "bin", vocab_min_count=1, table_sizes="5", show_progress=False)


def criteo_line(label, cats):
    return "\t".join([str(label), *["1"] * 13, *cats])


def test_criteo_with_a_vocabulary_keys_on_the_raw_hex(tmp_path):
    rows = [["a", "3e8"], ["A", "3e8"], ["a", ""], ["ff", "3e8"], ["a", "1"]]
    (tmp_path / "train.tsv").write_text("".join(criteo_line(i % 2, r) + "\n" for i, r in enumerate(rows)))
    (tmp_path / "test.tsv").write_text(criteo_line(1, ["ff", "2"]) + "\n")
    (tmp_path / "meta.json").write_text(json.dumps({"table_sizes": [5, 5, 5]}))  # for hashing: not used here
    meta = preprocess(tmp_path, tmp_path / "bin", vocab_min_count=1, show_progress=False)
    data = open_dataset(tmp_path / "bin")
    # C1: a 3 times, then A and ff once (by value: "A" < "ff"); C2: 3e8 3 times, then 1; empty: the OOV id
    np.testing.assert_array_equal(data.train.ids, [[1, 1], [2, 1], [1, OOV_ID], [3, 1], [1, 2]])
    np.testing.assert_array_equal(data.test.ids, [[3, OOV_ID]])
    assert data.table_sizes == [4, 3] and data.schema.num_dense == 13
    assert meta["made_from"]["table_sizes_from"] == "vocabulary" and vocab_lines(tmp_path / "bin", "C2") == ["3e8\t3",
                                                                                                             "1\t1"]
    with pytest.raises(ValueError, match="jsonl data holds ids already"):
        preprocess(tmp_path, tmp_path / "bin2", fmt="jsonl", vocab_min_count=1, show_progress=False)


def test_bad_criteo_rows_under_a_vocabulary_are_named_or_skipped(tmp_path):
    lines = [criteo_line(1, ["a", "1"]), criteo_line(0, ["zz", "1"]), criteo_line(0, ["a", "2"])]
    path = tmp_path / "train.tsv"
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(DataError, match=re.escape(f"{path}:2: non-hex token: column C1 is 'zz'")):
        preprocess(path, tmp_path / "bin", vocab_min_count=1, holdout=0, show_progress=False)
    meta = preprocess(path, tmp_path / "bin", vocab_min_count=1, holdout=0, on_bad_row="skip", show_progress=False)
    assert meta["skipped_by_reason"] == {"non-hex token": 1}
    np.testing.assert_array_equal(open_dataset(tmp_path / "bin").train.ids, [[1, 1], [1, 2]])


BAD_AVAZU = {
    "wrong column count": avazu_line(7, 1) + ",extra",
    "bad label": avazu_line(7, 2),
}


@pytest.mark.parametrize("reason", sorted(BAD_AVAZU))
@pytest.mark.parametrize("vocab_min_count", [0, 1])
def test_bad_avazu_row_names_file_and_line(tmp_path, reason, vocab_min_count):
    path = write_csv(tmp_path / "train.csv", [*site_rows(["a", "b"]), BAD_AVAZU[reason], *site_rows(["c"])])
    sizes = None if vocab_min_count else [5] * 22
    with pytest.raises(DataError) as err:
        preprocess(path, tmp_path / "bin", vocab_min_count=vocab_min_count, table_sizes=sizes, holdout=0,
                   show_progress=False)
    assert err.value.path == str(path) and err.value.line == 4 and f"{path}:4: {reason}" in str(err.value)


def test_skipped_avazu_rows_are_counted_once_by_reason(tmp_path):
    lines = [*site_rows(["a", "b"]), *BAD_AVAZU.values(), *site_rows(["a"], start=2)]
    write_csv(tmp_path / "train.csv", lines)
    meta = preprocess(tmp_path / "train.csv", tmp_path / "bin", vocab_min_count=1, on_bad_row="skip", holdout=0,
                      show_progress=False)
    assert meta["skipped_by_reason"] == {reason: 1 for reason in BAD_AVAZU}
    assert open_dataset(tmp_path / "bin").train.rows == 3 and vocab_lines(tmp_path / "bin", "site_id") == ["a\t2",
                                                                                                           "b\t1"]


def test_a_split_without_click_is_refused_naming_the_file(tmp_path):
    write_csv(tmp_path / "train.csv", site_rows(["a", "b"]))
    test = tmp_path / "test.csv"
    test.write_text(",".join(c for c in COLUMNS if c != "click") + "\n" + "1,14102100" + ",x" * 21 + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{test}:1: no 'click' column")):
        preprocess(tmp_path, tmp_path / "bin", vocab_min_count=1, show_progress=False)
    test.unlink()
    write_csv(tmp_path / "test.csv", site_rows(["a"]), header=",".join(COLUMNS[::-1]))
    with pytest.raises(ValueError, match=re.escape(f"{test}:1: its header differs")):
        preprocess(tmp_path, tmp_path / "bin", vocab_min_count=1, show_progress=False)


def test_vocab_min_count_is_checked_in_the_config():
    assert TrainConfig(data="d", run_dir="r", vocab_min_count=3).vocab_min_count == 3
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="vocab_min_count"):
            TrainConfig(data="d", run_dir="r", vocab_min_count=bad)


def test_train_on_avazu_end_to_end(tmp_path):
    rng = np.random.default_rng(0)
    lines = [avazu_line(i, int(rng.random() < 0.3), site_id=f"s{rng.zipf(1.5) % 50}", hour=14102100 + i % 24,
                        device_ip=f"{rng.integers(0, 1 << 32):08x}") for i in range(700)]
    (tmp_path / "data").mkdir()
    write_csv(tmp_path / "data" / "train.csv", lines)
    code = main(["train", "--data", str(tmp_path / "data"), "--run-dir", str(tmp_path / "run"), "--mode", "reference",
                 "--model", "deepfm", "--iterations", "5", "--batch-size", "32", "--deep-mlp", "16-16",
                 "--emb-dim", "4", "--no-progress"])
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == 5
    converted = open_dataset(tmp_path / "data" / "preprocessed")
    assert converted.meta["made_from"]["vocab_min_count"] == prepare.AVAZU_DEFAULT_MIN_COUNT  # neither vocab nor sizes
    assert converted.train.rows == 600 and converted.test.rows == 100  # the last 1/7 held out
