"""Avazu's click logs (Kaggle's CTR contest): a CSV header line, then one ad impression a line.

``click`` is the label, ``id`` a sample id (not a feature); every other column (``hour`` as YYMMDDHH,
the site, app and device columns, C1, C14..C21) is a categorical string: 22 sparse features, no dense.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bagpipe.data import fast_tsv
from bagpipe.data.formats import BadRows, DataError, TextBlock, Tokens, by_runs, columns, parse_label, valid_rows
from bagpipe.data.schema import Feature, Schema

LABEL = "click"
SAMPLE_ID = "id"
COLUMNS = ("id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id",
           "app_domain", "app_category", "device_id", "device_ip", "device_model", "device_type",
           "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21")  # Kaggle's train.csv
_LABELS = {"0": 0.0, "1": 1.0}


def is_avazu_header(line: str) -> bool:
    """A first line that names Avazu's label column."""
    return line.startswith(f"{SAMPLE_ID},{LABEL},") or LABEL in line.rstrip("\r\n").split(",")


class AvazuParser:
    """Rows of comma-separated values (no quoting) under the train split's header, which every split repeats
    on its line 1. The columns besides ``click`` and ``id`` are the features, in the header's order."""

    def __init__(self, headers: dict[str, str]) -> None:
        """``headers``: each split's path and its first line, the train split's first."""
        (train, header), *others = headers.items()
        self.columns = _header_columns(header, path=train)
        for path, other in others:
            if _header_columns(other, path=path) != self.columns:
                raise ValueError(f"{path}:1: its header differs from {train}'s: the splits must have the same "
                                 f"columns in the same order")
        self.label_column = self.columns.index(LABEL)
        self.feature_columns = [i for i, name in enumerate(self.columns) if name not in (LABEL, SAMPLE_ID)]
        if not self.feature_columns:
            raise ValueError(f"{train}:1: no feature columns besides {LABEL!r} and {SAMPLE_ID!r}")
        self.num_tables = len(self.feature_columns)

    @property
    def table_names(self) -> list[str]:
        return [self.columns[i] for i in self.feature_columns]

    def schema(self, sizes: list[int]) -> Schema:
        return Schema(num_dense=0, features=tuple(Feature(name=name, cardinality=int(n))
                                                  for name, n in zip(self.table_names, sizes, strict=True)))

    def tokens(self, block: TextBlock, *, path: str, first_line: int, bad: BadRows | None) -> Tokens:
        """The block's labels and raw values, read whole (data.fast_tsv) if it can be, else line by line."""
        if first_line == 1:  # the header, read already
            block, first_line = block.split(1)[1], 2
        pieces = fast_tsv.in_pieces(block.data, self._tokens_piece) if block.data else None
        if pieces is not None:
            return Tokens.joined(pieces)
        return Tokens.joined(by_runs(self.tokens_lines, block, path=path, first_line=first_line, bad=bad))

    def _tokens_piece(self, data: memoryview) -> Tokens | None:
        fields = fast_tsv.split_fields(data, num_columns=len(self.columns), delimiter=",")
        if fields is None:
            return None
        labels = fast_tsv.zero_one(fields[self.label_column])
        values = [fast_tsv.ascii_strings(fields[i]) for i in self.feature_columns]
        if labels is None or any(column is None for column in values):
            return None
        return Tokens(labels, np.zeros((len(labels), 0), dtype=np.float32), values)

    def tokens_lines(self, lines: list[str], *, path: str, first_line: int, bad: BadRows | None) -> Tokens:
        """Decoded lines, split in Python: the reference for ``tokens``."""
        try:
            labels, rows = self._fast(lines)
        except (ValueError, KeyError):
            valid = valid_rows(self._row, lines, path=path, first_line=first_line, bad=bad)
            labels = np.asarray([label for label, _ in valid], dtype=np.float32)
            rows = [fields for _, fields in valid]
        fields = columns(rows, start=0, count=len(self.columns))
        return Tokens(labels, np.zeros((len(labels), 0), dtype=np.float32), [fields[i] for i in self.feature_columns])

    def _fast(self, lines: list[str]) -> tuple[np.ndarray, list[list[str]]]:
        rows = [line.rstrip("\r\n").split(",") for line in lines]
        if any(len(row) != len(self.columns) for row in rows):
            raise ValueError("column count")
        labels = np.array([_LABELS[row[self.label_column]] for row in rows], dtype=np.float32)
        return labels, rows

    def _row(self, line: str, *, path: str, number: int) -> tuple[float, Sequence[str]]:
        fields = line.rstrip("\r\n").split(",")
        if len(fields) != len(self.columns):
            raise DataError(path, number, f"wrong column count: expected {len(self.columns)} as the header, "
                                          f"got {len(fields)}")
        return parse_label(fields[self.label_column], path=path, number=number), fields


def _header_columns(header: str, *, path: str) -> list[str]:
    names = header.rstrip("\r\n").split(",")
    if LABEL not in names:
        raise ValueError(f"{path}:1: no {LABEL!r} column in the header, so its rows have no labels (as in "
                         f"Kaggle's Avazu test.csv); train and test splits need them. Leave this file out: "
                         f"data without a test split has its last lines held out as one")
    if any(not name.strip() for name in names) or len(set(names)) != len(names):
        raise ValueError(f"{path}:1: the header must name every column once, got {header.rstrip()!r}")
    return names
