"""Ids for raw categorical values (Avazu's strings, Criteo's hex): a per-table vocabulary counted over the
train split, numbered by descending frequency; or a stable hash of each value modulo a fixed table size.

Vocabulary ids: 1, 2, ... from the most frequent value down (ties by the value, in code point order, the
order of its UTF-8 bytes); ``OOV_ID`` (0) is shared by values seen fewer than the min count times, values
the train split never shows, and empty fields (missing values, as Criteo's empty -> 0 when hashed). A
table's size is its vocabulary's + 1. Every step works on whole columns of a chunk in numpy.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from bagpipe.data.formats import BadRows, Chunk, TextBlock, Tokens

OOV_ID = 0
VOCAB_DIR = "vocab"  # beside the converted splits: one <column>.tsv a table
_MERGE_AT = 1 << 20  # distinct values gathered from chunks before they are merged into the counts
_ESCAPES = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}
_TRANSLATION = str.maketrans(_ESCAPES)


def check_vocab_min_count(min_count: int) -> None:
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 0:
        raise ValueError(f"--vocab-min-count must be an integer >= 0 (0: no vocabulary), got {min_count!r}")


def _strings(column: Sequence[str]) -> np.ndarray:
    """A column as a numpy string array (as the fast readers give it already); its width found first, which
    halves numpy's time."""
    if isinstance(column, np.ndarray) and column.dtype.kind == "U":
        return column
    return np.array(column, dtype=f"U{max(map(len, column), default=0) or 1}")


class ValueCounts:
    """How often each value of one column occurs, gathered chunk by chunk (distinct values only)."""

    def __init__(self) -> None:
        self.values = np.zeros(0, dtype=str)  # sorted, distinct
        self.counts = np.zeros(0, dtype=np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_size = 0

    def add(self, column: Sequence[str]) -> None:
        values, counts = np.unique(_strings(column), return_counts=True)
        present = values != ""  # an empty field is a missing value, never a key
        self._pending.append((values[present], counts[present]))
        self._pending_size += int(present.sum())
        # Merging re-sorts everything seen so far: only once the chunks' values outnumber it.
        if self._pending_size >= max(len(self.values), _MERGE_AT):
            self._merge()

    def merged(self) -> tuple[np.ndarray, np.ndarray]:
        self._merge()
        return self.values, self.counts

    def _merge(self) -> None:
        if not self._pending:
            return
        values = np.concatenate([self.values, *(v for v, _ in self._pending)])
        counts = np.concatenate([self.counts, *(c for _, c in self._pending)])
        self.values, inverse = np.unique(values, return_inverse=True)
        self.counts = np.bincount(inverse, weights=counts, minlength=len(self.values)).astype(np.int64)
        self._pending, self._pending_size = [], 0


class Vocabulary:
    """One table's values in id order (id i + 1 is ``values[i]``) with their counts in the train split."""

    def __init__(self, name: str, values: np.ndarray, counts: np.ndarray) -> None:
        self.name, self.values, self.counts = name, values, counts
        by_value = np.argsort(values, kind="stable")
        self._sorted, self._sorted_ids = values[by_value], by_value + 1

    @classmethod
    def from_counts(cls, name: str, counts: ValueCounts, *, min_count: int) -> "Vocabulary":
        values, value_counts = counts.merged()
        kept = value_counts >= min_count
        values, value_counts = values[kept], value_counts[kept]
        order = np.argsort(-value_counts, kind="stable")  # values are sorted: ties stay in value order
        return cls(name, values[order], value_counts[order])

    @property
    def size(self) -> int:
        return len(self.values) + 1

    def encode(self, column: Sequence[str]) -> np.ndarray:
        """Each value's id; OOV_ID for a value not in the vocabulary (or empty)."""
        column = _strings(column)
        if not len(self._sorted):
            return np.full(len(column), OOV_ID, dtype=np.int64)
        at = np.searchsorted(self._sorted, column).clip(max=len(self._sorted) - 1)
        return np.where(self._sorted[at] == column, self._sorted_ids[at], OOV_ID).astype(np.int64)

    def write(self, path: Path) -> None:
        """Line i holds id i's value and count, tab-separated (id 0, OOV, has no line); a backslash, tab
        or line break in a value is written as ``\\\\``, ``\\t``, ``\\n``, ``\\r``."""
        values = self.values.tolist()
        if any(np.char.find(self.values, char).max(initial=-1) >= 0 for char in _ESCAPES):  # rare: escape
            values = [value.translate(_TRANSLATION) for value in values]
        with open(path, "w", encoding="utf-8") as handle:
            handle.writelines(f"{value}\t{count}\n" for value, count in zip(values, self.counts.tolist()))


def write_vocabularies(directory: Path, vocabularies: list[Vocabulary]) -> list[str]:
    """Each table's vocabulary as ``directory/<column>.tsv`` (Vocabulary.write); the files' names."""
    directory.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    for table, vocabulary in enumerate(vocabularies):
        name = _file_name(vocabulary.name)
        name = f"{name}-{table}" if name in names else name  # names that differ only in odd characters
        vocabulary.write(directory / f"{name}.tsv")
        names.append(name)
    return [f"{name}.tsv" for name in names]


class HashedColumn:
    """Ids as a stable hash of each value (BLAKE2b, 8 bytes) modulo ``size``; an empty field is id 0."""

    def __init__(self, size: int) -> None:
        self.size = size

    def encode(self, column: Sequence[str]) -> np.ndarray:
        values, inverse = np.unique(_strings(column), return_inverse=True)
        ids = np.fromiter((stable_hash(v) % self.size for v in values.tolist()), dtype=np.int64, count=len(values))
        ids[values == ""] = 0
        return ids[inverse.reshape(-1)]


def stable_hash(value: str) -> int:
    """The same number for the same value in every process and run (unlike Python's salted ``hash``)."""
    return int.from_bytes(hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest(), "little")


class EncodedParser:
    """A parser of raw values (``tokens``: Avazu's, or Criteo's) whose values get ids from one encoder a
    table (a Vocabulary or a HashedColumn)."""

    def __init__(self, base, encoders: list) -> None:
        assert len(encoders) == base.num_tables
        self.base, self.encoders = base, encoders

    def parse(self, block: TextBlock, *, path: str, first_line: int, bad: BadRows | None) -> Chunk:
        tokens = self.base.tokens(block, path=path, first_line=first_line, bad=bad)
        ids = np.empty((len(tokens.labels), len(self.encoders)), dtype=np.int64)
        for table, (column, encoder) in enumerate(zip(tokens.columns, self.encoders)):
            ids[:, table] = encoder.encode(column)
        return Chunk(tokens.labels, tokens.dense, ids)

    def schema(self, sizes: list[int]):
        return self.base.schema(sizes)


def count_values(base, blocks: Iterable[tuple[str, int, TextBlock]], *, bad: BadRows | None) -> list[ValueCounts]:
    """Each table's value counts over ``blocks`` ((path, first line, block) of the train split only)."""
    counts = [ValueCounts() for _ in range(base.num_tables)]
    for path, first_line, block in blocks:
        tokens: Tokens = base.tokens(block, path=path, first_line=first_line, bad=bad)
        for table, column in zip(counts, tokens.columns):
            table.add(column)
    return counts


def _file_name(name: str) -> str:
    """A column's name as a file name: characters other than letters, digits, ``.``, ``_`` and ``-`` as ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "_"
