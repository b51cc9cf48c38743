"""Single-process cached embeddings: drop-in modules whose tables live in host memory behind a small cache."""

from bagpipe.nn.cached_bag import CachedEmbedding, CachedEmbeddingBag, CachedTableModule, without_optimizer_state
from bagpipe.nn.collection import CachedEmbeddingBagCollection
from bagpipe.nn.dynamic import DynamicEmbeddingBag
from bagpipe.nn.lookahead import Lookahead
from bagpipe.nn.optimizer import FusedOptimizer
from bagpipe.nn.rows import CachedRows
from bagpipe.nn.slots import CLEANUP_FRACTION, ONLINE_POLICIES, SlotIndex
from bagpipe.nn.tables import CachedTables

__all__ = ["CLEANUP_FRACTION", "ONLINE_POLICIES", "CachedEmbedding", "CachedEmbeddingBag", "CachedEmbeddingBagCollection",
           "CachedRows", "CachedTableModule", "CachedTables", "DynamicEmbeddingBag", "FusedOptimizer", "Lookahead",
           "SlotIndex",
           "without_optimizer_state"]
