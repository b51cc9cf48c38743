"""Shared fixtures: small synthetic data sets made once per session."""

from __future__ import annotations

import pytest

from bagpipe.data.preprocess import ensure_preprocessed, preprocess
from bagpipe.synth import generate, resolve_table_sizes
from bagpipe.synth_sequences import generate_sequences


@pytest.fixture(scope="session")
def small_tsv(tmp_path_factory):
    """A learnable TSV data set: Criteo's 26 tables capped at 40 rows, 40k train rows."""
    out = tmp_path_factory.mktemp("small_tsv")
    sizes = resolve_table_sizes(tables=None, table_sizes=None, max_rows_per_table=40)
    generate(out, rows=40_000, test_rows=10_000, seed=3, table_sizes=sizes, show_progress=False)
    return out


@pytest.fixture(scope="session")
def small_binary(small_tsv, tmp_path_factory):
    out = tmp_path_factory.mktemp("small_bin")
    preprocess(small_tsv, out, show_progress=False)
    return out


@pytest.fixture(scope="session")
def wide_tsv(tmp_path_factory):
    """Criteo's 26 tables capped at 20k rows (~230k rows in all), 60k train rows: room for the default
    model, cache (5% of rows) and optimizer at a small batch."""
    out = tmp_path_factory.mktemp("wide_tsv")
    sizes = resolve_table_sizes(tables=None, table_sizes=None, max_rows_per_table=20_000)
    generate(out, rows=60_000, test_rows=6_000, seed=1, table_sizes=sizes, show_progress=False)
    return out


@pytest.fixture(scope="session")
def sequence_data(tmp_path_factory):
    """8000 users of 20 interactions over 300 items in 8 genres, preprocessed."""
    out = tmp_path_factory.mktemp("sequences")
    generate_sequences(out, users=8000, items=300, interactions=20, seed=1, genres=8, show_progress=False)
    return ensure_preprocessed(out, show_progress=False)
