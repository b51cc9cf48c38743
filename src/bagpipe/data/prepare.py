"""Data ready for a run: the one place that decides "prepared and fresh, else convert". A data file or directory
is converted once (data.preprocess) and again only when its sources or the settings change (data.sources) or the
converted copy fails its checksums (data.binary); each of those is asked here, and none of them asks back."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from bagpipe.data.binary import (META_FILE, CorruptData, is_preprocessed, open_dataset, partial_path, read_meta,
                                 swap_in, write_meta)
from bagpipe.data.preprocess import preprocess
from bagpipe.data.sources import (DEFAULT_HOLDOUT, check_format, check_holdout, find_splits, guess_format,
                                  has_sizes, source_meta_path, why_stale)
from bagpipe.data.vocab import check_vocab_min_count

log = logging.getLogger(__name__)

# train --data with Avazu and neither a vocabulary nor table sizes: every value of the train split gets an id.
AVAZU_DEFAULT_MIN_COUNT = 1


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
    if fmt == "avazu" and not vocab_min_count and not has_sizes(source_meta_path(path)):
        vocab_min_count = AVAZU_DEFAULT_MIN_COUNT
        log.info("Avazu data with no table sizes: ids from a vocabulary of min count %d (--vocab-min-count)",
                 vocab_min_count)
    cached = converted_path(path)
    if is_preprocessed(cached):
        try:
            reason = _why_not_current(cached, path, splits, fmt=fmt, holdout=holdout,
                                      vocab_min_count=vocab_min_count)
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


def _why_not_current(cached: Path, input_path: Path, splits: dict[str, Path], *, fmt: str, holdout: float,
                     vocab_min_count: int) -> str | None:
    """Why ``cached`` cannot be used as the conversion of ``input_path``, or None if it can: stale (its sources or
    settings changed), else unverified; CorruptData if a file of it is not as written. Verified last: that reads
    every array, which a stale copy is spared."""
    meta = read_meta(cached)
    reason, refreshed = why_stale(meta.get("made_from"), cached=cached, input_path=input_path, splits=splits,
                                  fmt=fmt, holdout=holdout, vocab_min_count=vocab_min_count)
    if refreshed:
        _refresh_meta(cached, meta)
    return reason or _why_unverified(cached)


def _why_unverified(cached: Path) -> str | None:
    """Why ``cached`` cannot be verified, or None once every array matches its checksum (CorruptData if one
    does not, or a file is unreadable or of the wrong size)."""
    if not open_dataset(cached, verify=True).checksummed:
        return f"{cached} was made by an older version of bagpipe that recorded no checksums"
    return None


def _refresh_meta(cached: Path, meta: dict) -> None:
    try:
        write_meta(cached, meta)
    except OSError as err:  # a read-only data set is still current: it is only hashed on every start
        log.info("could not record the new stat fields in %s (%s)", cached / META_FILE, err)


def _convert_and_swap(input_path: Path, cached: Path, *, show_progress: bool, fmt: str, holdout: float,
                      vocab_min_count: int) -> None:
    """Convert into a sibling of ``cached`` and swap it in only when complete and readable."""
    partial = partial_path(cached)
    try:
        preprocess(input_path, partial, show_progress=show_progress, fmt=fmt, holdout=holdout,
                   vocab_min_count=vocab_min_count)
        open_dataset(partial)  # fail here, not mid-training, if anything is inconsistent
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    swap_in(partial, cached)
