"""A preprocessed data set is used only as its conversion wrote it: a changed byte in an array, a header or
meta.json that is invalid or fails its checksum, or an array of the wrong size is found when a run opens it;
converted again when its sources are there, else refused naming the file."""

import json
import logging
import os

import numpy as np
import pytest
import xxhash

import bagpipe.data.binary as binary
import bagpipe.data.prepare as prepare
from bagpipe.config import TrainConfig
from bagpipe.data.binary import open_dataset
from bagpipe.data.prepare import ensure_preprocessed
from bagpipe.data.preprocess import preprocess
from bagpipe.preflight import prepare_data
from bagpipe.synth import generate

SIZES = [7, 30, 5]
ARRAYS = ["train/dense.f32", "train/labels.f32", "train/ids.int32", "test/ids.int32"]
CORRUPTED = "the preprocessed data is corrupted; convert it again from its sources"


@pytest.fixture
def data(tmp_path):
    generate(tmp_path / "data", rows=300, test_rows=60, seed=0, table_sizes=SIZES, show_progress=False)
    return tmp_path / "data"


@pytest.fixture
def warnings(caplog):
    caplog.set_level(logging.INFO, logger=prepare.log.name)
    return lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def flip_a_byte(path, at=None):
    """One bit of ``path`` changed in place, its size and mtime as they were (as a disk's fault leaves them)."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x10
    path.write_bytes(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size


def assert_same_data(a, b):
    for split in ("train", "test"):
        for name in ("labels", "dense", "ids"):
            np.testing.assert_array_equal(getattr(getattr(a, split), name), getattr(getattr(b, split), name))


def fresh_conversion(data, out):
    preprocess(data, out, show_progress=False)
    return open_dataset(out)


def run_config(data, tmp_path):
    return TrainConfig(data=str(data), run_dir=str(tmp_path / "run"), mode="reference")


@pytest.mark.parametrize("array", ARRAYS)
def test_a_flipped_byte_in_a_converted_copy_is_found_and_the_copy_converted_again(data, tmp_path, conversions,
                                                                                 warnings, array):
    cached = ensure_preprocessed(data, show_progress=False)
    expected = fresh_conversion(data, tmp_path / "expected")
    flip_a_byte(cached / array)

    dataset = prepare_data(run_config(data, tmp_path))  # what a run does first
    assert dataset.directory == cached and len(conversions) == 2
    assert warnings() == [f"{cached / array}: checksum mismatch: converting it again from {data}"]
    assert_same_data(dataset, expected)
    ensure_preprocessed(data, show_progress=False)
    assert len(conversions) == 2  # sound again: reused


@pytest.mark.parametrize("array", ARRAYS)
def test_a_flipped_byte_in_a_preprocessed_directory_is_refused_naming_the_file(data, tmp_path, array):
    out = tmp_path / "bin"
    preprocess(data, out, show_progress=False)
    prepare_data(run_config(out, tmp_path))
    flip_a_byte(out / array)
    with pytest.raises(ValueError) as err:
        prepare_data(run_config(out, tmp_path))
    assert str(err.value) == f"{out / array}: checksum mismatch: {CORRUPTED}"


@pytest.mark.parametrize("damage", ["invalid JSON", "a changed value", "cut short"])
def test_a_damaged_header_is_named_and_converted_again_or_refused(data, tmp_path, conversions, warnings, damage):
    cached = ensure_preprocessed(data, show_progress=False)
    out = tmp_path / "bin"
    preprocess(data, out, show_progress=False)
    for directory in (cached, out):
        header = directory / "train" / "header.json"
        text = header.read_text()
        if damage == "invalid JSON":
            header.write_text(text.replace('"rows"', '"ro\x01ws"'))  # a control character: invalid JSON
        elif damage == "a changed value":  # still valid JSON, the arrays' sizes still right
            header.write_text(text.replace('"cardinality": 30', '"cardinality": 31'))
        else:
            header.write_text(text[:len(text) // 2])
    header = cached / "train" / "header.json"
    reason = "checksum mismatch" if damage == "a changed value" else "not valid JSON"
    assert ensure_preprocessed(data, show_progress=False) == cached
    assert len(conversions) == 2
    [warning] = warnings()
    assert warning.startswith(f"{header}: {reason}") and warning.endswith(f": converting it again from {data}")
    assert_same_data(open_dataset(cached), fresh_conversion(data, tmp_path / "expected"))
    for opened in (lambda: open_dataset(out), lambda: ensure_preprocessed(out, show_progress=False)):
        with pytest.raises(ValueError, match=f"^{out / 'train' / 'header.json'}: {reason}.*{CORRUPTED}$"):
            opened()


def test_an_array_of_the_wrong_size_or_an_invalid_meta_is_converted_again_or_refused(data, tmp_path, conversions,
                                                                                     warnings):
    cached = ensure_preprocessed(data, show_progress=False)
    with open(cached / "test" / "dense.f32", "ab") as handle:
        handle.write(b"\0\0\0\0")
    ensure_preprocessed(data, show_progress=False)
    (cached / "meta.json").write_text((cached / "meta.json").read_text()[:-20])
    ensure_preprocessed(data, show_progress=False)
    assert len(conversions) == 3
    first, second = warnings()
    assert first.startswith(f"{cached / 'test' / 'dense.f32'}: 3124 bytes, not the 3120 its header gives: truncated")
    assert second.startswith(f"{cached / 'meta.json'}: not valid JSON")
    out = tmp_path / "bin"
    preprocess(data, out, show_progress=False)
    (out / "train" / "labels.f32").unlink()
    with pytest.raises(ValueError, match=f"^{out / 'train' / 'labels.f32'}: missing .*{CORRUPTED}$"):
        prepare_data(run_config(out, tmp_path))


def as_written_before_checksums(directory):
    for path in [directory / "meta.json", *directory.glob("*/header.json")]:
        record = json.loads(path.read_text())
        record.pop("checksum"), record.pop("checksums", None)
        path.write_text(json.dumps(record))


def test_data_converted_before_checksums_opens_unverified_or_is_converted_again_from_its_sources(
        data, tmp_path, conversions, caplog):
    caplog.set_level(logging.DEBUG, logger=prepare.log.name)
    out = tmp_path / "bin"
    preprocess(data, out, show_progress=False)
    as_written_before_checksums(out)
    flip_a_byte(out / "train" / "dense.f32")  # cannot be told
    assert ensure_preprocessed(out, show_progress=False) == out
    assert not open_dataset(out).checksummed
    assert f"{out} records no checksums (an older bagpipe converted it): used unverified" in caplog.text

    cached = ensure_preprocessed(data, show_progress=False)
    as_written_before_checksums(cached)
    ensure_preprocessed(data, show_progress=False)
    assert len(conversions) == 2 and open_dataset(cached).checksummed
    assert f"{cached} was made by an older version of bagpipe that recorded no checksums" in caplog.text


def test_the_checksums_recorded_while_writing_are_the_files_own_read_in_bounded_blocks(data, tmp_path,
                                                                                      monkeypatch):
    out = tmp_path / "bin"
    preprocess(data, out, show_progress=False)
    monkeypatch.setattr(binary, "HASH_BLOCK_BYTES", 7)  # many blocks a file, the last one short
    for split in ("train", "test"):
        header = json.loads((out / split / "header.json").read_text())
        assert sorted(header["checksums"]) == ["dense.f32", "ids.int32", "labels.f32"]
        for name, recorded in header["checksums"].items():
            content = (out / split / name).read_bytes()
            assert len(content) > 7 and len(content) % 7
            assert recorded == binary.file_checksum(out / split / name)
            assert recorded == f"xxh3_128:{xxhash.xxh3_128_hexdigest(content)}"
    flip_a_byte(out / "train" / "ids.int32", at=250)  # in block 36 of 515
    with pytest.raises(ValueError, match="ids.int32: checksum mismatch"):
        open_dataset(out, verify=True)
    open_dataset(out)  # unverified, as analysis tools open it


def test_a_lost_test_split_is_not_taken_for_data_without_one(data, tmp_path, conversions, warnings):
    cached = ensure_preprocessed(data, show_progress=False)
    (cached / "test" / "header.json").unlink()  # the rest of a split that was deleted, or never finished
    ensure_preprocessed(data, show_progress=False)
    assert len(conversions) == 2 and open_dataset(cached).test.rows == 60
    assert warnings() == [f"{cached / 'test' / 'header.json'}: is missing, where {cached / 'meta.json'} records 60 "
                          f"rows: converting it again from {data}"]
    out = tmp_path / "bin"
    preprocess(data, out, show_progress=False)
    (out / "test" / "header.json").unlink()
    with pytest.raises(ValueError, match=f"^{out / 'test' / 'header.json'}: is missing, where .* records 60 rows: "
                                         f"{CORRUPTED}$"):
        prepare_data(run_config(out, tmp_path))
