"""Batch-consistent checkpoints of a run: the whole training state at one iteration boundary, as a
full base or as the rows changed since the previous checkpoint, atomic and checksummed.

A checkpoint is a directory ``RUN_DIR/checkpoints/step-NNNNNNNN`` (the boundary: iterations done).
It is written under ``.tmp``, every file fsynced, then ``manifest.json`` (each file's size and
BLAKE2b hash) and a rename into place: a crash mid-write leaves only a ``.tmp`` that nothing reads.
Embedding rows come in *parts* (one space's keys, rows and optimizer state; the keys a file or a
range ``start::step``), so several writers (the reference, or each server and a trainer) can each
write their own; applied in order, a later part overrides an earlier one. A delta's parent is the
checkpoint before it: restoring applies the chain from its full base up. A checkpoint whose chain
fails its checksums is skipped with a warning naming it, and the one before is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bagpipe.faults import inject_fault
from bagpipe.files import save_torch, writing
from bagpipe.threads import Background

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
MANIFEST = "manifest.json"
FORMAT = 1
_HASH_BLOCK = 1 << 22


@dataclass
class RowPart:
    """Rows of one embedding space: ``keys`` (int64) or a range ``(start, step)`` over ``len(rows)`` keys."""

    space: int
    rows: np.ndarray  # float32 [n, dim]
    state: np.ndarray  # float32 [n, state width]
    keys: np.ndarray | None = None
    start: int = 0
    step: int = 1

    def key_array(self) -> np.ndarray:
        if self.keys is not None:
            return self.keys
        return self.start + self.step * np.arange(len(self.rows), dtype=np.int64)


@dataclass
class TrainState:
    """What training continues from: everything that decides the iterations after ``iteration``."""

    iteration: int  # iterations done; training resumes with this one
    dense: dict[str, torch.Tensor]  # the model's state_dict
    dense_optimizer: dict  # its optimizer's state_dict
    parts: list[RowPart] = field(default_factory=list)  # embedding rows (a delta: only the changed ones)
    extra: dict = field(default_factory=dict)  # JSON: counters the run reports (samples, losses so far, ...)


def step_name(iteration: int) -> str:
    return f"step-{iteration:08d}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path) -> dict:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return {"bytes": path.stat().st_size, "blake2b": digest.hexdigest()}


def save_dense(directory: Path, dense: dict, dense_optimizer: dict) -> None:
    path = directory / "dense.pt"
    with writing(path), open(path, "wb") as handle:
        save_torch({"dense": dense, "dense_optimizer": dense_optimizer}, handle)
    _fsync(path)


BACKGROUND_NICE = 10  # how much lower a checkpoint writer's thread runs than training's


def background_priority() -> None:
    """Lower the calling thread's CPU priority (Linux: per thread): writing a checkpoint yields to training."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


class HashedFile:
    """A file written front to back, hashed as it is written (a checkpoint never reads its files back)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with writing(path):
            self.handle = open(path, "wb")
        self.digest = hashlib.blake2b(digest_size=16)
        self.size = 0

    def write(self, data) -> int:
        if memoryview(data).nbytes == 0:  # (an SGD shard's state has no columns: nothing to cast or write)
            return 0
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += len(view)
        with writing(self.path):
            return self.handle.write(view)

    def close(self) -> dict:
        with writing(self.path):
            self.handle.flush()
            os.fsync(self.handle.fileno())
        self.handle.close()
        return {"bytes": self.size, "blake2b": self.digest.hexdigest()}


def _save(path: Path, array: np.ndarray) -> dict:
    """``np.save`` of ``array`` to ``path``, fsynced; its digest."""
    out = HashedFile(path)
    np.lib.format.write_array(out, np.ascontiguousarray(array), allow_pickle=False)
    return out.close()


def write_parts(directory: Path, parts: list[RowPart], *, prefix: str) -> list[dict]:
    """Write ``parts`` into ``directory`` (fsynced) as ``prefix``-named files; return their manifest entries
    (each with the digests of its files under ``digests``)."""
    entries = []
    for index, part in enumerate(parts):
        name = f"{prefix}{index}.space{part.space}"
        entry = {"space": part.space, "count": len(part.rows), "rows": f"{name}.rows.npy",
                 "state": f"{name}.state.npy", "digests": {}}
        entry["digests"][entry["rows"]] = _save(directory / entry["rows"], part.rows.astype(np.float32, copy=False))
        entry["digests"][entry["state"]] = _save(directory / entry["state"], part.state.astype(np.float32, copy=False))
        if part.keys is not None:
            entry["keys"] = f"{name}.keys.npy"
            entry["digests"][entry["keys"]] = _save(directory / entry["keys"], part.keys.astype(np.int64, copy=False))
        else:
            entry["start"], entry["step"] = part.start, part.step
        entries.append(entry)
    return entries


def write_snapshot(directory: Path, *, name: str, space: int, chunks, num_rows: int, dim: int, state_width: int,
                   start: int, step: int, full: bool) -> dict:
    """A shard's rows as one part (fsynced, hashed as written), from ``chunks`` of (local rows, rows,
    state) as ``RowStore.snapshot_chunks`` yields them, in order; key = ``start + step * local row``. A
    full part streams its chunks into its files (no second copy of the shard in memory), a delta lists
    its keys."""
    entry = {"space": space, "rows": f"{name}.rows.npy", "state": f"{name}.state.npy", "digests": {}}
    if full:
        files = {kind: HashedFile(directory / entry[kind]) for kind in ("rows", "state")}
        for kind, width in (("rows", dim), ("state", state_width)):
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)), "fortran_order": False,
                      "shape": (num_rows, width)}
            np.lib.format.write_array_header_1_0(files[kind], header)
        written = 0
        for local, chunk_rows, chunk_state in chunks:
            assert len(local) == 0 or local[0] == written, "a full snapshot's chunks come in order, every row"
            files["rows"].write(np.ascontiguousarray(chunk_rows, dtype=np.float32))
            files["state"].write(np.ascontiguousarray(chunk_state, dtype=np.float32))
            written += len(local)
        assert written == num_rows, f"a full snapshot of {num_rows} rows got {written}"
        entry["digests"] = {entry[kind]: handle.close() for kind, handle in files.items()}
        entry.update(count=num_rows, start=start, step=step)
    else:
        pieces = list(chunks)
        local = np.concatenate([p[0] for p in pieces]) if pieces else np.zeros(0, dtype=np.int64)
        rows = np.concatenate([p[1] for p in pieces]) if pieces else np.zeros((0, dim), dtype=np.float32)
        state = np.concatenate([p[2] for p in pieces]) if pieces else np.zeros((0, state_width), dtype=np.float32)
        entry.update(count=len(local), keys=f"{name}.keys.npy")
        for kind, array in (("rows", rows), ("state", state), ("keys", start + step * local)):
            entry["digests"][entry[kind]] = _save(directory / entry[kind], array)
    return entry


class CheckpointWriter:
    """Writes a run's checkpoints, one at a time, in the background, and keeps the newest ``keep``."""

    def __init__(self, run_dir: str | Path, *, keep: int, full_every: int = 5, clear_staged: bool = True) -> None:
        """``clear_staged``: remove checkpoints left half-written (False: a lost oracle's replacement takes over
        those its servers may still be writing)."""
        if keep < 1:
            raise ValueError(f"--keep-checkpoints must be at least 1, got {keep}")
        self.root = checkpoints_dir(run_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep, self.full_every = keep, full_every
        self.last: str | None = None  # the newest committed checkpoint (a delta's parent)
        self.chain = 0  # deltas since the last full base
        self._job: Background | None = None  # the write in flight
        for stale in self.root.glob("*.tmp") if clear_staged else ():  # a write that a crash interrupted
            shutil.rmtree(stale, ignore_errors=True)
        newest = valid_checkpoints(run_dir, newest_only=True)
        if newest:
            self.last = newest[0][0].name
            self.chain = _chain_length(self.root, self.last)

    def wants_full(self) -> bool:
        """Whether the next checkpoint is a full base (the first, or every ``full_every``-th)."""
        return self.last is None or self.chain + 1 >= self.full_every

    def save(self, state: TrainState, *, full: bool) -> None:
        """Write ``state`` in the background (after any write still in flight); raise an earlier write's error."""
        self.wait()
        self._job = Background(lambda: self._in_background(state, full), name="checkpoint")

    def wait(self) -> None:
        """Wait for the write in flight, and raise its error. A wait cut short (Ctrl-C, SIGTERM) keeps the write in
        flight, so that ``close`` still waits for it: a run stopped while a checkpoint is being written keeps it."""
        job = self._job
        if job is None:
            return
        try:
            job.join(failed="writing a checkpoint failed")
        finally:
            if job.done():
                self._job = None

    def close(self) -> None:
        """Let the write in flight finish (a run that is ending for another reason: its error only logged), so
        that nothing writes into the checkpoints once the run has let its directory go."""
        try:
            self.wait()
        except Exception as err:  # noqa: BLE001 - the run is already failing or interrupted: that error is the one
            log.warning("%s", err)

    def _in_background(self, state: TrainState, full: bool) -> None:
        background_priority()
        self.write(state, full=full)

    def write(self, state: TrainState, *, full: bool) -> Path:
        """Write ``state`` whole, now (``save`` does it in the background)."""
        tmp = self.stage(state.iteration)
        save_dense(tmp, state.dense, state.dense_optimizer)
        parts = write_parts(tmp, state.parts, prefix="part")
        inject_fault("checkpoint parts written")
        return self.publish(state.iteration, full=full, parts=parts, extra=state.extra)

    def stage(self, iteration: int) -> Path:
        """The empty directory the checkpoint of ``iteration`` is written into (by one writer or several)."""
        tmp = self.staged(iteration)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def staged(self, iteration: int) -> Path:
        """The directory the checkpoint of ``iteration`` is written into until it is committed."""
        return self.root / f"{step_name(iteration)}.tmp"

    def publish(self, iteration: int, *, full: bool, parts: list[dict], extra: dict) -> Path:
        """Commit the staged checkpoint of ``iteration`` (its dense.pt and the files of ``parts``, applied in
        that order) and rename it into place; prune the old ones."""
        name = step_name(iteration)
        tmp = self.root / f"{name}.tmp"
        manifest = {"format": FORMAT, "iteration": iteration, "kind": "full" if full else "delta",
                    "parent": None if full else self.last, "dense": "dense.pt", "parts": parts, "extra": extra}
        commit(tmp, manifest)
        final = self.root / name
        if final.exists():  # the same boundary written again (a resumed run): the new one replaces it
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_dir(self.root)
        self.last, self.chain = name, 0 if full else self.chain + 1
        self._prune()
        log.info("checkpoint %s written (%s, %d row parts)", name, manifest["kind"], len(parts))
        return final

    def _prune(self) -> None:
        """Remove checkpoints beyond the newest ``keep``, except the bases and deltas those restore from."""
        names = sorted((p.name for p in self.root.iterdir() if p.is_dir() and not p.name.endswith(".tmp")),
                       reverse=True)
        needed: set[str] = set()
        for name in names[:self.keep]:
            while name is not None and name not in needed:
                needed.add(name)
                name = _read_manifest(self.root / name).get("parent") if (self.root / name / MANIFEST).exists() \
                    else None
        for name in names:
            if name not in needed:
                shutil.rmtree(self.root / name, ignore_errors=True)


def commit(directory: Path, manifest: dict) -> None:
    """Checksum every file of ``directory`` into ``manifest`` (its parts' writers hashed theirs as they wrote
    them: ``digests``), then write the manifest last, fsynced."""
    known = {}
    for entry in manifest["parts"]:
        known.update(entry.pop("digests", {}))
    files = sorted(p for p in directory.iterdir() if p.name != MANIFEST)
    manifest = {**manifest, "files": {p.name: known[p.name] if p.name in known else file_digest(p) for p in files}}
    with writing(directory / MANIFEST):
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _fsync(directory / MANIFEST)
    fsync_dir(directory)


def _read_manifest(directory: Path) -> dict:
    return json.loads((directory / MANIFEST).read_text())


def _chain_length(root: Path, name: str) -> int:
    length = 0
    while (parent := _read_manifest(root / name).get("parent")) is not None:
        length, name = length + 1, parent
    return length


def _check(directory: Path) -> dict:
    """The manifest of ``directory`` if it and every file it lists are whole; else a ValueError saying why."""
    if not (directory / MANIFEST).is_file():
        raise ValueError(f"{directory} has no {MANIFEST}")
    try:
        manifest = _read_manifest(directory)
    except json.JSONDecodeError as err:
        raise ValueError(f"{directory / MANIFEST} is not valid JSON ({err.msg})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{directory}: checkpoint format {manifest.get('format')}, this version reads {FORMAT}")
    for name, want in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise ValueError(f"{path} is missing")
        if file_digest(path) != want:
            raise ValueError(f"{path} fails its checksum")
    return manifest


def valid_checkpoints(run_dir: str | Path, *, newest_only: bool = False) -> list[tuple[Path, list[dict]]]:
    """Every checkpoint of ``run_dir`` whose whole chain is intact, newest first, with its chain's
    manifests (the full base first); a broken one is skipped with a warning naming it. ``newest_only``:
    the newest intact one alone (the older ones are not read)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for directory in sorted((p for p in root.iterdir() if p.is_dir() and not p.name.endswith(".tmp")), reverse=True):
        try:
            found.append((directory, _chain(directory)))
        except (ValueError, OSError) as err:
            log.warning("skipping checkpoint %s: %s", directory, err)
        if found and newest_only:
            break
    return found


def after_a_full_disk(run_dir: str | Path) -> str:
    """What a run that met a full disk does once there is room: resume from its newest intact checkpoint, or start
    again where it wrote none yet."""
    found = valid_checkpoints(run_dir, newest_only=True)
    if not found:
        return (f"free space there, then start the run again (`bagpipe train ... --run-dir {run_dir} --overwrite`): "
                f"it had written no checkpoint yet")
    return (f"free space there, then `bagpipe train --run-dir {run_dir} --resume` continues the run from its "
            f"checkpoint at iteration {found[0][1][-1]['iteration']}")


def resumable_checkpoint(run_dir: str | Path, *, iterations: int, every: int = 0,
                         every_s: float = 0.0) -> tuple[Path, list[dict]]:
    """The checkpoint ``--resume`` continues ``run_dir`` from (its newest intact one) to train up to
    ``iterations``, and its chain; a ValueError saying why the run cannot be resumed, before anything starts.
    ``every``/``every_s``: the run's --checkpoint-every and --checkpoint-every-s, to say when its first was due."""
    root = checkpoints_dir(run_dir)
    found = valid_checkpoints(run_dir, newest_only=True)
    if not found:
        broken = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        due = " or ".join(([f"at iteration {every}"] if every else []) + ([f"after {every_s:g} s"] if every_s else []))
        why = (f"{', '.join(broken)} {'is' if len(broken) == 1 else 'are'} not whole (interrupted while written, or "
               f"damaged)" if broken else f"it wrote none: it stopped before its first checkpoint, due {due}"
               if due else "it wrote none (a run checkpoints with --checkpoint-every N or --checkpoint-every-s S)")
        raise ValueError(f"--resume: {run_dir} has no valid checkpoint to resume from: {why}; start the run again "
                         f"with --overwrite")
    directory, chain = found[0]
    boundary = chain[-1]["iteration"]
    if boundary > iterations:
        raise ValueError(f"--resume: the newest checkpoint of {run_dir} ({directory.name}) is at iteration {boundary}, "
                         f"past --iterations {iterations}: give --iterations {boundary} or more")
    return directory, chain


def _chain(directory: Path) -> list[dict]:
    """The manifests a checkpoint restores from, its full base first, each checked whole."""
    chain, name = [], directory.name
    while name is not None:
        manifest = _check(directory.parent / name)
        chain.append(manifest)
        name = manifest["parent"]
    return chain[::-1]


def read_chain(directory: Path) -> list[dict]:
    """The manifests of a checkpoint just committed by this job, its full base first (not re-hashed)."""
    chain, name = [], directory.name
    while name is not None:
        chain.append(_read_manifest(directory.parent / name))
        name = chain[-1]["parent"]
    return chain[::-1]


def resume_chain(run_dir: str | Path, name: str) -> tuple[Path, list[dict]]:
    """The checkpoint ``name`` of ``run_dir`` (the one a resumed job continues from) and its chain."""
    directory = checkpoints_dir(run_dir) / name
    try:
        return directory, _chain(directory)
    except (ValueError, OSError) as err:
        raise ValueError(f"cannot resume from checkpoint {directory}: {err}") from None


def chain_parts(directory: Path, chain: list[dict]):
    """Every row part of a checkpoint's chain, base first: (space, keys, rows, state), arrays memory-mapped."""
    root = directory.parent
    for manifest in chain:
        where = root / step_name(manifest["iteration"])
        for entry in manifest["parts"]:
            keys = (np.load(where / entry["keys"]) if "keys" in entry
                    else entry["start"] + entry["step"] * np.arange(entry["count"], dtype=np.int64))
            yield (entry["space"], keys, np.load(where / entry["rows"], mmap_mode="r"),
                   np.load(where / entry["state"], mmap_mode="r"))


class _MappedRows:
    """A part's ``.npy`` rows, memory-mapped by this object so that the pages a read touched can be dropped
    from this process's memory right after (they stay in the page cache): reading a checkpoint's rows never
    adds up to holding its tables. A fault maps the pages around it too (here 150-170 KiB a fault on average:
    the kernel maps whole large folios), so rows scattered over a file cost that much each until dropped:
    ``take`` reads them in sorted chunks of at most WINDOWS distinct windows of the file, dropping each chunk's
    pages, so a scattered read (an evaluation batch's rows) and a dense one (a model's table, block by block)
    alike map a few tens of MiB at a time."""

    WINDOW_BYTES = 256 << 10  # rows in one window of the file: about one fault's mapping
    WINDOWS = 64  # windows read between drops
    MARGIN = 1 << 20  # bytes dropped beyond a chunk's rows on each side (the pages mapped around a fault)

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(handle)
            assert not fortran and dtype == np.float32, f"{path}: float32 rows in C order expected"
            self.offset = handle.tell()
            self.map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if shape[0] else None
        self.array = (np.frombuffer(self.map, dtype=np.float32, count=shape[0] * shape[1], offset=self.offset)
                      .reshape(shape) if self.map is not None else np.zeros(shape, dtype=np.float32))

    def take(self, local: np.ndarray) -> np.ndarray:
        """The rows at ``local`` (indices into the part), their pages dropped as they are read."""
        out = np.empty((len(local), self.array.shape[1]), dtype=np.float32)
        if not len(local):
            return out
        order = np.argsort(local, kind="stable")
        at = np.asarray(local)[order]
        row_bytes = 4 * self.array.shape[1]
        window = (self.offset + at * row_bytes) // self.WINDOW_BYTES
        fresh = np.empty(len(at), dtype=bool)
        fresh[0] = True
        np.not_equal(window[1:], window[:-1], out=fresh[1:])
        group = (np.cumsum(fresh) - 1) // self.WINDOWS
        bounds = [0, *(np.flatnonzero(group[1:] != group[:-1]) + 1).tolist(), len(at)]
        for start, stop in zip(bounds[:-1], bounds[1:]):
            out[order[start:stop]] = self.array[at[start:stop]]
            first = max(self.offset + int(at[start]) * row_bytes - self.MARGIN, 0) // mmap.PAGESIZE * mmap.PAGESIZE
            last = min(self.offset + (int(at[stop - 1]) + 1) * row_bytes + self.MARGIN, len(self.map))
            self.map.madvise(mmap.MADV_DONTNEED, first, last - first)
        return out

    def release(self) -> None:
        if self.map is not None:
            self.map.madvise(mmap.MADV_DONTNEED)


class ChainRows:
    """The rows of a checkpoint's chain by key, read from its memory-mapped parts, never whole tables.

    A full part is a range of keys ``start::step`` (a server's shard), located by arithmetic; a delta's
    keys are held sorted and searched. Later parts override earlier ones, as a restore applies them.
    The files are opened when this is made, so a checkpoint pruned meanwhile stays readable.
    """

    def __init__(self, located: list[tuple[Path, list[dict]]]) -> None:
        """``located``: (directory, its part entries) in the order they apply."""
        self.parts: dict[int, list[tuple]] = {}  # space -> (keys sorted or None, order, start, step, count, rows)
        for where, entries in located:
            for entry in entries:
                rows = _MappedRows(where / entry["rows"])
                if "keys" in entry:
                    keys = np.load(where / entry["keys"])
                    order = np.argsort(keys, kind="stable")
                    located = (keys[order], order, 0, 1, entry["count"], rows)
                else:
                    located = (None, None, entry["start"], entry["step"], entry["count"], rows)
                self.parts.setdefault(entry["space"], []).append(located)

    @classmethod
    def of_chain(cls, directory: Path, chain: list[dict]) -> "ChainRows":
        """The rows of checkpoint ``directory`` whose chain (its manifests, base first) is ``chain``."""
        return cls([(directory.parent / step_name(m["iteration"]), m["parts"]) for m in chain])

    def rows(self, space: int, keys: np.ndarray) -> np.ndarray:
        """float32 ``[len(keys), dim]``: each key's row as the chain's newest part holding it has it."""
        parts = self.parts.get(space)
        if not parts:
            raise ValueError(f"the checkpoint holds no rows of embedding space {space}")
        keys = np.asarray(keys, dtype=np.int64)
        out = np.empty((len(keys), parts[0][5].array.shape[1]), dtype=np.float32)
        missing = np.ones(len(keys), dtype=bool)
        for sorted_keys, order, start, step, count, rows in reversed(parts):
            wanted = np.flatnonzero(missing)
            if not len(wanted):
                break
            asked = keys[wanted]
            if sorted_keys is None:
                relative = asked - start
                local = relative // step
                held = (relative >= 0) & (relative % step == 0) & (local < count)
            else:
                position = np.minimum(np.searchsorted(sorted_keys, asked), max(len(sorted_keys) - 1, 0))
                held = sorted_keys[position] == asked if len(sorted_keys) else np.zeros(len(asked), dtype=bool)
                local = order[position] if len(sorted_keys) else position
            out[wanted[held]] = rows.take(local[held])
            missing[wanted[held]] = False
        if missing.any():
            raise ValueError(f"the checkpoint holds no row for key {int(keys[missing][0])} of space {space}")
        return out

    def release(self) -> None:
        """Drop the pages read so far from this process's memory (the next read maps them again)."""
        for parts in self.parts.values():
            for part in parts:
                part[5].release()


def load_dense(directory: Path, manifest: dict) -> dict:
    """``{"dense": state_dict, "dense_optimizer": state_dict}`` of a checkpoint."""
    return torch.load(directory / manifest["dense"], map_location="cpu", weights_only=True)


def load_latest(run_dir: str | Path, *, num_rows: list[int]) -> TrainState | None:
    """The newest intact checkpoint of ``run_dir`` as one TrainState with every space's rows in full
    (``num_rows`` per space); None if there is none."""
    found = valid_checkpoints(run_dir, newest_only=True)
    return load_checkpoint(*found[0], num_rows=num_rows) if found else None


def load_checkpoint(directory: Path, chain: list[dict], *, num_rows: list[int]) -> TrainState:
    """The checkpoint in ``directory`` (``chain``: its manifests, base first, as checked) as one TrainState."""
    rows: list[np.ndarray | None] = [None] * len(num_rows)
    state: list[np.ndarray | None] = [None] * len(num_rows)
    for space, keys, part_rows, part_state in chain_parts(directory, chain):
        if rows[space] is None:
            rows[space] = np.zeros((num_rows[space], part_rows.shape[1]), dtype=np.float32)
            state[space] = np.zeros((num_rows[space], part_state.shape[1]), dtype=np.float32)
        rows[space][keys] = part_rows
        state[space][keys] = part_state
    missing = [s for s, r in enumerate(rows) if r is None]
    if missing:
        raise ValueError(f"{directory}: its chain holds no rows of embedding space(s) {missing}")
    last = chain[-1]
    dense = load_dense(directory, last)
    return TrainState(iteration=last["iteration"], dense=dense["dense"], dense_optimizer=dense["dense_optimizer"],
                      parts=[RowPart(space=s, rows=r, state=st) for s, (r, st) in enumerate(zip(rows, state))],
                      extra=last["extra"])


class CheckpointSchedule:
    """When a run checkpoints: every ``every`` iterations and/or every ``every_s`` seconds (0: not by that)."""

    def __init__(self, *, every: int, every_s: float, clock=time.monotonic) -> None:
        self.every, self.every_s = every, every_s
        self._clock = clock
        self._last = clock()

    def due(self, iterations_done: int) -> bool:
        by_count = self.every > 0 and iterations_done % self.every == 0
        by_time = self.every_s > 0 and self._clock() - self._last >= self.every_s
        if by_count or by_time:
            self._last = self._clock()
            return True
        return False


def discard_after(run_dir: str | Path, iteration: int) -> None:
    """Remove the checkpoints past ``iteration`` (a resumed run continues from it; later ones are of a
    past that will be computed again) and any unfinished write."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return
    for directory in root.iterdir():
        if directory.name.endswith(".tmp") or (directory.name.startswith("step-")
                                                and int(directory.name[5:13]) > iteration):
            shutil.rmtree(directory, ignore_errors=True)


def capture(iteration: int, model: torch.nn.Module, dense_optimizer: torch.optim.Optimizer, tables, *,
            full: bool, extra: dict) -> TrainState:
    """A copy of one process's training state at a boundary (``tables``: ``EmbeddingTables`` or
    ``nn.CachedTables`` that track their changed rows): every row for a full base, else the rows changed since
    the last capture."""
    parts = []
    for space, changed in enumerate(tables.changed):
        if full:
            rows, state = tables.read_rows(space)
            parts.append(RowPart(space=space, rows=rows, state=state))
        else:
            keys = torch.nonzero(changed).flatten().cpu().numpy()
            rows, state = tables.read_rows(space, keys)
            parts.append(RowPart(space=space, keys=keys, rows=rows, state=state))
        changed.zero_()
    return TrainState(iteration=iteration, dense=cloned_state(model.state_dict()),
                      dense_optimizer=cloned_state(dense_optimizer.state_dict()), parts=parts, extra=extra)


def restore(state: TrainState, model: torch.nn.Module, dense_optimizer: torch.optim.Optimizer, tables) -> None:
    """Put a loaded ``state`` (every row, as ``load_latest`` gives it) into in-memory training."""
    model.load_state_dict(state.dense)
    dense_optimizer.load_state_dict(state.dense_optimizer)
    for part in state.parts:
        tables.load_rows(part.space, part.rows, part.state)


def cloned_state(value):
    """A deep copy of a state dict's tensors (they change in place as training goes on), in host memory (a
    checkpoint written on a GPU machine loads anywhere; ``load_state_dict`` moves them back to the model's device)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cloned_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [cloned_state(v) for v in value]
    return value
