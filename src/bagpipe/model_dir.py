"""A trained model as a directory that loads lazily: one safetensors file per table, written row block by
row block, so neither writing nor reading it ever holds a whole table (``RUN_DIR/model``).

    model.json                        what the directory holds: the run's iteration, mode, model, tables
    dense.safetensors                 the dense part's state_dict
    table_<i>_<name>.safetensors      table i's rows: one float32 tensor "weight" [rows, dim]

Every file is plain safetensors (8-byte header length, JSON header, raw little-endian data), so
``safetensors.safe_open(path, framework="pt").get_slice("weight")[a:b]`` reads rows a..b-1 only, and
``ModelDir.table`` memory-maps a table as a numpy array.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from bagpipe.embeddings import EmbeddingLayout, EmbeddingTables
from bagpipe.faults import inject_fault

MODEL_DIR = "model"
META = "model.json"
DENSE = "dense.safetensors"
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


def write_table(path: Path, *, num_rows: int, dim: int, blocks, metadata: dict[str, str]) -> None:
    """One table's safetensors file from ``blocks`` (float32 arrays of rows, in order), fsynced."""
    with open(path, "wb") as handle:
        handle.write(_header_bytes({TENSOR: ("F32", [num_rows, dim], num_rows * dim * 4)}, metadata))
        written = 0
        for block in blocks:
            handle.write(np.ascontiguousarray(block, dtype="<f4").tobytes())
            written += len(block)
        assert written == num_rows, f"{path.name}: {written} rows written of {num_rows}"
        handle.flush()
        os.fsync(handle.fileno())


def table_blocks(source: RowSource, *, space: int, offset: int, num_rows: int, dim: int):
    """A table's rows (keys ``offset`` .. ``offset + num_rows - 1`` of ``space``) in blocks of BLOCK_BYTES."""
    step = max(BLOCK_BYTES // (4 * dim), 1)
    for start in range(0, num_rows, step):
        yield source.rows(space, np.arange(offset + start, offset + min(start + step, num_rows), dtype=np.int64))
        source.release()


def write_model_dir(path: str | Path, *, dense: dict[str, torch.Tensor], layout: EmbeddingLayout, source: RowSource,
                    info: dict) -> Path:
    """Write the model into ``path`` (replacing one there) table by table from ``source``; atomic: written
    under ``path.tmp`` and renamed. ``info``: what model.json records beside the tables (iteration, mode, ...)."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({name: value.detach().contiguous().clone() for name, value in dense.items()}, tmp / DENSE)
    tables = []
    for index, table in enumerate(layout.tables):
        space, offset = layout.place(index)
        name = table_file(index, table.name)
        write_table(tmp / name, num_rows=table.num_rows, dim=table.dim,
                    blocks=table_blocks(source, space=space, offset=offset, num_rows=table.num_rows, dim=table.dim),
                    metadata={"table": table.name, "index": str(index)})
        tables.append({"name": table.name, "file": name, "rows": table.num_rows, "dim": table.dim})
    meta = {"format": FORMAT, **info, "dense": DENSE, "dense_keys": list(dense), "tables": tables}
    (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
    inject_fault("model written")
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


@dataclass
class ModelDir:
    """A model directory, read lazily: tables are memory-mapped, never read whole unless asked."""

    path: Path
    meta: dict

    @classmethod
    def open(cls, path: str | Path) -> "ModelDir":
        path = Path(path)
        if not (path / META).is_file():
            raise ValueError(f"{path}: not a model directory (no {META})")
        meta = json.loads((path / META).read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: model format {meta.get('format')}, this version reads {FORMAT}")
        return cls(path=path, meta=meta)

    @property
    def num_tables(self) -> int:
        return len(self.meta["tables"])

    def dense(self) -> dict[str, torch.Tensor]:
        """The dense part's state_dict, in the order the model gave it."""
        from safetensors.torch import load_file

        loaded = load_file(self.path / self.meta["dense"])
        return {name: loaded[name] for name in self.meta["dense_keys"]}

    def table(self, index: int) -> np.ndarray:
        """Table ``index`` as a read-only memory-mapped float32 array [rows, dim]: rows are read as touched."""
        entry = self.meta["tables"][index]
        with open(self.path / entry["file"], "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))[TENSOR]
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        start = 8 + length + header["data_offsets"][0]
        return np.frombuffer(mapped, dtype="<f4", count=math.prod(header["shape"]), offset=start).reshape(header["shape"])

    def load(self) -> dict:
        """``{"dense": state_dict, "embeddings": [one tensor per table]}``, every table read into memory
        (small models: what ``bagpipe export`` writes as one .pt)."""
        return {"dense": self.dense(),
                "embeddings": [torch.from_numpy(self.table(t).copy()) for t in range(self.num_tables)]}


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
