"""Text formats we read: Criteo TSV and the original system's JSON lines (Avazu CSV: data.avazu).

Parsers take a TextBlock (whole lines as read, data.blocks) and turn it into (labels, dense, ids) arrays;
Criteo's also into its raw values (``tokens``), for ids from a vocabulary (data.vocab). A block is read whole
where it can be (data.fast_tsv, data.fast_jsonl); one with anything else goes to the line parsers
(``parse_lines``, the reference those readers are tested against): lines decoded (the whole block at once,
line by line only when it is not UTF-8), parsed, and if anything is off, walked line by line to name the
first bad line (or to skip and count bad lines, when asked).
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bagpipe.data import fast_jsonl, fast_tsv
from bagpipe.data.schema import NEXT_ITEM_FEATURES, PAD, Feature, Schema

NUM_DENSE = 13  # Criteo TSV's dense columns
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
class TextBlock:
    """Whole lines of a file as read, not yet decoded: each but perhaps the last ends with a newline."""

    data: bytes | bytearray
    num_lines: int

    @classmethod
    def of(cls, data: bytes | bytearray) -> "TextBlock":
        return cls(data, fast_tsv.count_byte(data, ord("\n")) + (bool(data) and not data.endswith(b"\n")))

    def __len__(self) -> int:
        return self.num_lines

    def split(self, lines: int) -> tuple["TextBlock", "TextBlock"]:
        """The first ``lines`` lines, and the rest."""
        if lines <= 0 or lines >= self.num_lines:
            return (TextBlock(b"", 0), self) if lines <= 0 else (self, TextBlock(b"", 0))
        end = int(np.flatnonzero(np.frombuffer(self.data, dtype=np.uint8) == ord("\n"))[lines - 1]) + 1
        return TextBlock(self.data[:end], lines), TextBlock(self.data[end:], self.num_lines - lines)

    def lines(self) -> list[bytes]:
        """Each line, with its newline."""
        lines = self.data.split(b"\n")
        last = lines.pop()  # what follows the last newline: nothing, or a last line without one
        return [line + b"\n" for line in lines] + ([last] if last else [])

    def decoded(self, *, path: str, first_line: int, bad: BadRows | None) -> list[tuple[int, list[str]]]:
        """The lines as text, in runs of consecutive lines (decode_lines)."""
        return decode_lines(self.lines(), path=path, first_line=first_line, bad=bad)


def by_runs(parse_lines: Callable, block: TextBlock, *, path: str, first_line: int, bad: BadRows | None) -> list:
    """``parse_lines`` of each run of the block's decoded lines (of no lines, if not one is left)."""
    runs = block.decoded(path=path, first_line=first_line, bad=bad) or [(first_line, [])]
    return [parse_lines(lines, path=path, first_line=first, bad=bad) for first, lines in runs]


@dataclass(frozen=True)
class Chunk:
    labels: np.ndarray  # float32 [n]
    dense: np.ndarray  # float32 [n, num_dense], already transformed
    ids: np.ndarray  # int64 [n, columns]: each sparse feature's columns (data.schema)

    @staticmethod
    def joined(chunks: list["Chunk"]) -> "Chunk":
        """The rows of ``chunks`` in order (those without rows left out: their shapes may be unknown)."""
        chunks = [chunk for chunk in chunks if len(chunk.labels)] or chunks[:1]
        if len(chunks) == 1:
            return chunks[0]
        return Chunk(*(np.concatenate([getattr(chunk, name) for chunk in chunks]) for name in ("labels", "dense", "ids")))


@dataclass(frozen=True)
class Tokens:
    """A chunk's rows before their categorical values have ids."""

    labels: np.ndarray  # float32 [n]
    dense: np.ndarray  # float32 [n, num_dense], already transformed
    columns: list[Sequence[str]]  # per table, the n rows' raw values ("" where a field is empty)

    @staticmethod
    def joined(parts: list["Tokens"]) -> "Tokens":
        """The rows of ``parts`` in order."""
        parts = [part for part in parts if len(part.labels)] or parts[:1]
        if len(parts) == 1:
            return parts[0]
        columns = [np.concatenate(column) if all(isinstance(part, np.ndarray) for part in column)
                   else list(itertools.chain.from_iterable(column)) for column in zip(*(part.columns for part in parts))]
        return Tokens(np.concatenate([part.labels for part in parts]), np.concatenate([part.dense for part in parts]),
                      columns)


class CriteoParser:
    """Criteo TSV: label, 13 integer columns, one hexadecimal column per table; empty -> 0.

    ``parse`` takes each hex value modulo its table's size; ``tokens`` (with only ``num_tables``
    given) leaves the values as they are, for a vocabulary to number.
    """

    def __init__(self, table_sizes: list[int] | None = None, *, num_tables: int | None = None) -> None:
        self.table_sizes = np.asarray(table_sizes or [], dtype=np.uint64)  # (raw ids: 2**63, beyond int64)
        self.num_tables = len(table_sizes) if table_sizes else num_tables
        assert self.num_tables, "table sizes or a number of tables"
        self.num_columns = 1 + NUM_DENSE + self.num_tables
        self.fixed_widths = True  # try fast_tsv's fixed-width readers first, until a block is not read by them

    @property
    def table_names(self) -> list[str]:
        return [f"C{t + 1}" for t in range(self.num_tables)]

    def schema(self, sizes: list[int]) -> Schema:
        return Schema.one_hot(sizes, num_dense=NUM_DENSE)

    def parse(self, block: TextBlock, *, path: str, first_line: int, bad: BadRows | None) -> Chunk:
        """The block's rows, read whole (data.fast_tsv) if it can be, else line by line (``parse_lines``)."""
        pieces = fast_tsv.in_pieces(block.data, self._parse_piece)
        if pieces is not None:
            return Chunk.joined(pieces)
        return Chunk.joined(by_runs(self.parse_lines, block, path=path, first_line=first_line, bad=bad))

    def tokens(self, block: TextBlock, *, path: str, first_line: int, bad: BadRows | None) -> Tokens:
        """``parse`` without ids: each table's raw values."""
        pieces = fast_tsv.in_pieces(block.data, self._tokens_piece)
        if pieces is not None:
            return Tokens.joined(pieces)
        return Tokens.joined(by_runs(self.tokens_lines, block, path=path, first_line=first_line, bad=bad))

    def _parse_piece(self, data: memoryview) -> Chunk | None:
        fixed = self._fixed_width_piece(data) if self.fixed_widths else None
        if fixed is not None:
            return fixed
        self.fixed_widths = False  # the data is not Criteo as published: the general reader from here on
        fields = self._piece_fields(data)
        if fields is None:
            return None
        labels, dense, categorical = fields
        ids = np.empty((len(labels), self.num_tables), dtype=np.int64)
        for table, (column, size) in enumerate(zip(categorical, self.table_sizes.astype(np.uint64))):
            hashes = fast_tsv.hex_values(column)
            if hashes is None:
                return None
            np.remainder(hashes, size, out=ids.view(np.uint64)[:, table])
        return Chunk(labels, dense, ids)

    def _fixed_width_piece(self, data: memoryview) -> Chunk | None:
        """``data`` read by numpy alone, if its fields are Criteo's as published: a label 0 or 1, decimals of at
        most 8 digits, hex values of 8 digits or empty."""
        split = fast_tsv.separate(data, num_columns=self.num_columns, delimiter="\t")
        if split is None:
            return None
        labels = fast_tsv.zero_one_at(split, 0)
        hashes = None if labels is None else fast_tsv.hex8_values(split, slice(1 + NUM_DENSE, None))
        dense = None if hashes is None else fast_tsv.short_decimals(split, slice(1, 1 + NUM_DENSE))
        if dense is None:
            return None
        for table, size in enumerate(self.table_sizes.astype(np.uint64)):  # a scalar divisor is several times faster
            np.remainder(hashes[:, table], size, out=hashes[:, table])
        return Chunk(labels, dense_transform(dense), hashes.view(np.int64))

    def _tokens_piece(self, data: memoryview) -> Tokens | None:
        fields = self._piece_fields(data)
        if fields is None or not all(fast_tsv.is_hex(column.chars) for column in fields[2]):
            return None
        labels, dense, categorical = fields
        return Tokens(labels, dense, [fast_tsv.ascii_strings(column) for column in categorical])

    def _piece_fields(self, data: memoryview) -> tuple[np.ndarray, np.ndarray, list[fast_tsv.Fields]] | None:
        """Labels, transformed dense values and the categorical columns' fields, if ``data`` is plain Criteo."""
        fields = fast_tsv.split_fields(data, num_columns=self.num_columns, delimiter="\t")
        if fields is None:
            return None
        labels = fast_tsv.zero_one(fields[0])
        dense = [fast_tsv.decimals(column) for column in fields[1:1 + NUM_DENSE]]
        if labels is None or any(values is None for values in dense):
            return None
        return labels, dense_transform(np.stack(dense, axis=1)), fields[1 + NUM_DENSE:]

    def tokens_lines(self, lines: list[str], *, path: str, first_line: int, bad: BadRows | None) -> Tokens:
        try:
            labels, dense, rows = self._fast_fields(lines)
            return Tokens(labels, dense, columns(rows, start=1 + NUM_DENSE, count=self.num_tables))
        except (ValueError, IndexError, OverflowError):
            valid = valid_rows(self._fields, lines, path=path, first_line=first_line, bad=bad)
            labels = np.asarray([row[0] for row in valid], dtype=np.float32)
            dense = dense_transform(np.asarray([row[1] for row in valid], dtype=np.float64).reshape(-1, NUM_DENSE))
            return Tokens(labels, dense, columns([row[2] for row in valid], start=0, count=self.num_tables))

    def parse_lines(self, lines: list[str], *, path: str, first_line: int, bad: BadRows | None) -> Chunk:
        """Decoded lines, parsed in Python: the reference for ``parse``."""
        try:
            return self._fast(lines)
        except (ValueError, IndexError, OverflowError):
            return self._slow(lines, path=path, first_line=first_line, bad=bad)

    def _fast(self, lines: list[str]) -> Chunk:
        labels, dense, rows = self._fast_fields(lines)
        hashes = np.array([int(tok, 16) if tok else 0 for row in rows for tok in row[1 + NUM_DENSE:]],
                          dtype=np.uint64)
        ids = (hashes.reshape(len(rows), -1) % self.table_sizes.astype(np.uint64)).astype(np.int64)
        return Chunk(labels, dense, ids)

    def _fast_fields(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray, list[list[str]]]:
        """Labels, transformed dense values and each line's fields, if every line is valid (else a ValueError)."""
        rows = [line.rstrip("\r\n").split("\t") for line in lines]
        if any(len(row) != self.num_columns for row in rows):
            raise ValueError("column count")
        if not _HEX_CHARS.issuperset("".join("".join(row[1 + NUM_DENSE:]) for row in rows)):
            raise ValueError("non-hex")
        labels = np.array([float(row[0]) for row in rows], dtype=np.float32)
        if ((labels != 0) & (labels != 1)).any():
            raise ValueError("label")
        dense = np.array([[float(x) if x else 0.0 for x in row[1:1 + NUM_DENSE]] for row in rows],
                         dtype=np.float64).reshape(len(rows), NUM_DENSE)
        if not np.isfinite(dense).all():
            raise ValueError("dense")
        return labels, dense_transform(dense), rows

    def _row(self, line: str, *, path: str, number: int) -> tuple[float, list[float], list[int]]:
        label, dense, tokens = self._fields(line, path=path, number=number)
        return label, dense, [int(tok, 16) % int(size) if tok else 0 for tok, size in zip(tokens, self.table_sizes)]

    def _fields(self, line: str, *, path: str, number: int) -> tuple[float, list[float], list[str]]:
        """(label, dense values, raw hex values) of a valid line, else a DataError."""
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) != self.num_columns:
            raise DataError(path, number, f"wrong column count: expected {self.num_columns}, got {len(fields)}")
        label = parse_label(fields[0], path=path, number=number)
        dense = []
        for j, tok in enumerate(fields[1:1 + NUM_DENSE]):
            try:
                value = float(tok) if tok else 0.0
            except ValueError:
                raise DataError(path, number, f"non-numeric dense value: column I{j + 1} is {tok!r}") from None
            if not np.isfinite(value):
                raise DataError(path, number, f"non-numeric dense value: column I{j + 1} is {tok!r}")
            dense.append(value)
        tokens = fields[1 + NUM_DENSE:]
        for t, tok in enumerate(tokens):
            if tok and not _HEX_CHARS.issuperset(tok):
                raise DataError(path, number, f"non-hex token: column C{t + 1} is {tok!r}")
        return label, dense, tokens

    def _slow(self, lines, *, path, first_line, bad) -> Chunk:
        return _collect(self._row, lines, path=path, first_line=first_line, bad=bad, num_tables=self.num_tables)


def columns(rows: list[list[str]], *, start: int, count: int) -> list[Sequence[str]]:
    """Fields ``start`` to ``start + count`` of each row, one sequence a column (empty ones for no rows)."""
    return list(zip(*rows))[start:start + count] or [()] * count


class NeedsWidths(Exception):
    """Raised by a JsonlParser without a shape at its first multi-valued or next-item row: the caller
    measures the input first (``JsonlParser.measure``) and converts again with the shape it learned."""


@dataclass(frozen=True)
class JsonlShape:
    """What a first pass over JSON lines learns before anything is written: the layout, the dense count,
    and each sparse feature's width (next-item samples: user, history, targets, negatives)."""

    next_item: bool
    num_dense: int
    widths: tuple[int, ...]


class JsonlParser:
    """The original system's format, one JSON object a line: {"label": 0 or 1, "dense": [floats], "sparse": [ids]}.

    Every row has as many dense values as the first valid one (none is allowed). A ``sparse`` entry is an
    id or a list of ids (a multi-valued feature, padded with PAD to its longest list in the input). A row
    whose label is a list is the original's CASER layout, a next-item sample (data.sequences):
    {"label": [target items], "dense": [negative items], "sparse": [user, [history items]]}.

    Ids must already lie in [0, table size); the sizes of next-item samples are [users, items]. With no
    sizes given any id >= 0 is accepted and the sizes are inferred afterwards as the largest id + 1.

    Padding needs the widths before a row is written: without ``shape`` every feature is taken as one-hot
    and the first row that is not raises NeedsWidths; ``measure`` (a first pass) learns the shape.
    """

    def __init__(self, table_sizes: list[int] | None, *, num_tables: int | None = None,
                 shape: JsonlShape | None = None) -> None:
        self.table_sizes = list(table_sizes) if table_sizes else None
        self.num_tables = len(table_sizes) if table_sizes else num_tables
        self.shape = shape
        self.measuring = False
        # Learned from the first valid row, unless the shape says.
        self.next_item: bool | None = shape.next_item if shape else None
        self.num_dense: int | None = shape.num_dense if shape else None
        if shape is not None:
            self.num_tables = 2 if shape.next_item else len(shape.widths)
        self.longest: list[int] | None = None  # while measuring: each feature's longest entry
        self.has_empty: list[bool] | None = None  # and whether any entry of it is empty

    def parse(self, block: TextBlock, *, path: str, first_line: int, bad: BadRows | None) -> Chunk:
        """The block's rows, read whole (data.fast_jsonl) if they are plain one-hot rows, else line by line."""
        if self.shape is None and not self.next_item:
            rows = fast_jsonl.one_hot_rows(block.data, num_dense=self.num_dense, num_tables=self.num_tables,
                                           table_sizes=self.table_sizes)
            if rows is not None:
                labels, dense, ids = rows
                self.next_item, self.num_dense, self.num_tables = False, dense.shape[1], ids.shape[1]
                return Chunk(labels, dense_transform(dense), ids)
        return Chunk.joined(by_runs(self.parse_lines, block, path=path, first_line=first_line, bad=bad))

    def measure(self, block: TextBlock, *, path: str, first_line: int, bad: BadRows | None) -> None:
        """The first pass: check the block's lines as ``parse`` does, noting each feature's longest entry."""
        by_runs(self.measure_lines, block, path=path, first_line=first_line, bad=bad)

    def parse_lines(self, lines: list[str], *, path: str, first_line: int, bad: BadRows | None) -> Chunk:
        rows = valid_rows(self._row, lines, path=path, first_line=first_line, bad=bad)
        dense = np.asarray([row[1] for row in rows], dtype=np.float64).reshape(len(rows), self.num_dense or 0)
        return Chunk(np.asarray([row[0] for row in rows], dtype=np.float32), dense_transform(dense),
                     self._id_matrix([row[2] for row in rows]))

    def measure_lines(self, lines: list[str], *, path: str, first_line: int, bad: BadRows | None) -> None:
        self.measuring = True
        valid_rows(self._row, lines, path=path, first_line=first_line, bad=bad)

    def learned_shape(self) -> JsonlShape | None:
        """The shape the rows measured so far have; None before the first valid row."""
        if self.next_item is None:
            return None
        # A feature that is sometimes empty needs a place for PAD: one column is a one-hot feature's.
        widths = [max(longest, 2 if empty else 1) for longest, empty in zip(self.longest, self.has_empty)]
        return JsonlShape(next_item=self.next_item, num_dense=self.num_dense, widths=tuple(widths))

    def schema(self, sizes: list[int]) -> Schema:
        """The converted rows' schema, given each table's size (next-item samples: users and items)."""
        if self.shape is None:
            return Schema.one_hot(sizes, num_dense=self.num_dense or 0)
        if self.shape.next_item:
            users, items = sizes
            return Schema(num_dense=0, features=tuple(
                Feature(name=name, cardinality=users if name == "user" else items, width=width)
                for name, width in zip(NEXT_ITEM_FEATURES, self.shape.widths, strict=True)))
        return Schema(num_dense=self.shape.num_dense, features=tuple(
            Feature(name=f"C{i + 1}", cardinality=int(n), width=width)
            for i, (n, width) in enumerate(zip(sizes, self.shape.widths, strict=True))))

    def table_starts(self) -> list[int]:
        """The first column of each table's features in the id matrix (next-item: the user's, the items')."""
        if self.shape is None:
            return list(range(self.num_tables or 0))
        if self.shape.next_item:
            return [0, 1]
        return np.cumsum([0, *self.shape.widths[:-1]]).tolist()

    def table_names(self) -> list[str]:
        """How an error names each table."""
        if self.next_item:
            return ["the users (index 0 in 'sparse')", "the items ('label', 'dense' and index 1 in 'sparse')"]
        return [f"table {t} (index {t} in 'sparse')" for t in range(self.num_tables or 0)]

    def _row(self, line: str, *, path: str, number: int) -> tuple[float, list[float], list]:
        """(label, dense values, each feature's id or list of ids) of a valid row, else a DataError."""
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(path, number, f"not valid JSON: {err.msg}") from None
        if not isinstance(record, dict) or not {"label", "dense", "sparse"} <= record.keys():
            raise DataError(path, number, "missing field: a row needs 'label', 'dense' and 'sparse'")
        next_item = isinstance(record["label"], list) if self.next_item is None else self.next_item
        if next_item:
            row = self._next_item_row(record, path=path, number=number)
        else:
            row = self._feature_row(record, path=path, number=number)
        self._fit(row[2], next_item=next_item, path=path, number=number)
        if self.next_item is None:  # the first valid row sets the layout and the counts for the rest
            self.next_item, self.num_dense = next_item, len(row[1])
            self.num_tables = 2 if next_item else len(row[2])
        return row

    def _feature_row(self, record: dict, *, path: str, number: int) -> tuple[float, list[float], list]:
        label = parse_label(record["label"], path=path, number=number)
        dense, sparse = record["dense"], record["sparse"]
        if not isinstance(dense, list):
            raise DataError(path, number, f"wrong column count: 'dense' must be a list of numbers, got {dense!r}")
        if self.num_dense is not None and len(dense) != self.num_dense:
            raise DataError(path, number, f"wrong column count: 'dense' holds {len(dense)} values, not "
                                          f"{self.num_dense} as the first valid row")
        if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not _finite(x) for x in dense):
            raise DataError(path, number, f"non-numeric dense value in {dense!r}")
        if not isinstance(sparse, list) or (self.num_tables is not None and len(sparse) != self.num_tables):
            expected = "a list of ids" if self.num_tables is None else f"{self.num_tables} ids"
            raise DataError(path, number, f"wrong column count: 'sparse' must hold {expected}")
        for t, value in enumerate(sparse):
            limit = self.table_sizes[t] if self.table_sizes else _INT64_LIMIT
            for item in value if isinstance(value, list) else [value]:
                _check_id(item, limit, what=f"table {t}", path=path, number=number)
        return label, [float(x) for x in dense], sparse

    def _next_item_row(self, record: dict, *, path: str, number: int) -> tuple[float, list[float], list]:
        targets, negatives, sparse = record["label"], record["dense"], record["sparse"]
        if not isinstance(targets, list) or not targets:
            raise DataError(path, number, f"bad label: {targets!r} is not a list of target items, as a next-item "
                                          f"sample's (the rows before are such samples)")
        if not isinstance(negatives, list):
            raise DataError(path, number, f"wrong column count: a next-item sample's 'dense' is a list of negative "
                                          f"items, got {negatives!r}")
        if not isinstance(sparse, list) or len(sparse) != 2:
            raise DataError(path, number, "wrong column count: a next-item sample's 'sparse' is "
                                          "[user, [history items]]")
        if self.table_sizes is not None and len(self.table_sizes) != 2:
            raise ValueError(f"{path}:{number}: next-item samples (a list in 'label') take two table sizes, the users' "
                             f"and the items', got {self.table_sizes}")
        users, items = self.table_sizes or (_INT64_LIMIT, _INT64_LIMIT)
        user, history = sparse
        history = history if isinstance(history, list) else [history]
        _check_id(user, users, what="the user", path=path, number=number)
        for item in history:
            _check_id(item, items, what="a history item", path=path, number=number)
        # The original reads 'label' and 'dense' as floats: 12.0 is item 12.
        targets = [_check_id(_integral(x), items, what="a target item", path=path, number=number) for x in targets]
        negatives = [_check_id(_integral(x), items, what="a negative item", path=path, number=number)
                     for x in negatives]
        return 1.0, [], [user, history, targets, negatives]

    def _fit(self, entries: list, *, next_item: bool, path: str, number: int) -> None:
        """Note the entries' widths while measuring; else check that they fit the columns there are."""
        widths = [len(e) if isinstance(e, list) else 1 for e in entries]
        if self.measuring:
            empty = [isinstance(e, list) and not e for e in entries]
            self.longest = widths if self.longest is None else [max(a, b) for a, b in zip(self.longest, widths)]
            self.has_empty = empty if self.has_empty is None else [a or b for a, b in zip(self.has_empty, empty)]
        elif self.shape is None:
            if next_item or any(isinstance(e, list) for e in entries):
                raise NeedsWidths(f"{path}:{number}")
        elif any(w > limit for w, limit in zip(widths, self.shape.widths)):
            raise DataError(path, number, f"wrong column count: lists of {widths} ids, longer than the "
                                          f"{list(self.shape.widths)} the first pass found (did the file change "
                                          f"while it was read?)")

    def _id_matrix(self, rows: list[list]) -> np.ndarray:
        """Each row's ids in its features' columns: a list left-aligned, a history right-aligned (as
        data.sequences pads it), PAD in the places left."""
        if self.shape is None:
            return np.asarray(rows, dtype=np.int64).reshape(len(rows), self.num_tables or 0)
        widths = self.shape.widths
        starts = np.cumsum([0, *widths[:-1]]).tolist()
        pad_left = [self.shape.next_item and f == 1 for f in range(len(widths))]
        ids = np.full((len(rows), sum(widths)), PAD, dtype=np.int64)
        for r, row in enumerate(rows):
            for f, value in enumerate(row):
                values = value if isinstance(value, list) else [value]
                start = starts[f] + widths[f] - len(values) if pad_left[f] else starts[f]
                ids[r, start:start + len(values)] = values
        return ids


def _finite(number: int | float) -> bool:
    """Whether ``float(number)`` is a finite float (an int past the float range is not)."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def _integral(value):
    """An integral float as the int it stands for; anything else as it is (and refused as an id)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _check_id(value, limit: int, *, what: str, path: str, number: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DataError(path, number, f"non-integer id: {what} has {value!r}")
    if not 0 <= value < limit:
        raise DataError(path, number, f"id out of range: {what} has {value}, expected [0, {limit})")
    return value


def parse_label(token, *, path: str, number: int) -> float:
    try:
        label = float(token)
    except (TypeError, ValueError):
        raise DataError(path, number, f"bad label: {token!r} is not 0 or 1") from None
    if label not in (0.0, 1.0):
        raise DataError(path, number, f"bad label: {token!r} is not 0 or 1")
    return label


def valid_rows(parse_row, lines, *, path, first_line, bad) -> list:
    """Each line parsed; a bad one raises its DataError, or under ``bad`` is counted and left out."""
    rows = []
    for offset, line in enumerate(lines):
        try:
            rows.append(parse_row(line, path=path, number=first_line + offset))
        except DataError as err:
            if bad is None:
                raise
            bad.add(err)
    return rows


def _collect(parse_row, lines, *, path, first_line, bad, num_tables) -> Chunk:
    rows = valid_rows(parse_row, lines, path=path, first_line=first_line, bad=bad)
    return Chunk(
        np.asarray([row[0] for row in rows], dtype=np.float32),
        dense_transform(np.asarray([row[1] for row in rows], dtype=np.float64).reshape(-1, NUM_DENSE)),
        np.asarray([row[2] for row in rows], dtype=np.int64).reshape(len(rows), num_tables),
    )
