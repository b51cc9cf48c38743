"""The models: each a dense part that takes its embeddings as input, with the tables it embeds.

A model module provides ``tables(config, schema)`` (its TableConfigs), ``check(config, schema)``
(a ValueError if the data cannot feed it) and a module class built ``from_config(config,
schema)`` whose ``forward(dense_x, embeddings)`` gives logits and whose ``early_params()`` names
the parameters the backward completes first (their all-reduce starts early), possibly none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from bagpipe.config import EXTERNAL, MODEL_NAMES, ModelConfig
from bagpipe.data.schema import Schema, is_next_item
from bagpipe.embeddings import TableConfig, one_per_feature
from bagpipe.models import caser, dcn, deepfm, dlrm, fgcnn, wide_deep


@dataclass(frozen=True)
class ModelSpec:
    tables: Callable[[ModelConfig, Schema], list[TableConfig]]
    check: Callable[[ModelConfig, Schema], None]
    build: Callable[[ModelConfig, Schema], nn.Module]
    settings: tuple[str, ...]  # the ModelConfig fields it reads


MODELS: dict[str, ModelSpec] = {
    "dlrm": ModelSpec(dlrm.tables, dlrm.check, dlrm.DLRM.from_config, ("emb_dim", "arch_mlp_bot", "arch_mlp_top")),
    "wide-deep": ModelSpec(wide_deep.tables, wide_deep.check, wide_deep.WideDeep.from_config,
                           ("emb_dim", "deep_mlp", "dropout")),
    "deepfm": ModelSpec(deepfm.tables, deepfm.check, deepfm.DeepFM.from_config, ("emb_dim", "deep_mlp", "dropout")),
    "dcn": ModelSpec(dcn.tables, dcn.check, dcn.DCN.from_config,
                     ("emb_dim", "deep_mlp", "cross_layers", "cross_kind", "cross_rank", "dropout")),
    "fgcnn": ModelSpec(fgcnn.tables, fgcnn.check, fgcnn.FGCNN.from_config,
                       ("emb_dim", "conv_channels", "conv_kernel", "conv_pool", "recombine", "deep_mlp", "dropout")),
    "caser": ModelSpec(caser.tables, caser.check, caser.Caser.from_config,
                       ("emb_dim", "vertical_filters", "horizontal_filters", "dropout")),
}
assert tuple(MODELS) == MODEL_NAMES, "config.MODEL_NAMES lists the registry's models"


def _no_check(config: ModelConfig, schema: Schema) -> None:
    pass


def _not_ours(config: ModelConfig, schema: Schema) -> nn.Module:
    raise ValueError("model external is the trainers' own (scripts using the original API, init_cache): the "
                     "oracle serves their embeddings and neither builds nor evaluates the model")


# A job whose trainers are user scripts: a table of emb_dim per sparse feature, the model their own.
MODELS[EXTERNAL] = ModelSpec(lambda config, schema: one_per_feature(schema, config.emb_dim), _no_check, _not_ours,
                             ("emb_dim",))


SEQUENCE_MODELS = ("caser", EXTERNAL)  # the models that read next-item samples (data.sequences)


def _readable(config: ModelConfig, schema: Schema) -> None:
    """Sequence data given to a click model (or the reverse) refused by what the data is, before any model's own
    check meets a symptom of it (no dense features, a missing column)."""
    if is_next_item(schema) and config.name not in SEQUENCE_MODELS:
        raise ValueError(f"the data holds next-item sequences (a user's last items, the next ones, negatives), which "
                         f"--model {config.name} cannot read: train --model caser on it (the click models, "
                         f"{', '.join(n for n in MODEL_NAMES if n not in SEQUENCE_MODELS)}, read click logs such as "
                         f"`bagpipe synth --kind ctr`, Criteo or Avazu)")


def model_tables(config: ModelConfig, schema: Schema) -> list[TableConfig]:
    _readable(config, schema)
    return MODELS[config.name].tables(config, schema)


def check_model(config: ModelConfig, schema: Schema) -> None:
    _readable(config, schema)
    MODELS[config.name].check(config, schema)


def build_model(config: ModelConfig, schema: Schema, *, seed: int) -> nn.Module:
    """The model's dense part, initialised from ``seed`` (every trainer builds the same one)."""
    check_model(config, schema)
    torch.manual_seed(seed)
    return MODELS[config.name].build(config, schema)
