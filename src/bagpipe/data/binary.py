"""The preprocessed binary format: per split, raw memory-mapped arrays plus a JSON header.

Layout of a data set directory::

    meta.json                  table sizes, source, skipped rows, and the synth metadata if any
    train/header.json          {"rows", "num_dense", "table_sizes", "id_dtype", ...}
    train/labels.f32           float32 [rows]
    train/dense.f32            float32 [rows, num_dense], already log(1 + max(x, 0))
    train/ids.<dtype>          int32 or int64 [rows, num_tables], row-major
    test/...                   the same
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bagpipe.data.formats import NUM_DENSE, Chunk
from bagpipe.data.schema import Schema

FORMAT_VERSION = 1
SPLITS = ("train", "test")


def id_dtype_for(table_sizes: list[int]) -> np.dtype:
    return np.dtype(np.int32) if max(table_sizes, default=1) <= np.iinfo(np.int32).max else np.dtype(np.int64)


class SplitWriter:
    """Appends parsed chunks to one split's files; ``close`` writes the header last."""

    def __init__(self, directory: Path, *, num_tables: int, id_dtype: np.dtype) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.num_tables = num_tables
        self.id_dtype = np.dtype(id_dtype)
        (directory / "header.json").unlink(missing_ok=True)  # a split without header is incomplete
        self.files = {
            "labels": open(directory / "labels.f32", "wb"),
            "dense": open(directory / "dense.f32", "wb"),
            "ids": open(directory / f"ids.{self.id_dtype.name}", "wb"),
        }
        self.rows = 0

    def append(self, chunk: Chunk) -> None:
        self.files["labels"].write(np.ascontiguousarray(chunk.labels, dtype=np.float32).tobytes())
        self.files["dense"].write(np.ascontiguousarray(chunk.dense, dtype=np.float32).tobytes())
        self.files["ids"].write(np.ascontiguousarray(chunk.ids, dtype=self.id_dtype).tobytes())
        self.rows += len(chunk.labels)

    def close(self, *, table_sizes: list[int], extra: dict | None = None) -> None:
        for handle in self.files.values():
            handle.close()
        header = {
            "version": FORMAT_VERSION,
            "rows": self.rows,
            "num_dense": NUM_DENSE,
            "table_sizes": list(table_sizes),
            "id_dtype": self.id_dtype.name,
            **(extra or {}),
        }
        (self.directory / "header.json").write_text(json.dumps(header, indent=2) + "\n")


@dataclass
class BinarySplit:
    """One split, memory-mapped: slicing reads only the rows asked for."""

    directory: Path
    rows: int
    table_sizes: list[int]
    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray

    @property
    def num_tables(self) -> int:
        return len(self.table_sizes)

    @property
    def schema(self) -> Schema:
        return Schema.one_hot(self.table_sizes, num_dense=self.dense.shape[1])

    @classmethod
    def open(cls, directory: str | Path) -> "BinarySplit":
        directory = Path(directory)
        header_path = directory / "header.json"
        if not header_path.is_file():
            raise ValueError(f"{directory}: not a preprocessed split (no header.json); run `bagpipe preprocess`")
        header = json.loads(header_path.read_text())
        if header.get("version") != FORMAT_VERSION:
            raise ValueError(f"{header_path}: format version {header.get('version')}, expected {FORMAT_VERSION}")
        rows, sizes = int(header["rows"]), list(header["table_sizes"])
        num_dense, id_dtype = int(header["num_dense"]), np.dtype(header["id_dtype"])

        def mapped(name: str, dtype, shape):
            path = directory / name
            expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
            if not path.is_file() or path.stat().st_size != expected:
                raise ValueError(f"{path}: missing or truncated (expected {expected} bytes)")
            if rows == 0:
                return np.zeros(shape, dtype=dtype)
            return np.memmap(path, dtype=dtype, mode="r", shape=shape)

        return cls(
            directory=directory,
            rows=rows,
            table_sizes=sizes,
            labels=mapped("labels.f32", np.float32, (rows,)),
            dense=mapped("dense.f32", np.float32, (rows, num_dense)),
            ids=mapped(f"ids.{id_dtype.name}", id_dtype, (rows, len(sizes))),
        )


@dataclass
class BinaryDataset:
    directory: Path
    meta: dict
    train: BinarySplit
    test: BinarySplit | None

    @property
    def table_sizes(self) -> list[int]:
        return self.train.table_sizes

    @property
    def schema(self) -> Schema:
        return self.train.schema


def is_preprocessed(directory: str | Path) -> bool:
    return (Path(directory) / "train" / "header.json").is_file()


def open_dataset(directory: str | Path) -> BinaryDataset:
    directory = Path(directory)
    meta_path = directory / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    train = BinarySplit.open(directory / "train")
    test = BinarySplit.open(directory / "test") if (directory / "test" / "header.json").is_file() else None
    if test is not None and test.table_sizes != train.table_sizes:
        raise ValueError(f"{directory}: train and test splits disagree on table sizes")
    return BinaryDataset(directory=directory, meta=meta, train=train, test=test)
