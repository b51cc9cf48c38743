"""JSON lines of one-hot rows read a block at a time: orjson parses, numpy checks every value at once; a block with
anything else gives None, for the line parser (data.formats.JsonlParser) to read or name."""

from __future__ import annotations

import numpy as np
import orjson

_NUMBERS = "iuf"  # numpy kinds of arrays built from JSON numbers alone


def one_hot_rows(data: bytes, *, num_dense: int | None, num_tables: int | None,
                 table_sizes: list[int] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Labels (float32), dense values (float64 [n, num_dense], as read) and ids (int64 [n, num_tables]) of
    ``data``'s lines, if each is {"label": 0 or 1, "dense": [numbers], "sparse": [ids]} with the given counts
    (None: the first line's), every id in [0, its table's size) and every dense value finite."""
    # numpy reads true and false as numbers, where the line parser refuses a boolean id and takes a boolean
    # label or dense value as a number: such blocks are left to it.
    if b"true" in data or b"false" in data:
        return None
    lines = data.split(b"\n")
    if not lines[-1]:
        lines.pop()  # after the last newline
    try:
        records = [orjson.loads(line) for line in lines]
        labels = np.array([record["label"] for record in records])
        dense = np.array([record["dense"] for record in records])
        ids = np.array([record["sparse"] for record in records])
    except (orjson.JSONDecodeError, TypeError, KeyError, ValueError):  # not JSON, not a dict, no field, ragged
        return None
    num_rows = len(records)
    if (labels.dtype.kind not in _NUMBERS or labels.shape != (num_rows,) or not ((labels == 0) | (labels == 1)).all()
            or dense.ndim != 2 or (dense.dtype.kind not in _NUMBERS and dense.size)
            or dense.shape[1] != (dense.shape[1] if num_dense is None else num_dense)
            or not np.isfinite(dense.astype(np.float64)).all()
            or ids.dtype != np.int64 or ids.ndim != 2 or ids.shape[1] != (num_tables or ids.shape[1])
            or (ids < 0).any() or (table_sizes is not None and (ids >= np.asarray(table_sizes)).any())):
        return None
    return labels.astype(np.float32), dense.astype(np.float64), ids
