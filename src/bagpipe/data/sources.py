"""The sources of a conversion: an input's splits, their format and table sizes, and the record (``made_from``)
of the files and settings a converted copy was made from, which tells whether it is still theirs."""

from __future__ import annotations

import hashlib
import zlib
from contextlib import ExitStack
from pathlib import Path

import xxhash

from bagpipe.data.avazu import is_avazu_header
from bagpipe.data.blocks import open_decompressed
from bagpipe.data.sequences import INTERACTION_FILES, SNIFF_LINES, is_atomic_header, is_interaction_log
from bagpipe.files import read_json

FORMATS = ("criteo", "avazu", "jsonl", "movielens")
SUFFIX_FORMATS = {".tsv": "criteo", ".txt": "criteo", ".csv": "avazu", ".jsonl": "jsonl", ".json": "jsonl"}
VOCAB_FORMATS = ("criteo", "avazu")  # raw values that a vocabulary numbers (data.vocab)
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


def effective_holdout(splits: dict[str, Path], fmt: str, holdout: float) -> float | None:
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
    beside = source_meta_path(input_path)
    if beside.is_file():
        return _sizes_in(beside), "meta.json"
    return None, "inferred"


def _sizes_in(meta_path: Path) -> list[int]:
    sizes = read_json(meta_path).get("table_sizes")
    if not sizes:
        raise ValueError(f"{meta_path}: has no 'table_sizes'")
    return [int(x) for x in sizes]


def source_meta_path(input_path: Path) -> Path:
    """The meta.json that may lie beside the input (table sizes, synth settings), there or not."""
    return (input_path if input_path.is_dir() else input_path.parent) / "meta.json"


def fingerprint(path: Path, *, stat: list[int] | None = None, digest=None) -> dict:
    """What a converted file was made from: name, size, content hash and the stat fields of that moment.
    ``digest``: the file's hash, made while it was read (with ``stat`` taken before that read), else it is
    read here."""
    stat = stat or stat_fields(path)  # before hashing: a write during the hash then fails the next comparison
    if digest is None:
        with open(path, "rb") as handle:
            digest = hashlib.file_digest(handle, xxhash.xxh3_128)
    return {"file": path.name, "size": stat[0], CONTENT_HASH: digest.hexdigest(), "stat": stat}


def stat_fields(path: Path) -> list[int]:
    """Changed by any write (ctime) or replacement (inode), so equal fields mean equal content."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def source_files(input_path: Path, splits: dict[str, Path]) -> dict[str, Path]:
    """The files a conversion reads: each split, and the meta.json beside them if there is one."""
    meta_path = source_meta_path(input_path)
    return {**splits, **({"meta.json": meta_path} if meta_path.is_file() else {})}


def conversion_settings(*, fmt: str, on_bad_row: str, table_sizes_from: str, holdout: float | None,
                        vocab_min_count: int) -> dict:
    """The settings besides the sources that shape a conversion's output (``holdout``: the one that applies)."""
    return {"converter_version": CONVERTER_VERSIONS.get(fmt, CONVERTER_VERSION), "format": fmt,
            "on_bad_row": on_bad_row, "table_sizes_from": table_sizes_from, "holdout": holdout,
            "vocab_min_count": vocab_min_count}


# Settings recorded since a later version; a record without one was made with this value.
_SETTINGS_BEFORE = {"vocab_min_count": 0}


def has_sizes(meta_path: Path) -> bool:
    """Whether the source meta.json at ``meta_path`` gives table sizes."""
    return meta_path.is_file() and bool(read_json(meta_path).get("table_sizes"))


def why_stale(made_from: dict | None, *, cached: Path, input_path: Path, splits: dict[str, Path], fmt: str,
              holdout: float, vocab_min_count: int) -> tuple[str | None, bool]:
    """Why ``cached``, whose meta.json records ``made_from``, is not the conversion of ``input_path`` as it is now,
    with these settings, or None if it is; and whether ``made_from`` was brought up to date.

    Files whose stat fields changed are hashed; if their content did not, their new fields are put in
    ``made_from`` (True is returned), for the caller to record, so that the next start takes the fast path again.
    """
    if made_from is None:
        return f"{cached} was made by an older version of bagpipe that kept no record of its sources", False
    sources, recorded = source_files(input_path, splits), made_from["sources"]
    # Files gone or new first: they also change the holdout that applies.
    for name in sorted(recorded.keys() - sources.keys()):
        gone = source_meta_path(input_path).parent / recorded[name]["file"]
        return f"{gone} is gone since {cached} was made from it", False
    for name in sorted(sources.keys() - recorded.keys()):
        return f"{sources[name]} is new since {cached} was made", False
    sizes_from = ("the log" if fmt == "movielens" else "vocabulary" if vocab_min_count
                  else "meta.json" if source_meta_path(input_path).is_file() else "inferred")
    current = conversion_settings(fmt=fmt, on_bad_row="error", table_sizes_from=sizes_from,
                                  holdout=effective_holdout(splits, fmt, holdout), vocab_min_count=vocab_min_count)
    for key, value in current.items():
        recorded_value = made_from.get(key, _SETTINGS_BEFORE.get(key))
        if recorded_value != value:
            return f"{cached} was made with {key} {recorded_value!r}, not {value!r}", False
    for name, path in sources.items():
        if path.name != recorded[name]["file"]:
            return f"{cached} was made from {recorded[name]['file']}, not {path.name}", False
    moved = [name for name, path in sources.items() if stat_fields(path) != recorded[name]["stat"]]
    for name in moved:
        if CONTENT_HASH not in recorded[name]:
            return f"{cached} was fingerprinted by an earlier version (another hash), so it is converted again", False
        now = fingerprint(sources[name])
        if (now["size"], now[CONTENT_HASH]) != (recorded[name]["size"], recorded[name][CONTENT_HASH]):
            return f"{sources[name]} changed since {cached} was made from it (content differs)", False
        recorded[name]["stat"] = now["stat"]
    return None, bool(moved)
