"""Tables that grow with the data: raw-id tables (``bagpipe preprocess --raw-ids``), rows made for the keys a run
trains on, and a default row for every other key.

A raw-id table has no size: its ids are 63-bit keys (data.rawids). A run gives a row to each key its planned
batches look up, made on first use: ``RowNumbering.of_run`` reads the run's batch selectors (the same that training
reads: ``data.batches.batch_rows``) before training and numbers each table's keys 1, 2, ... in the order the
batches first look them up; row 0 is the table's default row, which every key without a row uses (a test split's
new ids, or, in an evaluation during training, a key whose row is made later).
Every mode reads its batches through the numbering (``numbered_dataset``: the splits' ids numbered as they are
read), so from the layout on a raw-id table is an ordinary table of ``rows_made + 1`` rows, and reference, single,
a resume (which numbers the same batches again) and any later mode see the same rows.

A row's initial value is a function of (seed, table, key) alone (``init_keyed``), so whichever process makes the
row, and whatever else it makes, it makes the same one.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Iterator

import numpy as np
import torch

from bagpipe.data.rawids import KEY_SPACE, mix64
from bagpipe.data.schema import Schema
from bagpipe.planner.keys import KeyIndex

DEFAULT_KEY = KEY_SPACE  # the default row's key: no raw key is this (keys lie below 2**63)
INIT_CHUNK_KEYS = 1 << 16  # keys whose initial rows are drawn at once (their words: keys x dim x 8 bytes, twice)


def init_keyed(keys: np.ndarray, *, seed: int, table: int, dim: int, num_rows: int, init: str = "uniform"
               ) -> torch.Tensor:
    """The initial rows of ``keys`` (uint64-able: raw keys, or DEFAULT_KEY) of table ``table``: each a function of
    (seed, table, key) alone, so any process makes the same row. ``init`` as the fixed tables' (data-sized by
    ``num_rows``): uniform in +-1/sqrt(num_rows), normal with standard deviation 1/dim, or zeros."""
    keys = np.asarray(keys).astype(np.uint64)
    if init == "zeros":
        return torch.zeros(len(keys), dim)
    if len(keys) > INIT_CHUNK_KEYS:  # (a row's value depends on its key alone: made a chunk at a time, the same)
        return torch.cat([init_keyed(keys[start:start + INIT_CHUNK_KEYS], seed=seed, table=table, dim=dim,
                                     num_rows=num_rows, init=init) for start in range(0, len(keys), INIT_CHUNK_KEYS)])
    with np.errstate(over="ignore"):
        salt = mix64(np.array([(seed * 1_000_003 + table) % 2**64], dtype=np.uint64))[0]
        columns = np.arange(dim, dtype=np.uint64)[None, :] * np.uint64(0xD1B54A32D192ED03)
        words = mix64(keys ^ salt)[:, None] + columns
    bits = mix64(words)
    uniform = ((bits >> np.uint64(40)).astype(np.float64) + 0.5) / float(1 << 24)  # (0, 1), 24 bits: exact in f32
    if init == "normal":
        second = ((mix64(bits) >> np.uint64(40)).astype(np.float64) + 0.5) / float(1 << 24)
        values = np.sqrt(-2.0 * np.log(uniform)) * np.cos(2.0 * math.pi * second) / dim  # Box-Muller
    else:
        values = (uniform * 2.0 - 1.0) * math.sqrt(1.0 / num_rows)
    return torch.from_numpy(values.astype(np.float32))


class RowNumbering:
    """The rows a run makes in its raw-id tables: each table's keys numbered 1, 2, ... in the order the run's
    batches first look them up (row 0: the default row), with the iteration each row is made at.

    ``numbered`` gives a key its row; for an evaluation during training, ``as_of`` an iteration gives the rows
    made before it, every other key the default row, as rows made on first use would (``split_as_of``). Rows are
    made in the order of their numbers, so "made by iteration i" is a prefix of each table's rows."""

    def __init__(self, sorted_keys: list[np.ndarray], rows: list[np.ndarray], made_at: list[np.ndarray], *,
                 default_lookups: int = 0) -> None:
        self.sorted_keys = sorted_keys  # per table, its keys with rows, sorted
        self.rows = rows  # per table, the row of each of those keys
        self.made_at = made_at  # per table, by row - 1: the iteration the row is made at (non-decreasing)
        self.default_lookups = default_lookups  # the run's training look-ups of a default row (all its batches')

    @classmethod
    def of_run(cls, split, selectors, *, min_count: int = 1, retire_after: int = 0,
               budget: int = 0) -> "RowNumbering":
        """The rows the batches of ``selectors`` (``data.batches.batch_rows``, from iteration 0) make from
        ``split``'s raw ids: a key's row is made at the iteration whose batch brings its look-ups to ``min_count``
        (admission; 1: its first), numbered in that order (within a batch, by the row of that look-up). A key
        looked up fewer times has no row. ``retire_after`` N > 0: a row unused for N iterations is retired and its
        number reused; ``budget`` B > 0: a table holds B rows at most, the least frequently used retired to make
        room (``RetiringNumbering``)."""
        if min_count < 1:
            raise ValueError(f"row_min_count must be at least 1, got {min_count}")
        if retire_after < 0 or budget < 0:
            raise ValueError(f"row_retire_after and row_budget must not be negative, got {retire_after} and {budget}")
        order, iterations = [], []  # every look-up's row of the split, in the run's order, and its iteration
        for iteration, rows in enumerate(selectors):
            rows = np.arange(*rows.indices(split.rows)) if isinstance(rows, slice) else np.asarray(rows, dtype=np.int64)
            order.append(rows)
            iterations.append(np.full(len(rows), iteration, dtype=np.int64))
        count = len(order)
        # each table's initial values are scaled for its train split's distinct keys and the default row: the data's,
        # whatever rows the run makes (so a longer run's rows start as a shorter one's)
        init_rows = [len(np.unique(np.asarray(split.ids[:, table], dtype=np.int64))) + 1
                     for table in range(split.ids.shape[1])]
        order = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
        at = np.concatenate(iterations) if iterations else np.zeros(0, dtype=np.int64)
        if budget or retire_after:
            numbering = (RetiringNumbering.of_lookups_in_turn(split, order, at, iterations=count, min_count=min_count,
                                                              retire_after=retire_after, budget=budget) if budget else
                         RetiringNumbering.of_lookups(split, order, at, iterations=count, min_count=min_count,
                                                      retire_after=retire_after))
            numbering.init_rows = init_rows
            return numbering
        sorted_keys, rows, made_at, default_lookups = [], [], [], 0
        for table in range(split.ids.shape[1]):  # a column at a time: memory of the look-ups, not of the batches
            looked_up = np.asarray(split.ids[:, table], dtype=np.int64)[order]
            by_key = np.argsort(looked_up, kind="stable")  # each key's look-ups together, in the run's order
            keys, starts, counts = np.unique(looked_up[by_key], return_index=True, return_counts=True)
            admitted = counts >= min_count
            keys, made_by_look_up = keys[admitted], by_key[starts[admitted] + min_count - 1]  # its min_count-th
            # the look-ups of the default row: a key's before the iteration its row is made at, or all of them
            made_iteration = np.full(len(counts), np.iinfo(np.int64).max)
            made_iteration[admitted] = at[made_by_look_up]
            default_lookups += int(np.count_nonzero(at[by_key] < np.repeat(made_iteration, counts)))
            in_made_order = np.argsort(made_by_look_up, kind="stable")
            row = np.empty(len(keys), dtype=np.int64)
            row[in_made_order] = np.arange(1, len(keys) + 1)
            sorted_keys.append(keys)
            rows.append(row)
            made_at.append(at[made_by_look_up[in_made_order]])
        numbering = cls(sorted_keys, rows, made_at, default_lookups=default_lookups)
        numbering.init_rows = init_rows
        return numbering

    @property
    def rows_made(self) -> list[int]:
        """Per table, the rows made for keys (the default row not counted)."""
        return [len(keys) for keys in self.sorted_keys]

    @property
    def rows_retired(self) -> list[int]:
        """Per table, the rows retired (none: ``RetiringNumbering`` retires them)."""
        return [0 for _ in self.sorted_keys]

    @property
    def table_rows(self) -> list[int]:
        """Per table, its rows: those made and the default row."""
        return [len(keys) + 1 for keys in self.sorted_keys]

    def made_by(self, iteration: int) -> list[int]:
        """Per table, the rows made before ``iteration``."""
        return [int(np.searchsorted(made, iteration)) for made in self.made_at]

    def numbered(self, ids: np.ndarray, *, as_of: int | None = None) -> np.ndarray:
        """Raw ids ``[B, T]`` as rows: a key's own (made before ``as_of``, if given), else 0, the default row."""
        ids = np.asarray(ids, dtype=np.int64)
        rows = np.zeros(ids.shape, dtype=np.int64)
        for table, (keys, table_rows) in enumerate(zip(self.sorted_keys, self.rows)):
            if not len(keys):
                continue
            column = ids[..., table]
            at = np.minimum(np.searchsorted(keys, column), len(keys) - 1)
            rows[..., table] = np.where(keys[at] == column, table_rows[at], 0)
        return rows if as_of is None else self.made_only(rows, as_of)

    def made_only(self, rows: np.ndarray, as_of: int) -> np.ndarray:
        """Numbered ids ``[B, T]`` with the rows not made before iteration ``as_of`` as the default row (0)."""
        limits = np.asarray(self.made_by(as_of), dtype=np.int64)
        return np.where(rows <= limits, rows, 0)

    retire_after = 0  # (RetiringNumbering: rows unused this long are retired)
    retires = False  # rows are retired and their numbers reused (RetiringNumbering: made again, ``resets``)
    init_rows: list[int] | None = None  # per table, the rows its initial values are scaled for (of_run: the data's)

    def training_ids(self, ids: np.ndarray, iteration: int) -> np.ndarray:
        """Iteration ``iteration``'s training batch (its raw ids numbered: ``numbered``) as it trains: each key on
        the row it has then (a key not admitted yet: the default row)."""
        return self.made_only(ids, iteration + 1)

    def resets(self, iteration: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per table, the rows made again at the start of ``iteration`` (a retired row's number reused: its
        rows and their keys) and the keys they are made for; none without retirement."""
        return [(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64)) for _ in self.sorted_keys]

    def as_made(self, batches, *, start: int):
        """The training batches (from iteration ``start``) each with the rows made by its own iteration: a key
        not admitted yet looks its table's default row up (a no-op without admission: every key a batch looks up
        has its row by then)."""
        for iteration, batch in enumerate(batches, start=start):
            yield self.batch_as_made(batch, iteration)

    def batch_as_made(self, batch, iteration: int):
        """Iteration ``iteration``'s training batch with the rows made by then (``as_made``)."""
        return dataclasses.replace(batch, ids=torch.from_numpy(self.training_ids(batch.ids.numpy(), iteration)))

    def summary(self, test) -> dict:
        """What summary.json says of the rows: made, per table, and the share of ``test``'s look-ups (a split of
        raw ids, numbered) that had no row of their own and used the default row."""
        figures = {"rows_made": sum(self.rows_made), "rows_made_per_table": self.rows_made,
                   "training_lookups_on_the_default_row": self.default_lookups}
        if test is not None and test.rows:
            figures["test_lookups_on_the_default_row"] = float(np.mean(self.numbered(test.ids.raw[:]) == 0))
        return figures

    def row_keys(self, table: int) -> np.ndarray:
        """Table ``table``'s key of each row (uint64; the default row's is DEFAULT_KEY)."""
        keys = np.empty(len(self.sorted_keys[table]) + 1, dtype=np.uint64)
        keys[0] = DEFAULT_KEY
        keys[self.rows[table]] = self.sorted_keys[table].astype(np.uint64)
        return keys

    def stored_row_keys(self, as_of: int | None = None) -> list[np.ndarray]:
        """Each table's key of each row as the model directory stores them: int64, -1 for the default row and,
        ``as_of`` an iteration, for the rows made from it on (the state then looked their keys up on the default row)."""
        stored = [self.row_keys(table).view(np.int64).copy() for table in range(len(self.sorted_keys))]
        made = self.made_by(as_of) if as_of is not None else self.rows_made
        for keys, rows in zip(stored, made):
            keys[0] = -1
            keys[rows + 1:] = -1
        return stored

    def model_table_keys(self, layout) -> list[np.ndarray]:
        """Each table of ``layout`` (an EmbeddingLayout over this numbering's data)'s key of each row (uint64; the
        default row's DEFAULT_KEY): what its initial rows are made from (``keyed_blocks``)."""
        keys = []
        for table in layout.tables:
            if len(table.features) != 1:
                raise ValueError(f"table {table.name} embeds {len(table.features)} features: a raw-id table embeds "
                                 f"one")
            keys.append(self.row_keys(table.features[0]))
        return keys


class RetiringNumbering(RowNumbering):
    """A run's rows when rows unused for ``retire_after`` iterations are retired (``--row-retire-after N``).

    A key's look-ups fall into episodes: a gap of more than N iterations between two look-ups ends one. Each
    episode's row is made at its admitting look-up (its ``min_count``-th) and retired at the start of the
    iteration N + 1 after its last look-up (if the run gets there); a key that comes back later is a new key and
    gets a new row, from its key (the same value: ``init_keyed``) with fresh optimizer state. A retired row's number
    is reused: each row made takes the smallest number free (retirements first, then the rows made at an
    iteration in the order of their admitting look-ups), so a table holds as many rows as are alive at once, plus
    its default row, and a reused number is made again (``resets``) at the start of the iteration it is reused.
    The training batches are numbered as they train (``training_ids``: each look-up's row, held for the run);
    an evaluation as of iteration i sees the rows alive then.

    With a ``budget`` B a table holds B rows at most: when an iteration's rows made would pass it, the least
    frequently used rows that the iteration does not look up are retired first (fewest look-ups since made, then the
    longest unused, then the smallest number), and a batch that needs more than B rows of a table is refused. That
    needs the iterations in turn (``of_lookups_in_turn``); without one, a key's episodes give every row at once
    (``of_lookups``), and the two agree (tests/unit/train/test_dynamic_tables.py)."""

    def __init__(self, tenures: list[dict], assigned: list[np.ndarray], ends: np.ndarray, *, iterations: int,
                 retire_after: int, default_lookups: int) -> None:
        self.tenures = tenures  # per table: keys, rows, start (made at), end (retired at the start of; -1: never)
        self.assigned = assigned  # per table, every training look-up's row, in the run's order
        self.ends = ends  # where each iteration's look-ups end in ``assigned``
        self.iterations, self.retire_after, self.default_lookups = iterations, retire_after, default_lookups
        self.sorted_keys = [np.unique(t["keys"]) for t in tenures]  # (the keys that ever had a row)
        self._again: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None  # (resets, made at first use)
        self._maps: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # the live key -> row maps, by as_of

    retires = True

    @classmethod
    def of_lookups(cls, split, order: np.ndarray, at: np.ndarray, *, iterations: int, min_count: int,
                   retire_after: int) -> "RetiringNumbering":
        tenures, assigned, default_lookups = [], [], 0
        for table in range(split.ids.shape[1]):
            looked_up = np.asarray(split.ids[:, table], dtype=np.int64)[order]
            by_key = np.argsort(looked_up, kind="stable")  # each key's look-ups together, in the run's order
            keys, when = looked_up[by_key], at[by_key]
            starts = np.ones(len(keys), dtype=bool)  # where an episode starts: a key's first look-up, or a gap
            starts[1:] = (keys[1:] != keys[:-1]) | (when[1:] - when[:-1] > retire_after)
            first = np.flatnonzero(starts)
            last = np.append(first[1:], len(keys)) - 1
            admitted = last - first + 1 >= min_count
            admitting = first[admitted] + min_count - 1
            made = when[admitting]
            end = when[last[admitted]] + retire_after + 1
            end = np.where(end < iterations, end, -1)
            numbers = _numbers(made, by_key[admitting], end)
            # each look-up's row: its episode's from the iteration the row is made at, else the default row
            episode = np.cumsum(starts) - 1
            row_of_episode = np.zeros(len(first), dtype=np.int64)
            row_of_episode[admitted] = numbers
            made_of_episode = np.full(len(first), np.iinfo(np.int64).max)
            made_of_episode[admitted] = made
            rows = np.where(when >= made_of_episode[episode], row_of_episode[episode], 0)
            in_order = np.empty(len(rows), dtype=np.int64)
            in_order[by_key] = rows
            default_lookups += int(np.count_nonzero(rows == 0))
            tenures.append({"keys": keys[admitting], "rows": numbers, "start": made, "end": end})
            assigned.append(in_order)
        ends = np.searchsorted(at, np.arange(1, iterations + 1), side="left")  # (at: non-decreasing)
        return cls(tenures, assigned, ends, iterations=iterations, retire_after=retire_after,
                   default_lookups=default_lookups)

    @classmethod
    def of_lookups_in_turn(cls, split, order: np.ndarray, at: np.ndarray, *, iterations: int, min_count: int,
                           retire_after: int, budget: int = 0) -> "RetiringNumbering":
        """``of_lookups`` an iteration at a time (what a ``budget`` needs: which rows it retires depends on the
        rows alive at each iteration)."""
        ends = np.searchsorted(at, np.arange(1, iterations + 1), side="left")
        tenures, assigned, default_lookups = [], [], 0
        for table in range(split.ids.shape[1]):
            looked_up = np.asarray(split.ids[:, table], dtype=np.int64)[order]
            tenure, rows = _in_turn(looked_up, ends, table=table, min_count=min_count, retire_after=retire_after,
                                    budget=budget)
            default_lookups += int(np.count_nonzero(rows == 0))
            tenures.append(tenure)
            assigned.append(rows)
        numbering = cls(tenures, assigned, ends, iterations=iterations, retire_after=retire_after,
                        default_lookups=default_lookups)
        numbering.budget = budget
        return numbering

    budget = 0  # (of_lookups_in_turn: the rows a table holds at most)

    @property
    def rows_made(self) -> list[int]:
        """Per table, the rows made (a key that came back after its row was retired: counted again)."""
        return [len(t["rows"]) for t in self.tenures]

    @property
    def rows_retired(self) -> list[int]:
        return [int(np.count_nonzero(t["end"] >= 0)) for t in self.tenures]

    @property
    def table_rows(self) -> list[int]:
        """Per table, its rows: the most alive at once (numbers are reused) and the default row."""
        return [int(t["rows"].max()) + 1 if len(t["rows"]) else 1 for t in self.tenures]

    def _alive(self, table: int, as_of: int) -> np.ndarray:
        """Table ``table``'s rows alive as of iteration ``as_of`` (made before it, not retired by then)."""
        tenure = self.tenures[table]
        return (tenure["start"] < as_of) & ((tenure["end"] < 0) | (tenure["end"] >= as_of))

    def numbered(self, ids: np.ndarray, *, as_of: int | None = None) -> np.ndarray:
        """Raw ids ``[B, T]`` as the rows their keys have as of iteration ``as_of`` (default: the run's end)."""
        as_of = self.iterations if as_of is None else as_of
        ids = np.asarray(ids, dtype=np.int64)
        rows = np.zeros(ids.shape, dtype=np.int64)
        for table, (keys, table_rows) in enumerate(self._map(as_of)):
            if not len(keys):
                continue
            column = ids[..., table]
            at = np.minimum(np.searchsorted(keys, column), len(keys) - 1)
            rows[..., table] = np.where(keys[at] == column, table_rows[at], 0)
        return rows

    def _map(self, as_of: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per table, the keys alive as of ``as_of`` (sorted) and their rows; the last few kept (every batch of a
        split is numbered as of one iteration)."""
        if as_of not in self._maps:
            if len(self._maps) >= 4:
                self._maps.pop(next(iter(self._maps)))
            maps = []
            for table, tenure in enumerate(self.tenures):
                alive = self._alive(table, as_of)
                keys, order = np.unique(tenure["keys"][alive], return_index=True)  # (one row alive a key at once)
                maps.append((keys, tenure["rows"][alive][order]))
            self._maps[as_of] = maps
        return self._maps[as_of]

    def made_only(self, rows: np.ndarray, as_of: int) -> np.ndarray:
        raise NotImplementedError("with retirement a key's row depends on the iteration: use training_ids")

    def training_ids(self, ids: np.ndarray, iteration: int) -> np.ndarray:
        start = self.ends[iteration - 1] if iteration else 0
        rows = np.stack([assigned[start:self.ends[iteration]] for assigned in self.assigned], axis=1)
        if rows.shape != np.shape(ids):
            raise ValueError(f"iteration {iteration}'s batch is {np.shape(ids)}, the run's numbering planned "
                             f"{rows.shape}")
        return rows

    def resets(self, iteration: int) -> list[tuple[np.ndarray, np.ndarray]]:
        if self._again is None:  # per table, the tenures of a number used before, by the iteration they start at
            self._again = []
            for tenure in self.tenures:
                again = np.ones(len(tenure["rows"]), dtype=bool)
                again[_first_tenures(tenure)] = False  # (a number's first tenure: its initial row)
                order = np.flatnonzero(again)[np.argsort(tenure["start"][again], kind="stable")]
                self._again.append((tenure["start"][order], tenure["rows"][order], tenure["keys"][order]))
        out = []
        for starts, rows, keys in self._again:
            first, last = np.searchsorted(starts, [iteration, iteration + 1])
            out.append((rows[first:last], keys[first:last].astype(np.uint64)))
        return out

    def row_keys(self, table: int) -> np.ndarray:
        """Table ``table``'s key of each row as first made (what its initial value is drawn from)."""
        tenure = self.tenures[table]
        keys = np.empty(self.table_rows[table], dtype=np.uint64)
        keys[0] = DEFAULT_KEY
        first = _first_tenures(tenure)
        keys[tenure["rows"][first]] = tenure["keys"][first].astype(np.uint64)
        return keys

    def stored_row_keys(self, as_of: int | None = None) -> list[np.ndarray]:
        """Each table's key of each row alive as of ``as_of`` (default: the run's end), int64; -1 for the default
        row and for numbers free then."""
        as_of = self.iterations if as_of is None else as_of
        stored = []
        for table, tenure in enumerate(self.tenures):
            keys = np.full(self.table_rows[table], -1, dtype=np.int64)
            alive = self._alive(table, as_of)
            keys[tenure["rows"][alive]] = tenure["keys"][alive]
            stored.append(keys)
        return stored

    def made_by(self, iteration: int) -> list[int]:
        raise NotImplementedError("with retirement rows are not made in the order of their numbers")

    def summary(self, test) -> dict:
        figures = super().summary(test)
        return {**figures, "rows_retired": sum(self.rows_retired), "rows_held_per_table": self.table_rows,
                "retire_after": self.retire_after, **({"row_budget": self.budget} if self.budget else {})}


class TableRows:
    """One raw-id table's rows as its batches arrive, one ``step`` a batch: retirements of rows unused for
    ``retire_after`` iterations, admission (``min_count``), the least frequently used retired to keep ``budget``
    rows at most (0: no bound), then the rows made, each taking the smallest free number. What
    ``RetiringNumbering.of_lookups_in_turn`` works out for a run before it trains, and what
    ``bagpipe.nn.DynamicEmbeddingBag`` does as it trains: one rule, so the two agree."""

    def __init__(self, *, min_count: int = 1, retire_after: int = 0, budget: int = 0, table: int = 0) -> None:
        self.min_count, self.retire_after, self.budget, self.table = min_count, retire_after, budget, table
        self.ids = KeyIndex()  # every key seen -> its id (the arrays below are by id)
        self.row_of = np.zeros(0, dtype=np.int64)  # each key's row (0: none)
        self.pending = np.zeros(0, dtype=np.int64)  # look-ups toward admission, while without a row
        self.last = np.zeros(0, dtype=np.int64)  # each key's last look-up
        self.uses = np.zeros(0, dtype=np.int64)  # look-ups since its row was made (the LFU's count)
        self.tenure_of = np.zeros(0, dtype=np.int64)
        self.made_keys: list[int] = []  # every row made: its key, number, iteration, and where it was retired
        self.made_rows: list[int] = []
        self.made_at: list[int] = []
        self.retired_at: list[int] = []
        self.free: list[int] = []
        self.next_number = 1
        self.iteration = 0
        self.made_now: tuple[np.ndarray, np.ndarray] = (np.zeros(0, dtype=np.int64),) * 2  # the last step's

    def _grow(self, count: int) -> None:
        if count <= len(self.row_of):
            return
        size = max(count, 2 * len(self.row_of), 64)
        for name, fill in (("row_of", 0), ("pending", 0), ("last", np.iinfo(np.int64).min // 2), ("uses", 0),
                           ("tenure_of", -1)):
            grown = np.full(size, fill, dtype=np.int64)
            grown[:len(getattr(self, name))] = getattr(self, name)
            setattr(self, name, grown)

    def rows(self, keys: np.ndarray) -> np.ndarray:
        """Each key's row now (0: none), making none."""
        known = self.ids.known(np.asarray(keys, dtype=np.int64))
        return np.where(known >= 0, self.row_of[np.maximum(known, 0)] if len(self.row_of) else 0, 0)

    def _retire(self, victims: np.ndarray) -> None:
        for victim in victims.tolist():
            heapq.heappush(self.free, int(self.row_of[victim]))
            self.retired_at[self.tenure_of[victim]] = self.iteration
        self.row_of[victims], self.tenure_of[victims] = 0, -1

    def step(self, keys: np.ndarray, *, capacity: int = 0) -> np.ndarray:
        """The next iteration's look-ups (raw keys, in batch order): each one's row, rows retired and made first
        (``made_now``: the numbers made and their keys, in order). A batch that needs more rows than the budget,
        or (``capacity`` > 0: a cache's) touches more distinct rows than that, is refused before anything
        changes."""
        keys = np.asarray(keys, dtype=np.int64)
        iteration, min_count, retire_after = self.iteration, self.min_count, self.retire_after
        distinct, counts = np.unique(keys, return_counts=True)
        known = self.ids.known(distinct)
        rowless = (known < 0) | (self.row_of[np.maximum(known, 0)] == 0 if len(self.row_of) else True)
        if retire_after:  # unused for retire_after iterations: retired at the start of the next (even if back now)
            alive = np.flatnonzero(self.row_of[:self.ids.count])
            retiring = alive[self.last[alive] < iteration - retire_after]
            rowless |= np.isin(known, retiring) & (known >= 0)
        else:
            retiring = np.zeros(0, dtype=np.int64)
        seen_before = np.where(known >= 0, self.last[np.maximum(known, 0)] if len(self.last) else 0,
                               np.iinfo(np.int64).min // 2)
        before = np.where(known >= 0, self.pending[np.maximum(known, 0)] if len(self.pending) else 0, 0)
        if retire_after:  # (a key away longer than that starts counting toward admission again)
            before = np.where(rowless & (iteration - seen_before > retire_after), 0, before)
        admit = rowless & (before + counts >= min_count)
        order = np.argsort(keys, kind="stable")
        at = order[np.searchsorted(keys[order], distinct[admit]) + min_count - before[admit] - 1]
        admitted = np.argsort(at, kind="stable")
        if self.budget:
            kept = int(np.count_nonzero(~rowless))
            if kept + int(np.count_nonzero(admit)) > self.budget:
                raise ValueError(f"iteration {iteration}'s batch looks up {kept + int(np.count_nonzero(admit))} rows "
                                 f"of table {self.table}, more than its row budget of {self.budget} (--row-budget): "
                                 f"give it a budget of one batch's rows at least, or use smaller batches")
        touched = int(np.count_nonzero(~rowless | admit)) + int((rowless & ~admit).any())  # (+ the default row)
        if capacity and touched > capacity:
            raise ValueError(f"a batch touches {touched} distinct rows, more than the cache's {capacity}: give the "
                             f"table more cache rows or use smaller batches")
        # from here on the batch is taken
        ids = self.ids.numbers(distinct)  # (new keys get ids, in key order: ids only index the arrays)
        self._grow(self.ids.count)
        self._retire(retiring)
        self.pending[ids] = np.where(rowless & ~admit, before + counts, 0)
        new = ids[admit][admitted]
        if self.budget:
            alive = np.flatnonzero(self.row_of[:self.ids.count])
            over = len(alive) + len(new) - self.budget
            if over > 0:  # the least frequently used rows this batch does not look up
                idle = alive[~np.isin(alive, ids)]
                self._retire(idle[np.lexsort((self.row_of[idle], self.last[idle], self.uses[idle]))[:over]])
        reused = min(len(new), len(self.free))  # the smallest free numbers first, then new ones
        numbers = np.concatenate([np.array([heapq.heappop(self.free) for _ in range(reused)], dtype=np.int64),
                                  np.arange(self.next_number, self.next_number + len(new) - reused, dtype=np.int64)])
        self.next_number += len(new) - reused
        made = distinct[admit][admitted]
        self.row_of[new], self.uses[new] = numbers, 0
        self.tenure_of[new] = np.arange(len(self.made_keys), len(self.made_keys) + len(new))
        self.made_keys.extend(made.tolist())
        self.made_rows.extend(numbers.tolist())
        self.made_at.extend([iteration] * len(new))
        self.retired_at.extend([-1] * len(new))
        self.made_now = (numbers, made)
        rows = self.row_of[ids][np.searchsorted(distinct, keys)]
        holding = self.row_of[ids] > 0
        self.uses[ids[holding]] += counts[holding]
        self.last[ids] = iteration
        self.iteration += 1
        return rows

    def row_keys(self, size: int) -> np.ndarray:
        """The key of each row number below ``size`` alive now (int64; -1: the default row, or a number free)."""
        keys = np.full(size, -1, dtype=np.int64)
        ids = np.flatnonzero(self.row_of[:self.ids.count])
        keys[self.row_of[ids]] = self.ids.keys_of(ids)
        return keys

    def state(self) -> dict[str, np.ndarray]:
        """What ``load`` takes: every key seen with its row, pending count, last look-up and uses, and the counters."""
        count = self.ids.count
        columns = [self.ids.keys_of(np.arange(count)), self.row_of[:count], self.pending[:count], self.last[:count],
                   self.uses[:count]]
        return {"keys": np.stack(columns, axis=1) if count else np.zeros((0, 5), dtype=np.int64),
                "counters": np.array([self.next_number, self.iteration], dtype=np.int64)}

    def load(self, state: dict[str, np.ndarray]) -> None:
        """The rows as ``state`` (``state()``) had them; rows made before are not listed as made (``tenures``)."""
        keys = np.asarray(state["keys"], dtype=np.int64).reshape(-1, 5)
        self.__init__(min_count=self.min_count, retire_after=self.retire_after, budget=self.budget, table=self.table)
        ids = self.ids.numbers(keys[:, 0]) if len(keys) else np.zeros(0, dtype=np.int64)
        self._grow(self.ids.count)
        for column, name in enumerate(("row_of", "pending", "last", "uses"), start=1):
            getattr(self, name)[ids] = keys[:, column]
        self.next_number, self.iteration = (int(v) for v in state["counters"])
        alive = ids[keys[:, 1] > 0]
        for key in alive.tolist():  # (a tenure each, so that retiring them is recorded)
            self.tenure_of[key] = len(self.made_keys)
            self.made_keys.append(int(self.ids.keys_of(np.array([key]))[0]))
            self.made_rows.append(int(self.row_of[key]))
            self.made_at.append(-1)
            self.retired_at.append(-1)
        taken = set(self.row_of[alive].tolist())
        self.free = [number for number in range(1, self.next_number) if number not in taken]
        heapq.heapify(self.free)

    def tenures(self) -> dict:
        """Every row made: its key, number, the iteration it was made at and the one it was retired at (-1: not)."""
        return {"keys": np.asarray(self.made_keys, dtype=np.int64), "rows": np.asarray(self.made_rows, dtype=np.int64),
                "start": np.asarray(self.made_at, dtype=np.int64), "end": np.asarray(self.retired_at, dtype=np.int64)}


def _in_turn(looked_up: np.ndarray, ends: np.ndarray, *, table: int, min_count: int, retire_after: int,
             budget: int) -> tuple[dict, np.ndarray]:
    """One table's tenures and each look-up's row (``RetiringNumbering.of_lookups_in_turn``): its batches
    through a ``TableRows`` in turn."""
    life = TableRows(min_count=min_count, retire_after=retire_after, budget=budget, table=table)
    rows = np.zeros(len(looked_up), dtype=np.int64)
    start = 0
    for stop in ends.tolist():
        rows[start:stop] = life.step(looked_up[start:stop])
        start = stop
    return life.tenures(), rows


def _first_tenures(tenure: dict) -> np.ndarray:
    """The index of each number's first tenure (the earliest made: a number's tenures never overlap)."""
    by_start = np.argsort(tenure["start"], kind="stable")
    return by_start[np.unique(tenure["rows"][by_start], return_index=True)[1]]


def _numbers(made: np.ndarray, position: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Each row's number, 1 and up, made at iteration ``made`` (in the order of ``position``, its admitting
    look-up's place in the run) and retired at the start of iteration ``end`` (-1: never): the smallest number
    free then, retirements taken before the rows made at the same iteration."""
    numbers = np.zeros(len(made), dtype=np.int64)
    retiring = sorted((int(e), i) for i, e in enumerate(end) if e >= 0)
    free: list[int] = []
    next_number, j = 1, 0
    for i in np.lexsort((position, made)).tolist():
        while j < len(retiring) and retiring[j][0] <= made[i]:
            heapq.heappush(free, int(numbers[retiring[j][1]]))
            j += 1
        if free:
            numbers[i] = heapq.heappop(free)
        else:
            numbers[i], next_number = next_number, next_number + 1
    return numbers


def keyed_blocks(keys: np.ndarray, *, table_index: int, table, seed: int) -> Iterator[torch.Tensor]:
    """The initial rows of ``keys`` (some of table ``table_index``'s row keys: ``RowNumbering.model_table_keys``,
    or a shard's every n-th of them) of ``table`` (a TableConfig), a chunk at a time: each row a function of
    (seed, table, key) alone, so a server's shard holds the rows the reference's whole table does."""
    for start in range(0, len(keys), INIT_CHUNK_KEYS):
        yield init_keyed(keys[start:start + INIT_CHUNK_KEYS], seed=seed, table=table_index, dim=table.dim,
                         num_rows=table.init_rows or table.num_rows, init=table.init)


def remade(numbering: RowNumbering, layout, iteration: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per space of ``layout`` (an EmbeddingLayout), the rows made again at the start of ``iteration`` (retirement:
    ``RowNumbering.resets``): their flat keys, their new raw keys (int64) and each one's model table."""
    resets = numbering.resets(iteration)
    parts = [([], [], []) for _ in layout.spaces]
    for index, table in enumerate(layout.tables):
        rows, keys = resets[table.features[0]]
        if len(rows):
            space, offset = layout.place(index)
            parts[space][0].append(rows + offset)
            parts[space][1].append(keys.astype(np.int64))
            parts[space][2].append(np.full(len(rows), index, dtype=np.int64))
    return [tuple(np.concatenate(part) if part else np.zeros(0, dtype=np.int64) for part in space)
            for space in parts]


def remade_weights(layout, tables: np.ndarray, keys: np.ndarray, *, seed: int) -> torch.Tensor:
    """The rows ``remade`` gives, made from their keys as a row made then is (``keyed_blocks``), in its order."""
    dim = layout.tables[int(tables[0])].dim if len(tables) else 0
    weights = torch.empty(len(keys), dim)
    for index in np.unique(tables):
        mine = np.flatnonzero(tables == index)
        weights[torch.from_numpy(mine)] = torch.cat(list(keyed_blocks(
            np.asarray(keys[mine]).astype(np.uint64), table_index=int(index), table=layout.tables[int(index)],
            seed=seed)))
    return weights


class NumberedIds:
    """A split's raw ids read as rows: indexing reads the raw ids asked for and numbers them (``RowNumbering``),
    as of iteration ``as_of`` if given (an evaluation during training: rows made later are the default row)."""

    def __init__(self, raw, numbering: RowNumbering, *, as_of: int | None = None) -> None:
        self.raw, self.numbering, self.as_of = raw, numbering, as_of

    @property
    def shape(self) -> tuple[int, ...]:
        return self.raw.shape

    dtype = np.dtype(np.int64)

    @property
    def size(self) -> int:
        return self.raw.size

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, rows) -> np.ndarray:
        if isinstance(rows, tuple):  # (its columns are tables: a column selection would number them otherwise)
            raise TypeError("numbered raw ids are read by rows only (split.ids[rows])")
        return self.numbering.numbered(np.asarray(self.raw[rows], dtype=np.int64), as_of=self.as_of)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self[:], dtype=dtype)


def numbered_dataset(dataset, numbering: RowNumbering):
    """``dataset`` (raw ids) as a run reads it: every split's ids numbered, the tables ``numbering``'s sizes."""
    schema = dataset.schema
    if len(numbering.sorted_keys) != len(schema.features) or any(f.width != 1 for f in schema.features):
        raise ValueError("raw-id data holds one id a feature")
    numbered = Schema(num_dense=schema.num_dense, features=tuple(
        dataclasses.replace(feature, cardinality=rows, init_rows=scale)
        for feature, rows, scale in zip(schema.features, numbering.table_rows,
                                        numbering.init_rows or [0] * len(schema.features))))
    return dataclasses.replace(dataset, **{name: dataclasses.replace(split, schema=numbered,
                                                                     ids=NumberedIds(split.ids, numbering))
                                           for name, split in dataset.splits().items()})


def split_as_of(split, iteration: int | None):
    """``split`` as an evaluation of the state after ``iteration`` iterations reads it: a split of raw ids with
    the rows made before then, every other key on its table's default row (None: the final state, every row);
    any other split as it is."""
    if iteration is None or not isinstance(split.ids, NumberedIds):
        return split
    return dataclasses.replace(split, ids=NumberedIds(split.ids.raw, split.ids.numbering, as_of=iteration))
