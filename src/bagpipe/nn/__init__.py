"""Single-process cached embeddings: drop-in modules whose tables live in host memory behind a small cache."""

from bagpipe.nn.cached_bag import CachedEmbeddingBag
from bagpipe.nn.lookahead import Lookahead
from bagpipe.nn.slots import ONLINE_POLICIES, SlotIndex

__all__ = ["ONLINE_POLICIES", "CachedEmbeddingBag", "Lookahead", "SlotIndex"]
