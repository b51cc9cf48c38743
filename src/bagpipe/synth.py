"""Synthetic Criteo-format data with a planted model, so the best achievable AUC is known.

Categorical ids follow a bounded Zipf law per table (hot rows scattered by a random bijection);
labels are drawn from a logistic model over the parsed features, exactly as a reader sees them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from bagpipe.data.formats import NUM_DENSE, dense_transform
from bagpipe.data.rawids import mix63, mix64
from bagpipe.metrics import log_loss, roc_auc
from bagpipe.progress import progress

CRITEO_KAGGLE_TABLE_SIZES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
TABLE_PRESETS = {"criteo-kaggle": CRITEO_KAGGLE_TABLE_SIZES}

DEFAULT_ZIPF = 1.2  # about 1% of a large table's rows then take over 90% of its lookups
EMPTY_CATEGORICAL = 0.03
EMPTY_DENSE = 0.05
CHUNK_ROWS = 262_144
_EXACT_CDF_LIMIT = 1 << 20


def resolve_table_sizes(*, tables: str | None, table_sizes: str | None, max_rows_per_table: int = 0) -> list[int]:
    if tables and table_sizes:
        raise ValueError("give either --tables or --table-sizes, not both")
    if table_sizes:
        try:
            sizes = [int(part) for part in table_sizes.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"--table-sizes: expected comma-separated integers, got {table_sizes!r}") from None
    else:
        name = tables or "criteo-kaggle"
        if name not in TABLE_PRESETS:
            raise ValueError(f"--tables: unknown preset {name!r}; known: {', '.join(TABLE_PRESETS)}")
        sizes = list(TABLE_PRESETS[name])
    if not sizes or any(size <= 0 for size in sizes):
        raise ValueError(f"table sizes must be positive integers, got {sizes}")
    if max_rows_per_table < 0:
        raise ValueError(f"--max-rows-per-table must not be negative, got {max_rows_per_table}")
    if max_rows_per_table:
        sizes = [min(size, max_rows_per_table) for size in sizes]
    return sizes


class PlantedModel:
    """The logistic model that generates labels: dense weights plus one effect per (table, row)."""

    def __init__(self, *, table_sizes: list[int], seed: int) -> None:
        rng = np.random.default_rng([seed, 1])
        self.table_sizes = table_sizes
        self.salt = np.uint64(rng.integers(1, 2**62))
        self.dense_weights = rng.normal(0.0, 0.25, NUM_DENSE)
        self.dense_center = 1.5
        self.table_scale = 3.0 / math.sqrt(len(table_sizes))  # best AUC about 0.85 on Criteo's shape
        self.bias = -1.0

    def row_effects(self, table: int, ids: np.ndarray) -> np.ndarray:
        """Effect in [-1, 1) of each row, computed by hashing so no table-sized array is kept."""
        with np.errstate(over="ignore"):
            key = ids.astype(np.uint64) * np.uint64(len(self.table_sizes)) + np.uint64(table)
            bits = mix64(key ^ self.salt)
        return (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53) * 2.0 - 1.0

    def logits(self, dense_features: np.ndarray, ids: np.ndarray) -> np.ndarray:
        logit = self.bias + (dense_features - self.dense_center) @ self.dense_weights
        for table in range(ids.shape[1]):
            logit = logit + self.table_scale * self.row_effects(table, ids[:, table])
        return logit


class ZipfSampler:
    """Draws row ids of one table: Zipf ranks, scattered by ``rank * a + b mod n``."""

    def __init__(self, *, num_rows: int, exponent: float, rng: np.random.Generator) -> None:
        self.num_rows = num_rows
        self.exponent = exponent
        multiplier = int(rng.integers(1, max(num_rows, 2)))
        while math.gcd(multiplier, num_rows) != 1:
            multiplier = int(rng.integers(1, max(num_rows, 2)))
        self.multiplier = multiplier
        self.offset = int(rng.integers(0, num_rows))
        self.cdf = None
        if num_rows <= _EXACT_CDF_LIMIT:
            weights = np.arange(1, num_rows + 1, dtype=np.float64) ** -exponent
            self.cdf = np.cumsum(weights) / weights.sum()

    def ranks(self, uniforms: np.ndarray) -> np.ndarray:
        if self.cdf is not None:
            return np.minimum(np.searchsorted(self.cdf, uniforms, side="right"), self.num_rows - 1)
        # Continuous inverse CDF of a bounded power law on [1, n + 1).
        a, n = self.exponent, float(self.num_rows)
        if abs(a - 1.0) < 1e-9:
            ranks = np.exp(uniforms * math.log(n + 1.0))
        else:
            top = (n + 1.0) ** (1.0 - a)
            ranks = (1.0 + uniforms * (top - 1.0)) ** (1.0 / (1.0 - a))
        return np.clip(np.floor(ranks).astype(np.int64) - 1, 0, self.num_rows - 1)

    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        ranks = self.ranks(rng.random(count))
        return (ranks * self.multiplier + self.offset) % self.num_rows


def _dense_values(count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Integer dense counts and their empty mask, shaped like Criteo's I1..I13."""
    scales = np.linspace(0.5, 3.0, NUM_DENSE)
    values = np.floor(rng.lognormal(mean=scales, sigma=1.0, size=(count, NUM_DENSE))).astype(np.int64)
    negatives = rng.random(count) < 0.02  # Criteo's I2 holds a few negative values
    values[negatives, 1] = -rng.integers(1, 4, negatives.sum())
    empty = rng.random((count, NUM_DENSE)) < EMPTY_DENSE
    values[empty] = 0
    return values, empty


class ArrivingIds:
    """Raw ids that keep arriving (``bagpipe synth --raw-ids``): table by table, each period's ids are a window of
    ``active`` indices that slides by ``new`` a period, so that a share ``new / active`` of a period's ids were never
    seen before. A Zipf draw picks a window position (``ZipfSampler``'s scattered rank); index ``i`` sits at position
    ``i mod active`` as long as the window holds it, so an id keeps its popularity for its life, and the ids that
    arrive take the positions (and popularity) of those that leave. An index is written as a 63-bit id,
    ``mix63(index ^ salt)`` (a bijection: no two indices share an id), as 16 hex digits."""

    EMPTY_INDEX = 1 << 62  # the planted model's index of an empty field (written as no value): no real id's

    def __init__(self, *, active: list[int], new_share: float, seed: int) -> None:
        self.active = np.asarray(active, dtype=np.int64)
        self.new = np.array([max(1, round(new_share * n)) if new_share > 0 else 0 for n in active], dtype=np.int64)
        self.salts = np.random.default_rng([seed, 2]).integers(1, 2**62, len(active), dtype=np.uint64)

    def indices(self, table: int, positions: np.ndarray, periods: np.ndarray) -> np.ndarray:
        """The ids' indices at window ``positions`` in each row's period."""
        start = periods * self.new[table]
        return start + (positions - start) % self.active[table]

    def written(self, table: int, indices: np.ndarray) -> np.ndarray:
        """The ids as written (uint64 below 2**63)."""
        return mix63(indices.astype(np.uint64) ^ self.salts[table])

    def ids_up_to(self, periods: int) -> list[int]:
        """Per table, the indices any of ``periods`` periods can draw."""
        return (self.active + (periods - 1) * self.new).tolist()


def _format_rows(labels, dense, dense_empty, hashes, cat_empty, *, hex_digits: int = 8) -> str:
    dense_cols = [
        ["" if e else str(v) for v, e in zip(dense[:, j].tolist(), dense_empty[:, j].tolist())]
        for j in range(dense.shape[1])
    ]
    cat_cols = [
        ["" if e else f"{v:0{hex_digits}x}" for v, e in zip(hashes[:, t].tolist(), cat_empty[:, t].tolist())]
        for t in range(hashes.shape[1])
    ]
    label_col = [str(int(v)) for v in labels.tolist()]
    lines = ["\t".join(fields) for fields in zip(label_col, *dense_cols, *cat_cols)]
    return "\n".join(lines) + "\n"


def generate(
    out_dir: str | Path,
    *,
    rows: int,
    test_rows: int,
    seed: int = 0,
    table_sizes: list[int],
    zipf: float = DEFAULT_ZIPF,
    show_progress: bool = True,
    raw_ids: bool = False,
    periods: int = 10,
    new_share: float = 0.1,
) -> dict:
    """Write train.tsv, test.tsv and meta.json into ``out_dir``; return the metadata.

    ``raw_ids``: 63-bit ids that keep arriving (``ArrivingIds``): the train rows are ``periods`` periods in file
    order and the test rows the next one, each period's ids a share ``new_share`` new (``table_sizes``: each
    table's ids active in a period). ``meta.json``'s table_sizes are then the distinct ids each table's train rows
    hold (hashing the ids modulo them gives fixed tables of as many rows as tables that grow with the data make)."""
    if rows <= 0:
        raise ValueError(f"--rows must be positive, got {rows}")
    if test_rows < 0:
        raise ValueError(f"--test-rows must not be negative, got {test_rows}")
    if not zipf > 0:
        raise ValueError(f"--zipf must be positive, got {zipf}")
    if raw_ids and periods < 1:
        raise ValueError(f"--periods must be at least 1, got {periods}")
    if raw_ids and not 0 <= new_share <= 1:
        raise ValueError(f"--new-share must lie in [0, 1], got {new_share}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 0])
    samplers = [ZipfSampler(num_rows=n, exponent=zipf, rng=rng) for n in table_sizes]
    planted = PlantedModel(table_sizes=table_sizes, seed=seed)
    sizes = np.asarray(table_sizes, dtype=np.uint64)
    arriving = ArrivingIds(active=table_sizes, new_share=new_share, seed=seed) if raw_ids else None
    seen = [np.zeros(n, dtype=bool) for n in arriving.ids_up_to(periods)] if raw_ids else None
    test_labels, test_probs = [], []
    bar = progress(total=rows + test_rows, desc="synth", unit="rows", enabled=show_progress)
    for split, count in (("train", rows), ("test", test_rows)):
        with open(out / f"{split}.tsv", "w") as handle:
            for start in range(0, count, CHUNK_ROWS):
                n = min(CHUNK_ROWS, count - start)
                dense, dense_empty = _dense_values(n, rng)
                ids = np.stack([s.sample(n, rng) for s in samplers], axis=1).astype(np.int64)
                cat_empty = rng.random(ids.shape) < EMPTY_CATEGORICAL
                if arriving is not None:
                    row_periods = (np.full(n, periods) if split == "test"
                                   else (np.arange(start, start + n) * periods) // count)
                    ids = np.stack([arriving.indices(t, ids[:, t], row_periods) for t in range(ids.shape[1])], axis=1)
                    hashes = np.stack([arriving.written(t, ids[:, t]) for t in range(ids.shape[1])], axis=1)
                    if split == "train":
                        for t, table_seen in enumerate(seen):
                            table_seen[ids[~cat_empty[:, t], t]] = True
                    ids[cat_empty] = ArrivingIds.EMPTY_INDEX
                else:
                    ids[cat_empty] = 0
                    # A 32-bit hash value that the reader's "hex mod table size" maps back to the id.
                    wraps = (np.uint64(1 << 32) - 1 - ids.astype(np.uint64)) // sizes
                    hashes = ids.astype(np.uint64) + (rng.random(ids.shape) * wraps).astype(np.uint64) * sizes
                probs = 1.0 / (1.0 + np.exp(-planted.logits(dense_transform(dense), ids)))
                labels = (rng.random(n) < probs).astype(np.int64)
                handle.write(_format_rows(labels, dense, dense_empty, hashes, cat_empty,
                                          hex_digits=16 if raw_ids else 8))
                if split == "test":
                    test_labels.append(labels)
                    test_probs.append(probs)
                bar.update(n)
    bar.close()
    meta = {
        "format": "criteo-tsv",
        "table_sizes": list(table_sizes),
        "num_dense": NUM_DENSE,
        "train_rows": rows,
        "test_rows": test_rows,
        "seed": seed,
        "zipf": zipf,
    }
    if raw_ids:
        distinct = [int(np.count_nonzero(table_seen)) + 1 for table_seen in seen]  # (+1: the empty field's row)
        meta["table_sizes"] = distinct
        meta["raw_ids"] = {"periods": periods, "new_share": new_share, "active_ids": list(table_sizes),
                           "ids_per_table": arriving.ids_up_to(periods + 1), "train_distinct_ids": distinct,
                           "note": "ids of 63 bits, as 16 hex digits; train rows are periods 0.. in file order, "
                                   "the test rows the next period; table_sizes: the distinct values (the empty one "
                                   "included) of each table's train rows"}
    if test_rows:
        labels, probs = np.concatenate(test_labels), np.concatenate(test_probs)
        meta["best_auc"] = roc_auc(labels, probs)
        meta["best_logloss"] = log_loss(labels, probs)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def zipf_bags(count: int, *, num_rows: int, dim: int, bags: int = 16, ids_per_bag: int = 3, seed: int = 0,
              skew: float = 1.3) -> list[tuple]:
    """``count`` batches for an ``nn.EmbeddingBag``-shaped module: ``bags`` bags of ``ids_per_bag`` Zipf-skewed
    ids below ``num_rows`` (ids 1-D, offsets) and a regression target ``[bags, dim]``, as tensors (tests and the
    GPU check of bagpipe.nn)."""
    import torch

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = np.minimum(rng.zipf(skew, bags * ids_per_bag) - 1, num_rows - 1)
        rng.shuffle(ids)
        out.append((torch.from_numpy(ids), torch.arange(0, bags * ids_per_bag, ids_per_bag),
                    torch.from_numpy(rng.standard_normal((bags, dim)).astype(np.float32))))
    return out
