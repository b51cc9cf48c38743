"""Turn Criteo TSV or JSON-lines files (plain or gzip) into the binary format, with clear errors;
``ensure_preprocessed`` converts a data directory once and again only when its sources change."""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import json
import logging
import os
import secrets
import shutil
import zlib
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import numpy as np

from bagpipe.data.binary import SPLITS, SplitWriter, id_dtype_for, is_preprocessed, open_dataset
from bagpipe.data.formats import NUM_DENSE, BadRows, CriteoParser, DataError, JsonlParser, decode_lines
from bagpipe.data.schema import Schema
from bagpipe.data.sequences import INTERACTION_FILES, SequenceSettings, convert_interactions, is_interaction_log
from bagpipe.planner.plan import PLANNER_BYTES_PER_ROW
from bagpipe.progress import progress

log = logging.getLogger(__name__)

FORMATS = ("criteo", "jsonl", "movielens")
SUFFIX_FORMATS = {".tsv": "criteo", ".txt": "criteo", ".csv": "criteo", ".jsonl": "jsonl", ".json": "jsonl"}
LINES_PER_CHUNK = 65_536
BAD_ROW_POLICIES = ("error", "skip")
GZIP_MAGIC = b"\x1f\x8b"
GZIP_READ_BYTES = 1 << 20
# Bump when the same input and settings would convert to different output: older conversions
# then no longer count as current.
CONVERTER_VERSION = 2


def find_splits(path: Path) -> dict[str, Path]:
    """A file is a lone train split; a directory must hold ``train.*`` (and may hold ``test.*``)."""
    if path.is_file():
        return {"train": path}
    if not path.is_dir():
        raise ValueError(f"--input: no such file or directory: {path}")
    splits = {}
    for split in SPLITS:
        matches = sorted(p for p in path.glob(f"{split}.*") if _text_suffix(p) in SUFFIX_FORMATS)
        if len(matches) > 1:
            raise ValueError(f"{path}: several {split} files ({', '.join(m.name for m in matches)}); keep one")
        if matches:
            splits[split] = matches[0]
    logs = [path / name for name in INTERACTION_FILES if (path / name).is_file()]
    if "train" not in splits and len(logs) == 1:
        return {"train": logs[0]}  # an interaction log: the test split is each user's last item
    if "train" not in splits:
        raise ValueError(f"{path}: no train split (expected a file such as train.tsv, train.tsv.gz or train.jsonl, "
                         f"or an interaction log: {', '.join(INTERACTION_FILES)})")
    return splits


def _text_suffix(path: Path) -> str:
    """The suffix that names the text format: ``.tsv`` for both ``train.tsv`` and ``train.tsv.gz``."""
    return Path(path.stem).suffix if path.suffix == ".gz" else path.suffix


def guess_format(path: Path) -> str:
    if is_interaction_log(path):
        return "movielens"
    fmt = SUFFIX_FORMATS.get(_text_suffix(path))
    if fmt is None:
        raise ValueError(f"{path}: cannot tell the format from the suffix; pass --format criteo|jsonl")
    return fmt


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
    sizes = json.loads(meta_path.read_text()).get("table_sizes")
    if not sizes:
        raise ValueError(f"{meta_path}: has no 'table_sizes'")
    return [int(x) for x in sizes]


def _source_meta_path(input_path: Path) -> Path:
    return (input_path if input_path.is_dir() else input_path.parent) / "meta.json"


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class _InferredSizes:
    """Each table's largest id so far (its inferred size is that + 1), and where it was seen."""

    def __init__(self) -> None:
        self.max_ids: np.ndarray | None = None
        self.seen_at: list[str] = []

    def update(self, ids: np.ndarray, *, path: Path, first_line: int | None) -> None:
        """``first_line`` is the line of ``ids[0]`` if row i is line first_line + i, else None."""
        chunk_max = ids.max(axis=0)
        if self.max_ids is None:
            self.max_ids = np.full_like(chunk_max, -1)
            self.seen_at = [str(path)] * len(chunk_max)
        for table in np.flatnonzero(chunk_max > self.max_ids):
            row = int(ids[:, table].argmax())
            self.seen_at[table] = f"{path}:{first_line + row}" if first_line is not None else str(path)
        self.max_ids = np.maximum(self.max_ids, chunk_max)

    def sizes(self) -> list[int]:
        return [int(m) + 1 for m in self.max_ids]

    def refuse_if_unplannable(self) -> None:
        """Ids no role could plan for (the oracle holds a few arrays over every row) are an error."""
        rows = sum(self.sizes())
        need, have = rows * PLANNER_BYTES_PER_ROW, physical_memory_bytes()
        if need <= have:
            return
        table = int(np.argmax(self.max_ids))
        raise ValueError(
            f"{self.seen_at[table]}: table {table} (index {table} in 'sparse') has id {int(self.max_ids[table])}, "
            f"so with no table sizes given the tables would hold {rows:,} rows; planning them needs "
            f"{PLANNER_BYTES_PER_ROW} bytes a row, {_gib(need)}, but this machine has {_gib(have)}. Give "
            f"--table-sizes or a meta.json with table_sizes beside the data, or map the ids into a dense range "
            f"0..n-1 per table")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.1f} GiB"


def _read_chunks(path: Path, *, bad: BadRows | None, show_progress: bool, desc: str) -> Iterator[tuple[int, list[str]]]:
    """Runs of decoded lines, LINES_PER_CHUNK lines at a time, from a plain or a gzip file.

    Gzip is told by its magic bytes, whatever the name; the progress bar counts bytes as stored.
    """
    with ExitStack() as stack:
        raw = stack.enter_context(open(path, "rb"))
        compressed = raw.read(len(GZIP_MAGIC)) == GZIP_MAGIC
        raw.seek(0)
        # A buffered reader over the gzip stream splits lines in C, as it does for a plain file.
        lines_in = (stack.enter_context(io.BufferedReader(gzip.GzipFile(fileobj=raw), GZIP_READ_BYTES))
                    if compressed else raw)
        bar = stack.enter_context(progress(total=path.stat().st_size, desc=desc, unit="B", enabled=show_progress))
        first_line, stored_bytes_read = 1, 0
        while lines := _next_lines(lines_in, path=path, first_line=first_line):
            yield from decode_lines(lines, path=str(path), first_line=first_line, bad=bad)
            first_line += len(lines)
            bar.update(raw.tell() - stored_bytes_read)
            stored_bytes_read = raw.tell()


def _next_lines(handle, *, path: Path, first_line: int) -> list[bytes]:
    lines: list[bytes] = []
    try:
        lines.extend(itertools.islice(handle, LINES_PER_CHUNK))  # keeps what it read if this fails
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise DataError(str(path), first_line + len(lines), f"corrupt or truncated gzip data ({err})") from None
    return lines


def _fingerprint(path: Path) -> dict:
    """What a converted file was made from: name, size, content hash and the stat fields of that moment."""
    stat = _stat_fields(path)  # before hashing: a write during the hash then fails the next comparison
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, lambda: hashlib.blake2b(digest_size=32)).hexdigest()
    return {"file": path.name, "size": stat[0], "blake2b": digest, "stat": stat}


def _stat_fields(path: Path) -> list[int]:
    """Changed by any write (ctime) or replacement (inode), so equal fields mean equal content."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _sources(input_path: Path, splits: dict[str, Path]) -> dict[str, Path]:
    """The files a conversion reads: each split, and the meta.json beside them if there is one."""
    meta_path = _source_meta_path(input_path)
    return {**splits, **({"meta.json": meta_path} if meta_path.is_file() else {})}


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
) -> dict:
    """Preprocess every split under ``input_path`` into ``out_dir``; return the written meta."""
    input_path, out = Path(input_path), Path(out_dir)
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ValueError(f"--on-bad-row must be one of {', '.join(BAD_ROW_POLICIES)}, got {on_bad_row!r}")
    splits = find_splits(input_path)
    fmt = fmt or guess_format(splits["train"])
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "movielens":
        return _preprocess_interactions(input_path, splits, out, meta_file=meta_file, sequence=sequence)
    sizes, sizes_from = table_sizes_from(table_sizes=table_sizes, meta_file=meta_file, input_path=input_path)
    if sizes is not None and (not sizes or any(s <= 0 for s in sizes)):
        raise ValueError(f"table sizes must be positive integers, got {sizes}")
    if fmt == "criteo" and sizes is None:
        raise ValueError(f"{input_path}: Criteo ids are hashed; give --table-sizes or --meta FILE (a meta.json)")
    sources = {name: _fingerprint(path) for name, path in _sources(input_path, splits).items()}
    parser = CriteoParser(sizes) if fmt == "criteo" else JsonlParser(sizes)
    # With inferred sizes (JSON lines only) ids may exceed int32 only if the data says so: use int64.
    id_dtype = id_dtype_for(sizes) if sizes else np.dtype(np.int64)

    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    bad = BadRows() if on_bad_row == "skip" else None
    inferred = _InferredSizes() if sizes is None else None
    writers = {}
    for split, path in splits.items():
        writers[split] = SplitWriter(out / split, id_dtype=id_dtype)
        _convert_split(path, writers[split], parser=parser, bad=bad, inferred=inferred,
                       show_progress=show_progress, desc=f"preprocess {split}")
    if inferred is not None:
        if inferred.max_ids is None:
            raise ValueError(f"{input_path}: no valid rows, so table sizes cannot be inferred")
        sizes = inferred.sizes()
        log.warning("no table sizes given: inferred %s from the largest ids", sizes)
    for writer in writers.values():
        writer.close(schema=Schema.one_hot(sizes, num_dense=NUM_DENSE))

    source_meta_path = _source_meta_path(input_path)
    source_meta = json.loads(source_meta_path.read_text()) if source_meta_path.is_file() else {}
    meta = {
        **{k: v for k, v in source_meta.items() if k not in ("format", "table_sizes")},
        "format": "bagpipe-binary",
        "source": {split: str(path) for split, path in splits.items()},
        "source_format": fmt,
        "table_sizes": sizes,
        "rows": {split: writer.rows for split, writer in writers.items()},
        "skipped_rows": bad.total if bad else 0,
        "skipped_by_reason": dict(bad.counts) if bad else {},
        "made_from": {
            **_settings(fmt=fmt, on_bad_row=on_bad_row, table_sizes_from=sizes_from),
            "table_sizes": sizes,
            "sources": sources,
        },
    }
    if bad and bad.total:
        log.warning("skipped %d bad rows (%s); first: %s", bad.total, dict(bad.counts), bad.examples[0])
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _settings(*, fmt: str, on_bad_row: str, table_sizes_from: str) -> dict:
    """The settings besides the sources that shape a conversion's output."""
    return {"converter_version": CONVERTER_VERSION, "format": fmt, "on_bad_row": on_bad_row,
            "table_sizes_from": table_sizes_from}


def sequence_settings(meta_path: Path | None) -> SequenceSettings:
    """A log's sample shape: the ``sequence`` entry of its meta.json (as ``bagpipe synth`` writes), else defaults."""
    if meta_path is None or not meta_path.is_file():
        return SequenceSettings()
    return SequenceSettings(**json.loads(meta_path.read_text()).get("sequence", {}))


def _preprocess_interactions(input_path: Path, splits: dict[str, Path], out: Path, *,
                             meta_file: str | Path | None, sequence: SequenceSettings | None) -> dict:
    """An interaction log into next-item samples (data.sequences), with the same records as the text formats."""
    if set(splits) != {"train"}:
        raise ValueError(f"{input_path}: an interaction log is one file; its test split is each user's last item")
    meta_path = Path(meta_file) if meta_file else _source_meta_path(input_path)
    settings = sequence or sequence_settings(meta_path)
    sources = {name: _fingerprint(path) for name, path in _sources(input_path, splits).items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    converted = convert_interactions(splits["train"], out, settings)
    source_meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if source_meta.get("sequence", settings.to_dict()) != settings.to_dict():
        # The planted best was ranked over the synthesised history; other samples have another.
        source_meta = {k: v for k, v in source_meta.items() if not k.startswith("best_")}
    meta = {**{k: v for k, v in source_meta.items() if k not in ("format", "table_sizes")}, **converted,
            "format": "bagpipe-binary", "source": {"log": str(splits["train"])}, "source_format": "movielens",
            "skipped_rows": 0, "skipped_by_reason": {},
            "made_from": {**_settings(fmt="movielens", on_bad_row="error", table_sizes_from="the log"),
                          "table_sizes": converted["table_sizes"], "sources": sources}}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _convert_split(path: Path, writer: SplitWriter, *, parser, bad: BadRows | None,
                   inferred: _InferredSizes | None, show_progress: bool, desc: str) -> None:
    for first_line, lines in _read_chunks(path, bad=bad, show_progress=show_progress, desc=desc):
        skipped_before = bad.total if bad else 0
        chunk = parser.parse(lines, path=str(path), first_line=first_line, bad=bad)
        if inferred is not None and len(chunk.labels):
            rows_are_lines = (bad.total if bad else 0) == skipped_before
            inferred.update(chunk.ids, path=path, first_line=first_line if rows_are_lines else None)
            inferred.refuse_if_unplannable()  # as soon as it shows, not after reading everything
        writer.append(chunk)


def ensure_preprocessed(data_dir: str | Path, *, show_progress: bool = True) -> Path:
    """Return a preprocessed data directory for ``data_dir``, converting text splits once.

    A text data set is converted into ``data_dir/preprocessed``; later runs reuse it as long as it
    was made, with the settings used here, from the files now there (same stat fields, or else same
    content hash). Otherwise it is converted again, into a sibling swapped in only when complete.
    """
    data_dir = Path(data_dir)
    if data_dir.is_file():
        raise ValueError(f"--data {data_dir} is a file; pass a directory holding train.* and test.* "
                         f"(or a preprocessed one), or convert the file first with "
                         f"`bagpipe preprocess --input {data_dir} --out DIR` and pass --data DIR")
    if not data_dir.exists():
        raise ValueError(f"--data: no such directory {data_dir}")
    if is_preprocessed(data_dir):
        return data_dir
    splits = find_splits(data_dir)
    cached = data_dir / "preprocessed"
    if is_preprocessed(cached):
        reason = _why_stale(cached, data_dir, splits)
        if reason is None:
            return cached
        log.info("%s: converting again", reason)
    else:
        log.info("preprocessing %s into %s (once)", data_dir, cached)
    _convert_and_swap(data_dir, cached, show_progress=show_progress)
    return cached


def _why_stale(cached: Path, data_dir: Path, splits: dict[str, Path]) -> str | None:
    """Why ``cached`` is not the conversion of ``data_dir`` as it is now, or None if it is.

    Files whose stat fields changed are hashed; if their content did not, the new fields are
    recorded, so that the next start takes the fast path again.
    """
    meta_path = cached / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    made_from = meta.get("made_from")
    if made_from is None:
        return f"{cached} was made by an older version of bagpipe that kept no record of its sources"
    fmt = guess_format(splits["train"])
    sizes_from = "the log" if fmt == "movielens" else "meta.json" if (data_dir / "meta.json").is_file() else "inferred"
    current = _settings(fmt=fmt, on_bad_row="error", table_sizes_from=sizes_from)
    for key, value in current.items():
        if made_from.get(key) != value:
            return f"{cached} was made with {key} {made_from.get(key)!r}, not {value!r}"
    sources, recorded = _sources(data_dir, splits), made_from["sources"]
    for name in sorted(recorded.keys() - sources.keys()):
        return f"{data_dir / recorded[name]['file']} is gone since {cached} was made from it"
    for name in sorted(sources.keys() - recorded.keys()):
        return f"{sources[name]} is new since {cached} was made"
    for name, path in sources.items():
        if path.name != recorded[name]["file"]:
            return f"{cached} was made from {recorded[name]['file']}, not {path.name}"
    moved = [name for name, path in sources.items() if _stat_fields(path) != recorded[name]["stat"]]
    for name in moved:
        now = _fingerprint(sources[name])
        if (now["size"], now["blake2b"]) != (recorded[name]["size"], recorded[name]["blake2b"]):
            return f"{sources[name]} changed since {cached} was made from it (content differs)"
        recorded[name]["stat"] = now["stat"]
    if moved:
        _refresh_meta(meta_path, meta)
    return None


def _refresh_meta(meta_path: Path, meta: dict) -> None:
    partial = meta_path.with_name(f"{meta_path.name}.partial-{os.getpid()}")
    try:
        partial.write_text(json.dumps(meta, indent=2) + "\n")
        partial.replace(meta_path)
    except OSError as err:  # a read-only data set is still current: it is only hashed on every start
        partial.unlink(missing_ok=True)
        log.info("could not record the new stat fields in %s (%s)", meta_path, err)


def _convert_and_swap(data_dir: Path, cached: Path, *, show_progress: bool) -> None:
    """Convert into a sibling of ``cached`` and swap it in only when complete and readable."""
    partial = cached.with_name(f".{cached.name}.partial-{secrets.token_hex(4)}")
    try:
        preprocess(data_dir, partial, show_progress=show_progress)
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
