"""Text files read as the parsers take them: blocks of whole lines, undecoded, from a plain or a gzip file (told
by its magic bytes); and the whole-file reads done before parsing (the first line, the number of lines)."""

from __future__ import annotations

import gzip
import io
import queue
import threading
import zlib
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TypeVar

from bagpipe.data.fast_tsv import count_byte
from bagpipe.data.formats import DataError, TextBlock

GZIP_MAGIC = b"\x1f\x8b"
GZIP_READ_BYTES = 1 << 20
COUNT_READ_BYTES = 1 << 20
Item = TypeVar("Item")
_END = object()


class HashedReader(io.RawIOBase):
    """A file's bytes passed through ``digest`` as they are read: a source hashed by the read that converts it,
    instead of a second read. ``tell`` is the bytes read so far."""

    def __init__(self, handle, digest) -> None:
        super().__init__()
        self._handle, self.digest, self.bytes_read = handle, digest, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = self._handle.readinto(buffer)
        if count:
            with memoryview(buffer) as view:
                self.digest.update(view[:count])
            self.bytes_read += count
        return count

    def tell(self) -> int:
        return self.bytes_read


def open_decompressed(path: Path, stack: ExitStack, *, digest=None) -> tuple[io.BufferedIOBase, io.BufferedIOBase]:
    """The file as stored, and its content: gzip is told by its magic bytes, whatever the name. ``digest``: a
    hash object that every stored byte read is passed through."""
    raw = stack.enter_context(open(path, "rb"))
    compressed = raw.read(len(GZIP_MAGIC)) == GZIP_MAGIC
    raw.seek(0)
    if digest is not None:
        raw = stack.enter_context(io.BufferedReader(HashedReader(raw, digest), GZIP_READ_BYTES))
    # A buffered reader over the gzip stream splits lines in C, as it does for a plain file.
    return raw, (stack.enter_context(io.BufferedReader(gzip.GzipFile(fileobj=raw), GZIP_READ_BYTES))
                 if compressed else raw)


def next_block(handle, ahead: bytes, *, path: Path, first_line: int, max_bytes: int,
               max_lines: int) -> tuple[TextBlock, bytes]:
    """The next block of ``handle``: ``ahead`` (read before) and whole lines after it, read straight into one
    buffer of ``max_bytes`` (or more, for a longer line), at most ``max_lines`` lines; and what was read beyond."""
    data = bytearray(max(max_bytes, len(ahead) + 1))
    data[:len(ahead)] = ahead
    size = len(ahead)
    try:
        with memoryview(data) as view:
            while size < len(data) and (count := handle.readinto1(view[size:])):
                size += count
        end = data.rfind(b"\n") + 1 if size == len(data) else size  # full: up to its last line end
        if not end and size:  # a line longer than the buffer
            data += handle.readline()
            end = size = len(data)
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        complete = count_byte(memoryview(data)[:size], ord("\n"))
        raise DataError(str(path), first_line + complete, f"corrupt or truncated gzip data ({err})") from None
    rest = bytes(data[end:size])
    del data[end:]
    block = TextBlock.of(data)
    if len(block) <= max_lines:
        return block, rest
    block, after = block.split(max_lines)
    return block, bytes(after.data) + rest


def first_line(path: Path) -> str:
    """The first line of a plain or gzip file, as text."""
    with ExitStack() as stack:
        _, lines_in = open_decompressed(path, stack)
        try:
            return lines_in.readline().decode("utf-8-sig")  # a byte order mark is not part of a header
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:
            raise DataError(str(path), 1, f"corrupt or truncated gzip data ({err})") from None
        except UnicodeDecodeError:
            raise DataError(str(path), 1, "not UTF-8 text (is this a binary or compressed file?)") from None


def count_lines(path: Path) -> int:
    """The lines of a plain or gzip file, in one binary pass; a last line without a newline counts."""
    with ExitStack() as stack:
        _, data = open_decompressed(path, stack)
        lines, last = 0, b"\n"
        try:
            while block := data.read(COUNT_READ_BYTES):
                lines, last = lines + count_byte(block, ord("\n")), block[-1:]
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:
            raise DataError(str(path), lines + 1, f"corrupt or truncated gzip data ({err})") from None
    return lines + (last != b"\n")


def read_ahead(items: Iterator[Item]) -> Iterator[Item]:
    """``items``, each made on another thread while the one before is used: reading lets go of the GIL, so the
    next block is read while this one is parsed. Close it (``contextlib.closing``) before what ``items`` reads."""
    ready: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def hand_over(entry) -> bool:
        while not stop.is_set():
            try:
                ready.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def make() -> None:
        try:
            for item in items:
                if not hand_over((item, None)):
                    return
            hand_over((_END, None))
        except BaseException as err:  # raised where the consumer takes it
            hand_over((None, err))

    maker = threading.Thread(target=make, name="bagpipe-read-ahead", daemon=True)
    maker.start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        stop.set()
        maker.join()

