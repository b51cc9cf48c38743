import json

import numpy as np
import pytest

from bagpipe.data.binary import open_dataset
from bagpipe.data.formats import DataError, dense_transform
from bagpipe.data.preprocess import preprocess

SIZES = [5, 1000, 3]


def criteo_line(label, dense, cats):
    return "\t".join([str(label), *dense, *cats])


GOOD_TSV = [
    criteo_line(1, ["1", "", "-3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13"], ["a", "3e8", ""]),
    criteo_line(0, [""] * 13, ["", "", ""]),
    criteo_line(0, ["0"] * 12 + ["2.5"], ["FFFFFFFF", "0", "2"]),
]


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_criteo_round_trip(tmp_path):
    write(tmp_path / "train.tsv", GOOD_TSV)
    preprocess(tmp_path / "train.tsv", tmp_path / "bin", table_sizes=SIZES, show_progress=False)
    split = open_dataset(tmp_path / "bin").train
    assert split.rows == 3
    np.testing.assert_array_equal(split.labels, [1, 0, 0])
    expected_ids = [[0xA % 5, 0x3E8 % 1000, 0], [0, 0, 0], [0xFFFFFFFF % 5, 0, 2]]
    np.testing.assert_array_equal(split.ids, expected_ids)
    dense0 = dense_transform(np.array([1, 0, -3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]))
    np.testing.assert_array_equal(split.dense[0], dense0)
    np.testing.assert_array_equal(split.dense[1], np.zeros(13, np.float32))
    assert split.dense[2, 12] == np.float32(np.log1p(2.5))
    assert split.ids.dtype == np.int32


def test_jsonl_round_trip_and_inferred_sizes(tmp_path):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 50)
    dense = rng.integers(-2, 100, (50, 13)).astype(float)
    ids = np.stack([rng.integers(0, n, 50) for n in SIZES], axis=1)
    for split in ("train", "test"):
        with open(tmp_path / f"{split}.jsonl", "w") as handle:
            for row in range(50):
                record = {"label": float(labels[row]), "dense": dense[row].tolist(), "sparse": ids[row].tolist()}
                handle.write(json.dumps(record) + "\n")
    preprocess(tmp_path, tmp_path / "bin", fmt="jsonl", table_sizes=SIZES, show_progress=False)
    data = open_dataset(tmp_path / "bin")
    for split in (data.train, data.test):
        np.testing.assert_array_equal(split.labels, labels)
        np.testing.assert_array_equal(split.dense, dense_transform(dense))
        np.testing.assert_array_equal(split.ids, ids)
    preprocess(tmp_path, tmp_path / "inferred", fmt="jsonl", show_progress=False)
    assert open_dataset(tmp_path / "inferred").table_sizes == (ids.max(axis=0) + 1).tolist()


def test_criteo_chunks_larger_than_one_parse_batch(tmp_path, monkeypatch):
    import bagpipe.data.preprocess as pre

    monkeypatch.setattr(pre, "LINES_PER_CHUNK", 2)
    write(tmp_path / "train.tsv", GOOD_TSV * 3 + [criteo_line(1, ["1"] * 13, ["zz", "1", "1"])])
    with pytest.raises(DataError) as err:
        preprocess(tmp_path / "train.tsv", tmp_path / "bin", table_sizes=SIZES, show_progress=False)
    assert err.value.line == 10  # line numbers carry across chunks


BAD_TSV = {
    "wrong column count": criteo_line(1, ["1"] * 12, ["1", "1", "1"]),
    "non-hex token": criteo_line(1, ["1"] * 13, ["1", "0x12", "1"]),
    "non-numeric dense value": criteo_line(1, ["1"] * 6 + ["abc"] + ["1"] * 6, ["1", "1", "1"]),
    "bad label": criteo_line(2, ["1"] * 13, ["1", "1", "1"]),
}


@pytest.mark.parametrize("reason", sorted(BAD_TSV))
def test_bad_criteo_row_names_file_and_line(tmp_path, reason):
    path = write(tmp_path / "train.tsv", [GOOD_TSV[0], GOOD_TSV[1], BAD_TSV[reason], GOOD_TSV[2]])
    with pytest.raises(DataError) as err:
        preprocess(path, tmp_path / "bin", table_sizes=SIZES, show_progress=False)
    assert err.value.path == str(path) and err.value.line == 3
    assert reason in str(err.value) and f"{path}:3:" in str(err.value)


def jsonl_line(label=1.0, dense=None, sparse=None):
    return json.dumps({"label": label, "dense": [1.0] * 13 if dense is None else dense,
                       "sparse": [0, 1, 2] if sparse is None else sparse})


BAD_JSONL = {
    "id out of range": jsonl_line(sparse=[0, 1000, 0]),
    "negative id": jsonl_line(sparse=[0, -1, 0]),
    "wrong column count": jsonl_line(sparse=[0, 1]),
    "non-numeric dense value": jsonl_line(dense=[1.0] * 12 + ["x"]),
    "not valid JSON": '{"label": 1, "dense": [',
    "missing field": json.dumps({"label": 1, "dense": [1.0] * 13}),
    "non-integer id": jsonl_line(sparse=[0, 1.5, 0]),
}


@pytest.mark.parametrize("reason", sorted(BAD_JSONL))
def test_bad_jsonl_row_names_file_and_line(tmp_path, reason):
    path = write(tmp_path / "train.jsonl", [jsonl_line(), BAD_JSONL[reason]])
    with pytest.raises(DataError) as err:
        preprocess(path, tmp_path / "bin", table_sizes=SIZES, show_progress=False)
    assert err.value.line == 2 and str(path) in str(err.value)
    expected = "id out of range" if reason == "negative id" else reason
    assert expected in str(err.value)


def test_skip_counts_and_reports_bad_rows(tmp_path):
    lines = [GOOD_TSV[0], *BAD_TSV.values(), GOOD_TSV[1], GOOD_TSV[2]]
    write(tmp_path / "train.tsv", lines)
    meta = preprocess(tmp_path / "train.tsv", tmp_path / "bin", table_sizes=SIZES, on_bad_row="skip",
                      show_progress=False)
    assert meta["skipped_rows"] == len(BAD_TSV)
    assert sorted(meta["skipped_by_reason"]) == sorted(BAD_TSV)
    split = open_dataset(tmp_path / "bin").train
    assert split.rows == 3
    np.testing.assert_array_equal(split.labels, [1, 0, 0])


def test_missing_table_sizes_for_criteo_is_an_error(tmp_path):
    write(tmp_path / "train.tsv", GOOD_TSV)
    with pytest.raises(ValueError, match="--table-sizes"):
        preprocess(tmp_path / "train.tsv", tmp_path / "bin", show_progress=False)


def test_truncated_binary_file_is_detected(tmp_path):
    write(tmp_path / "train.tsv", GOOD_TSV)
    preprocess(tmp_path / "train.tsv", tmp_path / "bin", table_sizes=SIZES, show_progress=False)
    ids_file = tmp_path / "bin" / "train" / "ids.int32"
    ids_file.write_bytes(ids_file.read_bytes()[:-4])
    with pytest.raises(ValueError, match="truncated"):
        open_dataset(tmp_path / "bin")
