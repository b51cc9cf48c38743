"""Criteo TSV and Avazu CSV blocks split into fields and read by numpy under a strict grammar; a block with anything
outside it gives None, for the line-by-line parsers (data.formats) to read or name.

Two ways to split: ``separate`` (numpy alone: every line has the same number of fields, no carriage return) with
readers of fixed-width fields (``zero_one_at``, ``short_decimals``, ``hex8_values``: Criteo as published, each field
read as one little-endian 64-bit word and converted with SWAR arithmetic), and pyarrow's CSV tokenizer
(``split_fields``) with readers of any width, for what the first refuses."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

MAX_HEX_DIGITS = 16  # a uint64; longer values are left to the line parser's Python ints
MAX_DECIMAL_CHARS = 15  # -?[0-9]+ below 10**15: every partial sum of its digits is exact in a float64
MIN_PIECE_BYTES = 1 << 20  # smaller blocks are read in one piece, on the calling thread
_POW10 = 10.0 ** np.arange(MAX_DECIMAL_CHARS)
_BOM = np.frombuffer(b"\xef\xbb\xbf", dtype=np.uint8)  # pyarrow would drop it; the line parsers keep it
_NEWLINE, _CR, _MINUS, _ZERO = 0x0A, 0x0D, 0x2D, 0x30
WORD = 8  # bytes of a field read at once: hex fields of 8 digits, decimal fields of at most 8 digits and a sign
_LOW_BYTES = np.array([(1 << (8 * k)) - 1 for k in range(WORD + 1)], dtype=np.uint64)  # [k]: k low bytes kept


def _repeat(byte: int) -> np.uint64:
    return np.uint64(int.from_bytes(bytes([byte]) * WORD, "little"))


_ZEROS, _SIXES, _HIGH_NIBBLES, _LOW_NIBBLES, _ONES = (_repeat(b) for b in (0x30, 0x06, 0xF0, 0x0F, 0x01))
# Pairs of digits combined in place: each lane of 2k bytes holds (first << k-bytes) | second, first digit lowest.
_HEX_STEPS = ((np.uint64(16 * 2**8 + 1), np.uint64(8), np.uint64(0x00FF00FF00FF00FF)),
              (np.uint64(2**8 * 2**16 + 1), np.uint64(16), np.uint64(0x0000FFFF0000FFFF)),
              (np.uint64(2**16 * 2**32 + 1), np.uint64(32), np.uint64(0xFFFFFFFF)))
_DECIMAL_STEPS = ((np.uint64(10 * 2**8 + 1), np.uint64(8), np.uint64(0x00FF00FF00FF00FF)),
                  (np.uint64(100 * 2**16 + 1), np.uint64(16), np.uint64(0x0000FFFF0000FFFF)),
                  (np.uint64(10_000 * 2**32 + 1), np.uint64(32), np.uint64(0xFFFFFFFF)))
Result = TypeVar("Result")


class Fields(NamedTuple):
    """One column of a block: row i's field is ``chars[offsets[i]:offsets[i + 1]]``."""

    offsets: np.ndarray  # int32 [rows + 1], from 0
    chars: np.ndarray  # uint8, the fields' bytes back to back

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def count_byte(data, byte: int) -> int:
    """How often ``byte`` occurs in ``data`` (numpy counts several times faster than ``bytes.count``)."""
    return int(np.count_nonzero(np.frombuffer(data, dtype=np.uint8) == byte))


def in_pieces(data: bytes | bytearray, read: Callable[[memoryview], Result | None]) -> list[Result] | None:
    """``read`` of each of ``pa.cpu_count()`` pieces of whole lines of ``data``, in threads (pyarrow and numpy let
    go of the GIL), in order; None if any piece gives None."""
    view = memoryview(data)
    num_pieces = max(1, min(pa.cpu_count(), len(data) // MIN_PIECE_BYTES))
    if num_pieces == 1:
        piece = read(view)
        return None if piece is None else [piece]
    ends = [data.find(b"\n", len(data) * k // num_pieces) + 1 for k in range(1, num_pieces)]
    bounds = sorted({0, *(end for end in ends if end > 0), len(data)})
    with ThreadPoolExecutor(max_workers=num_pieces) as pool:
        pieces = list(pool.map(read, [view[start:end] for start, end in zip(bounds, bounds[1:])]))
    return None if any(piece is None for piece in pieces) else pieces


class Separated(NamedTuple):
    """Lines of ``columns`` fields each: field (i, k) is ``chars[starts[i, k]:starts[i, k] + lengths[i, k]]``."""

    chars: np.ndarray  # uint8, the block
    starts: np.ndarray  # int64 [rows, columns]
    lengths: np.ndarray  # int64 [rows, columns]


def separate(data, *, num_columns: int, delimiter: str) -> Separated | None:
    """``data``'s lines split at ``delimiter`` by numpy, if every line ends with a newline and holds exactly
    ``num_columns`` fields, and no line holds a carriage return (``split_fields`` takes those)."""
    chars = np.frombuffer(data, dtype=np.uint8)
    if len(chars) < WORD or chars[-1] != _NEWLINE or _CR in chars:
        return None
    newline = chars == _NEWLINE
    ends = np.flatnonzero(newline | (chars == ord(delimiter)))
    rows = len(ends) // num_columns
    if len(ends) != rows * num_columns:
        return None
    ends = ends.reshape(rows, num_columns)
    # Every line's last field ends at a newline and there are no others: every line has num_columns fields.
    if np.count_nonzero(newline) != rows or not newline[ends[:, -1]].all():
        return None
    starts = np.empty_like(ends)
    starts[0, 0] = 0
    starts[1:, 0] = ends[:-1, -1] + 1
    starts[:, 1:] = ends[:, :-1] + 1
    return Separated(chars, starts, ends - starts)


def _words(chars: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The little-endian uint64 of ``chars[i:i + WORD]`` for each ``i`` in ``at``, zero-padded past the end."""
    last = len(chars) - WORD
    words = np.ndarray(buffer=chars, dtype="<u8", shape=(last + 1,), strides=(1,))  # overlapping, unaligned
    out = words[np.minimum(at, last)]
    over = np.flatnonzero(at > last)
    if len(over):  # fields in the last WORD - 1 bytes: read from a padded copy
        tail = np.zeros(2 * WORD, dtype=np.uint8)
        tail[:WORD] = chars[last:]
        out[over] = np.ndarray(buffer=tail, dtype="<u8", shape=(WORD + 1,), strides=(1,))[at[over] - last]
    return out


def _combine(words: np.ndarray, steps) -> np.ndarray:
    """Digits one a byte (first digit lowest) combined pairwise into one number: SWAR, three multiplies."""
    for multiplier, shift, keep in steps:
        words = (words * multiplier) >> shift
        words &= keep
    return words


def zero_one_at(split: Separated, column: int) -> np.ndarray | None:
    """Labels written ``0`` or ``1``, as float32."""
    if (split.lengths[:, column] != 1).any():
        return None
    digits = split.chars[split.starts[:, column]] - np.uint8(_ZERO)
    return None if (digits > 1).any() else digits.astype(np.float32)


def short_decimals(split: Separated, columns: slice) -> np.ndarray | None:
    """Integers written ``-?[0-9]{1,8}``, as float64 [rows, columns] equal to Python's ``float(field)`` (``-0`` is
    -0.0); an empty field is 0.0. Longer ones are ``decimals``'s."""
    lengths = split.lengths[:, columns]
    if lengths.max(initial=0) > WORD + 1:
        return None
    starts = split.starts[:, columns]
    negative = split.chars[starts] == _MINUS  # a field is followed by its separator: its start is in the block
    digits = lengths - negative
    if digits.max(initial=0) > WORD or (negative.any() and (digits[negative] < 1).any()):
        return None
    words = _words(split.chars, (starts + negative).ravel()).reshape(lengths.shape)
    mask = _LOW_BYTES[digits]
    words &= mask
    zeros = _ZEROS & mask
    # Each byte kept is a digit: its high nibble is 3, and still 3 after adding 6 (0x3A-0x3F carry to 4).
    if (((words & _HIGH_NIBBLES) != zeros) | (((words + (_SIXES & mask)) & _HIGH_NIBBLES) != zeros)).any():
        return None
    words -= zeros
    words <<= (np.uint64(WORD) - digits.astype(np.uint64)) * np.uint64(8)  # right-aligned: leading zero digits
    values = _combine(words, _DECIMAL_STEPS).astype(np.float64)
    return np.negative(values, out=values, where=negative)


def hex8_values(split: Separated, columns: slice) -> np.ndarray | None:
    """Fields of exactly 8 hexadecimal digits, or empty (0), as uint64 [rows, columns]: Criteo's."""
    lengths = split.lengths[:, columns]
    if (lengths & ~np.int64(WORD)).any():  # neither 0 nor 8
        return None
    words = _words(split.chars, split.starts[:, columns].ravel()).reshape(lengths.shape)
    np.copyto(words, _ZEROS, where=lengths == 0)  # an empty field reads as "00000000"
    if not is_hex(words.view(np.uint8)):
        return None
    nibbles = (words & _LOW_NIBBLES) + np.uint64(9) * ((words >> np.uint64(6)) & _ONES)  # letters: 0x4_, 0x6_
    return _combine(nibbles, _HEX_STEPS)


def split_fields(data, *, num_columns: int, delimiter: str) -> list[Fields] | None:
    """Each column of ``data`` (whole lines), if every line holds exactly ``num_columns`` fields and nothing
    that pyarrow splits otherwise than ``line.rstrip("\\r\\n").split(delimiter)``: a byte order mark, a
    carriage return other than in a line's ``\\r\\n``, an empty line. Quotes are plain characters here."""
    chars = np.frombuffer(data, dtype=np.uint8)
    if not len(chars) or np.array_equal(chars[:len(_BOM)], _BOM):
        return None
    if _CR in chars and not _carriage_returns_end_lines(chars):
        return None
    names = [str(column) for column in range(num_columns)]
    try:
        table = pa_csv.read_csv(
            pa.py_buffer(data),
            read_options=pa_csv.ReadOptions(column_names=names, use_threads=False, block_size=len(chars) + 1),
            parse_options=pa_csv.ParseOptions(delimiter=delimiter, quote_char=False, escape_char=False,
                                              double_quote=False, newlines_in_values=False, ignore_empty_lines=False),
            convert_options=pa_csv.ConvertOptions(column_types={name: pa.binary() for name in names},
                                                  strings_can_be_null=False, check_utf8=False))
    except pa.ArrowInvalid:  # a line with another number of fields
        return None
    # pyarrow reads an empty line as a row of empty fields: its line then has too few delimiters.
    if np.count_nonzero(chars == ord(delimiter)) != table.num_rows * (num_columns - 1):
        return None
    return [_fields(table.column(column)) for column in range(num_columns)]


def _carriage_returns_end_lines(chars: np.ndarray) -> bool:
    """Whether every carriage return comes just before a newline: pyarrow drops one there, as ``rstrip("\\r\\n")``
    does, but ends a line at any other (and ``rstrip`` drops more than one)."""
    returns = np.flatnonzero(chars == _CR)
    return bool(returns[-1] + 1 < len(chars) and (chars[returns + 1] == _NEWLINE).all())


def _fields(column: pa.ChunkedArray) -> Fields:
    array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    _, offsets_buffer, chars_buffer = array.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int32, count=len(array) + 1, offset=array.offset * 4)
    if chars_buffer is None:
        return Fields(offsets - offsets[0], np.zeros(0, dtype=np.uint8))
    chars = np.frombuffer(chars_buffer, dtype=np.uint8, count=int(offsets[-1] - offsets[0]), offset=int(offsets[0]))
    return Fields(offsets - offsets[0], chars)


def zero_one(fields: Fields) -> np.ndarray | None:
    """Labels written ``0`` or ``1``, as float32."""
    digits = fields.chars - np.uint8(_ZERO)
    if len(digits) != len(fields.offsets) - 1 or (fields.lengths != 1).any() or (digits > 1).any():
        return None
    return digits.astype(np.float32)


def decimals(fields: Fields) -> np.ndarray | None:
    """Integers written ``-?[0-9]+`` (at most MAX_DECIMAL_CHARS), as float64 equal to Python's ``float(field)``
    (``-0`` is -0.0); an empty field is 0.0."""
    lengths = fields.lengths
    if not len(fields.chars):
        return np.zeros(len(lengths))
    if lengths.max() > MAX_DECIMAL_CHARS:
        return None
    row = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)  # each character's field
    digits = fields.chars - np.uint8(_ZERO)  # a non-digit wraps past 9
    negative = np.zeros(len(lengths), dtype=bool)
    minus = np.flatnonzero(fields.chars == _MINUS)
    if len(minus):
        signed = row[minus]
        if (fields.offsets[signed] != minus).any() or (lengths[signed] < 2).any():  # a sign first, then digits
            return None
        negative[signed], digits[minus] = True, 0
    if (digits > 9).any():
        return None
    places = fields.offsets[1:][row] - 1 - np.arange(len(digits), dtype=np.int32)  # digits after each in its field
    values = np.bincount(row, weights=_POW10[places] * digits, minlength=len(lengths))  # exact: sums < 2**53
    return np.negative(values, out=values, where=negative)


def is_hex(chars: np.ndarray) -> bool:
    """Whether every byte is one of 0-9, a-f, A-F."""
    return bool((((chars - np.uint8(_ZERO)) < 10) | (((chars | np.uint8(0x20)) - np.uint8(ord("a"))) < 6)).all())


def hex_values(fields: Fields) -> np.ndarray | None:
    """Hexadecimal fields (at most MAX_HEX_DIGITS) as uint64; an empty field is 0."""
    lengths = fields.lengths
    longest = int(lengths.max(initial=0))
    if longest > MAX_HEX_DIGITS or not is_hex(fields.chars):
        return None
    present = lengths > 0
    num_present = int(np.count_nonzero(present))
    nibbles = (fields.chars & np.uint8(0x0F)) + np.uint8(9) * (fields.chars >> np.uint8(6))  # letters: 0x4_, 0x6_
    width = 8 if longest <= 8 else 16  # digits of a big-endian uint32 or uint64
    if len(nibbles) == 8 * num_present and width == 8:  # Criteo's: 8 digits, or none
        digits = nibbles.reshape(num_present, 8)
    elif len(nibbles) == longest * num_present:  # the same number of digits in every field that has any
        digits = np.zeros((num_present, width), dtype=np.uint8)
        digits[:, width - longest:] = nibbles.reshape(num_present, longest)
    else:  # right-aligned, each in its row
        ends = fields.offsets[1:][present]
        row = np.repeat(np.arange(num_present), lengths[present])
        digits = np.zeros((num_present, width), dtype=np.uint8)
        digits[row, np.arange(len(nibbles)) - ends[row] + width] = nibbles
    packed = (digits[:, 0::2] << np.uint8(4)) | digits[:, 1::2]
    values = packed.view(">u4" if width == 8 else ">u8").reshape(-1).astype(np.uint64)
    if num_present == len(lengths):
        return values
    every = np.zeros(len(lengths), dtype=np.uint64)
    every[present] = values
    return every


def ascii_strings(fields: Fields) -> np.ndarray | None:
    """The fields as a numpy str array, if every byte is printable ASCII (numpy would drop trailing NULs, and
    its arrays of other text are no faster to build than Python's)."""
    chars = fields.chars
    if ((chars - np.uint8(0x20)) > 0x5E).any():
        return None
    lengths = fields.lengths
    longest = max(int(lengths.max(initial=0)), 1)
    if len(chars) == longest * len(lengths):  # all as long as the longest
        padded = chars.reshape(len(lengths), longest)
    else:  # left-aligned, NUL-padded as numpy pads
        row = np.repeat(np.arange(len(lengths)), lengths)
        padded = np.zeros((len(lengths), longest), dtype=np.uint8)
        padded[row, np.arange(len(chars)) - fields.offsets[row]] = chars
    return padded.view(f"S{longest}").reshape(-1).astype(f"U{longest}")
