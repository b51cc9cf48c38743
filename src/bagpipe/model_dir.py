"""A trained model as a directory that loads lazily: one safetensors file per table, written row block by
row block, so neither writing nor reading it ever holds a whole table (``RUN_DIR/model``).

    model.json                        what the directory holds: the run's iteration, mode, model, tables, and
                                      every file's size and BLAKE2b hash ("files")
    dense.safetensors                 the dense part's state_dict
    table_<i>_<name>.safetensors      table i's rows: one float32 tensor "weight" [rows, dim]

Every file is plain safetensors (8-byte header length, JSON header, raw little-endian data), so
``safetensors.safe_open(path, framework="pt").get_slice("weight")[a:b]`` reads rows a..b-1 only, and
``ModelDir.table`` memory-maps a table as a numpy array.

Each file is hashed block by block as it is written and fsynced; model.json is written last, and the whole
directory is written under ``model.tmp`` and renamed into place, so a crash mid-write never leaves a model.json
naming half-written files. Reading checks what it reads: a file against its recorded hash when it is first
opened (streamed, in bounded memory), its header against model.json; any fault is a ValueError naming the file.
A model dir written before checksums were recorded still loads, with a warning that it cannot be verified.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from bagpipe.train.checkpoints import fsync_dir, HashedFile, file_digest
from bagpipe.embeddings import EmbeddingLayout, EmbeddingTables
from bagpipe.faults import inject_fault
from bagpipe.files import read_json

log = logging.getLogger(__name__)

MODEL_DIR = "model"
META = "model.json"
DENSE = "dense.safetensors"
ROW_KEYS = "row_keys.safetensors"  # a model of raw ids: each table's key of each row
TENSOR = "weight"  # the name of a table file's one tensor
FORMAT = 1
BLOCK_BYTES = 1 << 24  # rows streamed into a table file at a time (16 MiB)


class RowSource(Protocol):
    """Where a model's rows come from: in-memory tables, or a checkpoint read lazily (``checkpoint.ChainRows``)."""

    def rows(self, space: int, keys: np.ndarray) -> np.ndarray:
        """float32 ``[len(keys), dim]``: the rows of ``keys`` (flat keys of embedding space ``space``)."""

    def release(self) -> None:
        """Forget what was read so far (a source that maps files drops their pages from memory)."""


class TableRows:
    """The rows of one process's tables (the reference trainer's ``EmbeddingTables``, or ``--mode single``'s
    ``nn.CachedTables`` in memory or on disk)."""

    def __init__(self, tables: EmbeddingTables) -> None:
        self.tables = tables

    def rows(self, space: int, keys: np.ndarray) -> np.ndarray:
        return self.tables.read_rows(space, keys, with_state=False)[0]

    def release(self) -> None:
        pass


def table_file(index: int, name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
    return f"table_{index}_{safe}.safetensors"


def _header_bytes(tensors: dict[str, tuple[str, list[int], int]], metadata: dict[str, str]) -> bytes:
    """A safetensors header (length prefix included) for ``tensors``: name -> (dtype, shape, bytes), laid out
    in that order; padded with spaces to 8 bytes as the reference writer does."""
    header, offset = {}, 0
    for name, (dtype, shape, size) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_table(path: Path, *, num_rows: int, dim: int, blocks, metadata: dict[str, str]) -> dict:
    """One table's safetensors file from ``blocks`` (float32 arrays of rows, in order), fsynced; its size and
    hash, taken block by block as it is written (a table may not fit in memory, and is never read back)."""
    out = HashedFile(path)
    out.write(_header_bytes({TENSOR: ("F32", [num_rows, dim], num_rows * dim * 4)}, metadata))
    written = 0
    for block in blocks:
        out.write(np.ascontiguousarray(block, dtype="<f4"))
        written += len(block)
    assert written == num_rows, f"{path.name}: {written} rows written of {num_rows}"
    return out.close()


def table_blocks(source: RowSource, *, space: int, offset: int, num_rows: int, dim: int):
    """A table's rows (keys ``offset`` .. ``offset + num_rows - 1`` of ``space``) in blocks of BLOCK_BYTES."""
    step = max(BLOCK_BYTES // (4 * dim), 1)
    for start in range(0, num_rows, step):
        yield source.rows(space, np.arange(offset + start, offset + min(start + step, num_rows), dtype=np.int64))
        source.release()


def write_model_dir(path: str | Path, *, dense: dict[str, torch.Tensor], layout: EmbeddingLayout, source: RowSource,
                    info: dict, row_keys: list[np.ndarray] | None = None) -> Path:
    """Write the model into ``path`` (replacing one there) table by table from ``source``; atomic: written
    under ``path.tmp``, every file fsynced and hashed, model.json last, then renamed into place.
    ``info``: what model.json records beside the tables (iteration, mode, ...). ``row_keys``: raw-id tables'
    key of each row (int64, the default row's -1), written to ROW_KEYS: what a model of raw ids is looked up by."""
    from safetensors.torch import save

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dense_file = HashedFile(tmp / DENSE)
    dense_file.write(save({name: value.detach().contiguous().to("cpu", copy=True) for name, value in dense.items()}))
    files = {DENSE: dense_file.close()}
    tables = []
    for index, table in enumerate(layout.tables):
        space, offset = layout.place(index)
        name = table_file(index, table.name)
        files[name] = write_table(
            tmp / name, num_rows=table.num_rows, dim=table.dim, metadata={"table": table.name, "index": str(index)},
            blocks=table_blocks(source, space=space, offset=offset, num_rows=table.num_rows, dim=table.dim))
        tables.append({"name": table.name, "file": name, "rows": table.num_rows, "dim": table.dim})
    if row_keys is not None:
        keys_file = HashedFile(tmp / ROW_KEYS)
        keys_file.write(save({str(index): torch.from_numpy(np.array(keys, dtype=np.int64))  # (a copy each)
                              for index, keys in enumerate(row_keys)}))
        files[ROW_KEYS] = keys_file.close()
    meta = {"format": FORMAT, **info, "dense": DENSE, "dense_keys": list(dense), "tables": tables, "files": files,
            **({"row_keys": ROW_KEYS} if row_keys is not None else {})}
    with open(tmp / META, "w") as handle:
        handle.write(json.dumps(meta, indent=2) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(tmp)
    inject_fault("model written")
    # The old model is moved aside whole, not deleted in place: a crash while deleting it would leave its
    # model.json naming files already gone. (Named *.tmp: what a crash leaves, a run's sweep removes.)
    old = path.with_name(path.name + ".old.tmp")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    return path


def evaluation_of(path: str | Path) -> tuple[int, dict] | None:
    """The iteration and the evaluation that the model dir at ``path`` records (``info``'s ``iteration`` and
    ``metrics``), if there is one there with an evaluation."""
    meta_path = Path(path) / META
    if not meta_path.is_file():
        return None
    meta = _read_meta(meta_path)
    return (meta["iteration"], meta["metrics"]) if isinstance(meta.get("metrics"), dict) else None


def _read_meta(path: Path) -> dict:
    """model.json at ``path``, checked for every field a reader uses; a ValueError naming it if one is wrong."""
    meta = read_json(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: model format {meta.get('format')}, this version reads {FORMAT}")
    try:
        names = [meta["dense"], *(entry["file"] for entry in meta["tables"])]
        counts = [n for entry in meta["tables"] for n in (entry["rows"], entry["dim"])]
        digests = [meta["files"][name] for name in names] if "files" in meta else []
        well_typed = (all(isinstance(name, str) for name in [*names, *meta["dense_keys"]])
                      and all(isinstance(n, int) and n >= 0 for n in counts)
                      and all(isinstance(d, dict) and isinstance(d.get("bytes"), int) for d in digests))
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a valid model description (missing {err})") from None
    if not well_typed:
        raise ValueError(f"{path} is not a valid model description (a file name, key, row count or checksum "
                         f"of the wrong type)")
    return meta


def _table_start(file: Path, handle, *, rows: int, dim: int) -> int:
    """Where table ``file``'s rows begin, once its header is found to describe float32 [rows, dim] that the
    file holds whole (read from ``handle``: the header alone, whatever length it claims)."""
    size = os.fstat(handle.fileno()).st_size
    prefix = handle.read(8)
    length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else size
    if 8 + length > size:
        raise ValueError(f"{file} is truncated or not a safetensors file (its header does not fit in its "
                         f"{size} bytes)")
    try:
        tensor = json.loads(handle.read(length))[TENSOR]
        dtype, shape, (begin, end) = tensor["dtype"], tensor["shape"], map(int, tensor["data_offsets"])
    except (KeyError, TypeError, ValueError) as err:  # (bad JSON or UTF-8 are ValueErrors)
        raise ValueError(f"{file} has a bad safetensors header: no readable tensor {TENSOR!r} ({err!r})") from None
    if dtype != "F32" or shape != [rows, dim] or end - begin != rows * dim * 4:
        raise ValueError(f"{file} holds {dtype} {shape}, {META} records float32 [{rows}, {dim}]")
    if 8 + length + end > size:
        raise ValueError(f"{file} is truncated: {size} bytes, its rows end at byte {8 + length + end}")
    return 8 + length + begin


@dataclass
class ModelDir:
    """A model directory, read lazily: tables are memory-mapped, never read whole unless asked. Each file is
    checked against its hash when first read."""

    path: Path
    meta: dict
    checked: set[str] = field(default_factory=set)  # files found to match their hashes (each is hashed once)

    @classmethod
    def open(cls, path: str | Path) -> "ModelDir":
        """The model dir at ``path``, its model.json valid and every file it names there (of the recorded size)."""
        path = Path(path)
        if not (path / META).is_file():
            raise ValueError(f"{path}: not a model directory (no {META})")
        meta = _read_meta(path / META)
        if "files" not in meta:
            log.warning("%s was written without checksums (by an older bagpipe): its files cannot be verified", path)
        model = cls(path=path, meta=meta)
        for name in (meta["dense"], *(entry["file"] for entry in meta["tables"])):
            model._file(name)
        return model

    def _file(self, name: str) -> Path:
        """The path of file ``name``, if it is there and of the size model.json records."""
        file = self.path / name
        if not file.is_file():
            raise ValueError(f"{file} is missing ({self.path / META} lists it)")
        want = self.meta.get("files", {}).get(name)
        if want is not None and file.stat().st_size != want["bytes"]:
            raise ValueError(f"{file} has {file.stat().st_size} bytes, {META} records {want['bytes']}: it is "
                             f"truncated or was changed after the run wrote it")
        return file

    def _checked(self, name: str) -> Path:
        """The path of file ``name``, once its content is found to match its recorded hash."""
        file = self._file(name)
        want = self.meta.get("files", {}).get(name)
        if want is not None and name not in self.checked:
            if file_digest(file) != want:
                raise ValueError(f"{file} fails its checksum: it was corrupted or changed after the run wrote it")
            self.checked.add(name)
        return file

    @property
    def num_tables(self) -> int:
        return len(self.meta["tables"])

    def dense(self) -> dict[str, torch.Tensor]:
        """The dense part's state_dict, in the order the model gave it."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        file = self._checked(self.meta["dense"])
        try:
            loaded = load_file(file)
        except SafetensorError as err:
            raise ValueError(f"{file} is not a readable safetensors file ({err})") from None
        missing = [name for name in self.meta["dense_keys"] if name not in loaded]
        if missing:
            raise ValueError(f"{file} has no tensor {missing[0]!r} ({len(missing)} of {META}'s dense_keys missing)")
        return {name: loaded[name] for name in self.meta["dense_keys"]}

    def table(self, index: int) -> np.ndarray:
        """Table ``index`` as a read-only memory-mapped float32 array [rows, dim]: rows are read as touched."""
        entry = self.meta["tables"][index]
        rows, dim = int(entry["rows"]), int(entry["dim"])
        file = self._checked(entry["file"])
        with open(file, "rb") as handle:
            start = _table_start(file, handle, rows=rows, dim=dim)
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(mapped, dtype="<f4", count=rows * dim, offset=start).reshape(rows, dim)

    def row_keys(self) -> list[torch.Tensor] | None:
        """A model of raw ids: each table's key of each row (int64; the default row's -1); else None."""
        if "row_keys" not in self.meta:
            return None
        from safetensors.torch import load_file

        loaded = load_file(self._checked(self.meta["row_keys"]))
        return [loaded[str(index)] for index in range(self.num_tables)]

    def load(self) -> dict:
        """``{"dense": state_dict, "embeddings": [one tensor per table]}``, every table read into memory
        (small models: what ``bagpipe export`` writes as one .pt), and, for a model of raw ids, ``"row_keys"``: each
        table's key of each row (the default row's -1)."""
        keys = self.row_keys()
        return {"dense": self.dense(),
                "embeddings": [torch.from_numpy(self.table(t).copy()) for t in range(self.num_tables)],
                **({"row_keys": keys} if keys is not None else {})}


class ModelRows:
    """A model directory's rows by embedding-space key (a ``RowSource``): evaluate an exported model, or
    read a few of its rows, with its tables memory-mapped rather than loaded."""

    def __init__(self, model: ModelDir, layout: EmbeddingLayout) -> None:
        if model.num_tables != len(layout.tables):
            raise ValueError(f"{model.path} holds {model.num_tables} tables, the model has {len(layout.tables)}")
        self.tables = [model.table(t) for t in range(model.num_tables)]
        self.layout = layout

    def rows(self, space: int, keys: np.ndarray) -> np.ndarray:
        out = np.empty((len(keys), self.layout.spaces[space].dim), dtype=np.float32)
        for index in self.layout.spaces[space].tables:
            _, offset = self.layout.place(index)
            mine = np.flatnonzero((keys >= offset) & (keys < offset + self.layout.tables[index].num_rows))
            out[mine] = self.tables[index][keys[mine] - offset]
        return out

    def release(self) -> None:
        pass
