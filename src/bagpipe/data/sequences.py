"""Interaction logs (MovieLens and the like) into next-item samples: a user's last items, the items
that follow, and sampled negatives; each user's last item is held out for the test split and the one
before it for the validation split (leave-one-out, as SASRec and RecBole's ``LS`` split do).

A log is one line per interaction, ``user item rating timestamp``, as MovieLens ships it:
``u.data`` (tab-separated), ``ratings.dat`` (``::``-separated), ``ratings.csv`` (a header, then
comma-separated). Users and items are numbered densely by descending interaction count (hot rows
get small ids) and the raw ids are kept in ``vocab/``. Each user's interactions are ordered by
time; a training sample is ``history`` items (left-padded with PAD) and the ``targets`` items
after them, all before the user's last two; the validation sample the ``history`` items before the
second-to-last one and it; the test sample the last ``history`` items before the last one and it (its
history holds the validation item: it is known by then, though never trained on). A user with two
interactions has no validation sample (the first is its only training item). Training samples are
ordered by the time of their first target (the log's time order), each with ``negatives`` items
drawn from those the user never touched.

A RecBole atomic file (``ml-100k.inter``) is a log too: a typed header, ``user_id:token<TAB>
item_id:token<TAB>...``, names its columns, in any order, among others. Which layout a file has,
its first lines tell, whatever its name (``log_layout``).
"""

from __future__ import annotations

import gzip
import itertools
import logging
import math
import zlib
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bagpipe.data.binary import SplitWriter, id_dtype_for
from bagpipe.data.blocks import open_decompressed
from bagpipe.data.formats import Chunk, DataError
from bagpipe.data.schema import PAD, Feature, Schema

log = logging.getLogger(__name__)

INTERACTION_FILES = ("u.data", "ratings.dat", "ratings.csv")  # a directory's log, by name (a file's: by content)
SEPARATORS = ("::", "\t", ",")  # ratings.dat, u.data, ratings.csv
ATOMIC_TYPES = ("token", "token_seq", "float", "float_seq")  # RecBole's field types, in ``name:type``
ATOMIC_FIELDS = ("user_id", "item_id", "timestamp")  # the fields an interaction log reads, by name
SNIFF_LINES = 2  # the non-empty lines that tell a log's layout: a header and a row


@dataclass(frozen=True, kw_only=True)
class SequenceSettings:
    history: int = 5  # L: the items a sample sees
    targets: int = 3  # T: the items that follow, predicted at once (Caser's T)
    negatives: int = 3  # sampled items the user never touched
    seed: int = 0  # of the negatives

    def __post_init__(self) -> None:
        for name in ("history", "targets", "negatives"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sequence {name} must be positive, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LogLayout:
    """Where a log's interactions are: the separator, the header lines before the rows, and the columns."""

    separator: str
    header_lines: int  # 0 or 1
    num_columns: int
    user: int
    item: int
    time: int


def log_layout(lines: list[tuple[int, str]], *, path: str) -> LogLayout:
    """The layout of a log, from its first SNIFF_LINES non-empty lines (each with its line number); a DataError
    saying why if they are not an interaction log's.

    A RecBole atomic header (tab-separated ``name:type`` fields) names the columns: ``user_id``, ``item_id`` and
    ``timestamp`` are read, in whatever order, among any others. Otherwise a row is 4 numbers, user item rating
    timestamp, separated by ``::``, a tab or a comma, perhaps under a header line of 4 fields.
    """
    if not lines:
        raise DataError(path, 1, "no interactions")
    number, first = lines[0]
    if is_atomic_header(first):
        fields = first.split("\t")
        names = [field.strip().rpartition(":")[0] for field in fields]
        missing = [name for name in ATOMIC_FIELDS if name not in names]
        if missing:
            raise DataError(path, number, f"a RecBole atomic file without {' or '.join(missing)} (its fields: "
                                          f"{', '.join(fields)}): not an interaction log")
        return LogLayout(separator="\t", header_lines=1, num_columns=len(fields),
                         **{key: names.index(name) for key, name in zip(("user", "item", "time"), ATOMIC_FIELDS)})
    separator = next((s for s in SEPARATORS if s in first), None)
    header_lines = 0 if _numbers(first, separator) else 1
    if separator is not None and len(first.split(separator)) == 4 and header_lines < len(lines):
        number, row = lines[header_lines]
        if _numbers(row, separator):
            return LogLayout(separator=separator, header_lines=header_lines, num_columns=4, user=0, item=1, time=3)
    raise DataError(path, number, "not an interaction log: expected user, item, rating and timestamp, 4 numbers "
                                  "separated by '::', a tab or a comma (under a header line, or none), or a "
                                  "RecBole atomic header (user_id:token, item_id:token, timestamp:float, "
                                  "tab-separated)")


def is_atomic_header(line: str) -> bool:
    """Whether ``line`` is a RecBole atomic file's header: tab-separated ``name:type`` fields."""
    return all(_is_typed(field) for field in line.split("\t"))


def _is_typed(field: str) -> bool:
    name, _, kind = field.strip().rpartition(":")
    return bool(name) and kind in ATOMIC_TYPES


def _numbers(line: str, separator: str | None) -> bool:
    """Whether ``line`` is 4 numbers separated by ``separator``."""
    fields = line.split(separator) if separator else []
    try:
        return len(fields) == 4 and all(math.isfinite(float(field)) for field in fields)
    except ValueError:
        return False


def is_interaction_log(lines: list[tuple[int, str]]) -> bool:
    """Whether a file's first SNIFF_LINES non-empty lines (numbered) are an interaction log's."""
    try:
        log_layout(lines, path="")
    except DataError:
        return False
    return True


def read_interactions(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw user ids, item ids and timestamps of a log (plain or gzip, any layout ``log_layout`` tells), in file
    order."""
    with ExitStack() as stack:
        _, content = open_decompressed(path, stack)  # as the other formats: no byte order mark
        try:
            data = content.read()
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:
            raise DataError(str(path), 1, f"corrupt or truncated gzip data ({err})") from None
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(str(path), data.count(b"\n", 0, err.start) + 1,
                        "not UTF-8 text (is this a binary or compressed file?)") from None
    rows = ((number, line) for number, line in enumerate(lines, start=1) if line.strip())
    head = list(itertools.islice(rows, SNIFF_LINES))
    layout = log_layout(head, path=str(path))
    users, items, times = [], [], []
    for number, line in itertools.chain(head[layout.header_lines:], rows):
        fields = line.split(layout.separator)
        if len(fields) != layout.num_columns:
            raise DataError(str(path), number, f"wrong column count: expected {layout.num_columns} fields (user, "
                                               f"item, timestamp and others), got {len(fields)}")
        try:
            users.append(int(fields[layout.user]))
            items.append(int(fields[layout.item]))
            times.append(int(float(fields[layout.time])))
        except ValueError:
            raise DataError(str(path), number, f"non-integer user, item or timestamp in {line!r}") from None
    if not users:
        raise ValueError(f"{path}: no interactions")
    return np.asarray(users, dtype=np.int64), np.asarray(items, dtype=np.int64), np.asarray(times, dtype=np.int64)


def dense_ids(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw ids renumbered 0.. by descending count (ties by raw id); and the raw id of each new id."""
    values, inverse, counts = np.unique(raw, return_inverse=True, return_counts=True)
    order = np.lexsort((values, -counts))  # most frequent first
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[inverse], values[order]


def schema_of(*, num_users: int, num_items: int, settings: SequenceSettings) -> Schema:
    return Schema(num_dense=0, features=(
        Feature(name="user", cardinality=num_users),
        Feature(name="history", cardinality=num_items, width=settings.history),
        Feature(name="targets", cardinality=num_items, width=settings.targets),
        Feature(name="negatives", cardinality=num_items, width=settings.negatives),
    ))


def build_samples(users: np.ndarray, items: np.ndarray, times: np.ndarray,
                  settings: SequenceSettings) -> tuple[dict[str, np.ndarray], int, int]:
    """Train, valid and test id matrices ``[n, 1 + L + T + N]`` of dense ids, by split name; and the user and item
    counts."""
    num_users, num_items = int(users.max()) + 1, int(items.max()) + 1
    L, T, N = settings.history, settings.targets, settings.negatives
    order = np.lexsort((np.arange(len(users)), times, users))  # by user, then time, then file order
    users, items, times = users[order], items[order], times[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    ends = np.r_[starts[1:], len(users)]
    rng = np.random.default_rng([settings.seed, 7])
    train, train_times, valid, test = [], [], [], []

    def held_out(user: int, padded: np.ndarray, at: int, touched: np.ndarray) -> np.ndarray:
        """The sample whose one target is the item at position ``at`` of the user's sequence."""
        target = np.r_[padded[at + L], np.full(T - 1, PAD, dtype=np.int64)]
        return np.concatenate([[user], padded[at:at + L], target, _negatives(rng, touched, num_items, (1, N))[0]])

    for start, end in zip(starts.tolist(), ends.tolist()):
        user, sequence = int(users[start]), items[start:end]
        if len(sequence) < 2:
            continue  # nothing to learn from and nothing to test on
        padded = np.r_[np.full(L, PAD, dtype=np.int64), sequence]
        touched = np.unique(sequence)
        # the last item is the test target, the one before it (with three or more) the validation target
        prefix = len(sequence) - (2 if len(sequence) >= 3 else 1)
        positions = np.arange(1, prefix - T + 1)  # a window's first target
        if len(positions):
            history = np.stack([padded[p:p + L] for p in positions])  # items before p (padded index p + L)
            targets = np.stack([sequence[p:p + T] for p in positions])
            negatives = _negatives(rng, touched, num_items, (len(positions), N))
            train.append(np.concatenate([np.full((len(positions), 1), user), history, targets, negatives], axis=1))
            train_times.append(times[start + positions])
        if len(sequence) >= 3:
            valid.append(held_out(user, padded, len(sequence) - 2, touched))
        test.append(held_out(user, padded, len(sequence) - 1, touched))
    width = 1 + L + T + N
    train_ids = np.concatenate(train) if train else np.zeros((0, width), dtype=np.int64)
    if train:
        train_ids = train_ids[np.argsort(np.concatenate(train_times), kind="stable")]
    samples = {"train": train_ids, "valid": np.asarray(valid, dtype=np.int64).reshape(-1, width),
               "test": np.asarray(test, dtype=np.int64).reshape(-1, width)}
    return samples, num_users, num_items


def _negatives(rng: np.random.Generator, touched: np.ndarray, num_items: int, shape: tuple[int, int]) -> np.ndarray:
    """Items drawn uniformly, redrawn (a few times) where the user touched them."""
    drawn = rng.integers(0, num_items, shape)
    if len(touched) >= num_items:
        return drawn
    for _ in range(10):
        clash = np.isin(drawn, touched)
        if not clash.any():
            break
        drawn[clash] = rng.integers(0, num_items, int(clash.sum()))
    return drawn


def convert_interactions(path: Path, out: Path, settings: SequenceSettings) -> dict:
    """Write ``out/train``, ``out/valid``, ``out/test`` and ``out/vocab`` from a log; return what the meta
    records."""
    raw_users, raw_items, times = read_interactions(path)
    users, user_vocab = dense_ids(raw_users)
    items, item_vocab = dense_ids(raw_items)
    samples, num_users, num_items = build_samples(users, items, times, settings)
    schema = schema_of(num_users=num_users, num_items=num_items, settings=settings)
    id_dtype = id_dtype_for([num_users, num_items])
    for split, ids in samples.items():
        writer = SplitWriter(out / split, id_dtype=id_dtype)
        writer.append(Chunk(labels=np.ones(len(ids), dtype=np.float32), dense=np.zeros((len(ids), 0), np.float32),
                            ids=ids))
        writer.close(schema=schema)
    (out / "vocab").mkdir(parents=True, exist_ok=True)
    np.save(out / "vocab" / "user.npy", user_vocab)
    np.save(out / "vocab" / "item.npy", item_vocab)
    log.info("%s: %d interactions of %d users and %d items -> %d train, %d validation and %d test samples", path,
             len(raw_users), num_users, num_items, *(len(samples[split]) for split in ("train", "valid", "test")))
    return {"rows": {split: len(ids) for split, ids in samples.items()}, "table_sizes": schema.cardinalities,
            "users": num_users, "items": num_items, "interactions": len(raw_users), "sequence": settings.to_dict()}
