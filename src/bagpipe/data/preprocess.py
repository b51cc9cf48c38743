"""Convert Criteo TSV, Avazu CSV, JSON-lines files or an interaction log (plain or gzip) into the binary format
(data.binary), with clear errors, recording what the conversion was made from (data.sources). Data without a test
split has its last lines held out as one. It converts whenever asked: data.prepare decides when that is needed."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager, suppress
from pathlib import Path

import numpy as np
import orjson
import xxhash

from bagpipe.data.avazu import AvazuParser
from bagpipe.data.binary import SplitWriter, id_dtype_for, move_into, partial_path, write_meta
from bagpipe.data.blocks import count_lines, next_block, open_decompressed, read_ahead
from bagpipe.data.blocks import first_line as read_first_line  # first_line: a line number here
from bagpipe.data.formats import NUM_DENSE, BadRows, CriteoParser, DataError, JsonlParser, NeedsWidths, TextBlock
from bagpipe.data.rawids import KEY_BITS, KEY_SPACE, RawIdParser
from bagpipe.data.sequences import SequenceSettings, convert_interactions
from bagpipe.data.sources import (DEFAULT_HOLDOUT, VOCAB_FORMATS, check_format, check_holdout, conversion_settings,
                                  effective_holdout, find_splits, fingerprint, guess_format, source_files,
                                  source_meta_path, stat_fields, table_sizes_from)
from bagpipe.data.vocab import (OOV_ID, VOCAB_DIR, EncodedParser, HashedColumn, Vocabulary, check_vocab_min_count,
                                count_values, write_vocabularies)
from bagpipe.files import mount_point, read_json
from bagpipe.heap import kept_heap
from bagpipe.progress import progress

log = logging.getLogger(__name__)

LINES_PER_CHUNK = 65_536
BYTES_PER_CHUNK = 8 << 20  # and at most as many lines as fit in this many bytes (a longer line: just it)
BAD_ROW_POLICIES = ("error", "skip")


def _held_out_lines(splits: dict[str, Path], fmt: str, holdout: float) -> int | None:
    """The first line of the train file that goes to the test split instead, or None if none does."""
    if not effective_holdout(splits, fmt, holdout):
        return None
    lines = count_lines(splits["train"])
    held = round(lines * holdout)
    return lines - held + 1 if held else None


def physical_memory_bytes() -> int:
    """This machine's memory (preprocess's and preflight's checks measure against it)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_disk_bytes(path: Path) -> int:
    """Free space on the file system that ``path`` (or its nearest existing parent) is on."""
    return shutil.disk_usage(mount_point(path)).free


# The least a table's row costs the servers that hold it, in memory or on disk: one float32 (a table of width 1,
# with no optimizer state). Tables sized by ids far beyond the data (hashed ids, say) cannot be held at all.
TABLE_BYTES_PER_ROW = 4


class _InferredSizes:
    """Each table's largest id so far (its inferred size is that + 1), and where it was seen."""

    def __init__(self) -> None:
        self.max_ids: np.ndarray | None = None
        self.seen_at: list[str] = []

    def update(self, ids: np.ndarray, *, path: Path, first_line: int | None) -> None:
        """``ids`` holds each row's largest id per table; ``first_line`` is the line of ``ids[0]`` if
        row i is line first_line + i, else None."""
        chunk_max = ids.max(axis=0)
        if self.max_ids is None:
            self.max_ids = np.full_like(chunk_max, -1)
            self.seen_at = [str(path)] * len(chunk_max)
        for table in np.flatnonzero(chunk_max > self.max_ids):
            row = int(ids[:, table].argmax())
            self.seen_at[table] = f"{path}:{first_line + row}" if first_line is not None else str(path)
        self.max_ids = np.maximum(self.max_ids, chunk_max)

    def sizes(self) -> list[int]:
        return [max(int(m) + 1, 1) for m in self.max_ids]  # a multi-valued feature may be all PAD

    def refuse_if_unstorable(self, names: list[str], out: Path) -> None:
        """Ids whose tables no server could hold (a table holds every row up to its largest id, in memory or on
        disk: at least TABLE_BYTES_PER_ROW each) are an error. (The planner is not the limit: its state grows with
        the rows the data uses, not with the tables.)"""
        rows = sum(self.sizes())
        need = rows * TABLE_BYTES_PER_ROW
        if need <= physical_memory_bytes():
            return
        have = physical_memory_bytes() + free_disk_bytes(out)
        if need <= have:
            return
        table = int(np.argmax(self.max_ids))
        raise ValueError(
            f"{self.seen_at[table]}: {names[table]} has id {int(self.max_ids[table])}, "
            f"so with no table sizes given the tables would hold {rows:,} rows; even at width 1 their servers need "
            f"{TABLE_BYTES_PER_ROW} bytes a row, {_gib(need)}, but this machine has {_gib(have)} of memory and free "
            f"disk. Give --table-sizes or a meta.json with table_sizes beside the data, or map the ids into a dense "
            f"range 0..n-1 per table")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.1f} GiB"


def _read_chunks(path: Path, *, show_progress: bool, desc: str, digest=None) -> Iterator[tuple[int, TextBlock]]:
    """Blocks of whole lines from a plain or a gzip file, each with the number of its first line:
    LINES_PER_CHUNK lines, or as many as fit in BYTES_PER_CHUNK bytes if fewer; each read while the one
    before is parsed.

    The progress bar counts bytes as stored; ``digest`` (a hash object) is given every stored byte.
    """
    with ExitStack() as stack:
        raw, data_in = open_decompressed(path, stack, digest=digest)
        bar = stack.enter_context(progress(total=path.stat().st_size, desc=desc, unit="B", enabled=show_progress))

        def blocks() -> Iterator[tuple[int, TextBlock, int]]:
            first_line, ahead = 1, b""
            while True:
                block, ahead = next_block(data_in, ahead, path=path, first_line=first_line,
                                          max_bytes=BYTES_PER_CHUNK, max_lines=LINES_PER_CHUNK)
                if not block.num_lines:
                    return
                yield first_line, block, raw.tell()
                first_line += len(block)

        stored_bytes_read = 0
        for first_line, block, stored_bytes in stack.enter_context(closing(read_ahead(blocks()))):
            yield first_line, block
            bar.update(stored_bytes - stored_bytes_read)
            stored_bytes_read = stored_bytes


@kept_heap()  # its numpy temporaries, reused block after block: a fifth less CPU
def preprocess(
    input_path: str | Path,
    out_dir: str | Path,
    *,
    fmt: str | None = None,
    table_sizes: str | list[int] | None = None,
    meta_file: str | Path | None = None,
    on_bad_row: str = "error",
    show_progress: bool = True,
    sequence: SequenceSettings | None = None,
    holdout: float = DEFAULT_HOLDOUT,
    vocab_min_count: int = 0,
    raw_ids: bool = False,
) -> dict:
    """Preprocess every split under ``input_path`` into ``out_dir``; return the written meta.

    Without a test split (a lone file, or no ``test.*``) the last ``round(lines * holdout)`` lines of
    the train file are the test split; an interaction log holds out each user's last item instead.
    ``vocab_min_count`` > 0 numbers Criteo's or Avazu's raw values by a vocabulary of the train split
    (data.vocab), written to ``out_dir/vocab``; ``raw_ids`` keeps each value as a 63-bit key of its own
    (data.rawids: no vocabulary, no table sizes); else their values are hashed modulo the table sizes.
    A conversion that fails leaves ``out_dir`` as it was, or absent if it was (``_written_whole``).
    """
    with _written_whole(Path(out_dir)) as partial:
        return _preprocess_into(Path(input_path), partial, fmt=fmt, table_sizes=table_sizes, meta_file=meta_file,
                                on_bad_row=on_bad_row, show_progress=show_progress, sequence=sequence,
                                holdout=holdout, vocab_min_count=vocab_min_count, raw_ids=raw_ids)


@contextmanager
def _written_whole(out: Path) -> Iterator[Path]:
    """A new sibling directory of ``out`` to write into, moved into ``out`` (data.binary's ``move_into``) when the
    block ends without an error; after one, removed, with the parent directories made for it."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a directory")
    out = out.resolve()  # "." has no name to make a sibling of
    made = [parent for parent in out.parents if not parent.exists()]  # deepest first
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(out)
    try:
        yield partial
        move_into(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        for parent in made:
            with suppress(OSError):  # not empty: something else wrote there meanwhile
                parent.rmdir()
        raise


def _preprocess_into(input_path: Path, out: Path, *, fmt: str | None, table_sizes: str | list[int] | None,
                     meta_file: str | Path | None, on_bad_row: str, show_progress: bool,
                     sequence: SequenceSettings | None, holdout: float, vocab_min_count: int,
                     raw_ids: bool = False) -> dict:
    """``preprocess``, into ``out``, a directory not there yet."""
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ValueError(f"--on-bad-row must be one of {', '.join(BAD_ROW_POLICIES)}, got {on_bad_row!r}")
    check_format(fmt)
    check_holdout(holdout)
    check_vocab_min_count(vocab_min_count)
    splits = find_splits(input_path)
    fmt = fmt or guess_format(splits["train"])
    if vocab_min_count and fmt not in VOCAB_FORMATS:
        raise ValueError(f"--vocab-min-count: {fmt} data holds ids already; a vocabulary numbers the raw values of "
                         f"{' and '.join(VOCAB_FORMATS)} data")
    if raw_ids and fmt == "movielens":
        raise ValueError("--raw-ids: an interaction log's users and items are numbered by popularity (next-item "
                         "samples need them dense); raw ids apply to click logs (criteo, avazu, jsonl)")
    if raw_ids and (vocab_min_count or table_sizes or meta_file):
        raise ValueError("--raw-ids keeps every value as a key of its own, with no table sizes: give it without "
                         "--vocab-min-count, --table-sizes and --meta")
    if fmt == "movielens":
        return _preprocess_interactions(input_path, splits, out, meta_file=meta_file, sequence=sequence)
    if vocab_min_count and (table_sizes or meta_file):
        raise ValueError("give either --vocab-min-count (table sizes from the vocabulary) or --table-sizes / --meta "
                         "(values hashed modulo the sizes), not both")
    if raw_ids:
        sizes, sizes_from = [KEY_SPACE] * _raw_tables(fmt, splits), "raw ids"
    else:
        sizes, sizes_from = (None, "vocabulary") if vocab_min_count else table_sizes_from(
            table_sizes=table_sizes, meta_file=meta_file, input_path=input_path)
    if sizes is not None and (not sizes or any(s <= 0 for s in sizes)):
        raise ValueError(f"table sizes must be positive integers, got {sizes}")
    if fmt in VOCAB_FORMATS and sizes is None and not vocab_min_count:
        raise ValueError(f"{input_path}: {fmt} values need ids: give --vocab-min-count N (a vocabulary of the train "
                         f"split's values seen N times or more) or --table-sizes / --meta FILE (a meta.json; values "
                         f"hashed modulo the sizes)")
    # The splits are hashed by the reads that convert them; their stat fields are taken before.
    stats = {name: stat_fields(path) for name, path in source_files(input_path, splits).items()}
    test_from = _held_out_lines(splits, fmt, holdout)

    out.mkdir()
    parser, vocabularies = _text_parser(fmt, splits, sizes=sizes, vocab_min_count=vocab_min_count,
                                        test_from=test_from, on_bad_row=on_bad_row, show_progress=show_progress)
    if raw_ids:
        parser = RawIdParser(parser)
    elif isinstance(parser, EncodedParser):
        sizes = [encoder.size for encoder in parser.encoders]
    convert = {"sizes": sizes, "test_from": test_from, "on_bad_row": on_bad_row, "show_progress": show_progress}
    digests = {name: xxhash.xxh3_128() for name in splits}
    try:
        writers, bad, sizes = _convert_splits(splits, out, parser, digests=digests, **convert)
    except NeedsWidths as first:
        if raw_ids:
            raise ValueError(f"--raw-ids: multi-valued features (first at {first}) are not supported yet: one id "
                             f"per feature and row") from None
        # Lists need their widths before anything is written: a first pass over every split finds them.
        log.info("%s: multi-valued rows (first at %s): measuring the input first", input_path, first)
        parser = JsonlParser(sizes, shape=_measure(splits, sizes=sizes, on_bad_row=on_bad_row,
                                                   show_progress=show_progress))
        digests = {name: xxhash.xxh3_128() for name in splits}
        writers, bad, sizes = _convert_splits(splits, out, parser, digests=digests, **convert)
    schema = parser.schema(sizes)
    for writer in writers.values():
        writer.close(schema=schema)

    beside = source_meta_path(input_path)
    source_meta = read_json(beside) if beside.is_file() else {}
    meta = {
        **{k: v for k, v in source_meta.items() if k not in ("format", "table_sizes")},
        "format": "bagpipe-binary",
        "source": {split: str(path) for split, path in splits.items()},
        "source_format": fmt,
        "table_sizes": schema.cardinalities,
        "rows": {split: writer.rows for split, writer in writers.items()},
        "held_out": None if test_from is None else {
            "holdout": holdout, "from_line": test_from, "rows": writers["test"].rows,
            "note": f"the test split is lines {test_from}.. of {splits['train']}"},
        **({"raw_ids": {"key_bits": KEY_BITS, "note": "each categorical value stored as a 63-bit key of its own "
                        "(bagpipe.data.rawids.raw_keys of the value and its table): no vocabulary, no table size; "
                        "table_sizes is the key space"}} if raw_ids else {}),
        "skipped_rows": bad.total if bad else 0,
        "skipped_by_reason": dict(bad.counts) if bad else {},
        "vocabulary": None if vocabularies is None else {
            "min_count": vocab_min_count, "oov_id": OOV_ID, "directory": VOCAB_DIR,
            "files": write_vocabularies(out / VOCAB_DIR, vocabularies),
            "note": f"ids 1.. by descending count in the train split; id {OOV_ID}: values seen fewer than "
                    f"min_count times there, values it never shows, empty fields"},
        "made_from": {
            **conversion_settings(fmt=fmt, on_bad_row=on_bad_row, table_sizes_from=sizes_from,
                                  holdout=effective_holdout(splits, fmt, holdout), vocab_min_count=vocab_min_count),
            "table_sizes": schema.cardinalities,
            "sources": {name: fingerprint(path, stat=stats[name], digest=digests.get(name))
                        for name, path in source_files(input_path, splits).items()},
        },
    }
    if bad and bad.total:
        log.warning("skipped %d bad rows (%s); first: %s", bad.total, dict(bad.counts), bad.examples[0])
    write_meta(out, meta)
    return meta


def _text_parser(fmt: str, splits: dict[str, Path], *, sizes: list[int] | None, vocab_min_count: int,
                 test_from: int | None, on_bad_row: str, show_progress: bool) -> tuple[object, list | None]:
    """The parser of ``fmt``'s rows, and the vocabularies it numbers values by (counted here, over the
    train split's lines before ``test_from``), if any."""
    if fmt == "jsonl":
        return JsonlParser(sizes), None
    if fmt == "criteo" and not vocab_min_count:
        return CriteoParser(sizes), None
    base = (AvazuParser({str(path): read_first_line(path) for path in splits.values()}) if fmt == "avazu"
            else CriteoParser(num_tables=_criteo_tables(splits["train"])))
    if not vocab_min_count:
        if len(sizes) != base.num_tables:
            raise ValueError(f"{len(sizes)} table sizes given, but {splits['train']} has {base.num_tables} "
                             f"categorical columns ({', '.join(base.table_names)})")
        return EncodedParser(base, [HashedColumn(size) for size in sizes]), None
    train = splits["train"]
    scratch = BadRows() if on_bad_row == "skip" else None  # the conversion counts them
    blocks = _routed(_read_chunks(train, show_progress=show_progress, desc="count train"), split="train",
                     test_from=test_from)
    counts = count_values(base, ((str(train), first, block) for part, first, block in blocks if part == "train"),
                          bad=scratch)
    vocabularies = [Vocabulary.from_counts(name, table_counts, min_count=vocab_min_count)
                    for name, table_counts in zip(base.table_names, counts)]
    empty = [vocabulary.name for vocabulary in vocabularies if vocabulary.size == 1]
    if empty:
        log.warning("%s: no value seen %d times or more in the train split of %s: every id there is the "
                    "out-of-vocabulary id %d", ", ".join(empty), vocab_min_count, train, OOV_ID)
    return EncodedParser(base, vocabularies), vocabularies


def _raw_tables(fmt: str, splits: dict[str, Path]) -> int:
    """The number of tables of raw-id data, read from the train split's first line."""
    train = splits["train"]
    if fmt == "criteo":
        return _criteo_tables(train)
    if fmt == "avazu":
        return AvazuParser({str(train): read_first_line(train)}).num_tables
    try:
        sparse = orjson.loads(read_first_line(train))["sparse"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise DataError(str(train), 1, "--raw-ids: the first line is not a JSON object with \"sparse\" ids") from None
    return len(sparse)


def _criteo_tables(path: Path) -> int:
    """Criteo's categorical columns, counted on its first line (a vocabulary needs no table sizes)."""
    tables = read_first_line(path).count("\t") - NUM_DENSE
    if tables < 1:
        raise DataError(str(path), 1, f"wrong column count: expected a label, {NUM_DENSE} dense columns and "
                                      f"categorical ones")
    return tables


def _convert_splits(splits: dict[str, Path], out: Path, parser, *, sizes: list[int] | None, test_from: int | None,
                    on_bad_row: str, show_progress: bool,
                    digests: dict) -> tuple[dict[str, SplitWriter], BadRows | None, list[int]]:
    """Write every split (and the train file's held-out lines from ``test_from`` on as the test split), each
    split's stored bytes passed through ``digests[split]`` as they are read; return the writers, the bad rows
    skipped and the table sizes (inferred if not given)."""
    # With inferred sizes (JSON lines only) ids may exceed int32 only if the data says so: use int64.
    id_dtype = id_dtype_for(sizes) if sizes else np.dtype(np.int64)
    bad = BadRows() if on_bad_row == "skip" else None
    inferred = _InferredSizes() if sizes is None else None
    writers = {split: SplitWriter(out / split, id_dtype=id_dtype) for split in splits}
    if test_from is not None:
        writers["test"] = SplitWriter(out / "test", id_dtype=id_dtype)
    try:
        for split, path in splits.items():
            blocks = _read_chunks(path, show_progress=show_progress, desc=f"preprocess {split}",
                                  digest=digests[split])
            for part, first_line, block in _routed(blocks, split=split,
                                                   test_from=test_from if split == "train" else None):
                skipped_before = bad.total if bad else 0
                chunk = parser.parse(block, path=str(path), first_line=first_line, bad=bad)
                if inferred is not None and len(chunk.labels):
                    rows_are_lines = (bad.total if bad else 0) == skipped_before
                    per_table = np.maximum.reduceat(chunk.ids, parser.table_starts(), axis=1)
                    inferred.update(per_table, path=path, first_line=first_line if rows_are_lines else None)
                    inferred.refuse_if_unstorable(parser.table_names(), out)  # as soon as it shows, not at the end
                writers[part].append(chunk)
    except BaseException:
        for writer in writers.values():  # no write lands later, in files a second pass opens again
            writer.discard()
        raise
    if inferred is not None:
        if inferred.max_ids is None:
            raise ValueError(f"{', '.join(map(str, splits.values()))}: no valid rows, so table sizes cannot be "
                             f"inferred")
        sizes = inferred.sizes()
        log.warning("no table sizes given: inferred %s from the largest ids", sizes)
    return writers, bad, sizes


def _routed(blocks: Iterator[tuple[int, TextBlock]], *, split: str,
            test_from: int | None) -> Iterator[tuple[str, int, TextBlock]]:
    """Each block of lines with the split it goes to: lines ``test_from`` on to the test split. By line
    number, before parsing, so that skipped bad rows do not move the boundary."""
    for first_line, block in blocks:
        cut = len(block) if test_from is None else min(max(test_from - first_line, 0), len(block))
        head, tail = block.split(cut)
        if cut:
            yield split, first_line, head
        if cut < len(block):
            yield "test", first_line + cut, tail


def _measure(splits: dict[str, Path], *, sizes: list[int] | None, on_bad_row: str, show_progress: bool):
    """JSON lines' shape (each feature's longest list) over every split, held-out lines too."""
    parser = JsonlParser(sizes)
    scratch = BadRows() if on_bad_row == "skip" else None  # the conversion counts them
    for split, path in splits.items():
        for first_line, block in _read_chunks(path, show_progress=show_progress, desc=f"measure {split}"):
            parser.measure(block, path=str(path), first_line=first_line, bad=scratch)
    shape = parser.learned_shape()
    assert shape is not None, "measured because a valid row needed it"
    return shape


def sequence_settings(meta_path: Path | None) -> SequenceSettings:
    """A log's sample shape: the ``sequence`` entry of its meta.json (as ``bagpipe synth`` writes), else defaults."""
    if meta_path is None or not meta_path.is_file():
        return SequenceSettings()
    return SequenceSettings(**read_json(meta_path).get("sequence", {}))


def _preprocess_interactions(input_path: Path, splits: dict[str, Path], out: Path, *,
                             meta_file: str | Path | None, sequence: SequenceSettings | None) -> dict:
    """An interaction log into next-item samples (data.sequences), with the same records as the text formats."""
    if set(splits) != {"train"}:
        raise ValueError(f"{input_path}: an interaction log is one file; its test split is each user's last item")
    meta_path = Path(meta_file) if meta_file else source_meta_path(input_path)
    settings = sequence or sequence_settings(meta_path)
    sources = {name: fingerprint(path) for name, path in source_files(input_path, splits).items()}
    out.mkdir()
    converted = convert_interactions(splits["train"], out, settings)
    source_meta = read_json(meta_path) if meta_path.is_file() else {}
    if source_meta.get("sequence", settings.to_dict()) != settings.to_dict():
        # The planted best was ranked over the synthesised history; other samples have another.
        source_meta = {k: v for k, v in source_meta.items() if not k.startswith("best_")}
    meta = {**{k: v for k, v in source_meta.items() if k not in ("format", "table_sizes")}, **converted,
            "format": "bagpipe-binary", "source": {"log": str(splits["train"])}, "source_format": "movielens",
            "skipped_rows": 0, "skipped_by_reason": {},
            "made_from": {**conversion_settings(fmt="movielens", on_bad_row="error", table_sizes_from="the log",
                                                holdout=None, vocab_min_count=0),
                          "table_sizes": converted["table_sizes"], "sources": sources}}
    write_meta(out, meta)
    return meta
