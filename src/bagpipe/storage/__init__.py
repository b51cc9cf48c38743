"""Storage of embedding rows: the tiers a table lives in (storage.tiers: tensors in memory, MemoryRows, or a file of
fixed-size records on local disk with the hottest rows in a bounded DRAM cache, DiskRows; registered by kind and
used by the servers and by bagpipe.nn alike), a server's shard over one with versions and snapshots (RowStore), and
erasure-coded groups of shards whose parity rebuilds a lost one bit for bit (storage.parity)."""

from bagpipe.config import STORAGE_KINDS
from bagpipe.storage.memory import MemoryRows
from bagpipe.storage.disk import DiskRows
from bagpipe.storage.rowstore import RowStore, StorageSpec, gather_flat
from bagpipe.storage.tiers import TIERS, RowTier, open_tier

assert set(TIERS) == set(STORAGE_KINDS), f"config.STORAGE_KINDS lists the registered tiers ({', '.join(TIERS)})"

__all__ = ["DiskRows", "MemoryRows", "RowStore", "RowTier", "StorageSpec", "gather_flat", "open_tier"]
