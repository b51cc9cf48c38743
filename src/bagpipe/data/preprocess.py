"""Turn Criteo TSV or JSON-lines files into the binary format, once, with clear errors."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import numpy as np

from bagpipe.data.binary import SPLITS, SplitWriter, id_dtype_for, is_preprocessed, open_dataset
from bagpipe.data.formats import BadRows, CriteoParser, JsonlParser
from bagpipe.progress import progress

log = logging.getLogger(__name__)

FORMATS = ("criteo", "jsonl")
SUFFIX_FORMATS = {".tsv": "criteo", ".txt": "criteo", ".csv": "criteo", ".jsonl": "jsonl", ".json": "jsonl"}
LINES_PER_CHUNK = 65_536
BAD_ROW_POLICIES = ("error", "skip")


def find_splits(path: Path) -> dict[str, Path]:
    """A file is a lone train split; a directory must hold ``train.*`` (and may hold ``test.*``)."""
    if path.is_file():
        return {"train": path}
    if not path.is_dir():
        raise ValueError(f"--input: no such file or directory: {path}")
    splits = {}
    for split in SPLITS:
        matches = sorted(p for p in path.glob(f"{split}.*") if p.suffix in SUFFIX_FORMATS)
        if len(matches) > 1:
            raise ValueError(f"{path}: several {split} files ({', '.join(m.name for m in matches)}); keep one")
        if matches:
            splits[split] = matches[0]
    if "train" not in splits:
        raise ValueError(f"{path}: no train split (expected a file such as train.tsv or train.jsonl)")
    return splits


def guess_format(path: Path) -> str:
    fmt = SUFFIX_FORMATS.get(path.suffix)
    if fmt is None:
        raise ValueError(f"{path}: cannot tell the format from the suffix; pass --format criteo|jsonl")
    return fmt


def table_sizes_from(*, table_sizes: str | list[int] | None, meta_file: str | Path | None,
                     input_path: Path) -> list[int] | None:
    """Table sizes from --table-sizes, --meta, or a meta.json beside the input; None if none given."""
    if table_sizes:
        if isinstance(table_sizes, str):
            try:
                return [int(x) for x in table_sizes.split(",") if x.strip()]
            except ValueError:
                raise ValueError(f"--table-sizes: expected comma-separated integers, got {table_sizes!r}") from None
        return list(table_sizes)
    candidates = [Path(meta_file)] if meta_file else []
    if not meta_file:
        folder = input_path if input_path.is_dir() else input_path.parent
        candidates.append(folder / "meta.json")
    for candidate in candidates:
        if candidate.is_file():
            sizes = json.loads(candidate.read_text()).get("table_sizes")
            if not sizes:
                raise ValueError(f"{candidate}: has no 'table_sizes'")
            return [int(x) for x in sizes]
        if meta_file:
            raise ValueError(f"--meta: no such file {meta_file}")
    return None


def _read_chunks(path: Path):
    with open(path, "r", encoding="utf-8", errors="strict", newline="") as handle:
        first_line = 1
        while True:
            lines = list(itertools.islice(handle, LINES_PER_CHUNK))
            if not lines:
                return
            yield first_line, lines
            first_line += len(lines)


def preprocess(
    input_path: str | Path,
    out_dir: str | Path,
    *,
    fmt: str | None = None,
    table_sizes: str | list[int] | None = None,
    meta_file: str | Path | None = None,
    on_bad_row: str = "error",
    show_progress: bool = True,
) -> dict:
    """Preprocess every split under ``input_path`` into ``out_dir``; return the written meta."""
    input_path, out = Path(input_path), Path(out_dir)
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ValueError(f"--on-bad-row must be one of {', '.join(BAD_ROW_POLICIES)}, got {on_bad_row!r}")
    splits = find_splits(input_path)
    fmt = fmt or guess_format(splits["train"])
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    sizes = table_sizes_from(table_sizes=table_sizes, meta_file=meta_file, input_path=input_path)
    if sizes is not None and (not sizes or any(s <= 0 for s in sizes)):
        raise ValueError(f"table sizes must be positive integers, got {sizes}")
    if fmt == "criteo" and sizes is None:
        raise ValueError(f"{input_path}: Criteo ids are hashed; give --table-sizes or --meta FILE (a meta.json)")
    parser = CriteoParser(sizes) if fmt == "criteo" else JsonlParser(sizes)
    # With inferred sizes (JSON lines only) ids may exceed int32 only if the data says so: use int64.
    id_dtype = id_dtype_for(sizes) if sizes else np.dtype(np.int64)

    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    bad = BadRows() if on_bad_row == "skip" else None
    max_ids = None
    writers = {}
    for split, path in splits.items():
        writer = SplitWriter(out / split, num_tables=len(sizes) if sizes else 0, id_dtype=id_dtype)
        bar = progress(total=path.stat().st_size, desc=f"preprocess {split}", unit="B", enabled=show_progress)
        for first_line, lines in _read_chunks(path):
            chunk = parser.parse(lines, path=str(path), first_line=first_line, bad=bad)
            if len(chunk.labels):
                chunk_max = chunk.ids.max(axis=0)
                max_ids = chunk_max if max_ids is None else np.maximum(max_ids, chunk_max)
            writer.append(chunk)
            bar.update(sum(len(line) for line in lines))
        bar.close()
        writers[split] = writer
    if sizes is None:
        if max_ids is None:
            raise ValueError(f"{input_path}: no valid rows, so table sizes cannot be inferred")
        sizes = [int(m) + 1 for m in max_ids]
        log.warning("no table sizes given: inferred %s from the largest ids", sizes)
    for writer in writers.values():
        writer.close(table_sizes=sizes)

    source_meta = {}
    folder = input_path if input_path.is_dir() else input_path.parent
    if (folder / "meta.json").is_file():
        source_meta = json.loads((folder / "meta.json").read_text())
    meta = {
        **{k: v for k, v in source_meta.items() if k not in ("format", "table_sizes")},
        "format": "bagpipe-binary",
        "source": {split: str(path) for split, path in splits.items()},
        "source_format": fmt,
        "table_sizes": sizes,
        "rows": {split: writer.rows for split, writer in writers.items()},
        "skipped_rows": bad.total if bad else 0,
        "skipped_by_reason": dict(bad.counts) if bad else {},
    }
    if bad and bad.total:
        log.warning("skipped %d bad rows (%s); first: %s", bad.total, dict(bad.counts), bad.examples[0])
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def ensure_preprocessed(data_dir: str | Path, *, show_progress: bool = True) -> Path:
    """Return a preprocessed data directory for ``data_dir``, converting text splits once.

    A text data set is converted into ``data_dir/preprocessed``; later runs reuse it as long as
    it is newer than the text files.
    """
    data_dir = Path(data_dir)
    if not data_dir.exists():
        raise ValueError(f"--data: no such directory {data_dir}")
    if is_preprocessed(data_dir):
        return data_dir
    splits = find_splits(data_dir)
    cached = data_dir / "preprocessed"
    if is_preprocessed(cached):
        built = (cached / "meta.json").stat().st_mtime if (cached / "meta.json").is_file() else 0.0
        if all(path.stat().st_mtime <= built for path in splits.values()):
            return cached
    log.info("preprocessing %s into %s (once)", data_dir, cached)
    preprocess(data_dir, cached, show_progress=show_progress)
    open_dataset(cached)  # fail here, not mid-training, if anything is inconsistent
    return cached
