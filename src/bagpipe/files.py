"""Files in the user's terms: sizes people read, write errors that name the device and the file, and
whether a directory can be written at all (asked of the file system, not of permission bits)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT)


def read_json(path: str | Path) -> dict:
    """A JSON object from a file; a ValueError naming the file if it is not one."""
    try:
        value = json.loads(Path(path).read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not valid JSON here (not an object)")
    return value


def human_bytes(num_bytes: float) -> str:
    """``num_bytes`` with a unit that shows it (``512 B``, ``3.2 MiB``, ``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:,.0f} {unit}" if unit == "B" else f"{num_bytes:,.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def mount_point(path: str | Path) -> Path:
    """The mount point of the file system holding ``path`` (or its nearest existing parent)."""
    path = Path(path).absolute()
    path = next(p for p in (path, *path.parents) if p.exists())
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def device_of(path: str | Path) -> str:
    """The device a path lives on, as ``df`` would name it (its mount point, and the source where known)."""
    mount = mount_point(path)
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            source, target = line.split()[:2]
            if target == str(mount):
                return f"{source} (mounted at {mount})"
    except OSError:
        pass
    return str(mount)


def describe_write_error(err: OSError, path: str | Path) -> str:
    """What failed, for an OSError met writing ``path``: "no space left on DEVICE while writing FILE"."""
    if err.errno in FULL:
        what = "no space left" if err.errno == errno.ENOSPC else "disk quota exceeded"
        return f"{what} on {device_of(path)} while writing {path}"
    if err.errno == errno.EROFS:
        return f"cannot write {path}: {device_of(path)} is a read-only file system"
    return f"cannot write {path}: {err.strerror or err}"


class WriteFailed(OSError):
    """A write that failed for a reason the user must fix (a full or read-only disk), saying so in one line
    that names the device and the file (an OSError still: callers that handle those handle this)."""

    def __str__(self) -> str:
        return self.strerror

    @property
    def full(self) -> bool:
        """The disk (or the user's quota) is full: freeing space and resuming goes on."""
        return self.errno in FULL


@contextlib.contextmanager
def writing(path: str | Path):
    """Turn an OSError of a full or read-only file system met inside the block into WriteFailed naming ``path``
    (torch and numpy report them as a bare errno, or not at all: write through Python file objects)."""
    try:
        yield
    except WriteFailed:
        raise
    except OSError as err:
        if err.errno in (*FULL, errno.EROFS):
            raise WriteFailed(err.errno, describe_write_error(err, path)) from err
        raise


def check_writable(directory: str | Path, *, what: str) -> None:
    """A ValueError naming ``what`` unless a file can be made in ``directory`` (made if missing, and removed
    again if this made it): catches read-only mounts and missing rights, which root's permission bits hide."""
    directory = Path(directory).absolute()
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{what} {directory}: {existing} is not a directory")
    made = [p for p in (directory, *directory.parents) if not p.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory, prefix=".bagpipe-probe-"):
            pass
    except OSError as err:
        raise ValueError(f"{what} {directory}: {describe_write_error(err, directory)}") from None
    finally:
        for path in made:  # innermost first
            try:
                path.rmdir()
            except OSError:
                pass


def save_torch(obj, handle) -> None:
    """``torch.save`` of ``obj`` to the open binary file ``handle``, an OSError of its writes raised as itself
    (torch reports some, such as a full disk, as an "unexpected pos" RuntimeError)."""
    import torch

    recorder = _RecordingWriter(handle)
    try:
        torch.save(obj, recorder)
    except RuntimeError:
        if recorder.error is None:
            raise
        raise recorder.error from None


class _RecordingWriter:
    """A file object that keeps the OSError its last write met."""

    def __init__(self, handle) -> None:
        self.handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.handle.flush()
