"""Server-side storage of embedding rows: a shard's rows with versions and snapshots (RowStore),
over one of two tiers: tensors in memory (MemoryRows), or a file of fixed-size records on local
disk with the hottest rows in a bounded DRAM cache (DiskRows); erasure-coded groups of shards whose parity
rebuilds a lost one bit for bit (storage.parity)."""

from bagpipe.storage.disk import DiskRows
from bagpipe.storage.memory import MemoryRows
from bagpipe.storage.rowstore import RowStore, StorageSpec, gather_flat

__all__ = ["DiskRows", "MemoryRows", "RowStore", "StorageSpec", "gather_flat"]
