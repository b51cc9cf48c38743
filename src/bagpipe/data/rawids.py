"""Raw ids: each categorical value kept as a 63-bit key of its own, with no vocabulary and no table size.

``bagpipe preprocess --raw-ids`` stores, for every categorical field, ``raw_keys(value, table)``: the value (a hex
value of Criteo's, a JSON id, a string's stable 64-bit hash) mixed with its table by a bijection of 63-bit words.
So two values of one table below 2**63 (Criteo's 8-digit hex values, every JSON id) never share a key, keys of
different tables are unrelated, and hot values spread evenly over any split of the key space (a server's shard,
say). Wider values are taken modulo 2**63 by the readers first (a 16-digit hex value v >= 2**63 shares its key with
v - 2**63; a string's 64-bit hash: two strings share a key with probability 2**-63 a pair), and an empty field is
the value 0, as in the other paths. Keys are never negative: -1 stays the padding of multi-valued features.

Tables of raw-id data have no fixed size: ``meta.json`` marks them (``raw_ids``), with ``table_sizes`` the key
space (2**63 rows each). The functions are pure numpy, the same in every process and run.
"""

from __future__ import annotations

import numpy as np

KEY_BITS = 63
KEY_SPACE = 1 << KEY_BITS  # a raw-id table's "size": the keys it may hold
_MASK = np.uint64(KEY_SPACE - 1)
_MULTIPLIERS = (np.uint64(0xBF58476D1CE4E5B9 & (KEY_SPACE - 1)), np.uint64(0x94D049BB133111EB & (KEY_SPACE - 1)))
_GOLDEN = 0x9E3779B97F4A7C15


def mix64(words: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fixed pseudo-random function of uint64 words (synthetic data's planted effects,
    dynamic tables' keyed initial rows)."""
    with np.errstate(over="ignore"):
        z = np.asarray(words).astype(np.uint64) + np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def mix63(words: np.ndarray) -> np.ndarray:
    """A bijection of 63-bit words (uint64 below 2**63 in, the same out): xor-shifts and odd multipliers modulo
    2**63, each invertible, in splitmix64's pattern."""
    x = np.asarray(words, dtype=np.uint64) & _MASK
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = (x * _MULTIPLIERS[0]) & _MASK
        x = x ^ (x >> np.uint64(27))
        x = (x * _MULTIPLIERS[1]) & _MASK
        return x ^ (x >> np.uint64(31))


def table_salt(table: int) -> np.uint64:
    """Table ``table``'s salt: a 63-bit word of its own (xored into its values before they are mixed)."""
    return np.uint64(int(mix63(np.array([(table + 1) * _GOLDEN & (KEY_SPACE - 1)], dtype=np.uint64))[0]))


def raw_keys(values: np.ndarray, table: int) -> np.ndarray:
    """The int64 keys (0 <= key < 2**63) of table ``table``'s ``values`` (any unsigned or non-negative integers,
    up to 64 bits; a value of 2**63 or more is folded into 63 bits first)."""
    words = np.asarray(values)
    if words.dtype.kind == "i":
        if words.size and int(words.min()) < 0:
            raise ValueError(f"raw ids are non-negative integers, got {int(words.min())} (table {table})")
        words = words.astype(np.uint64)
    elif words.dtype.kind != "u":
        raise ValueError(f"raw ids are integers, got an array of {words.dtype} (table {table})")
    words = words.astype(np.uint64, copy=False)
    folded = (words & _MASK) ^ (words >> np.uint64(KEY_BITS)) * np.uint64(_GOLDEN & (KEY_SPACE - 1))
    return mix63(folded ^ table_salt(table)).view(np.int64)


def raw_keys_padded(ids: np.ndarray, table: int) -> np.ndarray:
    """``raw_keys`` of a multi-valued feature's ids, its padding (-1) kept as it is."""
    ids = np.asarray(ids, dtype=np.int64)
    keys = np.full(ids.shape, -1, dtype=np.int64)
    present = ids >= 0
    keys[present] = raw_keys(ids[present], table)
    return keys


def unmix63(words: np.ndarray) -> np.ndarray:
    """``mix63``'s inverse (what a test checks the bijection by)."""
    x = np.asarray(words, dtype=np.uint64) & _MASK
    inverses = [np.uint64(pow(int(m), -1, KEY_SPACE)) for m in _MULTIPLIERS]
    with np.errstate(over="ignore"):
        x = _unshift(x, 31)
        x = (x * inverses[1]) & _MASK
        x = _unshift(x, 27)
        x = (x * inverses[0]) & _MASK
        return _unshift(x, 30)


def _unshift(y: np.ndarray, shift: int) -> np.ndarray:
    """The x with ``x ^ (x >> shift) == y`` (63-bit words)."""
    x = y.copy()
    for _ in range(KEY_BITS // shift + 1):
        x = y ^ (x >> np.uint64(shift))
    return x


class RawIdParser:
    """A text parser whose ids are its base parser's values made keys (``raw_keys``), table by table: the base
    reads values as they are (Criteo's hex modulo 2**63, Avazu's strings hashed, JSON ids), this mixes them.
    Anything else (schema, table names) is the base's."""

    def __init__(self, base) -> None:
        self.base = base

    def parse(self, block, *, path: str, first_line: int, bad):
        from bagpipe.data.formats import Chunk

        # one column a table: multi-valued features (lists) are refused before (preprocess's NeedsWidths)
        chunk = self.base.parse(block, path=path, first_line=first_line, bad=bad)
        keys = np.empty_like(chunk.ids)
        for table in range(chunk.ids.shape[1]):
            keys[:, table] = raw_keys(chunk.ids[:, table], table)
        return Chunk(chunk.labels, chunk.dense, keys)

    def __getattr__(self, name: str):
        return getattr(self.base, name)
