import gzip
import io
import json
import re

import numpy as np
import pytest

import bagpipe.data.blocks as blocks
import bagpipe.data.preprocess as pre
from bagpipe.data.binary import open_dataset
from bagpipe.data.blocks import BOM
from bagpipe.data.formats import BadRows, DataError, decode_lines, dense_transform
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
                      show_progress=False, holdout=0)
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


def assert_same_arrays(a, b):
    assert a.rows == b.rows
    for name in ("labels", "dense", "ids"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def write_jsonl_splits(directory, suffix=""):
    directory.mkdir()
    rows = [jsonl_line(label=float(i % 2), sparse=[i % 5, (7 * i) % 1000, i % 3]) for i in range(40)]
    for split in ("train", "test"):
        write(directory / f"{split}.jsonl", rows)
    return directory


@pytest.mark.parametrize("name", ["{split}.tsv.gz", "{split}.tsv"])  # .gz, or gzip told by its content
def test_gzip_splits_read_like_plain_ones(tmp_path, name):
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir(), packed.mkdir()
    for split, lines in (("train", GOOD_TSV * 4), ("test", GOOD_TSV[::-1])):
        text = write(plain / f"{split}.tsv", lines).read_bytes()
        (packed / name.format(split=split)).write_bytes(gzip.compress(text))
    preprocess(plain, tmp_path / "from_plain", table_sizes=SIZES, show_progress=False)
    preprocess(packed, tmp_path / "from_gzip", table_sizes=SIZES, show_progress=False)
    expected, actual = open_dataset(tmp_path / "from_plain"), open_dataset(tmp_path / "from_gzip")
    assert actual.train.rows == 12 and actual.test.rows == 3
    assert_same_arrays(actual.train, expected.train)
    assert_same_arrays(actual.test, expected.test)


def test_gzip_jsonl_format_comes_from_the_suffix_before_gz(tmp_path):
    plain = write_jsonl_splits(tmp_path / "plain")
    packed = tmp_path / "packed"
    packed.mkdir()
    for split in ("train", "test"):
        (packed / f"{split}.jsonl.gz").write_bytes(gzip.compress((plain / f"{split}.jsonl").read_bytes()))
    meta = preprocess(packed, tmp_path / "bin", table_sizes=SIZES, show_progress=False)
    assert meta["source_format"] == "jsonl"
    preprocess(plain, tmp_path / "expected", table_sizes=SIZES, show_progress=False)
    assert_same_arrays(open_dataset(tmp_path / "bin").train, open_dataset(tmp_path / "expected").train)


def test_progress_counts_compressed_bytes(tmp_path, monkeypatch):
    bars = []

    class Bar:
        def __init__(self, *, total, **_):
            self.total, self.counted = total, 0
            bars.append(self)

        def update(self, n):
            self.counted += n

        def __enter__(self):
            return self

        def __exit__(self, *_):
            pass

    monkeypatch.setattr(pre, "progress", Bar)
    monkeypatch.setattr(pre, "LINES_PER_CHUNK", 5)
    path = tmp_path / "train.tsv.gz"
    path.write_bytes(gzip.compress("".join(line + "\n" for line in GOOD_TSV * 20).encode()))
    preprocess(path, tmp_path / "bin", table_sizes=SIZES, show_progress=False)
    assert [(bar.total, bar.counted) for bar in bars] == [(path.stat().st_size, path.stat().st_size)]


def test_truncated_gzip_names_the_file(tmp_path):
    path = tmp_path / "train.tsv.gz"
    packed = gzip.compress("".join(line + "\n" for line in GOOD_TSV * 50).encode())
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(DataError, match="corrupt or truncated gzip data") as err:
        preprocess(path, tmp_path / "bin", table_sizes=SIZES, show_progress=False)
    assert err.value.path == str(path)


def random_bytes_file(path):
    data = np.random.default_rng(0).bytes(20_000)  # 81 lines, none of them UTF-8, not gzip
    path.write_bytes(data)
    return data.count(b"\n") + (not data.endswith(b"\n"))


def test_binary_garbage_names_file_and_line(tmp_path):
    path = tmp_path / "train.tsv"
    random_bytes_file(path)
    with pytest.raises(DataError, match=r"not UTF-8 text: byte 0x[0-9a-f]{2} at column [0-9]+ \(is this a binary"
                                        r" or compressed file\?\)") as err:
        preprocess(path, tmp_path / "bin", table_sizes=SIZES, show_progress=False)
    assert err.value.path == str(path) and err.value.line == 1 and f"{path}:1:" in str(err.value)


def test_binary_garbage_is_counted_under_skip(tmp_path):
    path = tmp_path / "train.tsv"
    lines = random_bytes_file(path)
    meta = preprocess(path, tmp_path / "bin", table_sizes=SIZES, on_bad_row="skip", show_progress=False)
    assert meta["skipped_rows"] == lines and meta["skipped_by_reason"] == {"not UTF-8 text": lines}
    assert open_dataset(tmp_path / "bin").train.rows == 0


def test_a_non_utf8_line_among_good_ones(tmp_path):
    path = tmp_path / "train.tsv"
    lines = [GOOD_TSV[0].encode(), b"1\t\x9a\xff", GOOD_TSV[1].encode(), BAD_TSV["bad label"].encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match="byte 0x9a at column 3") as err:
        preprocess(path, tmp_path / "bin", table_sizes=SIZES, show_progress=False)
    assert err.value.line == 2
    meta = preprocess(path, tmp_path / "bin", table_sizes=SIZES, on_bad_row="skip", show_progress=False)
    assert meta["skipped_by_reason"] == {"not UTF-8 text": 1, "bad label": 1}
    np.testing.assert_array_equal(open_dataset(tmp_path / "bin").train.labels, [1, 0])


def test_skipped_non_utf8_lines_keep_the_line_numbers_of_the_rest():
    bad = BadRows()
    runs = decode_lines([b"a\n", b"b\xff\n", b"c\r\n", b"d"], path="f.tsv", first_line=10, bad=bad)
    assert runs == [(10, ["a"]), (12, ["c\r", "d"])]
    assert bad.examples == ["f.tsv:11: not UTF-8 text: byte 0xff at column 2 (is this a binary or compressed file?)"]
    assert decode_lines([b"a\n", b"b\n"], path="f.tsv", first_line=1, bad=None) == [(1, ["a", "b"])]


def test_inferred_table_sizes_no_server_could_hold_are_refused(tmp_path):
    path = write(tmp_path / "train.jsonl", [jsonl_line(sparse=[0, 1, 2]), jsonl_line(sparse=[3, 2**40, 0])])
    with pytest.raises(ValueError) as err:
        preprocess(path, tmp_path / "bin", show_progress=False)
    message = str(err.value)
    assert message.startswith(f"{path}:2: table 1 (index 1 in 'sparse') has id {2**40}")
    assert f"{2**40 + 1 + 4 + 3:,} rows" in message and "--table-sizes" in message and "meta.json" in message


def test_inferred_table_sizes_are_refused_only_beyond_memory_and_disk(tmp_path, monkeypatch):
    row = pre.TABLE_BYTES_PER_ROW
    monkeypatch.setattr(pre, "physical_memory_bytes", lambda: 600 * row)
    monkeypatch.setattr(pre, "free_disk_bytes", lambda path: 400 * row)  # memory and disk: 1,000 rows
    fits = write(tmp_path / "fits.jsonl", [jsonl_line(sparse=[0, 997, 0])])  # 1 + 998 + 1 rows
    assert preprocess(fits, tmp_path / "bin", show_progress=False)["table_sizes"] == [1, 998, 1]
    too_big = write(tmp_path / "too_big.jsonl", [jsonl_line(sparse=[0, 1, 0]), jsonl_line(sparse=[0, 998, 0])])
    with pytest.raises(ValueError, match=re.escape(f"{too_big}:2: table 1 ") + ".* 1,001 rows"):
        preprocess(too_big, tmp_path / "bin", show_progress=False)
    assert preprocess(too_big, tmp_path / "bin", table_sizes=[1, 2000, 1], show_progress=False)["rows"]["train"] == 2


def test_jsonl_id_beyond_int64_is_a_bad_row(tmp_path):
    path = write(tmp_path / "train.jsonl", [jsonl_line(), jsonl_line(sparse=[0, 2**63, 0])])
    with pytest.raises(DataError, match="id out of range: table 1") as err:
        preprocess(path, tmp_path / "bin", show_progress=False)
    assert err.value.line == 2


def without_stray_ends(data: bytes) -> bytes:
    """What the readers make of a file's bytes: no byte order mark first, no blank line after the last row's."""
    data = data.removeprefix(BOM)
    last_line_at = data.rfind(b"\n", 0, len(data) - data.endswith(b"\n")) + 1
    return data[:last_line_at] if last_line_at and not data[last_line_at:].strip() else data


class Trickle(io.RawIOBase):
    """``data`` read a few bytes at a time."""

    def __init__(self, data, rng):
        self.data, self.at, self.rng = data, 0, rng

    def readable(self):
        return True

    def readinto(self, buffer):
        count = min(len(buffer), int(self.rng.integers(1, 5)), len(self.data) - self.at)
        buffer[:count] = self.data[self.at:self.at + count]
        self.at += count
        return count


def test_the_reader_drops_the_stray_ends_alone_however_the_file_is_read(monkeypatch):
    rng = np.random.default_rng(12)
    pieces = [b"a", b"\n", b"\n", b" ", b"\r", b"\t", b"  ", b"\r\n"]
    for _ in range(3000):
        monkeypatch.setattr(blocks, "TAIL_BYTES", int(rng.integers(0, 4)))  # reads judged by their tail or whole
        data = BOM * (rng.random() < 0.3) + b"".join(rng.choice(pieces, int(rng.integers(0, 14))))
        inner = io.BufferedReader(Trickle(data, rng), int(rng.integers(1, 6)))
        reader = io.BufferedReader(blocks.WithoutStrayEnds(inner), int(rng.integers(1, 12)))
        read = b""
        while chunk := reader.read1(int(rng.integers(1, 15))) if rng.random() < 0.5 else reader.readline():
            read += chunk
        assert read == without_stray_ends(data), data


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "gzip"])
def test_an_interaction_log_with_a_byte_order_mark_and_a_blank_last_line_converts_as_if_absent(tmp_path, compressed):
    rng = np.random.default_rng(13)
    text = "".join(f"{u}\t{i}\t3\t{t}\n" for t, (u, i) in enumerate(rng.integers(1, 9, (80, 2)))).encode()
    for name, data in (("clean", text), ("stray", BOM + text + b"\r\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "u.data").write_bytes(gzip.compress(data) if compressed and name == "stray" else data)
        preprocess(tmp_path / name / "u.data", tmp_path / f"{name}-bin", show_progress=False)
    assert_same_arrays(open_dataset(tmp_path / "stray-bin").train, open_dataset(tmp_path / "clean-bin").train)
    assert_same_arrays(open_dataset(tmp_path / "stray-bin").test, open_dataset(tmp_path / "clean-bin").test)
