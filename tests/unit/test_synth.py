import json

import numpy as np
import pytest

from bagpipe.data.binary import open_dataset
from bagpipe.data.preprocess import preprocess
from bagpipe.synth import CRITEO_KAGGLE_TABLE_SIZES, ZipfSampler, generate, resolve_table_sizes


def _files(directory):
    return {name: (directory / name).read_bytes() for name in ("train.tsv", "test.tsv", "meta.json")}


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    sizes = [100, 7, 5000]
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        generate(tmp_path / name, rows=3000, test_rows=500, seed=seed, table_sizes=sizes, show_progress=False)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert _files(tmp_path / "a")["train.tsv"] != _files(tmp_path / "c")["train.tsv"]


def test_criteo_format_and_meta(tmp_path):
    sizes = resolve_table_sizes(tables="criteo-kaggle", table_sizes=None, max_rows_per_table=1000)
    meta = generate(tmp_path, rows=2000, test_rows=1000, seed=1, table_sizes=sizes, show_progress=False)
    assert meta == json.loads((tmp_path / "meta.json").read_text())
    assert meta["table_sizes"] == [min(s, 1000) for s in CRITEO_KAGGLE_TABLE_SIZES]
    assert 0.6 < meta["best_auc"] < 1.0
    lines = (tmp_path / "train.tsv").read_text().splitlines()
    assert len(lines) == 2000
    fields = [line.split("\t") for line in lines]
    assert all(len(f) == 40 for f in fields)
    assert {f[0] for f in fields} == {"0", "1"}
    cats = [tok for f in fields for tok in f[14:]]
    assert any(tok == "" for tok in cats), "empty categorical fields must occur"
    assert all(tok == "" or (len(tok) == 8 and int(tok, 16) >= 0) for tok in cats)
    assert any(f[2].startswith("-") for f in fields), "negative dense values must occur"


def test_generated_ids_round_trip_through_the_reader(tmp_path):
    sizes = [13, 1000, 70000]
    generate(tmp_path / "tsv", rows=5000, test_rows=100, seed=2, table_sizes=sizes, show_progress=False)
    preprocess(tmp_path / "tsv", tmp_path / "bin", show_progress=False)
    data = open_dataset(tmp_path / "bin")
    assert data.train.rows == 5000 and data.test.rows == 100
    assert data.meta["best_auc"] > 0.5
    ids = np.asarray(data.train.ids)
    assert (ids >= 0).all() and (ids < np.asarray(sizes)).all()
    assert len(np.unique(ids[:, 2])) > 500  # hashes map back to many distinct rows


def test_zipf_skew_puts_most_lookups_on_one_percent_of_rows():
    rng = np.random.default_rng(0)
    for num_rows in (200_000, 5_000_000):  # exact CDF and continuous approximation
        sampler = ZipfSampler(num_rows=num_rows, exponent=1.2, rng=rng)
        ids = sampler.sample(2_000_000, rng)
        assert ids.min() >= 0 and ids.max() < num_rows
        counts = np.sort(np.bincount(ids, minlength=num_rows))[::-1]
        top_share = counts[: num_rows // 100].sum() / counts.sum()
        assert top_share > 0.85, top_share
        assert counts[0] < 0.5 * counts.sum()


@pytest.mark.parametrize("kwargs, message", [
    ({"tables": "nope", "table_sizes": None}, "unknown preset"),
    ({"tables": None, "table_sizes": "10,x"}, "comma-separated"),
    ({"tables": None, "table_sizes": "10,0"}, "positive"),
    ({"tables": "criteo-kaggle", "table_sizes": "10"}, "not both"),
])
def test_bad_table_sizes_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_table_sizes(**kwargs)
