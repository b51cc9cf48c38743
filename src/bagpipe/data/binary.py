"""The preprocessed binary format: per split, raw memory-mapped arrays plus a JSON header.

Layout of a data set directory::

    meta.json                  table sizes, source, skipped rows, and the synth metadata if any
    train/header.json          {"rows", "num_dense", "features", "table_sizes", "id_dtype", ...}
    train/labels.f32           float32 [rows]
    train/dense.f32            float32 [rows, num_dense], already log(1 + max(x, 0))
    train/ids.<dtype>          int32 or int64 [rows, columns], row-major: each sparse feature's
                               columns (data.schema), -1 where a multi-valued one is empty
    test/...                   the same

``features`` lists each sparse feature's name, cardinality and width; a header without it (the
first version) has one one-hot feature per entry of ``table_sizes``.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bagpipe.data.formats import Chunk
from bagpipe.data.schema import PAD, Feature, Schema

FORMAT_VERSIONS = (1, 2)  # read; 2 is written
SPLITS = ("train", "test")


def id_dtype_for(table_sizes: list[int]) -> np.dtype:
    return np.dtype(np.int32) if max(table_sizes, default=1) <= np.iinfo(np.int32).max else np.dtype(np.int64)


class SplitWriter:
    """Appends parsed chunks to one split's files, each written on another thread while the next is parsed
    (one at a time, in order); ``close`` waits for the last and writes the header last."""

    def __init__(self, directory: Path, *, id_dtype: np.dtype) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.id_dtype = np.dtype(id_dtype)
        (directory / "header.json").unlink(missing_ok=True)  # a split without header is incomplete
        self.files = {
            "labels": open(directory / "labels.f32", "wb"),
            "dense": open(directory / "dense.f32", "wb"),
            "ids": open(directory / f"ids.{self.id_dtype.name}", "wb"),
        }
        self.rows = 0
        self._writing: Future | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bagpipe-split-writer")

    def append(self, chunk: Chunk) -> None:
        self._wait()  # bounded memory: one chunk in flight; a failed write raises here
        self._writing = self._writer.submit(self._write, chunk)
        self.rows += len(chunk.labels)

    def _write(self, chunk: Chunk) -> None:
        self.files["labels"].write(np.ascontiguousarray(chunk.labels, dtype=np.float32).data)
        self.files["dense"].write(np.ascontiguousarray(chunk.dense, dtype=np.float32).data)
        self.files["ids"].write(np.ascontiguousarray(chunk.ids, dtype=self.id_dtype).data)

    def _wait(self) -> None:
        if self._writing is not None:
            self._writing.result()
            self._writing = None

    def discard(self) -> None:
        """Stop: the write in flight ends (its error, if any, is dropped) and the files close, without a header."""
        self._writer.shutdown()
        for handle in self.files.values():
            handle.close()

    def close(self, *, schema: Schema, extra: dict | None = None) -> None:
        self._wait()
        self._writer.shutdown()
        for handle in self.files.values():
            handle.close()
        header = {
            "version": FORMAT_VERSIONS[-1],
            "rows": self.rows,
            "num_dense": schema.num_dense,
            "features": [dataclasses.asdict(f) for f in schema.features],
            "table_sizes": schema.cardinalities,
            "id_dtype": self.id_dtype.name,
            **(extra or {}),
        }
        (self.directory / "header.json").write_text(json.dumps(header, indent=2) + "\n")


@dataclass
class BinarySplit:
    """One split, memory-mapped: slicing reads only the rows asked for."""

    directory: Path
    rows: int
    schema: Schema
    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray

    @property
    def table_sizes(self) -> list[int]:
        """Each sparse feature's cardinality."""
        return self.schema.cardinalities

    @property
    def num_tables(self) -> int:
        return len(self.schema.features)

    def column_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Per column of the id matrix: the cardinality its ids lie below, and the smallest id allowed
        (PAD in a multi-valued feature's columns, else 0)."""
        cardinalities = [f.cardinality for f in self.schema.features for _ in range(f.width)]
        lowest = [PAD if f.width > 1 else 0 for f in self.schema.features for _ in range(f.width)]
        return np.asarray(cardinalities, dtype=np.int64), np.asarray(lowest, dtype=np.int64)

    @classmethod
    def open(cls, directory: str | Path) -> "BinarySplit":
        directory = Path(directory)
        header_path = directory / "header.json"
        if not header_path.is_file():
            raise ValueError(f"{directory}: not a preprocessed split (no header.json); run `bagpipe preprocess`")
        header = json.loads(header_path.read_text())
        if header.get("version") not in FORMAT_VERSIONS:
            raise ValueError(f"{header_path}: format version {header.get('version')}, expected one of "
                             f"{FORMAT_VERSIONS}")
        rows, num_dense, id_dtype = int(header["rows"]), int(header["num_dense"]), np.dtype(header["id_dtype"])
        if "features" in header:
            schema = Schema(num_dense=num_dense, features=tuple(Feature(**f) for f in header["features"]))
        else:
            schema = Schema.one_hot(list(header["table_sizes"]), num_dense=num_dense)

        def mapped(name: str, dtype, shape):
            path = directory / name
            expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
            if not path.is_file() or path.stat().st_size != expected:
                raise ValueError(f"{path}: missing or truncated (expected {expected} bytes)")
            if rows == 0 or expected == 0:
                return np.zeros(shape, dtype=dtype)
            return np.memmap(path, dtype=dtype, mode="r", shape=shape)

        return cls(
            directory=directory,
            rows=rows,
            schema=schema,
            labels=mapped("labels.f32", np.float32, (rows,)),
            dense=mapped("dense.f32", np.float32, (rows, num_dense)),
            ids=mapped(f"ids.{id_dtype.name}", id_dtype, (rows, schema.num_columns)),
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

    def with_schema(self, schema: Schema) -> "BinaryDataset":
        """The same rows under ``schema`` (e.g. larger table sizes a job agreed on): its features must
        have the same widths, and the data's ids must fit its cardinalities."""
        assert [f.width for f in schema.features] == [f.width for f in self.schema.features]
        assert all(a.cardinality >= b.cardinality for a, b in zip(schema.features, self.schema.features))
        splits = [None if s is None else dataclasses.replace(s, schema=schema) for s in (self.train, self.test)]
        return dataclasses.replace(self, train=splits[0], test=splits[1])


def is_preprocessed(directory: str | Path) -> bool:
    return (Path(directory) / "train" / "header.json").is_file()


def open_dataset(directory: str | Path) -> BinaryDataset:
    directory = Path(directory)
    meta_path = directory / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    train = BinarySplit.open(directory / "train")
    test = BinarySplit.open(directory / "test") if (directory / "test" / "header.json").is_file() else None
    if test is not None and test.schema != train.schema:
        raise ValueError(f"{directory}: train and test splits disagree on their features")
    return BinaryDataset(directory=directory, meta=meta, train=train, test=test)
