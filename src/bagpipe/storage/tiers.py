"""Storage tiers: where a table's rows and their optimizer state live, one family for the servers' shards
(storage.RowStore) and for ``bagpipe.nn``'s host tables (nn/host.py), registered by kind.

A tier holds ``num_rows`` rows of ``dim`` floats, each with ``state_width`` floats of optimizer state and (if
versioned) the version of the write-back that wrote it, and answers:

- ``read(local)`` -> (rows, state, versions): copies (versions -1 where the tier keeps none);
- ``versions(local)``; ``write(local, rows, state, version=)``;
- ``read_range(start, stop)`` -> numpy copies of rows, state and versions, without disturbing any cache;
- ``rows(start, stop)`` -> (rows, state) as tensors: views of the table where the tier can give them
  (``views``), else copies; ``set_rows(start, rows)``: rows replaced, their state kept;
- ``step(optimizer, local, grads)``: the row-optimizer step on rows ``local`` (distinct), as the memory tier
  steps them, so that every tier trains alike bit for bit;
- ``set_versions(version)``, ``stats()`` (its counters), ``close()`` (a file is a working copy: deleted).

``open_tier(spec, ...)`` makes the tier ``spec.kind`` names, filled with the initial rows given block by block
(a table on disk is never whole in memory). Adding a tier: a class with this interface, its ``files``
attribute and a classmethod ``open`` (``MemoryRows``, ``DiskRows``) in a module of its own, registered with
``@tier("kind")`` and imported by storage/__init__.py, and its kind in ``config.STORAGE_KINDS`` (the flags' list;
storage/__init__.py checks the two agree). Nothing else branches on a tier's kind: what differs between tiers is
asked of the class (``files``; StorageSpec.files, StorageSpec.of, StorageSpec.split).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from bagpipe.optim import RowOptimizer
    from bagpipe.storage.rowstore import StorageSpec


class RowTier(Protocol):
    # keeps its rows in files of StorageSpec.directory, StorageSpec.budget_bytes of them in DRAM, and makes them a
    # block at a time (a table in files is never whole in memory); else in memory, whole
    files: bool
    num_rows: int
    dim: int
    state_width: int
    max_chunk_rows: int  # the rows a snapshot's writer asks for at once
    views: bool  # ``rows`` gives views of the table (a caller copies what it keeps)
    needs_lock: bool  # its reads change it too (a cache): callers on several threads serialise their calls

    def read(self, local: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]: ...
    def versions(self, local: np.ndarray) -> np.ndarray: ...
    def write(self, local: np.ndarray, rows: torch.Tensor, state: torch.Tensor, *,
              version: int | np.ndarray) -> None: ...
    def read_range(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def set_rows(self, start: int, rows: torch.Tensor) -> None: ...
    def step(self, optimizer: RowOptimizer, local: np.ndarray, grads: torch.Tensor) -> None: ...
    def set_versions(self, version: int) -> None: ...
    def stats(self) -> dict: ...
    def close(self) -> None: ...


TIERS: dict[str, type] = {}


def tier_class(kind: str) -> type:
    """The tier registered as ``kind``; a ValueError naming the kinds if none is."""
    if kind not in TIERS:
        raise ValueError(f"storage must be one of {', '.join(TIERS)}, got {kind!r}")
    return TIERS[kind]


def storage_path(storage_dir: str, run_dir: str) -> Path:
    """Where a run's tables' files go (a tier with ``files``): ``RUN_DIR/storage``, or a directory of
    ``--storage-dir`` named after the run (its run dir's name and absolute path), so that runs sharing a
    --storage-dir never touch each other's files and a later run in the same run dir finds, and removes, what a
    killed one left."""
    if not storage_dir:
        return Path(run_dir) / "storage"
    where = os.path.abspath(run_dir)
    tag = hashlib.blake2b(where.encode(), digest_size=6).hexdigest()
    return Path(storage_dir) / f"bagpipe-{Path(where).name}-{tag}"


def tier(kind: str):
    """Register a tier class under ``kind`` (what ``StorageSpec.kind`` and ``--storage`` name)."""
    def register(cls: type) -> type:
        TIERS[kind] = cls
        return cls
    return register


def open_tier(spec: StorageSpec, *, name: str, num_rows: int, dim: int, state_width: int,
              blocks: Iterable[torch.Tensor], versioned: bool = True, state: torch.Tensor | None = None) -> RowTier:
    """A tier of kind ``spec.kind`` holding the initial rows ``blocks`` (concatenated, ``num_rows`` in all) with
    zero optimizer state (or ``state``, which a tier in memory shares, as it shares a single block), named
    ``name`` where it needs a name (a file in ``spec.directory``). ``versioned``: it keeps each row's version
    (a server's shard does; a single process's table need not)."""
    return tier_class(spec.kind).open(spec, name=name, num_rows=num_rows, dim=dim, state_width=state_width,
                                 blocks=blocks, versioned=versioned, state=state)
