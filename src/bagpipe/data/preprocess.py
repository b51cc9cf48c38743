"""Turn Criteo TSV, Avazu CSV or JSON-lines files (plain or gzip) into the binary format, with clear
errors; ``ensure_preprocessed`` converts a data file or directory once, and again only when its
sources or the settings change or the converted copy fails its checksums. Data without a test split
has its last lines held out as one."""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import zlib
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager, suppress
from pathlib import Path

import numpy as np
import xxhash

from bagpipe.data.avazu import AvazuParser, is_avazu_header
from bagpipe.data.binary import (SPLITS, CorruptData, SplitWriter, id_dtype_for, is_preprocessed, open_dataset,
                                 read_json, read_record, write_record)
from bagpipe.data.blocks import count_lines, next_block, open_decompressed, read_ahead
from bagpipe.data.blocks import first_line as read_first_line  # first_line: a line number here
from bagpipe.data.formats import NUM_DENSE, BadRows, CriteoParser, DataError, JsonlParser, NeedsWidths, TextBlock
from bagpipe.data.sequences import (INTERACTION_FILES, SNIFF_LINES, SequenceSettings, convert_interactions,
                                    is_atomic_header, is_interaction_log)
from bagpipe.data.vocab import (OOV_ID, VOCAB_DIR, EncodedParser, HashedColumn, Vocabulary, check_vocab_min_count,
                                count_values, write_vocabularies)
from bagpipe.files import mount_point
from bagpipe.heap import kept_heap
from bagpipe.progress import progress

log = logging.getLogger(__name__)

FORMATS = ("criteo", "avazu", "jsonl", "movielens")
SUFFIX_FORMATS = {".tsv": "criteo", ".txt": "criteo", ".csv": "avazu", ".jsonl": "jsonl", ".json": "jsonl"}
VOCAB_FORMATS = ("criteo", "avazu")  # raw values that a vocabulary numbers (data.vocab)
# train --data with Avazu and neither a vocabulary nor table sizes: every value of the train split gets an id.
AVAZU_DEFAULT_MIN_COUNT = 1
LINES_PER_CHUNK = 65_536
BYTES_PER_CHUNK = 8 << 20  # and at most as many lines as fit in this many bytes (a longer line: just it)
BAD_ROW_POLICIES = ("error", "skip")
# a source's content fingerprint: non-cryptographic (it detects change, not tampering) and 13x as fast as
# BLAKE2b here, which mattered: hashing every source competed with parsing for the same cores
CONTENT_HASH = "xxh3_128"
SNIFF_LINE_BYTES = 1 << 16  # enough of a first line to tell its format
# Data without a test split: its last share of lines is held out as one. Criteo Kaggle's convention:
# the last 1/7 of its rows is the last of its seven days.
DEFAULT_HOLDOUT = 1 / 7
# Bump when the same input and settings would convert to different output: older conversions
# then no longer count as current.
CONVERTER_VERSION = 2
# A format's own, where its conversion changed since: an interaction log's 3 holds out a validation split (each
# user's second-to-last item).
CONVERTER_VERSIONS = {"movielens": 3}
TEXT_SPLITS = ("train", "test")  # the splits a directory of text files may hold (train.tsv, test.tsv, ...)


def find_splits(path: Path) -> dict[str, Path]:
    """A file is a lone train split; a directory must hold ``train.*`` (and may hold ``test.*``)."""
    if path.is_file():
        return {"train": path}
    if not path.is_dir():
        raise ValueError(f"--input: no such file or directory: {path}")
    splits = {}
    for split in TEXT_SPLITS:
        matches = sorted(p for p in path.glob(f"{split}.*") if _text_suffix(p) in SUFFIX_FORMATS)
        if len(matches) > 1:
            raise ValueError(f"{path}: several {split} files ({', '.join(m.name for m in matches)}); keep one")
        if matches:
            splits[split] = matches[0]
    logs = [path / name for name in INTERACTION_FILES if (path / name).is_file()] + sorted(path.glob("*.inter"))
    if "train" not in splits and len(logs) == 1:
        return {"train": logs[0]}  # an interaction log: the test split is each user's last item
    if "train" not in splits:
        raise ValueError(f"{path}: no train split (expected a file such as train.tsv, train.csv, train.tsv.gz or "
                         f"train.jsonl, "
                         f"or one interaction log: {', '.join(INTERACTION_FILES)} or RecBole's NAME.inter)")
    return splits


def _text_suffix(path: Path) -> str:
    """The suffix that names the text format: ``.tsv`` for both ``train.tsv`` and ``train.tsv.gz``."""
    return Path(path.stem).suffix if path.suffix == ".gz" else path.suffix


def guess_format(path: Path) -> str:
    """What the first non-empty lines show, whatever the file's name; else its suffix."""
    # Content first: the original system's JSON-lines files are named .txt, RecBole's logs .inter.
    fmt = _sniff(path) or SUFFIX_FORMATS.get(_text_suffix(path))
    if fmt is None:
        raise ValueError(f"{path}: cannot tell the format: its first line is neither a JSON object, nor "
                         f"tab-separated, nor a CSV header with a 'click' column, nor an interaction log's "
                         f"(user, item, rating, timestamp), and its suffix names no format; "
                         f"pass --format criteo|avazu|jsonl|movielens")
    return fmt


def _sniff(path: Path) -> str | None:
    """``jsonl`` if the first non-empty line starts with ``{``, ``avazu`` if it is a CSV header naming ``click``,
    ``movielens`` if it and the next are an interaction log's or it is a RecBole atomic header (data.sequences;
    reading one of another RecBole file says what it lacks), ``criteo`` if it holds a tab, else None."""
    lines: list[tuple[int, str]] = []
    try:
        with ExitStack() as stack:
            _, lines_in = open_decompressed(path, stack)
            for number, line in enumerate(iter(lambda: lines_in.readline(SNIFF_LINE_BYTES), b""), start=1):
                if line.strip():
                    lines.append((number, line.decode("utf-8", "replace").rstrip("\r\n")))
                if len(lines) == SNIFF_LINES:
                    break
    except (OSError, EOFError, zlib.error):
        return None  # unreadable here: the suffix decides, and reading the file names the trouble
    if not lines:
        return None
    first = lines[0][1]
    if first.lstrip().startswith("{"):
        return "jsonl"
    if is_avazu_header(first):
        return "avazu"
    if is_interaction_log(lines) or is_atomic_header(first):
        return "movielens"
    return "criteo" if "\t" in first else None


def check_format(fmt: str | None) -> None:
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def check_holdout(holdout: float) -> None:
    if isinstance(holdout, bool) or not isinstance(holdout, (int, float)) or not 0 <= holdout < 1:
        raise ValueError(f"--holdout must lie in [0, 1) (the share of lines held out as the test split of data "
                         f"without one), got {holdout!r}")


def _held_out_lines(splits: dict[str, Path], fmt: str, holdout: float) -> int | None:
    """The first line of the train file that goes to the test split instead, or None if none does."""
    if not _effective_holdout(splits, fmt, holdout):
        return None
    lines = count_lines(splits["train"])
    held = round(lines * holdout)
    return lines - held + 1 if held else None


def _effective_holdout(splits: dict[str, Path], fmt: str, holdout: float) -> float | None:
    """The holdout that shapes the output: none for data with a test split, or for an interaction log
    (which holds out each user's last item)."""
    return None if "test" in splits or fmt == "movielens" else holdout


def table_sizes_from(*, table_sizes: str | list[int] | None, meta_file: str | Path | None,
                     input_path: Path) -> tuple[list[int] | None, str]:
    """Table sizes from --table-sizes, --meta, or a meta.json beside the input, and which of them.

    Sizes are None, from "inferred", if none is given.
    """
    if table_sizes:
        if isinstance(table_sizes, str):
            try:
                return [int(x) for x in table_sizes.split(",") if x.strip()], "--table-sizes"
            except ValueError:
                raise ValueError(f"--table-sizes: expected comma-separated integers, got {table_sizes!r}") from None
        return list(table_sizes), "--table-sizes"
    if meta_file:
        if not Path(meta_file).is_file():
            raise ValueError(f"--meta: no such file {meta_file}")
        return _sizes_in(Path(meta_file)), f"--meta {meta_file}"
    beside = _source_meta_path(input_path)
    if beside.is_file():
        return _sizes_in(beside), "meta.json"
    return None, "inferred"


def _sizes_in(meta_path: Path) -> list[int]:
    sizes = read_json(meta_path).get("table_sizes")
    if not sizes:
        raise ValueError(f"{meta_path}: has no 'table_sizes'")
    return [int(x) for x in sizes]


def _source_meta_path(input_path: Path) -> Path:
    return (input_path if input_path.is_dir() else input_path.parent) / "meta.json"


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


def _fingerprint(path: Path, *, stat: list[int] | None = None, digest=None) -> dict:
    """What a converted file was made from: name, size, content hash and the stat fields of that moment.
    ``digest``: the file's hash, made while it was read (with ``stat`` taken before that read), else it is
    read here."""
    stat = stat or _stat_fields(path)  # before hashing: a write during the hash then fails the next comparison
    if digest is None:
        with open(path, "rb") as handle:
            digest = hashlib.file_digest(handle, xxhash.xxh3_128)
    return {"file": path.name, "size": stat[0], CONTENT_HASH: digest.hexdigest(), "stat": stat}


def _stat_fields(path: Path) -> list[int]:
    """Changed by any write (ctime) or replacement (inode), so equal fields mean equal content."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _sources(input_path: Path, splits: dict[str, Path]) -> dict[str, Path]:
    """The files a conversion reads: each split, and the meta.json beside them if there is one."""
    meta_path = _source_meta_path(input_path)
    return {**splits, **({"meta.json": meta_path} if meta_path.is_file() else {})}


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
) -> dict:
    """Preprocess every split under ``input_path`` into ``out_dir``; return the written meta.

    Without a test split (a lone file, or no ``test.*``) the last ``round(lines * holdout)`` lines of
    the train file are the test split; an interaction log holds out each user's last item instead.
    ``vocab_min_count`` > 0 numbers Criteo's or Avazu's raw values by a vocabulary of the train split
    (data.vocab), written to ``out_dir/vocab``; else their values are hashed modulo the table sizes.
    A conversion that fails leaves ``out_dir`` as it was, or absent if it was (``_written_whole``).
    """
    with _written_whole(Path(out_dir)) as partial:
        return _preprocess_into(Path(input_path), partial, fmt=fmt, table_sizes=table_sizes, meta_file=meta_file,
                                on_bad_row=on_bad_row, show_progress=show_progress, sequence=sequence,
                                holdout=holdout, vocab_min_count=vocab_min_count)


@contextmanager
def _written_whole(out: Path) -> Iterator[Path]:
    """A new sibling directory of ``out`` to write into, moved into ``out`` (``_move_into``) when the block ends
    without an error; after one, removed, with the parent directories made for it."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a directory")
    out = out.resolve()  # "." has no name to make a sibling of
    made = [parent for parent in out.parents if not parent.exists()]  # deepest first
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{secrets.token_hex(4)}")
    try:
        yield partial
        _move_into(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        for parent in made:
            with suppress(OSError):  # not empty: something else wrote there meanwhile
                parent.rmdir()
        raise


def _move_into(partial: Path, out: Path) -> None:
    """``partial``'s conversion in ``out``: ``partial`` renamed, if there is no ``out``; else in place of the
    conversion there, its meta.json removed first (without one it is no data set) and added last."""
    if not out.exists():
        partial.rename(out)
        return
    (out / "meta.json").unlink(missing_ok=True)
    for name in (*SPLITS, VOCAB_DIR):
        if (out / name).is_dir():
            shutil.rmtree(out / name)  # a split the new conversion lacks must not stay behind
        if (partial / name).exists():
            (partial / name).rename(out / name)
    (partial / "meta.json").rename(out / "meta.json")
    partial.rmdir()


def _preprocess_into(input_path: Path, out: Path, *, fmt: str | None, table_sizes: str | list[int] | None,
                     meta_file: str | Path | None, on_bad_row: str, show_progress: bool,
                     sequence: SequenceSettings | None, holdout: float, vocab_min_count: int) -> dict:
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
    if fmt == "movielens":
        return _preprocess_interactions(input_path, splits, out, meta_file=meta_file, sequence=sequence)
    if vocab_min_count and (table_sizes or meta_file):
        raise ValueError("give either --vocab-min-count (table sizes from the vocabulary) or --table-sizes / --meta "
                         "(values hashed modulo the sizes), not both")
    sizes, sizes_from = (None, "vocabulary") if vocab_min_count else table_sizes_from(
        table_sizes=table_sizes, meta_file=meta_file, input_path=input_path)
    if sizes is not None and (not sizes or any(s <= 0 for s in sizes)):
        raise ValueError(f"table sizes must be positive integers, got {sizes}")
    if fmt in VOCAB_FORMATS and sizes is None and not vocab_min_count:
        raise ValueError(f"{input_path}: {fmt} values need ids: give --vocab-min-count N (a vocabulary of the train "
                         f"split's values seen N times or more) or --table-sizes / --meta FILE (a meta.json; values "
                         f"hashed modulo the sizes)")
    # The splits are hashed by the reads that convert them; their stat fields are taken before.
    stats = {name: _stat_fields(path) for name, path in _sources(input_path, splits).items()}
    test_from = _held_out_lines(splits, fmt, holdout)

    out.mkdir()
    parser, vocabularies = _text_parser(fmt, splits, sizes=sizes, vocab_min_count=vocab_min_count,
                                        test_from=test_from, on_bad_row=on_bad_row, show_progress=show_progress)
    if isinstance(parser, EncodedParser):
        sizes = [encoder.size for encoder in parser.encoders]
    convert = {"sizes": sizes, "test_from": test_from, "on_bad_row": on_bad_row, "show_progress": show_progress}
    digests = {name: xxhash.xxh3_128() for name in splits}
    try:
        writers, bad, sizes = _convert_splits(splits, out, parser, digests=digests, **convert)
    except NeedsWidths as first:
        # Lists need their widths before anything is written: a first pass over every split finds them.
        log.info("%s: multi-valued rows (first at %s): measuring the input first", input_path, first)
        parser = JsonlParser(sizes, shape=_measure(splits, sizes=sizes, on_bad_row=on_bad_row,
                                                   show_progress=show_progress))
        digests = {name: xxhash.xxh3_128() for name in splits}
        writers, bad, sizes = _convert_splits(splits, out, parser, digests=digests, **convert)
    schema = parser.schema(sizes)
    for writer in writers.values():
        writer.close(schema=schema)

    source_meta_path = _source_meta_path(input_path)
    source_meta = read_json(source_meta_path) if source_meta_path.is_file() else {}
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
        "skipped_rows": bad.total if bad else 0,
        "skipped_by_reason": dict(bad.counts) if bad else {},
        "vocabulary": None if vocabularies is None else {
            "min_count": vocab_min_count, "oov_id": OOV_ID, "directory": VOCAB_DIR,
            "files": write_vocabularies(out / VOCAB_DIR, vocabularies),
            "note": f"ids 1.. by descending count in the train split; id {OOV_ID}: values seen fewer than "
                    f"min_count times there, values it never shows, empty fields"},
        "made_from": {
            **_settings(fmt=fmt, on_bad_row=on_bad_row, table_sizes_from=sizes_from,
                        holdout=_effective_holdout(splits, fmt, holdout), vocab_min_count=vocab_min_count),
            "table_sizes": schema.cardinalities,
            "sources": {name: _fingerprint(path, stat=stats[name], digest=digests.get(name))
                        for name, path in _sources(input_path, splits).items()},
        },
    }
    if bad and bad.total:
        log.warning("skipped %d bad rows (%s); first: %s", bad.total, dict(bad.counts), bad.examples[0])
    write_record(out / "meta.json", meta)
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


def _settings(*, fmt: str, on_bad_row: str, table_sizes_from: str, holdout: float | None,
              vocab_min_count: int) -> dict:
    """The settings besides the sources that shape a conversion's output (``holdout``: the one that applies)."""
    return {"converter_version": CONVERTER_VERSIONS.get(fmt, CONVERTER_VERSION), "format": fmt, "on_bad_row": on_bad_row,
            "table_sizes_from": table_sizes_from, "holdout": holdout, "vocab_min_count": vocab_min_count}


# Settings recorded since a later version; a record without one was made with this value.
_SETTINGS_BEFORE = {"vocab_min_count": 0}


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
    meta_path = Path(meta_file) if meta_file else _source_meta_path(input_path)
    settings = sequence or sequence_settings(meta_path)
    sources = {name: _fingerprint(path) for name, path in _sources(input_path, splits).items()}
    out.mkdir()
    converted = convert_interactions(splits["train"], out, settings)
    source_meta = read_json(meta_path) if meta_path.is_file() else {}
    if source_meta.get("sequence", settings.to_dict()) != settings.to_dict():
        # The planted best was ranked over the synthesised history; other samples have another.
        source_meta = {k: v for k, v in source_meta.items() if not k.startswith("best_")}
    meta = {**{k: v for k, v in source_meta.items() if k not in ("format", "table_sizes")}, **converted,
            "format": "bagpipe-binary", "source": {"log": str(splits["train"])}, "source_format": "movielens",
            "skipped_rows": 0, "skipped_by_reason": {},
            "made_from": {**_settings(fmt="movielens", on_bad_row="error", table_sizes_from="the log",
                                      holdout=None, vocab_min_count=0),
                          "table_sizes": converted["table_sizes"], "sources": sources}}
    write_record(out / "meta.json", meta)
    return meta


def converted_path(input_path: Path) -> Path:
    """Where ``ensure_preprocessed`` keeps the converted copy: ``DIR/preprocessed``, or beside a lone
    file as ``FILE.preprocessed``."""
    if input_path.is_dir():
        return input_path / "preprocessed"
    return input_path.with_name(f"{input_path.name}.preprocessed")


def ensure_preprocessed(path: str | Path, *, show_progress: bool = True, fmt: str | None = None,
                        holdout: float = DEFAULT_HOLDOUT, vocab_min_count: int = 0) -> Path:
    """Return a preprocessed data directory for ``path`` (a data directory, a lone data file, or a
    preprocessed directory, returned as is), converting the text once.

    The converted copy (``converted_path``) is reused as long as it was made, with the settings used
    here (``fmt``: the format, None to detect it; ``holdout``: the share of lines held out as the test
    split of data without one; ``vocab_min_count``: a vocabulary's, 0 for none), from the files now there
    (same stat fields, or else same content hash), and while every file of it is as written (its checksum,
    data.binary). Otherwise it is converted again, into a sibling swapped in only when complete; a copy
    found corrupted is named in a warning. A preprocessed directory, which has no sources to convert
    from, is verified the same way and refused (CorruptData, naming the file) if corrupted. Avazu data
    with neither a vocabulary nor table sizes (a meta.json beside it) gets a vocabulary of min count
    AVAZU_DEFAULT_MIN_COUNT.
    """
    path = Path(path)
    check_format(fmt)
    check_holdout(holdout)
    check_vocab_min_count(vocab_min_count)
    if not path.exists():
        raise ValueError(f"--data: no such file or directory {path}")
    if is_preprocessed(path):
        if vocab_min_count:
            log.warning("--vocab-min-count %d does nothing: %s is converted already", vocab_min_count, path)
        if not open_dataset(path, verify=True).checksummed:  # with no sources to convert from, corruption refuses
            log.debug("%s records no checksums (an older bagpipe converted it): used unverified", path)
        return path
    splits = find_splits(path)
    fmt = fmt or guess_format(splits["train"])
    if fmt == "avazu" and not vocab_min_count and not _has_sizes(_source_meta_path(path)):
        vocab_min_count = AVAZU_DEFAULT_MIN_COUNT
        log.info("Avazu data with no table sizes: ids from a vocabulary of min count %d (--vocab-min-count)",
                 vocab_min_count)
    cached = converted_path(path)
    if is_preprocessed(cached):
        try:
            reason = (_why_stale(cached, path, splits, fmt=fmt, holdout=holdout, vocab_min_count=vocab_min_count)
                      or _why_unverified(cached))
        except CorruptData as err:
            log.warning("%s: %s: converting it again from %s", err.path, err.reason, path)
        else:
            if reason is None:
                return cached
            log.info("%s: converting again", reason)
    else:
        log.info("preprocessing %s into %s (once)", path, cached)
    _convert_and_swap(path, cached, show_progress=show_progress, fmt=fmt, holdout=holdout,
                      vocab_min_count=vocab_min_count)
    return cached


def _why_unverified(cached: Path) -> str | None:
    """Why ``cached`` cannot be verified, or None once every array matches its checksum (CorruptData if one
    does not, or a file is unreadable or of the wrong size)."""
    if not open_dataset(cached, verify=True).checksummed:
        return f"{cached} was made by an older version of bagpipe that recorded no checksums"
    return None


def _has_sizes(meta_path: Path) -> bool:
    return meta_path.is_file() and bool(read_json(meta_path).get("table_sizes"))


def _why_stale(cached: Path, input_path: Path, splits: dict[str, Path], *, fmt: str, holdout: float,
               vocab_min_count: int) -> str | None:
    """Why ``cached`` is not the conversion of ``input_path`` as it is now, with these settings, or None if it is.

    Files whose stat fields changed are hashed; if their content did not, the new fields are
    recorded, so that the next start takes the fast path again.
    """
    meta_path = cached / "meta.json"
    meta = read_record(meta_path) if meta_path.is_file() else {}
    made_from = meta.get("made_from")
    if made_from is None:
        return f"{cached} was made by an older version of bagpipe that kept no record of its sources"
    sources, recorded = _sources(input_path, splits), made_from["sources"]
    # Files gone or new first: they also change the holdout that applies.
    for name in sorted(recorded.keys() - sources.keys()):
        gone = _source_meta_path(input_path).parent / recorded[name]["file"]
        return f"{gone} is gone since {cached} was made from it"
    for name in sorted(sources.keys() - recorded.keys()):
        return f"{sources[name]} is new since {cached} was made"
    sizes_from = ("the log" if fmt == "movielens" else "vocabulary" if vocab_min_count
                  else "meta.json" if _source_meta_path(input_path).is_file() else "inferred")
    current = _settings(fmt=fmt, on_bad_row="error", table_sizes_from=sizes_from,
                        holdout=_effective_holdout(splits, fmt, holdout), vocab_min_count=vocab_min_count)
    for key, value in current.items():
        recorded_value = made_from.get(key, _SETTINGS_BEFORE.get(key))
        if recorded_value != value:
            return f"{cached} was made with {key} {recorded_value!r}, not {value!r}"
    for name, path in sources.items():
        if path.name != recorded[name]["file"]:
            return f"{cached} was made from {recorded[name]['file']}, not {path.name}"
    moved = [name for name, path in sources.items() if _stat_fields(path) != recorded[name]["stat"]]
    for name in moved:
        if CONTENT_HASH not in recorded[name]:
            return f"{cached} was fingerprinted by an earlier version (another hash), so it is converted again"
        now = _fingerprint(sources[name])
        if (now["size"], now[CONTENT_HASH]) != (recorded[name]["size"], recorded[name][CONTENT_HASH]):
            return f"{sources[name]} changed since {cached} was made from it (content differs)"
        recorded[name]["stat"] = now["stat"]
    if moved:
        _refresh_meta(meta_path, meta)
    return None


def _refresh_meta(meta_path: Path, meta: dict) -> None:
    try:
        write_record(meta_path, meta)
    except OSError as err:  # a read-only data set is still current: it is only hashed on every start
        log.info("could not record the new stat fields in %s (%s)", meta_path, err)


def _convert_and_swap(input_path: Path, cached: Path, *, show_progress: bool, fmt: str, holdout: float,
                      vocab_min_count: int) -> None:
    """Convert into a sibling of ``cached`` and swap it in only when complete and readable."""
    partial = cached.with_name(f".{cached.name}.partial-{secrets.token_hex(4)}")
    try:
        preprocess(input_path, partial, show_progress=show_progress, fmt=fmt, holdout=holdout,
                   vocab_min_count=vocab_min_count)
        open_dataset(partial)  # fail here, not mid-training, if anything is inconsistent
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if not cached.exists():
        partial.rename(cached)
        return
    # Readers that mapped the old files keep them (an unlinked file lives while it is mapped).
    old = cached.with_name(f".{cached.name}.old-{secrets.token_hex(4)}")
    cached.rename(old)
    partial.rename(cached)
    shutil.rmtree(old)
