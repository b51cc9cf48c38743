"""Embedding tables: their configuration and layout in spaces, rows in memory, lookups."""

from bagpipe.embeddings.layout import EmbeddingLayout, LookupSpec, Space, TableConfig, one_per_feature
from bagpipe.embeddings.tables import (INIT_BLOCK_ROWS, Embeddings, EmbeddingTables, Lookup, gather, distinct_positions, id_places,
                                      init_block,
                                      init_row_blocks, init_rows, init_table, positions_in, row_sums, sparse_row_sums, table_offsets, update_rows,
                                      valid_keys)

__all__ = ["INIT_BLOCK_ROWS", "EmbeddingLayout", "EmbeddingTables", "Embeddings", "Lookup", "LookupSpec", "Space",
           "TableConfig", "distinct_positions", "gather", "id_places", "one_per_feature", "init_block", "init_row_blocks", "init_rows", "init_table", "positions_in", "row_sums",
           "sparse_row_sums", "table_offsets",
           "update_rows", "valid_keys"]
