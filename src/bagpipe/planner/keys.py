"""Sparse keys in vectorised hash tables: state sized by the rows a job touches, never by its tables.

A key space may be far larger than memory (26 tables of 40M rows; ids hashed into 2^40), while the rows a run
touches are what its batches bring. ``KeyTable`` maps at most a given number of keys to values (linear probing in
numpy arrays of twice its capacity, every operation vectorised over its keys); ``KeyIndex`` numbers keys densely in
the order first seen (0, 1, 2, ...) and grows with them, so that per-row state can live in arrays over those
numbers (``grown``): memory proportional to the distinct rows seen.
"""

from __future__ import annotations

import math

import numpy as np

_EMPTY, _GONE = -1, -2  # a hash table position never used, and one whose key was removed
_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)
# A lookup probes one place a key a round while many keys are left, then _SPAN places a key at once: linear probing's
# tail (a few keys each in 20-50 rounds at a table half full, each round's numpy calls costing what a thousand keys'
# probes cost) takes a round or two.
_SPAN, _SPAN_BELOW = 32, 4096
_SPAN_OFFSETS = np.arange(_SPAN, dtype=np.int64)


class KeyTable:
    """key -> value for at most ``capacity`` keys: linear probing, every operation vectorised over its keys.

    ``value_bits`` > 0 packs each key and its value into one int64 (key << value_bits | value), for non-negative keys
    below 2^(63 - value_bits) and values below 2^value_bits: a look-up then reads one random place of memory, not
    two (the keys' array and the values'), and the table takes half the memory. 0: keys and values in arrays of
    their own (any non-negative int64 key, any int64 value)."""

    def __init__(self, capacity: int, *, value_bits: int = 0) -> None:
        if not 0 <= value_bits < 63:
            raise ValueError(f"value_bits must be in [0, 63), got {value_bits}")
        self.bits = max(4, math.ceil(math.log2(2 * capacity)))
        self.mask = (1 << self.bits) - 1
        self.value_bits = value_bits
        self.value_mask = (1 << value_bits) - 1
        self.keys = np.full(1 << self.bits, _EMPTY, dtype=np.int64)  # keys, or packed entries
        self.values = np.zeros(0 if value_bits else 1 << self.bits, dtype=np.int64)
        self.live = self.gone = 0

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys.astype(np.uint64) * _FIBONACCI) >> np.uint64(64 - self.bits)).astype(np.int64)

    def _entries(self, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """What the key array holds for these keys and values: the keys, or packed entries."""
        if not self.value_bits:
            return keys
        if len(values) and (values.min() < 0 or values.max() > self.value_mask
                            or keys.max() >> (63 - self.value_bits)):
            raise ValueError(f"a table packing {self.value_bits}-bit values holds keys below 2^{63 - self.value_bits} "
                             f"and values in [0, 2^{self.value_bits}), got keys up to {keys.max()} and values in "
                             f"[{values.min()}, {values.max()}]")
        return (keys << self.value_bits) | values

    def find(self, keys: np.ndarray, ends: np.ndarray | None = None, values: np.ndarray | None = None
             ) -> np.ndarray:
        """The table position of each key, -1 where it is absent; ``ends``, if given, gets the position where each
        absent key's probe ended (a never-used place: where inserting it may start, ``insert(..., start=ends)``);
        ``values``, if given, gets each present key's value (from the place the probe read, where packed)."""
        # the first round, every key at its home: selects and masked copies over all keys (no compress by a
        # random mask, which costs several times a take); later rounds follow the keys still probing
        at = self._home(keys)
        held = self.keys[at]
        hit = (held >> self.value_bits if self.value_bits else held) == keys  # (a free place's entry is negative)
        found = np.where(hit, at, -1)
        if values is not None:
            if self.value_bits:
                np.copyto(values, held & self.value_mask, where=hit)
            else:
                values[hit] = self.values[at[hit]]
        empty = held == _EMPTY  # (never a hit)
        if ends is not None:
            np.copyto(ends, at, where=empty)
        todo = np.flatnonzero(~(hit | empty))
        at = (at[todo] + 1) & self.mask
        while len(todo):
            if len(todo) <= _SPAN_BELOW:  # the probes' tail: a span of places a key at once, in one or two rounds
                todo, at = self._find_spans(keys, todo, at, found, ends, values)
                continue
            held = self.keys[at]
            # (a free or removed place holds a negative entry: shifted, still negative)
            hit = (held >> self.value_bits if self.value_bits else held) == keys[todo]
            hits = todo[hit]
            found[hits] = at[hit]
            if values is not None:
                values[hits] = held[hit] & self.value_mask if self.value_bits else self.values[at[hit]]
            on = ~hit & (held != _EMPTY)  # a removed key's place does not end the probe
            if ends is not None:
                ended = ~hit & ~on
                ends[todo[ended]] = at[ended]
            todo, at = todo[on], (at[on] + 1) & self.mask
        return found

    def _find_spans(self, keys, todo, at, found, ends, values) -> tuple[np.ndarray, np.ndarray]:
        """``find``'s probes of keys ``todo`` from places ``at``, _SPAN places each at once (a row of consecutive
        places read per key): each key's probe ends at the first place holding it or never used; the keys whose
        span holds neither go on from the span's end."""
        places = (at[:, None] + _SPAN_OFFSETS) & self.mask
        held = self.keys[places]
        hit = (held >> self.value_bits if self.value_bits else held) == keys[todo][:, None]
        stop = hit | (held == _EMPTY)  # (a removed key's place does not end the probe)
        first = stop.argmax(axis=1)
        rows = np.arange(len(todo))
        ended = stop[rows, first]
        hits = ended & hit[rows, first]
        place = places[rows, first]
        found[todo[hits]] = place[hits]
        if values is not None:
            values[todo[hits]] = (held[rows, first][hits] & self.value_mask if self.value_bits
                                  else self.values[place[hits]])
        if ends is not None:
            empty = ended & ~hits
            ends[todo[empty]] = place[empty]
        on = ~ended
        return todo[on], (at[on] + _SPAN) & self.mask

    def get(self, keys: np.ndarray) -> np.ndarray:
        """The value of each key, -1 where it is absent."""
        values = np.full(len(keys), -1, dtype=np.int64)
        self.find(keys, values=values)
        return values

    def insert(self, keys: np.ndarray, values: np.ndarray, start: np.ndarray | None = None) -> None:
        """Add distinct keys that are absent (``start``: where each one's probe may begin, found by ``find``
        with no insertion since: every place before it on the key's probe is taken)."""
        entries = self._entries(keys, values)
        todo, at = np.arange(len(keys)), (self._home(keys) if start is None else start.copy())
        while len(todo):
            held = self.keys[at]
            open_ = np.flatnonzero(held < 0)
            # one winner per open place: every claim written, and the place read back (one of several keys claiming
            # a place stays: whichever numpy wrote last; which one only moves keys within the table, never changes
            # a value found; no sort of the claims, no scratch array as large as the table)
            claimed, claims = at[open_], entries[todo[open_]]
            self.keys[claimed] = claims
            won = open_[self.keys[claimed] == claims]
            if not self.value_bits:
                self.values[at[won]] = values[todo[won]]
            self.gone -= int((held[won] == _GONE).sum())
            rest = np.ones(len(todo), dtype=bool)
            rest[won] = False
            todo, at = todo[rest], (at[rest] + 1) & self.mask
        self.live += len(keys)

    def fill(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Put distinct keys into an empty table at once: in the order of their home places, each where linear
        probing in that order puts it (a run's positions by a running maximum, no probing rounds); those whose
        run would pass the table's end wrap around through ``insert``. The order comes from sorting each key's
        home and index packed into one int64 (a plain sort: about twice as fast as an argsort of the homes), a
        merge sort, which takes keys given nearly in home order (another table's, read place by place: ``live``)
        in a few passes, 25x faster than keys in random order."""
        assert self.live == 0 and self.gone == 0, "fill() is for an empty table"
        index_bits = max(1, int(len(keys) - 1).bit_length())
        if self.bits + index_bits > 63:  # (not with any table memory can hold)
            raise ValueError(f"fill: {len(keys)} keys into 2^{self.bits} places do not pack into an int64")
        packed = (self._home(keys) << index_bits) | np.arange(len(keys), dtype=np.int64)
        packed.sort(kind="stable")
        order, home = packed & ((1 << index_bits) - 1), packed >> index_bits
        ranks = np.arange(len(keys))
        at = ranks + np.maximum.accumulate(home - ranks) if len(keys) else ranks
        fits = at <= self.mask
        placed = order[fits]
        self.keys[at[fits]] = self._entries(keys[placed], values[placed])
        if not self.value_bits:
            self.values[at[fits]] = values[placed]
        self.live = len(placed)
        if not fits.all():
            self.insert(keys[order[~fits]], values[order[~fits]])

    def live_items(self) -> tuple[np.ndarray, np.ndarray]:
        """The keys held and their values, place by place (nearly in the order of their homes: what ``fill`` of a
        larger table sorts fastest)."""
        places = np.flatnonzero(self.keys >= 0)
        if self.value_bits:
            entries = self.keys[places]
            return entries >> self.value_bits, entries & self.value_mask
        return self.keys[places], self.values[places]

    def remove(self, keys: np.ndarray) -> None:
        """Remove keys that are present."""
        at = self.find(keys)
        assert (at >= 0).all(), "removing a key the table does not hold"
        self.keys[at] = _GONE
        self.live -= len(keys)
        self.gone += len(keys)
        if self.gone > len(self.keys) // 4:  # removed places lengthen every probe: start over with the live keys
            keys, values = self.live_items()
            self.keys.fill(_EMPTY)
            self.live = self.gone = 0
            self.fill(keys, values)


class KeyIndex:
    """Each distinct key's dense number, in the order keys are first seen; grows as keys arrive (a table of twice
    the keys seen, rebuilt at double the size when full: amortised O(1) a key). Keys are non-negative int64;
    ``key_bound``, if given, bounds them: below 2^31 (1.04B rows fit), each key and its number are packed into one
    int64 in the hash table (``KeyTable(value_bits=32)``: one random read a look-up, half the table's memory)."""

    _PACKED_VALUE_BITS = 32  # numbers below 2^32 beside keys below 2^31

    def __init__(self, capacity: int = 1 << 10, *, key_bound: int | None = None) -> None:
        packed = key_bound is not None and key_bound <= 1 << (63 - self._PACKED_VALUE_BITS)
        self.value_bits = self._PACKED_VALUE_BITS if packed else 0
        self.table = KeyTable(capacity, value_bits=self.value_bits)
        self.capacity = capacity
        self.keys = np.zeros(capacity, dtype=np.int64)  # number -> key
        self.count = 0

    def numbers(self, keys: np.ndarray) -> np.ndarray:
        """The number of each of ``keys`` (distinct), numbering those not seen before in the order given."""
        ends = np.zeros(len(keys), dtype=np.int64)
        found = np.full(len(keys), -1, dtype=np.int64)
        at = self.table.find(keys, ends, values=found)
        new = np.flatnonzero(at < 0)
        if len(new):
            numbers = np.arange(self.count, self.count + len(new), dtype=np.int64)
            if self._make_room(self.count + len(new)):  # a new table: every probe starts again
                self.table.insert(keys[new], numbers)
            else:
                self.table.insert(keys[new], numbers, start=ends[new])
            self.keys[numbers] = keys[new]
            self.count += len(new)
            found[new] = numbers
        return found

    def keys_of(self, numbers: np.ndarray) -> np.ndarray:
        """The key of each number."""
        return self.keys[numbers]

    def in_key_order(self, numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The keys of ``numbers`` and the numbers, both in key order."""
        return in_key_order(self.keys[numbers], numbers)

    def known(self, keys: np.ndarray) -> np.ndarray:
        """The number of each key, -1 for a key never seen."""
        return self.table.get(keys)

    def _make_room(self, count: int) -> bool:
        """Room for ``count`` keys; whether the table was rebuilt for it."""
        if count <= self.capacity:
            return False
        capacity = self.capacity
        while capacity < count:
            capacity *= 2
        table = KeyTable(capacity, value_bits=self.value_bits)
        table.fill(*self.table.live_items())  # (place by place: nearly in order of their homes in the new table)
        self.table, self.capacity = table, capacity
        self.keys = grown(self.keys, capacity, 0)
        return True


def in_key_order(keys: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``keys`` (distinct) and their ``rows`` (numbers, or anything one per key), both in key order."""
    ordered, order = sorted_order(keys)
    return ordered, rows[order]


def sorted_order(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``values`` (flat) sorted, and the stable order that sorts them (``np.argsort(values, kind="stable")``). Where
    the values are non-negative and each fits in an int64 beside its position (the keys of every table we plan: a
    value of up to 2^40 beside 2^23 positions), by one sort of the values and positions packed together: numpy
    sorts int64s with SIMD instructions where the CPU has them (AVX2, AVX-512) but argsorts with none: 1.0 against
    4.1 ms for a batch of 106k ids here (a two-pass 16-bit radix argsort: 4.3 ms); packed values are distinct, so
    any sort of them is the stable order. Else one stable argsort."""
    values = np.asarray(values).ravel()
    count = len(values)
    if not count:
        return values.astype(np.int64), np.zeros(0, dtype=np.int64)
    index_bits = max(1, (count - 1).bit_length())
    if values.dtype.kind in "iu" and values.min() >= 0 and int(values.max()).bit_length() + index_bits <= 63:
        packed = values.astype(np.int64) << index_bits
        packed |= np.arange(count, dtype=np.int64)
        packed.sort()
        order = packed & ((1 << index_bits) - 1)
        packed >>= index_bits
        return packed, order
    order = np.argsort(values, kind="stable")
    return values[order].astype(np.int64), order


def sorted_distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` (flattened, sorted) by one sort: numpy 2.4's np.unique of values alone hashes them,
    about 20x slower than a sort for 12k int64 here (its paths with return_inverse or return_counts sort)."""
    ordered = np.sort(np.asarray(values).ravel())
    return ordered[np.r_[True, ordered[1:] != ordered[:-1]]] if len(ordered) else ordered


def unique_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``values`` (int64, sorted) and each value's index among them (int32, flat): what
    ``np.unique(values, return_inverse=True)`` gives, by one sort (``sorted_order``). Mapping a batch's ids to its
    distinct keys this way costs less than a binary search per id (whose probes are random reads: 5.6 ms against 2
    for 53k ids of 20k keys, with a slower sort than today's) and than np.unique."""
    ordered, order = sorted_order(values)
    if not len(ordered):
        return ordered, np.zeros(0, dtype=np.int32)
    first = np.empty(len(ordered), dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(len(ordered), dtype=np.int32)
    inverse[order] = np.cumsum(first, dtype=np.int32) - 1
    return ordered[first], inverse


def grown(values: np.ndarray, size: int, fill) -> np.ndarray:
    """``values`` extended to at least ``size`` entries (doubling, so that growing one at a time stays linear),
    the new ones ``fill``."""
    if size <= len(values):
        return values
    longer = np.full(max(size, 2 * len(values)), fill, dtype=values.dtype)
    longer[:len(values)] = values
    return longer
