"""The models: each a dense part that takes its embeddings as input, with the tables it embeds.

A model is a module of this package and a ``ModelCard`` in ``CARDS`` below, and nothing else: the card names the
settings it reads (declared once here, as ``Setting``s: the flags, the TOML ``[model]`` keys, ``config.ModelConfig``'s
fields, their checks and the "does nothing with --model M" warnings all derive from them), its defaults for the
training settings, the data it reads, and any check across its settings. This module is free of torch, so that
``bagpipe.config`` reads it and a wrong setting is refused before torch loads.

The module (``card.code``, "module:Class") provides ``tables(config, schema)`` (its TableConfigs), ``check(config,
schema)`` (a ValueError if the data cannot feed it) and a class built ``from_config(config, schema)`` whose
``forward(dense_x, embeddings)`` gives logits and whose ``early_params()`` names the parameters the backward completes
first (their all-reduce starts early), possibly none.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from torch import nn

    from bagpipe.config import ModelConfig
    from bagpipe.data.schema import Schema
    from bagpipe.embeddings import TableConfig

CLICKS, SEQUENCES = "clicks", "sequences"  # the data a model reads: click logs, or next-item sequences


def parse_arch(text: str, *, name: str) -> tuple[int, ...]:
    """Parse a layer-size string such as ``13-512-256-64`` into a tuple of positive ints."""
    try:
        sizes = tuple(int(part) for part in str(text).split("-"))
    except ValueError:
        raise ValueError(f"{name}: expected sizes joined by '-', such as 13-512-64, got {text!r}") from None
    if not sizes or any(size <= 0 for size in sizes):
        raise ValueError(f"{name}: every layer size must be a positive integer, got {text!r}")
    return sizes


@dataclass(frozen=True)
class Setting:
    """A model setting: its default (whose type the setting holds), what it means (the flag's help, without the
    models that read it, which the cards say) and the values it takes."""

    name: str
    default: int | float | str
    help: str
    sizes: bool = False  # layer sizes joined by '-' (parse_arch); read as a tuple by ModelConfig.sizes(name)
    choices: tuple[str, ...] = ()
    low: float | None = None  # the least value allowed
    below: float | None = None  # every value is below this one (with ``low``)

    def check(self, value: Any) -> None:
        if self.sizes:
            parse_arch(value, name=self.name)
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}, got {value!r}")
        if self.below is not None and not self.low <= value < self.below:
            raise ValueError(f"{self.name} must be in [{self.low:g}, {self.below:g}), got {value}")
        if self.below is None and self.low is not None and value < self.low:
            what = {1: "be positive", 0: "not be negative"}.get(self.low, f"be at least {self.low:g}")
            raise ValueError(f"{self.name} must {what}, got {value}")


def _positive(name: str, default: int, help: str) -> Setting:
    return Setting(name, default, help, low=1)


# Settings more than one model reads; a card names them in ``reads``.
SHARED = (
    _positive("emb_dim", 16, "embedding width"),
    Setting("deep_mlp", "400-400-400", "the deep part's hidden sizes", sizes=True),
    Setting("dropout", 0.0, "dropout rate of the deep part", low=0, below=1),
)


@dataclass(frozen=True)
class ModelCard:
    """What the rest of bagpipe knows of a model without building it."""

    name: str
    code: str | None  # "module:Class" in this package; None: the trainers' own model (user scripts), never built here
    reads: tuple[str, ...] = ()  # the SHARED settings it reads
    own: tuple[Setting, ...] = ()  # the settings only it reads
    defaults: dict[str, Any] = field(default_factory=dict)  # its own defaults, of train and model settings
    data: tuple[str, ...] = (CLICKS,)
    check: Callable[["ModelConfig"], None] | None = None  # checks across its settings (each is checked alone first)
    complete: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # settings given -> those they imply
    implies: tuple[str, ...] = ()  # the settings ``complete`` may fill in

    @property
    def settings(self) -> tuple[str, ...]:
        """The names of every setting it reads."""
        return (*self.reads, *(s.name for s in self.own))

    @property
    def built(self) -> bool:
        """Whether bagpipe builds (and evaluates) this model; False: the trainers' own, user scripts."""
        return self.code is not None

    def module(self):
        return importlib.import_module(f"{__name__}.{self.code.partition(':')[0]}")

    def model_class(self):
        return getattr(self.module(), self.code.partition(":")[2])


def _dlrm_complete(values: dict[str, Any]) -> dict[str, Any]:
    """DLRM's embedding width and bottom MLP name each other: one given alone implies the other (``--arch-mlp-bot
    13-512-48`` means ``--emb-dim 48``; ``--emb-dim 48`` means a bottom MLP of 13-512-256-48)."""
    values = dict(values)
    if "arch_mlp_bot" in values and "emb_dim" not in values:
        values["emb_dim"] = parse_arch(values["arch_mlp_bot"], name="arch_mlp_bot")[-1]
    elif "emb_dim" in values and "arch_mlp_bot" not in values:
        default = parse_arch(SETTINGS["arch_mlp_bot"].default, name="arch_mlp_bot")
        values["arch_mlp_bot"] = "-".join(str(size) for size in (*default[:-1], values["emb_dim"]))
    return values


def _dlrm_check(config: "ModelConfig") -> None:
    bot, top = config.sizes("arch_mlp_bot"), config.sizes("arch_mlp_top")
    if len(bot) < 2:
        raise ValueError(f"arch_mlp_bot needs an input and an output size, got {config.arch_mlp_bot!r}")
    if bot[-1] != config.emb_dim:
        raise ValueError(f"arch_mlp_bot must end in the embedding dimension ({config.emb_dim}), "
                         f"got {config.arch_mlp_bot!r}")
    if top[-1] != 1:
        raise ValueError(f"arch_mlp_top must end in 1 (one logit), got {config.arch_mlp_top!r}")


# At their defaults (docs/history/benchmarks.md, "Every model at its defaults"): Adagrad at 0.01, batch 512 trains
# wide-deep, deepfm and dcn well. DLRM and FGCNN feed many pairwise products to a wide MLP: Adagrad's first step moves
# every weight by lr, and at 0.01 DLRM's loss jumps (0.69 to 3.8) and FGCNN's swings and ends near a constant
# prediction's; lower Adagrad rates learn too slowly, Adam at 1e-3 does neither. Caser's are its paper's (Tang & Wang
# 2018: d 50, Adam at 1e-3, batch 512, dropout 0.5) with the passes it needs; 20 passes overfit small data (its
# validation HR@10 peaks after 6 on the default synthetic sequences): evaluated every 250 iterations, it delivers the
# model best on the validation split.
_ADAM = {"optimizer": "adam", "lr": 1e-3}
CARDS: dict[str, ModelCard] = {card.name: card for card in (
    ModelCard("dlrm", "dlrm:DLRM", reads=("emb_dim",), own=(
        Setting("arch_mlp_bot", "13-512-256-16", "bottom MLP sizes, from the dense features to the embedding width",
                sizes=True),
        Setting("arch_mlp_top", "512-256-1", "top MLP sizes after the interaction, ending in 1", sizes=True),
    ), defaults=_ADAM, check=_dlrm_check, complete=_dlrm_complete, implies=("emb_dim", "arch_mlp_bot")),
    ModelCard("wide-deep", "wide_deep:WideDeep", reads=("emb_dim", "deep_mlp", "dropout")),
    ModelCard("deepfm", "deepfm:DeepFM", reads=("emb_dim", "deep_mlp", "dropout")),
    ModelCard("dcn", "dcn:DCN", reads=("emb_dim", "deep_mlp", "dropout"), own=(
        _positive("cross_layers", 3, "cross layers"),
        Setting("cross_kind", "vector", "vector (DCN, Wang et al. 2017) or matrix (DCN-v2, 2021)",
                choices=("vector", "matrix")),
        Setting("cross_rank", 0, "matrix crosses: 0 a full d x d matrix, r > 0 a low-rank U V^T of rank r", low=0),
    )),
    ModelCard("fgcnn", "fgcnn:FGCNN", reads=("emb_dim", "deep_mlp", "dropout"), own=(
        Setting("conv_channels", "14-16-18-20", "channels of each convolution", sizes=True),
        _positive("conv_kernel", 7, "kernel height (fields), odd"),
        _positive("conv_pool", 2, "max-pooling height"),
        _positive("recombine", 2, "new feature maps per convolution"),
    ), defaults=_ADAM),
    ModelCard("caser", "caser:Caser", reads=("emb_dim", "dropout"), own=(
        _positive("vertical_filters", 4, "vertical filters (n_v)"),
        _positive("horizontal_filters", 16, "horizontal filters per height 1..L (n_h)"),
    ), data=(SEQUENCES,), defaults={"emb_dim": 50, "dropout": 0.5, **_ADAM, "batch_size": 512, "epochs": 20,
                                    "shuffle": True, "eval_every": 250, "keep_best": True}),
)}
MODEL_NAMES = tuple(CARDS)  # the models bagpipe builds (--model)
EXTERNAL = "external"  # the model of a job whose trainers are user scripts (init_cache): the oracle has none
# A table of emb_dim per sparse feature, the model the scripts' own.
CARDS[EXTERNAL] = ModelCard(EXTERNAL, None, reads=("emb_dim",), data=(CLICKS, SEQUENCES))
DEFAULT_MODEL = "dlrm"


def _settings() -> dict[str, Setting]:
    found = {s.name: s for s in SHARED}
    for card in CARDS.values():
        for name in card.reads:
            if name not in found:
                raise AssertionError(f"model {card.name} reads {name}, which SHARED does not declare")
        for setting in card.own:
            if setting.name in found:
                raise AssertionError(f"model {card.name} declares {setting.name}, declared already: share it")
            found[setting.name] = setting
    return found


SETTINGS: dict[str, Setting] = _settings()  # every model setting, by name (ModelConfig's fields after its name)
IMPLIED = tuple(dict.fromkeys(name for card in CARDS.values() for name in card.implies))


def readers(setting: str) -> list[str]:
    """The models (--model names) that read ``setting``."""
    return [name for name in MODEL_NAMES if setting in CARDS[name].settings]


def complete_model(values: dict[str, Any]) -> dict[str, Any]:
    """The model settings given, with those they imply for the model they name (its card's ``complete``)."""
    card = CARDS.get(values.get("name", DEFAULT_MODEL))
    return card.complete(values) if card is not None and card.complete else dict(values)


def _readable(config: "ModelConfig", schema: "Schema") -> None:
    """Sequence data given to a click model (or the reverse) refused by what the data is, before any model's own
    check meets a symptom of it (no dense features, a missing column)."""
    from bagpipe.data.schema import is_next_item

    if is_next_item(schema) and SEQUENCES not in config.card.data:
        fits = [name for name in MODEL_NAMES if SEQUENCES in CARDS[name].data]
        others = [name for name in MODEL_NAMES if name not in fits]
        raise ValueError(f"the data holds next-item sequences (a user's last items, the next ones, negatives), which "
                         f"--model {config.name} cannot read: train --model {' or '.join(fits)} on it (the click "
                         f"models, {', '.join(others)}, read click logs such as `bagpipe synth --kind ctr`, Criteo or "
                         f"Avazu)")


def model_tables(config: "ModelConfig", schema: "Schema") -> list["TableConfig"]:
    _readable(config, schema)
    if not config.card.built:
        from bagpipe.embeddings import one_per_feature

        return one_per_feature(schema, config.emb_dim)
    return config.card.module().tables(config, schema)


def check_model(config: "ModelConfig", schema: "Schema") -> None:
    _readable(config, schema)
    if config.card.built:
        config.card.module().check(config, schema)


def build_model(config: "ModelConfig", schema: "Schema", *, seed: int) -> "nn.Module":
    """The model's dense part, initialised from ``seed`` (every trainer builds the same one)."""
    import torch

    if not config.card.built:
        raise ValueError(f"model {config.name} is the trainers' own (scripts using the original API, init_cache): "
                         f"the oracle serves their embeddings and neither builds nor evaluates the model")
    check_model(config, schema)
    torch.manual_seed(seed)
    return config.card.model_class().from_config(config, schema)
