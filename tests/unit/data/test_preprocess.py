"""ensure_preprocessed: a data directory's converted copy is reused exactly when it is current."""

import gzip
import json
import logging
import os
import shutil

import numpy as np
import pytest

import bagpipe.data.prepare as prepare
import bagpipe.data.preprocess as pre
import bagpipe.data.sources as sources
from bagpipe.data.binary import open_dataset
from bagpipe.data.formats import CriteoParser
from bagpipe.data.prepare import ensure_preprocessed
from bagpipe.data.preprocess import preprocess
from bagpipe.synth import generate

SIZES = [7, 30, 5]
HOUR_NS = 3600 * 10**9


def make_data(directory, *, seed=0, rows=200, test_rows=50, table_sizes=SIZES):
    generate(directory, rows=rows, test_rows=test_rows, seed=seed, table_sizes=table_sizes, show_progress=False)
    return directory


def set_mtime(path, ns):
    os.utime(path, ns=(ns, ns))


def assert_same_split(a, b):
    assert a.rows == b.rows
    for name in ("labels", "dense", "ids"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def files_of(directory, *, skip=()):
    return {p.relative_to(directory): (p.stat().st_ino, p.read_bytes()) for p in directory.rglob("*")
            if p.is_file() and p.name not in skip}


@pytest.fixture
def info_log(caplog):
    caplog.set_level(logging.INFO, logger=prepare.log.name)
    return caplog


def test_replaced_split_with_an_older_mtime_is_converted_again(tmp_path, conversions, info_log):
    data = make_data(tmp_path / "data", seed=0)
    cached = ensure_preprocessed(data, show_progress=False)
    made = (cached / "meta.json").stat().st_mtime_ns
    other = make_data(tmp_path / "other", seed=1)
    shutil.copyfile(other / "train.tsv", data / "train.tsv")
    set_mtime(data / "train.tsv", made - HOUR_NS)  # as cp -p, rsync -a or tar x leave it

    assert ensure_preprocessed(data, show_progress=False) == cached
    assert len(conversions) == 2
    assert (f"{data / 'train.tsv'} changed since {cached} was made from it (content differs): converting again"
            in info_log.text)
    preprocess(other, tmp_path / "expected", show_progress=False)
    assert_same_split(open_dataset(cached).train, open_dataset(tmp_path / "expected").train)


@pytest.mark.parametrize("rewrite", ["touch", "copy back"])
def test_same_content_rewrite_is_reused_and_the_next_start_does_not_hash(tmp_path, conversions, monkeypatch,
                                                                         rewrite):
    data = make_data(tmp_path / "data")
    cached = ensure_preprocessed(data, show_progress=False)
    before = files_of(cached / "train")
    made = (cached / "meta.json").stat().st_mtime_ns
    if rewrite == "touch":
        set_mtime(data / "train.tsv", made + HOUR_NS)
    else:  # a new inode and ctime with the old mtime
        shutil.copy2(data / "train.tsv", tmp_path / "copy.tsv")
        os.replace(tmp_path / "copy.tsv", data / "train.tsv")

    assert ensure_preprocessed(data, show_progress=False) == cached
    assert len(conversions) == 1 and files_of(cached / "train") == before

    def no_hashing(path):
        raise AssertionError(f"hashed {path} although its stat fields were recorded")

    monkeypatch.setattr(sources, "fingerprint", no_hashing)
    assert ensure_preprocessed(data, show_progress=False) == cached
    assert len(conversions) == 1


def test_a_removed_or_added_split_means_converting_again(tmp_path, conversions, info_log):
    data = make_data(tmp_path / "data")
    cached = ensure_preprocessed(data, show_progress=False)
    made = (cached / "meta.json").stat().st_mtime_ns
    test_rows = (data / "test.tsv").read_bytes()

    (data / "test.tsv").unlink()
    ensure_preprocessed(data, show_progress=False)
    held = round(200 * sources.DEFAULT_HOLDOUT)  # no test split: the train file's last lines are one
    assert len(conversions) == 2 and open_dataset(cached).test.rows == held
    assert open_dataset(cached).train.rows == 200 - held
    assert f"{data / 'test.tsv'} is gone since {cached} was made from it" in info_log.text

    (data / "test.tsv").write_bytes(test_rows)
    set_mtime(data / "test.tsv", made - HOUR_NS)
    ensure_preprocessed(data, show_progress=False)
    assert len(conversions) == 3 and open_dataset(cached).test.rows == 50
    assert f"{data / 'test.tsv'} is new since {cached} was made" in info_log.text


def test_changed_table_sizes_in_the_source_meta_mean_converting_again(tmp_path, conversions):
    data = make_data(tmp_path / "data")
    cached = ensure_preprocessed(data, show_progress=False)
    meta_path = data / "meta.json"
    stat = meta_path.stat()
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "table_sizes": [3, 30, 5]}))
    set_mtime(meta_path, stat.st_mtime_ns)

    ensure_preprocessed(data, show_progress=False)
    assert len(conversions) == 2 and open_dataset(cached).table_sizes == [3, 30, 5]


def test_a_copy_made_with_other_settings_is_converted_again(tmp_path, conversions, info_log):
    data = make_data(tmp_path / "data")
    preprocess(data, data / "preprocessed", on_bad_row="skip", show_progress=False)  # not through the spy
    ensure_preprocessed(data, show_progress=False)
    assert len(conversions) == 1
    assert "made with on_bad_row 'skip', not 'error'" in info_log.text


def test_a_copy_without_records_from_an_older_version_is_converted_again(tmp_path, conversions, info_log):
    data = make_data(tmp_path / "data")
    cached = ensure_preprocessed(data, show_progress=False)
    meta = json.loads((cached / "meta.json").read_text())
    del meta["made_from"], meta["checksum"]  # as an older version wrote it
    (cached / "meta.json").write_text(json.dumps(meta))

    ensure_preprocessed(data, show_progress=False)
    assert len(conversions) == 2 and "made by an older version of bagpipe" in info_log.text
    assert "made_from" in open_dataset(cached).meta


def test_a_copy_fingerprinted_with_the_earlier_hash_is_converted_again_once_its_sources_move(
        tmp_path, conversions, info_log):
    """Conversions recorded a BLAKE2b hash before xxh3-128: trusted while the sources' stat fields are
    unchanged (nothing to hash), converted again once they moved (the hashes cannot be compared)."""
    data = make_data(tmp_path / "data")
    cached = ensure_preprocessed(data, show_progress=False)
    meta = json.loads((cached / "meta.json").read_text())
    del meta["checksum"]  # as the earlier version wrote it
    for source in meta["made_from"]["sources"].values():
        source["blake2b"] = "0" * 64
        del source["xxh3_128"]
    (cached / "meta.json").write_text(json.dumps(meta))
    ensure_preprocessed(data, show_progress=False)
    assert len(conversions) == 1
    os.utime(data / "train.tsv")  # same content, new stat fields
    ensure_preprocessed(data, show_progress=False)
    assert len(conversions) == 2 and "fingerprinted by an earlier version (another hash)" in info_log.text
    assert "xxh3_128" in open_dataset(cached).meta["made_from"]["sources"]["train"]


@pytest.mark.parametrize("compressed", [False, True])
def test_the_hash_made_while_converting_is_the_files_own(tmp_path, compressed):
    """The splits are hashed by the reads that convert them (no second read): the same hash as reading the file
    alone, gzip's stored bytes too; the meta.json beside them is hashed on its own."""
    data = make_data(tmp_path / "data", rows=3000)
    if compressed:
        for name in ("train.tsv", "test.tsv"):
            (data / f"{name}.gz").write_bytes(gzip.compress((data / name).read_bytes()))
            (data / name).unlink()
    meta = preprocess(data, tmp_path / "out", show_progress=False)
    recorded = meta["made_from"]["sources"]
    assert sorted(recorded) == ["meta.json", "test", "train"]
    for name, path in sources.source_files(data, sources.find_splits(data)).items():
        assert recorded[name] == sources.fingerprint(path)


def test_a_crash_mid_conversion_leaves_the_earlier_copy_in_use(tmp_path, conversions, monkeypatch):
    data = make_data(tmp_path / "data", rows=400)
    cached = ensure_preprocessed(data, show_progress=False)
    before = files_of(cached)
    original = data / "train.original"
    shutil.copy2(data / "train.tsv", original)
    shutil.copyfile(make_data(tmp_path / "other", seed=1, rows=400) / "train.tsv", data / "train.tsv")

    parse, parsed = CriteoParser.parse, []

    def crash_on_the_third_chunk(self, lines, **kwargs):
        parsed.append(len(lines))
        if len(parsed) == 3:
            raise RuntimeError("killed mid-conversion")
        return parse(self, lines, **kwargs)

    monkeypatch.setattr(pre, "LINES_PER_CHUNK", 100)
    monkeypatch.setattr(CriteoParser, "parse", crash_on_the_third_chunk)
    with pytest.raises(RuntimeError, match="killed mid-conversion"):
        ensure_preprocessed(data, show_progress=False)
    assert files_of(cached) == before
    assert sorted(p.name for p in data.iterdir()) == ["meta.json", "preprocessed", "test.tsv", "train.original",
                                                      "train.tsv"]

    monkeypatch.setattr(CriteoParser, "parse", parse)
    os.replace(original, data / "train.tsv")  # the data as the copy was made from it, under a new inode
    assert ensure_preprocessed(data, show_progress=False) == cached
    assert len(conversions) == 2  # the first, and the one that crashed
    # The same arrays, untouched; meta.json is rewritten with the new inode's stat fields.
    assert files_of(cached, skip={"meta.json"}) == {k: v for k, v in before.items() if k.name != "meta.json"}


def test_a_lone_file_is_converted_beside_it_and_a_preprocessed_directory_is_used_as_is(tmp_path, conversions):
    data = make_data(tmp_path / "data")
    cached = ensure_preprocessed(data / "train.tsv", show_progress=False)
    assert cached == data / "train.tsv.preprocessed"
    assert ensure_preprocessed(data / "train.tsv", show_progress=False) == cached  # reused
    assert ensure_preprocessed(cached, show_progress=False) == cached
    assert len(conversions) == 1
    converted = ensure_preprocessed(data, show_progress=False)
    assert converted == data / "preprocessed" and ensure_preprocessed(converted, show_progress=False) == converted
    assert len(conversions) == 2
    with pytest.raises(ValueError, match="no such file or directory"):
        ensure_preprocessed(data / "nothing.tsv", show_progress=False)


def test_a_failed_conversion_leaves_no_new_directory_and_an_earlier_one_as_it_was(tmp_path, monkeypatch):
    data = make_data(tmp_path / "data", rows=400)
    out = tmp_path / "out"
    preprocess(data, out, show_progress=False)
    (out / "notes.txt").write_text("not bagpipe's")
    before = files_of(out)
    lines = (data / "train.tsv").read_text().splitlines(keepends=True)
    (data / "train.tsv").write_text("".join(lines[:300]) + "a malformed row\n" + "".join(lines[300:]))
    monkeypatch.setattr(pre, "LINES_PER_CHUNK", 100)  # the chunks before the bad row are written
    for target in (out, tmp_path / "new" / "out"):
        with pytest.raises(ValueError, match=r"train.tsv:301: wrong column count"):
            preprocess(data, target, show_progress=False)
    assert files_of(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "out"]  # no new directory, no partial one


def test_converting_again_replaces_the_earlier_conversion_and_keeps_other_files(tmp_path):
    data = make_data(tmp_path / "data")
    out = tmp_path / "out"
    preprocess(data / "train.tsv", out, show_progress=False)  # its end held out as the test split
    (out / "notes.txt").write_text("not bagpipe's")
    meta = preprocess(data / "train.tsv", out, show_progress=False, holdout=0)
    assert meta["rows"] == {"train": 200} and open_dataset(out).test is None
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "notes.txt", "train"]  # no stale test split
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "out"]
