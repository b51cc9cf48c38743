"""A model dir is verified whenever it is read: a damaged, truncated or missing file is refused naming it,
and ``export`` names what is wrong with its --run-dir or --out instead of writing a different model."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from bagpipe.train.checkpoints import file_digest
from bagpipe.cli import main
from bagpipe.data.binary import open_dataset
from bagpipe.model_dir import META, MODEL_DIR, ModelDir, RowSource, TableRows, write_model_dir
from bagpipe.train.reference import build_tables, train_reference
from bagpipe.rundir import SUMMARY, export
from helpers.jobs import small_config

TABLE = "table_2_C3.safetensors"  # the file the issue flipped a byte in


@pytest.fixture(scope="module")
def trained(small_binary, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train_reference(small_config(small_binary, run_dir, iterations=3), show_progress=False)
    return run_dir


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of a finished run, this test's to damage."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def flip_byte(path: Path, *, from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-from_end] ^= 0x01
    path.write_bytes(bytes(data))


def without_checksums(model: Path) -> None:
    """Make ``model`` what a bagpipe before checksums wrote: the same files, model.json without "files"."""
    meta = json.loads((model / META).read_text())
    meta.pop("files", None)
    (model / META).write_text(json.dumps(meta, indent=2) + "\n")


def test_every_file_is_recorded_with_the_checksum_of_what_was_written(run):
    meta = json.loads((run / MODEL_DIR / META).read_text())
    written = sorted(p.name for p in (run / MODEL_DIR).iterdir() if p.name != META)
    assert TABLE in written and sorted(meta["files"]) == written
    assert all(file_digest(run / MODEL_DIR / name) == meta["files"][name] for name in written)


@pytest.mark.parametrize("name", [TABLE, "dense.safetensors"])
def test_a_flipped_byte_is_refused_naming_its_file(run, tmp_path, name):
    """One bit of one parameter (the file's last float) changed: before, export wrote that model with exit 0."""
    flip_byte(run / MODEL_DIR / name, from_end=2)
    with pytest.raises(ValueError, match=f"{name} fails its checksum"):
        export(run, tmp_path / "model.pt")
    assert not list(tmp_path.glob("model.pt*"))
    model = ModelDir.open(run / MODEL_DIR)  # open reads model.json and sizes only; reading the file checks it
    with pytest.raises(ValueError, match=f"{name} fails its checksum"):
        model.table(2) if name == TABLE else model.dense()


@pytest.mark.parametrize("checksums", [True, False], ids=["checksummed", "older-model-dir"])
def test_a_truncated_table_file_is_named(run, tmp_path, checksums):
    model = run / MODEL_DIR
    if not checksums:
        without_checksums(model)
    table = model / TABLE
    os.truncate(table, table.stat().st_size - 4)
    with pytest.raises(ValueError, match=f"{TABLE} (has|is truncated)"):
        export(run, tmp_path / "model.pt")


def test_an_older_model_dir_without_checksums_loads_with_one_warning(run, tmp_path, caplog):
    expected = ModelDir.open(run / MODEL_DIR).load()
    without_checksums(run / MODEL_DIR)
    with caplog.at_level(logging.WARNING, logger="bagpipe.model_dir"):
        got = export(run, tmp_path / "model.pt")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cannot be verified" in warnings[0] and str(run / MODEL_DIR) in warnings[0]
    assert all(torch.equal(got["dense"][k], v) for k, v in expected["dense"].items())
    assert all(torch.equal(a, b) for a, b in zip(got["embeddings"], expected["embeddings"], strict=True))


def test_a_damaged_table_header_is_named_even_without_checksums(run, tmp_path):
    """An older model dir has no checksum to catch it: the header itself is checked (was KeyError: 'weight')."""
    without_checksums(run / MODEL_DIR)
    table = run / MODEL_DIR / TABLE
    table.write_bytes(table.read_bytes().replace(b'"weight"', b'"wxight"', 1))
    with pytest.raises(ValueError, match=f"{TABLE} has a bad safetensors header: no readable tensor 'weight'"):
        export(run, tmp_path / "model.pt")


def test_a_missing_file_a_missing_tensor_and_a_bad_model_json_are_named(run, tmp_path):
    model = run / MODEL_DIR
    meta_text = (model / META).read_text()
    meta = json.loads(meta_text)
    (model / META).write_text(json.dumps({**meta, "dense_keys": [*meta["dense_keys"], "top.9.weight"]}))
    with pytest.raises(ValueError, match="dense.safetensors has no tensor 'top.9.weight'"):
        export(run, tmp_path / "model.pt")
    (model / META).write_text(meta_text[: len(meta_text) // 2])
    with pytest.raises(ValueError, match=f"{model / META}: not valid JSON"):
        export(run, tmp_path / "model.pt")
    (model / META).write_text(json.dumps({**meta, "tables": [{"file": TABLE}]}))
    with pytest.raises(ValueError, match=f"{model / META} is not a valid model description \\(missing 'rows'\\)"):
        export(run, tmp_path / "model.pt")
    (model / META).write_text(meta_text)
    (model / TABLE).unlink()
    with pytest.raises(ValueError, match=f"{model / TABLE} is missing"):
        ModelDir.open(model)


def test_export_of_a_directory_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"\xff\xd8")
    assert main(["export", "--run-dir", str(tmp_path / "photos"), "--out", str(tmp_path / "model.pt")]) == 2
    assert f"--run-dir {tmp_path / 'photos'} is not a bagpipe run dir" in capsys.readouterr().err
    assert main(["export", "--run-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "model.pt")]) == 2
    assert "is not a bagpipe run dir" in capsys.readouterr().err


def test_export_of_an_unfinished_run_says_so(run, tmp_path):
    (run / SUMMARY).unlink()
    with pytest.raises(ValueError, match="not a finished run .* interrupted, failed or is still running"):
        export(run, tmp_path / "model.pt")


def test_export_out_a_directory_is_named(run, tmp_path, capsys):
    (tmp_path / "exports").mkdir()
    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "exports")]) == 2
    assert f"--out {tmp_path / 'exports'} is a directory" in capsys.readouterr().err
    assert not list((tmp_path / "exports").iterdir())


def unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create a file in: one without write permission, or, for root (whom
    permissions do not stop), sysfs, where the kernel refuses new files to everyone."""
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    if os.geteuid() != 0:
        return read_only
    if not Path("/sys/kernel").is_dir():
        pytest.skip("running as root without sysfs: no directory here refuses root a new file")
    return Path("/sys")


def test_export_out_in_a_read_only_place_is_named(run, tmp_path, capsys):
    out = unwritable_dir(tmp_path) / "model.pt"
    assert main(["export", "--run-dir", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and ("permission denied" in err.lower() or "read-only file system" in err.lower())
    assert not out.exists() and "enforce fail" not in err


def test_export_out_under_a_file_is_named(run, tmp_path):
    (tmp_path / "notes").write_text("keep me")
    with pytest.raises(ValueError, match="cannot write --out .*notes/model.pt: part of its path is a file"):
        export(run, tmp_path / "notes" / "model.pt")
    assert (tmp_path / "notes").read_text() == "keep me"


def test_a_full_disk_mid_export_is_named_and_keeps_an_earlier_export(run, tmp_path, monkeypatch):
    """The disk fills halfway through the .pt: the error names --out, and the file already there (an earlier
    export) is left whole rather than replaced by half a model."""
    out = tmp_path / "model.pt"
    export(run, out)
    before = out.read_bytes()
    real_save = torch.save

    def save_until_full(obj, f):
        whole = io.BytesIO()
        real_save(obj, whole)
        half = whole.getvalue()[: len(whole.getvalue()) // 2]
        Path(f).write_bytes(half) if isinstance(f, (str, os.PathLike)) else f.write(half)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", save_until_full)
    with pytest.raises(ValueError) as refused:
        export(run, out)
    assert str(out) in str(refused.value) and "no space left" in str(refused.value)
    assert out.read_bytes() == before and not (tmp_path / "model.pt.tmp").exists()


class FailingRows(RowSource):
    """A table source that fails at its ``fail_at``-th block: a crash while the model dir is written."""

    def __init__(self, source: RowSource, *, fail_at: int) -> None:
        self.source, self.left = source, fail_at

    def rows(self, space: int, keys: np.ndarray) -> np.ndarray:
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("killed mid-write")
        return self.source.rows(space, keys)

    def release(self) -> None:
        self.source.release()


def test_a_crash_while_replacing_a_model_dir_leaves_the_old_one_whole(run, small_binary):
    """A run resumed after its model was written writes it again: a crash midway leaves the first model
    whole and verified, never a model.json naming half-written files."""
    model = run / MODEL_DIR
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    tables = build_tables(small_config(small_binary, run), open_dataset(small_binary).schema)
    dense = ModelDir.open(model).dense()
    with pytest.raises(RuntimeError, match="killed mid-write"):
        write_model_dir(model, dense=dense, layout=tables.layout, source=FailingRows(TableRows(tables), fail_at=5),
                        info={"iteration": 3, "mode": "reference"})
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before
    ModelDir.open(model).load()  # every checksum still holds
    write_model_dir(model, dense=dense, layout=tables.layout, source=TableRows(tables), info={"iteration": 3})
    assert torch.equal(ModelDir.open(model).load()["embeddings"][2], tables.table(2))
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(MODEL_DIR)) == [MODEL_DIR]
