"""Text files read as the parsers take them: blocks of whole lines, undecoded, from a plain or a gzip file (told
by its magic bytes), less a byte order mark and a blank last line; and the whole-file reads done before parsing
(the first line, the number of lines)."""

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
BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark, which some editors and Windows tools write first
BLANKS = b" \t\r\f\v"  # what a blank line may hold besides its newline
TAIL_BYTES = 1 << 12  # the last bytes of a read that tell whether it may end in a blank line
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


class WithoutStrayEnds(io.RawIOBase):
    """A text file's content less what writers add around its rows: a byte order mark at the start, and one
    blank line (whitespace only) after the last row's newline, as in ``...\\n\\n``. A blank line anywhere else
    stays, for the parsers to name. What may still turn out to be that last line is held back until what
    follows it, or the end, shows whether it is."""

    def __init__(self, handle) -> None:
        super().__init__()
        self._handle = handle
        self._held = b""  # the end read so far that may be the blank last line, from the newline before it
        self._ready = memoryview(b"")  # content to hand out before reading on
        self._at_start, self._at_end = True, False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        with memoryview(buffer) as view, view.cast("B") as out:
            while not self._ready and not self._at_end:
                if len(out) > len(self._held) + len(BOM) + TAIL_BYTES:
                    count = self._read_into(out)  # the usual case: no copy besides the read's own
                    if count:
                        return count
                else:
                    self._ready = self._read_next(len(out))
            count = min(len(out), len(self._ready))
            out[:count] = self._ready[:count]
        self._ready = self._ready[count:]
        return count

    def _read_into(self, out: memoryview) -> int:
        """Read into ``out`` after what was held; hand out all but the end that may be the blank last line."""
        held = len(self._held)
        out[:held] = self._held
        count = self._handle.readinto(out[held:])  # a buffered read: short only at the end, so a whole BOM
        if not count:
            self._end()
            return 0
        end = held + count
        if self._at_start:
            self._at_start = False
            if out[:len(BOM)] == BOM:
                out[:end - len(BOM)] = out[len(BOM):end]
                end -= len(BOM)
        tail_start = max(0, end - TAIL_BYTES)
        tail = out[tail_start:end].tobytes()
        keep = _blank_end_start(tail)
        if tail_start and not tail[:keep].strip(BLANKS):  # blanks all along: the newline that counts may lie before
            tail_start, keep = 0, _blank_end_start(out[:end].tobytes())
        keep += tail_start
        self._held = out[keep:end].tobytes()
        return keep

    def _read_next(self, size: int) -> memoryview:
        """The next content, read through bytes: for reads too small for the end held and the bytes after it."""
        data = self._handle.read(max(size, len(BOM)))
        if not data:
            return self._end()
        if self._at_start:
            data, self._at_start = data.removeprefix(BOM), False
        data = self._held + data
        keep = _blank_end_start(data)
        self._held = data[keep:]
        return memoryview(data)[:keep]

    def _end(self) -> memoryview:
        """At the end of the file: what is left to hand out is the end held, less a blank last line."""
        self._at_end = True
        self._ready = memoryview(_without_blank_last_line(self._held))
        return self._ready


def _blank_end_start(data: bytes) -> int:
    """Where the end of ``data`` that may yet be a blank last line begins: at the last newline if only blanks
    follow it; at the newline before if nothing follows and the line between is blank; else nowhere."""
    last = data.rfind(b"\n")
    if last < 0 or data[last + 1:].strip(BLANKS):
        return len(data)
    before = data.rfind(b"\n", 0, last)
    if last == len(data) - 1 and before >= 0 and not data[before + 1:last].strip(BLANKS):
        return before
    return last


def _without_blank_last_line(end: bytes) -> bytes:
    """The held end of a file (a newline, then perhaps a line) without that line if it is blank."""
    newline = end.rfind(b"\n", 0, len(end) - end.endswith(b"\n"))
    return end[:newline + 1] if newline >= 0 and not end[newline + 1:].strip(BLANKS + b"\n") else end


def open_decompressed(path: Path, stack: ExitStack, *, digest=None) -> tuple[io.BufferedIOBase, io.BufferedIOBase]:
    """The file as stored, and its content (WithoutStrayEnds): gzip is told by its magic bytes, whatever the
    name. ``digest``: a hash object that every stored byte read is passed through."""
    raw = stack.enter_context(open(path, "rb"))
    compressed = raw.read(len(GZIP_MAGIC)) == GZIP_MAGIC
    raw.seek(0)
    if digest is not None:
        raw = stack.enter_context(io.BufferedReader(HashedReader(raw, digest), GZIP_READ_BYTES))
    # A buffered reader over the gzip stream splits lines in C, as it does for a plain file.
    content = stack.enter_context(io.BufferedReader(gzip.GzipFile(fileobj=raw), GZIP_READ_BYTES)) if compressed else raw
    return raw, stack.enter_context(io.BufferedReader(WithoutStrayEnds(content), GZIP_READ_BYTES))


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

