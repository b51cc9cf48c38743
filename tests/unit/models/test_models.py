"""The CTR models: shapes and gradients, learning the planted data, and exactness in every mode."""


import json

import pytest
import torch

from bagpipe import models
from bagpipe.train.single import gather_tables, train_cached
from bagpipe.config import ModelConfig, TrainConfig, load_train_config
from bagpipe.data.binary import open_dataset
from bagpipe.data.schema import Schema
from bagpipe.embeddings import EmbeddingLayout, EmbeddingTables
from bagpipe.models import CARDS, CLICKS, MODEL_NAMES
from bagpipe.optim import make_row_optimizer
from bagpipe.train.reference import build_model, build_tables, train_reference, train_step
from bagpipe.data.batches import iterate_batches
from bagpipe.data.preprocess import preprocess
from bagpipe.synth import generate
from helpers.small_models import SMALL


def test_every_click_model_has_a_small_shape_here():
    """(So the tests below, every mode and every optimizer, cover a model added to bagpipe.models.)"""
    assert {config.name for config in SMALL.values()} == {name for name in MODEL_NAMES if CLICKS in CARDS[name].data}


@pytest.mark.parametrize("name", SMALL)
def test_every_lookup_gets_a_gradient_and_the_output_is_a_logit_per_sample(name):
    config = SMALL[name]
    schema = Schema.one_hot([10] * 5, num_dense=13)
    model = models.build_model(config, schema, seed=0)
    tables = EmbeddingTables(layout=EmbeddingLayout(models.model_tables(config, schema), schema),
                             optimizer=make_row_optimizer("sgd", lr=0.1), seed=0)
    embeddings, lookups = tables.lookup(torch.randint(0, 10, (6, 5)))
    logits = model(torch.randn(6, 13), embeddings)
    assert logits.shape == (6,)
    model.loss(logits, torch.ones(6)).backward()
    for lookup in lookups:  # every space's rows, e.g. DeepFM's factors and first-order weights
        assert lookup.rows.grad is not None and lookup.rows.grad.abs().sum() > 0
    early = model.early_params()
    assert all(any(p is q for q in model.parameters()) for p in early)


def test_models_with_first_order_weights_plan_two_spaces():
    schema = Schema.one_hot([10] * 3, num_dense=13)
    for name in ("wide-deep", "deepfm"):
        layout = EmbeddingLayout(models.model_tables(SMALL[name], schema), schema)
        assert [(s.dim, len(s.tables)) for s in layout.spaces] == [(8, 3), (1, 3)]
        assert all(t.init == "zeros" for t in layout.tables[3:])


def test_fgcnn_refuses_an_even_kernel_and_dcn_an_unknown_cross():
    schema = Schema.one_hot([10] * 3, num_dense=13)
    with pytest.raises(ValueError, match="conv_kernel must be odd"):
        models.check_model(ModelConfig(name="fgcnn", conv_kernel=4), schema)
    with pytest.raises(ValueError, match="cross_kind must be one of"):
        ModelConfig(name="dcn", cross_kind="diagonal")


# FGCNN's pairwise products of its generated features make large early activations: at Adagrad's
# lr 0.05 its first steps overshoot into a constant output, at the default 0.01 it learns.
@pytest.mark.parametrize("name, lr", [("wide-deep", 0.05), ("deepfm", 0.05), ("dcn", 0.05), ("dcn-v2", 0.05),
                                      ("fgcnn", 0.01)])  # DLRM's is in test_reference
def test_each_model_learns_the_planted_data(small_binary, tmp_path, name, lr):
    config = TrainConfig(data=str(small_binary), run_dir=str(tmp_path / "run"), batch_size=256, iterations=300,
                         optimizer="adagrad", lr=lr, seed=0, log_every=100, model=SMALL[name])
    summary = train_reference(config, show_progress=False)
    assert summary["best_auc"] - summary["eval_auc"] < 0.03, summary


@pytest.fixture(scope="module")
def eight_tables(tmp_path_factory):
    """8 tables of 100 rows, 16,384 training rows: one pass is 32 steps at the default batch."""
    out = tmp_path_factory.mktemp("eight_tables")
    generate(out / "tsv", rows=16_384, test_rows=4096, seed=0, table_sizes=[100] * 8, show_progress=False)
    preprocess(out / "tsv", out / "bin", show_progress=False)
    return out / "bin"


def at_defaults(data, run_dir, name: str, **given) -> tuple[dict, float]:
    """One pass of model ``name`` at its defaults (its card's defaults, bagpipe.models.CARDS) with ``given`` instead: the summary and
    the largest logged training loss (the mean of 10 iterations)."""
    config = load_train_config(None, {"data": str(data), "run_dir": str(run_dir), "name": name, **given})
    summary = train_reference(config, show_progress=False)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, max(r["train_loss"] for r in records if "train_loss" in r)


def learned_stably(summary: dict, max_loss: float) -> bool:
    # 32 steps reach 0.74-0.84 here (the planted best 0.876); benchmarks/bench_defaults.py checks the issue's
    # 0.05 at full size. A diverging first step shows as a logged loss of 4.4 (FGCNN at Adagrad 0.01).
    return summary["eval_auc"] > 0.7 and summary["best_auc"] - summary["eval_auc"] < 0.15 and max_loss < 2.0 \
        and not summary["warnings"]


@pytest.mark.parametrize("name", ["dlrm", "wide-deep", "deepfm", "dcn", "fgcnn"])
def test_each_model_at_its_defaults_learns_in_one_pass_without_diverging(eight_tables, tmp_path, name):
    summary, max_loss = at_defaults(eight_tables, tmp_path / "run", name)
    assert learned_stably(summary, max_loss), (summary, max_loss)


def test_fgcnn_at_the_global_optimizer_defaults_diverges(eight_tables, tmp_path):
    """What its defaults keep it from: Adagrad at 0.01 (the dataclasses') moves every weight by 0.01 at once."""
    summary, max_loss = at_defaults(eight_tables, tmp_path / "run", "fgcnn", optimizer="adagrad", lr=0.01,
                                    iterations=10)
    kinds = [w["kind"] for w in summary["warnings"]]
    assert not learned_stably(summary, max_loss) and max_loss > 2.0 and "diverged" in kinds, (summary, max_loss)


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_cached_training_equals_the_reference_for_every_model(small_binary, name, optimizer):
    split = open_dataset(small_binary).train
    config = TrainConfig(data="-", run_dir="-", optimizer=optimizer, lr=0.05, seed=3, model=SMALL[name])
    model, tables = build_model(config, split.schema), build_tables(config, split.schema)
    dense = tables.optimizer.dense_optimizer(model.parameters())
    for iteration, batch in enumerate(iterate_batches(split, batch_size=64, iterations=30)):
        train_step(model, tables, dense, batch, seed=config.seed, iteration=iteration)
    cached_model = build_model(config, split.schema)
    stores = train_cached(cached_model, tables.optimizer.dense_optimizer(cached_model.parameters()), split,
                          layout=tables.layout, row_optimizer=tables.optimizer, seed=config.seed, batch_size=64,
                          iterations=30, cache_rows=1200, lookahead=4, num_shards=2)
    for t, got in enumerate(gather_tables(stores, tables.layout)):
        assert torch.equal(got, tables.table(t)), f"table {tables.layout.tables[t].name}"
    for (key, got), want in zip(cached_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), key
