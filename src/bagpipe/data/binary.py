"""The preprocessed binary format: per split, raw memory-mapped arrays plus a JSON header.

Layout of a data set directory::

    meta.json                  table sizes, source, skipped rows, and the synth metadata if any
    vocab/                     the vocabularies the ids number, if any (data.vocab)
    train/header.json          {"rows", "num_dense", "features", "table_sizes", "id_dtype", ...}
    train/labels.f32           float32 [rows]
    train/dense.f32            float32 [rows, num_dense], already log(1 + max(x, 0))
    train/ids.<dtype>          int32 or int64 [rows, columns], row-major: each sparse feature's
                               columns (data.schema), -1 where a multi-valued one is empty
    test/...                   the same
    valid/...                  the same, if the data has a validation split (next-item data: each user's
                               second-to-last item); --eval-every judges it and --keep-best chooses by it

``features`` lists each sparse feature's name, cardinality and width; a header without it (the
first version) has one one-hot feature per entry of ``table_sizes``.

A data set is written into a hidden sibling directory (``partial_path``) and put in place only when
complete (``move_into``, ``swap_in``).

Integrity: the writer hashes each array as it writes it and records the hashes in the header
(``checksums``), and every header and meta.json records the hash of its own other entries (``checksum``).
Opening checks that the headers and meta.json are valid and their sizes right; ``verify=True`` also reads
every array and checks it against its hash. Any fault is a CorruptData naming the file. Data written before
checksums were recorded opens as before, unverified.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from bagpipe.data.formats import Chunk
from bagpipe.data.schema import PAD, Feature, Schema
from bagpipe.data.vocab import VOCAB_DIR
from bagpipe.files import read_json

FORMAT_VERSIONS = (1, 2)  # read; 2 is written
SPLITS = ("train", "valid", "test")  # valid: optional (next-item data has one)
# Non-cryptographic: it detects corruption (a flipped bit, a torn or truncated write), not tampering; at about
# 10 GB/s here, verifying costs a read of the data and little more.
CHECKSUM = "xxh3_128"
HASH_BLOCK_BYTES = 8 << 20  # verifying reads a file in blocks of this size: memory stays bounded
META_FILE = "meta.json"  # a data set's record of itself (table sizes, sources, ...); without it, no data set


class CorruptData(ValueError):
    """A file of a preprocessed data set that is not as its conversion wrote it; the message names it."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}: the preprocessed data is corrupted; convert it again from its sources")
        self.path, self.reason = path, reason


def _digest_text(digest) -> str:
    return f"{CHECKSUM}:{digest.hexdigest()}"


def file_checksum(path: Path) -> str:
    """The checksum of a file's content, read in blocks of HASH_BLOCK_BYTES."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(HASH_BLOCK_BYTES)
    with open(path, "rb", buffering=0) as handle, memoryview(buffer) as view:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    return _digest_text(digest)


def _own_checksum(record: dict) -> str:
    """The checksum of a JSON record's entries besides ``checksum``, in a canonical form (a record read back
    gives the same)."""
    entries = {key: value for key, value in record.items() if key != "checksum"}
    return _digest_text(xxhash.xxh3_128(json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()))


def write_record(path: Path, record: dict) -> None:
    """``record`` as a JSON file with its own checksum, replacing ``path`` whole (a crash leaves the old one or
    none, never half of one)."""
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    try:
        partial.write_text(json.dumps({**record, "checksum": _own_checksum(record)}, indent=2) + "\n")
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def read_record(path: Path) -> dict:
    """A JSON record that ``write_record`` wrote (or an older version, without a checksum): CorruptData if it
    cannot be read, is not a JSON object or fails its checksum."""
    try:
        record = read_json(path)
    except OSError as err:
        raise CorruptData(path, f"unreadable ({err.strerror or err})") from None
    except ValueError as err:
        raise CorruptData(path, str(err).removeprefix(f"{path}: ")) from None
    if "checksum" in record and record["checksum"] != _own_checksum(record):
        raise CorruptData(path, "checksum mismatch")
    return record


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
        self.names = {"labels": "labels.f32", "dense": "dense.f32", "ids": f"ids.{self.id_dtype.name}"}
        self.files = {array: open(directory / name, "wb") for array, name in self.names.items()}
        self.digests = {array: xxhash.xxh3_128() for array in self.names}  # of what is written, as it is
        self.rows = 0
        self._writing: Future | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bagpipe-split-writer")

    def append(self, chunk: Chunk) -> None:
        self._wait()  # bounded memory: one chunk in flight; a failed write raises here
        self._writing = self._writer.submit(self._write, chunk)
        self.rows += len(chunk.labels)

    def _write(self, chunk: Chunk) -> None:
        for array, values, dtype in (("labels", chunk.labels, np.float32), ("dense", chunk.dense, np.float32),
                                     ("ids", chunk.ids, self.id_dtype)):
            data = np.ascontiguousarray(values, dtype=dtype).data
            self.files[array].write(data)
            self.digests[array].update(data)

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
            "checksums": {self.names[array]: _digest_text(digest) for array, digest in self.digests.items()},
            **(extra or {}),
        }
        write_record(self.directory / "header.json", header)


@dataclass
class BinarySplit:
    """One split, memory-mapped: slicing reads only the rows asked for."""

    directory: Path
    rows: int
    schema: Schema
    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray
    checksums: dict[str, str] | None = None  # each array file's, as written; None: written before they were kept

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
    def open(cls, directory: str | Path, *, verify: bool = False) -> "BinarySplit":
        """The split in ``directory``, its header valid and its arrays of the sizes it gives; ``verify``: each
        array also read and checked against its checksum. CorruptData names the first file at fault."""
        directory = Path(directory)
        header_path = directory / "header.json"
        if not header_path.is_file():
            raise ValueError(f"{directory}: not a preprocessed split (no header.json); run `bagpipe preprocess`")
        header = read_record(header_path)
        if header.get("version") not in FORMAT_VERSIONS:
            raise ValueError(f"{header_path}: format version {header.get('version')}, expected one of "
                             f"{FORMAT_VERSIONS}")
        try:
            rows, num_dense, id_dtype = int(header["rows"]), int(header["num_dense"]), np.dtype(header["id_dtype"])
            if "features" in header:
                schema = Schema(num_dense=num_dense, features=tuple(Feature(**f) for f in header["features"]))
            else:
                schema = Schema.one_hot(list(header["table_sizes"]), num_dense=num_dense)
        except (KeyError, TypeError, ValueError) as err:  # only in a header without its own checksum (older)
            raise CorruptData(header_path, f"not a valid split header ({type(err).__name__}: {err})") from None
        checksums = header.get("checksums")
        shapes = {"labels.f32": (np.float32, (rows,)), "dense.f32": (np.float32, (rows, num_dense)),
                  f"ids.{id_dtype.name}": (id_dtype, (rows, schema.num_columns))}
        for name, (dtype, shape) in shapes.items():
            path = directory / name
            expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
            if not path.is_file():
                raise CorruptData(path, f"missing (its header gives it {expected} bytes)")
            if (size := path.stat().st_size) != expected:
                raise CorruptData(path, f"{size} bytes, not the {expected} its header gives: truncated or changed")
        if verify and checksums is not None:
            for name in shapes:
                if checksums.get(name) != file_checksum(directory / name):
                    raise CorruptData(directory / name, "checksum mismatch")

        def mapped(name: str) -> np.ndarray:
            dtype, shape = shapes[name]
            if rows == 0 or int(np.prod(shape)) == 0:
                return np.zeros(shape, dtype=dtype)
            return np.memmap(directory / name, dtype=dtype, mode="r", shape=shape)

        return cls(
            directory=directory,
            rows=rows,
            schema=schema,
            labels=mapped("labels.f32"),
            dense=mapped("dense.f32"),
            ids=mapped(f"ids.{id_dtype.name}"),
            checksums=checksums,
        )


@dataclass
class BinaryDataset:
    directory: Path
    meta: dict
    train: BinarySplit
    test: BinarySplit | None
    valid: BinarySplit | None = None  # what evaluations during training are judged by, if the data has one
    # raw-id data as a run reads it: the rows its tables make (an embeddings.dynamic.RowNumbering); else None
    numbering: object | None = None

    @property
    def table_sizes(self) -> list[int]:
        return self.train.table_sizes

    @property
    def schema(self) -> Schema:
        return self.train.schema

    @property
    def checksummed(self) -> bool:
        """Whether every split records its arrays' checksums (not so in data written by an older bagpipe)."""
        return all(split.checksums is not None for split in self.splits().values())

    def splits(self) -> dict[str, BinarySplit]:
        """The splits it has, by name, in SPLITS' order."""
        return {name: split for name in SPLITS if (split := getattr(self, name)) is not None}

    def with_schema(self, schema: Schema) -> "BinaryDataset":
        """The same rows under ``schema`` (e.g. larger table sizes a job agreed on): its features must
        have the same widths, and the data's ids must fit its cardinalities."""
        assert [f.width for f in schema.features] == [f.width for f in self.schema.features]
        assert all(a.cardinality >= b.cardinality for a, b in zip(schema.features, self.schema.features))
        return dataclasses.replace(self, **{name: dataclasses.replace(split, schema=schema)
                                            for name, split in self.splits().items()})


def is_preprocessed(directory: str | Path) -> bool:
    return (Path(directory) / "train" / "header.json").is_file()


def read_meta(directory: Path) -> dict:
    """The meta.json of the data set in ``directory`` (``read_record``), or {} if it has none."""
    meta_path = directory / META_FILE
    return read_record(meta_path) if meta_path.is_file() else {}


def write_meta(directory: Path, meta: dict) -> None:
    write_record(directory / META_FILE, meta)


def partial_path(directory: Path) -> Path:
    """A new hidden sibling of ``directory`` to write a data set into before it is put in place."""
    return directory.with_name(f".{directory.name}.partial-{secrets.token_hex(4)}")


def move_into(partial: Path, out: Path) -> None:
    """The data set in ``partial`` in ``out``: ``partial`` renamed, if there is no ``out``; else in place of the
    data set there, entry by entry (other files in ``out`` stay), its meta.json removed first (without one it is no
    data set) and added last."""
    if not out.exists():
        partial.rename(out)
        return
    (out / META_FILE).unlink(missing_ok=True)
    for name in (*SPLITS, VOCAB_DIR):
        if (out / name).is_dir():
            shutil.rmtree(out / name)  # a split the new data set lacks must not stay behind
        if (partial / name).exists():
            (partial / name).rename(out / name)
    (partial / META_FILE).rename(out / META_FILE)
    partial.rmdir()


def swap_in(partial: Path, directory: Path) -> None:
    """The data set in ``partial`` as ``directory``, whole: renamed into its place, the one there (if any) renamed
    away just before and removed after."""
    if not directory.exists():
        partial.rename(directory)
        return
    # Readers that mapped the old files keep them (an unlinked file lives while it is mapped).
    old = directory.with_name(f".{directory.name}.old-{secrets.token_hex(4)}")
    directory.rename(old)
    partial.rename(directory)
    shutil.rmtree(old)


def open_dataset(directory: str | Path, *, verify: bool = False) -> BinaryDataset:
    """The data set in ``directory``, its headers and meta.json valid and its arrays of the right sizes.
    ``verify``: every array also read and checked against its checksum (``ensure_preprocessed`` does this for
    every run's data, once). CorruptData (a ValueError) names the first file at fault."""
    directory = Path(directory)
    meta_path = directory / META_FILE
    meta = read_meta(directory)
    splits = {name: BinarySplit.open(directory / name, verify=verify) for name in SPLITS
              if name == "train" or (directory / name / "header.json").is_file()}
    recorded = meta.get("rows")
    for name in SPLITS:
        split = splits.get(name)
        if isinstance(recorded, dict) and name in recorded and (split is None or split.rows != recorded[name]):
            found = "is missing" if split is None else f"holds {split.rows} rows"
            raise CorruptData(directory / name / "header.json", f"{found}, where {meta_path} records "
                                                                 f"{recorded[name]} rows")
    for name, split in splits.items():
        if split.schema != splits["train"].schema:
            raise ValueError(f"{directory}: the train and {name} splits disagree on their features")
    return BinaryDataset(directory=directory, meta=meta, train=splits["train"], test=splits.get("test"),
                         valid=splits.get("valid"))
