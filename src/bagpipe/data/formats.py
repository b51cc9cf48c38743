"""Text formats we read: Criteo TSV and the original system's JSON lines.

Both parsers turn a chunk of lines into (labels, dense, ids) arrays. A fast path parses the
whole chunk at once; if anything is off, the slow path walks the chunk line by line to name
the first bad line (or to skip and count bad lines, when asked). Lines arrive as bytes and are
decoded the same way: the whole chunk at once, line by line only when it is not UTF-8.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

NUM_DENSE = 13
_HEX_CHARS = frozenset("0123456789abcdefABCDEF")
_INT64_LIMIT = 1 << 63  # ids are stored as int64 at most


class DataError(ValueError):
    """A malformed input row; the message names the file and the 1-based line number."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


def dense_transform(values: np.ndarray) -> np.ndarray:
    """DLRM's dense feature transform: log(1 + max(x, 0)), as float32."""
    return np.log1p(np.maximum(np.asarray(values, dtype=np.float64), 0.0)).astype(np.float32)


@dataclass
class BadRows:
    """Counts of skipped rows by reason, with the first few examples for the report."""

    counts: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def add(self, err: DataError) -> None:
        self.counts[err.reason.split(":")[0]] += 1
        if len(self.examples) < 5:
            self.examples.append(str(err))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def decode_lines(lines: list[bytes], *, path: str, first_line: int,
                 bad: BadRows | None) -> list[tuple[int, list[str]]]:
    """``lines`` as text, in runs of consecutive lines: (number of the run's first line, its lines).

    A line that is not UTF-8 is a DataError, or under ``bad`` is counted and splits the run, so
    that line numbers stay right for the parser.
    """
    try:
        text = b"".join(lines).decode("utf-8")
    except UnicodeDecodeError:
        return _decode_line_by_line(lines, path=path, first_line=first_line, bad=bad)
    # UTF-8 never puts 0x0a inside a character, so the chunk splits back exactly at its lines.
    texts = text.split("\n")
    if len(texts) > len(lines):
        texts.pop()  # the empty tail after the chunk's last newline
    assert len(texts) == len(lines)
    return [(first_line, texts)]


def _decode_line_by_line(lines, *, path, first_line, bad) -> list[tuple[int, list[str]]]:
    runs: list[tuple[int, list[str]]] = []
    for number, raw in enumerate(lines, start=first_line):
        try:
            text = raw.decode("utf-8").removesuffix("\n")
        except UnicodeDecodeError as err:
            error = DataError(path, number, f"not UTF-8 text: byte 0x{raw[err.start]:02x} at column "
                                            f"{err.start + 1} (is this a binary or compressed file?)")
            if bad is None:
                raise error from None
            bad.add(error)
            continue
        if runs and runs[-1][0] + len(runs[-1][1]) == number:
            runs[-1][1].append(text)
        else:
            runs.append((number, [text]))
    return runs


@dataclass(frozen=True)
class Chunk:
    labels: np.ndarray  # float32 [n]
    dense: np.ndarray  # float32 [n, NUM_DENSE], already transformed
    ids: np.ndarray  # int64 [n, num_tables]


class CriteoParser:
    """Criteo TSV: label, 13 integer columns, one hexadecimal column per table; empty -> 0."""

    def __init__(self, table_sizes: list[int]) -> None:
        self.table_sizes = np.asarray(table_sizes, dtype=np.int64)
        self.num_columns = 1 + NUM_DENSE + len(table_sizes)

    def parse(self, lines: list[str], *, path: str, first_line: int, bad: BadRows | None) -> Chunk:
        try:
            return self._fast(lines)
        except (ValueError, IndexError, OverflowError):
            return self._slow(lines, path=path, first_line=first_line, bad=bad)

    def _fast(self, lines: list[str]) -> Chunk:
        rows = [line.rstrip("\r\n").split("\t") for line in lines]
        if any(len(row) != self.num_columns for row in rows):
            raise ValueError("column count")
        cat_tokens = [tok for row in rows for tok in row[1 + NUM_DENSE:]]
        if not _HEX_CHARS.issuperset("".join(cat_tokens)):
            raise ValueError("non-hex")
        labels = np.array([float(row[0]) for row in rows], dtype=np.float32)
        if ((labels != 0) & (labels != 1)).any():
            raise ValueError("label")
        dense = np.array([[float(x) if x else 0.0 for x in row[1:1 + NUM_DENSE]] for row in rows],
                         dtype=np.float64).reshape(len(rows), NUM_DENSE)
        if not np.isfinite(dense).all():
            raise ValueError("dense")
        hashes = np.array([int(tok, 16) if tok else 0 for tok in cat_tokens], dtype=np.uint64)
        ids = (hashes.reshape(len(rows), -1) % self.table_sizes.astype(np.uint64)).astype(np.int64)
        return Chunk(labels, dense_transform(dense), ids)

    def _row(self, line: str, *, path: str, number: int) -> tuple[float, list[float], list[int]]:
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) != self.num_columns:
            raise DataError(path, number, f"wrong column count: expected {self.num_columns}, got {len(fields)}")
        label = _parse_label(fields[0], path=path, number=number)
        dense = []
        for j, tok in enumerate(fields[1:1 + NUM_DENSE]):
            try:
                value = float(tok) if tok else 0.0
            except ValueError:
                raise DataError(path, number, f"non-numeric dense value: column I{j + 1} is {tok!r}") from None
            if not np.isfinite(value):
                raise DataError(path, number, f"non-numeric dense value: column I{j + 1} is {tok!r}")
            dense.append(value)
        ids = []
        for t, tok in enumerate(fields[1 + NUM_DENSE:]):
            if tok and not _HEX_CHARS.issuperset(tok):
                raise DataError(path, number, f"non-hex token: column C{t + 1} is {tok!r}")
            ids.append(int(tok, 16) % int(self.table_sizes[t]) if tok else 0)
        return label, dense, ids

    def _slow(self, lines, *, path, first_line, bad) -> Chunk:
        return _collect(self._row, lines, path=path, first_line=first_line, bad=bad,
                        num_tables=len(self.table_sizes))


class JsonlParser:
    """The original system's format: {"label": float, "dense": [13 floats], "sparse": [ints]}.

    Ids must already lie in [0, table size). With no table sizes given, any id >= 0 is accepted
    and the sizes are inferred afterwards as the largest id + 1.
    """

    def __init__(self, table_sizes: list[int] | None, *, num_tables: int | None = None) -> None:
        self.table_sizes = list(table_sizes) if table_sizes else None
        self.num_tables = len(table_sizes) if table_sizes else num_tables

    def parse(self, lines: list[str], *, path: str, first_line: int, bad: BadRows | None) -> Chunk:
        return _collect(self._row, lines, path=path, first_line=first_line, bad=bad,
                        num_tables=self.num_tables)

    def _row(self, line: str, *, path: str, number: int) -> tuple[float, list[float], list[int]]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(path, number, f"not valid JSON: {err.msg}") from None
        if not isinstance(record, dict) or not {"label", "dense", "sparse"} <= record.keys():
            raise DataError(path, number, "missing field: a row needs 'label', 'dense' and 'sparse'")
        label = _parse_label(record["label"], path=path, number=number)
        dense, sparse = record["dense"], record["sparse"]
        if not isinstance(dense, list) or len(dense) != NUM_DENSE:
            raise DataError(path, number, f"wrong column count: 'dense' must hold {NUM_DENSE} numbers")
        if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not np.isfinite(x) for x in dense):
            raise DataError(path, number, f"non-numeric dense value in {dense!r}")
        if self.num_tables is None:
            self.num_tables = len(sparse) if isinstance(sparse, list) else None
        if not isinstance(sparse, list) or len(sparse) != self.num_tables:
            raise DataError(path, number, f"wrong column count: 'sparse' must hold {self.num_tables} ids")
        for t, value in enumerate(sparse):
            if isinstance(value, bool) or not isinstance(value, int):
                raise DataError(path, number, f"non-integer id: table {t} has {value!r}")
            limit = self.table_sizes[t] if self.table_sizes else _INT64_LIMIT
            if not 0 <= value < limit:
                raise DataError(path, number, f"id out of range: table {t} has {value}, expected [0, {limit})")
        return label, [float(x) for x in dense], sparse


def _parse_label(token, *, path: str, number: int) -> float:
    try:
        label = float(token)
    except (TypeError, ValueError):
        raise DataError(path, number, f"bad label: {token!r} is not 0 or 1") from None
    if label not in (0.0, 1.0):
        raise DataError(path, number, f"bad label: {token!r} is not 0 or 1")
    return label


def _collect(parse_row, lines, *, path, first_line, bad, num_tables) -> Chunk:
    labels, dense, ids = [], [], []
    for offset, line in enumerate(lines):
        try:
            label, row_dense, row_ids = parse_row(line, path=path, number=first_line + offset)
        except DataError as err:
            if bad is None:
                raise
            bad.add(err)
            continue
        labels.append(label)
        dense.append(row_dense)
        ids.append(row_ids)
    return Chunk(
        np.asarray(labels, dtype=np.float32),
        dense_transform(np.asarray(dense, dtype=np.float64).reshape(-1, NUM_DENSE)),
        np.asarray(ids, dtype=np.int64).reshape(-1, len(ids[0]) if ids else (num_tables or 0)),
    )
