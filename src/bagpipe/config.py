"""Run configuration: frozen dataclasses loaded from TOML, overridden by flags.

Every field is validated in ``__post_init__`` so that an impossible value is refused before
anything runs, with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bagpipe import models
from bagpipe.planner.evict import ONLINE_POLICIES
from bagpipe.planner.plan import POLICIES, plans_ahead

log = logging.getLogger(__name__)

STORAGE_KINDS = ("memory", "disk")  # the tables' tiers (bagpipe.storage): the servers', --mode single's

OPTIMIZERS = ("sgd", "adagrad", "adam")
# --device: cpu, auto (a GPU if there is one), cuda or cuda:N (N: group 1); device.resolve_device
DEVICE_SPEC = re.compile(r"cpu|auto|cuda(?::(\d+))?")
CACHE_MODES = ("replicated", "partitioned")  # --mode bagpipe: every trainer holds every planned row, or its own
SINGLE_POLICIES = ("lookahead", *ONLINE_POLICIES)  # --mode single: the planner, or an online policy (nn.SlotIndex)
DATA_FORMATS = ("criteo", "avazu", "jsonl", "movielens")  # the readers in bagpipe.data
EVAL_PROTOCOLS = ("unseen", "history")  # next-item evaluation's candidates: bagpipe.ranking.PROTOCOLS
MIN_LIVENESS_S = 1.0  # the shortest liveness window (judged on four heartbeats: World.beat_s)
# TensorPipe's transports and channels, by the names TensorPipeRpcBackendOptions takes (whether one is usable
# depends on the machine: ibv needs InfiniBand, the cuda_* channels GPUs)
RPC_TRANSPORTS = ("uv", "shm", "ibv")
RPC_CHANNELS = ("basic", "xth", "cma", "mpt_uv", "cuda_basic", "cuda_xth", "cuda_ipc", "cuda_gdr")
DEFAULT_RPC_TRANSPORTS = "uv"  # TCP (shm, shared memory, busy-polls: on a few cores it takes CPU from compute)


def partitioned_cache(cache_mode: str) -> bool:
    """Whether ``cache_mode`` (CACHE_MODES) has each trainer hold only the rows its slices use."""
    return cache_mode == "partitioned"


def rpc_lists(transports: str | None, channels: str | None, *, names: tuple[str, str] = ("rpc_transports",
              "rpc_channels")) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The job's TensorPipe transports and channels, each a comma-separated list (``uv,shm``; None: uv, and
    TensorPipe's own choice of channels), as tuples of names checked against TensorPipe's; a ValueError naming the
    setting as its user knows it (``names``: config keys or flags) otherwise. Channels may be empty, transports not."""
    lists = []
    for text, name, known in ((DEFAULT_RPC_TRANSPORTS if transports is None else transports, names[0], RPC_TRANSPORTS),
                              ("" if channels is None else channels, names[1], RPC_CHANNELS)):
        parts = tuple(part.strip() for part in text.split(",") if part.strip())
        if any(part not in known for part in parts) or not (parts or known is RPC_CHANNELS):
            choice = " (or empty: TensorPipe chooses)" if known is RPC_CHANNELS else ""
            raise ValueError(f"{name} must be a comma-separated list of {', '.join(known)}{choice}, got {text!r}")
        lists.append(parts)
    return lists[0], lists[1]


def check_liveness(liveness: float, timeout: float, *, name: str, timeout_name: str) -> None:
    """A liveness window is 0 (derived from the timeout) or in [MIN_LIVENESS_S, timeout); a ValueError naming the
    settings as the caller's user knows them (``name``, ``timeout_name``: config keys or flags) otherwise."""
    if liveness and not MIN_LIVENESS_S <= liveness < timeout:
        raise ValueError(f"{name} must be 0 (from {timeout_name}) or in [{MIN_LIVENESS_S:.0f}, {timeout_name} "
                         f"{timeout:g}) s, got {liveness}")


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def checked_value(cls, name: str, value: Any) -> Any:
    """``value`` as field ``name`` of dataclass ``cls`` holds it, or a ValueError naming the type expected.

    TOML and Python both let a bool pass for an int and an int for a float: a bool is refused
    where a number is expected, and an int is accepted (as a float) where a float is.
    """
    kind = typing.get_type_hints(cls)[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in _KINDS and not (isinstance(value, kind) and (kind is bool or not isinstance(value, bool))):
        shown = "true" if value is True else "false" if value is False else repr(value)
        raise ValueError(f"{name}: expected {_KINDS[kind]}, got {shown} ({_type_name(value)})")
    return value


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "a table",
            list: "an array"}.get(type(value), type(value).__name__)


def _check_types(config) -> None:
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if not dataclasses.is_dataclass(value):
            object.__setattr__(config, f.name, checked_value(type(config), f.name, value))


class _Model:
    """What ModelConfig is beyond its fields: the checks of its values, its card, its sizes read as numbers."""

    def __post_init__(self) -> None:
        _check_types(self)
        if self.name not in models.CARDS:
            raise ValueError(f"model must be one of {', '.join(models.MODEL_NAMES)}, got {self.name!r}")
        for setting in models.SETTINGS.values():
            setting.check(getattr(self, setting.name))
        if self.card.check is not None:
            self.card.check(self)

    @property
    def card(self) -> models.ModelCard:
        return models.CARDS[self.name]

    def sizes(self, name: str) -> tuple[int, ...]:
        """Setting ``name`` (layer sizes joined by '-') as numbers."""
        return models.parse_arch(getattr(self, name), name=name)


# The model and its shape: a field per model setting (bagpipe.models.SETTINGS, declared with the models' cards), of
# its default's type; each model reads its own (its card's ``settings``).
ModelConfig = dataclasses.make_dataclass(
    "ModelConfig", [("name", str, field(default=models.DEFAULT_MODEL)),
                    *((s.name, type(s.default), field(default=s.default)) for s in models.SETTINGS.values())],
    bases=(_Model,), frozen=True, kw_only=True)
ModelConfig.__module__ = __name__  # (make_dataclass takes module= from Python 3.12): pickled by this name


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    data: str  # a directory holding train and test splits (TSV, JSON lines or preprocessed)
    run_dir: str
    mode: str = "reference"
    # where --mode reference keeps its model and tables, --mode single its model and cache (the full tables in host
    # memory or on disk): "cpu", "cuda" or "cuda:N"; without CUDA a GPU asked for falls back to the CPU, warned
    device: str = "cpu"
    # the dense model's forward and backward through torch.compile (models.compile_training), in every mode alike
    # (compiled runs equal each other bit for bit, not an eager run); off by default: on the CPU it measured no
    # faster (docs/history/benchmarks.md), on a GPU make gpu-check measures it
    compile: bool = False
    iterations: int = 0  # 0: `epochs` passes over the training split
    epochs: int = 1  # passes over the training split, when iterations is 0
    batch_size: int = 512  # 256 steps a pass over 131k rows; at 2,048 the CTR models end short of the data's best
    eval_batch_size: int = 16384
    optimizer: str = "adagrad"
    lr: float = 0.01
    seed: int = 0
    shuffle: bool = False  # Criteo data is in time order; shuffling is an explicit choice
    shuffle_seed: int = 0
    fresh_negatives: bool = True  # next-item data: each pass after the first draws new negatives (data.negatives)
    warmup_iterations: int = 5  # excluded from the steady-state samples/s
    log_every: int = 10
    max_eval_rows: int = 0  # 0: the whole test split
    eval_every: int = 0  # evaluate also every this many iterations (a metrics point each); 0: only at the end
    # next-item models: the items a test target is ranked among (bagpipe.ranking): "unseen", every item the user
    # did not interact with in training (the standard protocol), or "history", all but the sample's history
    eval_protocol: str = "unseen"
    keep_best: bool = False  # model/ holds the best evaluated state (by AUC or HR@10, every eval_every), not the last
    holdout: float = 1 / 7  # data with no test split: its last share is the test split (Criteo Kaggle's last day)
    data_format: str = ""  # criteo, avazu, jsonl or movielens; "": from the file's name or content
    # criteo, avazu text: ids by a vocabulary of the train split's values seen this often (the rest share
    # id 0); 0: none, values hashed modulo the table sizes (avazu without table sizes: a vocabulary, min count 1)
    vocab_min_count: int = 0
    # raw-id data (preprocess --raw-ids): look-ups a key needs before it gets a row of its own; until then, and
    # for keys that never do, the table's default row (admission: embeddings.dynamic)
    row_min_count: int = 1
    # raw-id data: a row unused for this many iterations is retired, its number reused by the next row made (the key,
    # if it comes back, gets a new row); 0: rows are never retired (embeddings.dynamic.RetiringNumbering)
    row_retire_after: int = 0
    # raw-id data: the rows a table holds at most (the default row aside): past it, the least frequently used row a
    # batch does not look up is retired, its number reused; 0: no bound
    row_budget: int = 0
    # checkpoints during training (RUN_DIR/checkpoints; --resume continues from the newest): every this many
    # iterations and/or seconds (0: not by that measure), the newest keep_checkpoints kept
    checkpoint_every: int = 0
    checkpoint_every_s: float = 0.0
    keep_checkpoints: int = 2
    # --mode bagpipe: a job that loses a process parity does not cover is started again by the local launcher
    # from its newest checkpoint, at most this many times (0: never; without a checkpoint it fails)
    max_restarts: int = 3
    # --mode bagpipe: where each embedding server keeps its shard (--mode single: the process its tables):
    # "memory", or "disk" (a file of fixed-size records in storage_dir, default RUN_DIR/storage, with
    # storage_budget_mb of DRAM per server, or for the process, for hot rows)
    storage: str = "memory"
    storage_dir: str = ""
    storage_budget_mb: float = 1024.0
    # --mode bagpipe: erasure-coded servers: the servers form groups of `parity` data shards and one parity
    # server holding the XOR of their rows and optimizer state (servers a multiple of parity + 1); 0: none.
    # check_parity: at the end, every parity server checks its parity against its group (reads every row once)
    parity: int = 0
    check_parity: bool = False
    # --mode bagpipe: a lost process replaced while training goes on (False: the job restarts from its newest
    # checkpoint instead, --max-restarts); data servers: with --parity (False: the stand-in serves to the end)
    replace_trainers: bool = True
    replace_oracle: bool = True
    replace_data_servers: bool = True
    # --mode reference: compute each batch's gradient as this many trainers do (bit for bit)
    slices: int = 1
    # --mode bagpipe: the local job's shape and the cache plan
    trainers: int = 2
    servers: int = 1
    cache_rows: int = 0  # rows each trainer caches; 0: 5% of all rows
    lookahead: int = 200  # batches the oracle plans ahead
    policy: str = "lookahead"
    # replicated: every trainer holds every row the plan caches, and every row of the global batch is summed over
    # all trainers; partitioned: each trainer holds only the rows its slices use, and a row's gradient is summed
    # among the trainers that use it (planner/partitioned.py)
    cache_mode: str = "replicated"
    # partitioned: a trainer keeps a row another trainer updates (receiving the update instead of letting it go and
    # fetching it again) when its own next use is at most this many iterations away, and joins the trainers using a
    # row it uses next; 0: it always lets such a row go
    keep_within: int = 4
    cleanup_fraction: float = 0.0  # evict this share of the cache at once when evicting
    prefetch_depth: int = 8  # iterations whose fetches a trainer has in flight
    # the oracle's planning: 1 process, or 2 (each embedding space's batches numbered in a process of its own, the
    # decisions in the oracle: the same plan; worth a core where the planner cannot keep up with the trainers)
    planner_processes: int = 1
    timeout: float = 60.0  # seconds any remote wait may take before the job fails
    liveness_s: float = 0.0  # silence after which a peer counts as lost (0: timeout / 2, within 3-10 s)
    master_port: int = 0  # 0: a free port on 127.0.0.1
    # TensorPipe's transports and channels for the job's RPC (every process of a job takes the same). uv is TCP; shm,
    # shared memory, busy-polls: on a few cores it takes CPU from compute (~13% more CPU per iteration measured).
    rpc_transports: str = DEFAULT_RPC_TRANSPORTS
    rpc_channels: str = ""  # empty: TensorPipe's own choice
    model: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        _check_types(self)
        if not isinstance(self.model, ModelConfig):
            raise ValueError(f"model: expected a table of model settings, got {self.model!r}")
        if not self.data:
            raise ValueError("data: a data directory is required (--data)")
        if not self.run_dir:
            raise ValueError("run_dir: a run directory is required (--run-dir)")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        for name in ("batch_size", "eval_batch_size", "log_every", "epochs", "row_min_count"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("iterations", "warmup_iterations", "max_eval_rows", "vocab_min_count", "row_retire_after",
                     "row_budget", "checkpoint_every", "eval_every", "max_restarts", "keep_within"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        for name in ("lr", "timeout"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be a positive, finite number, got {getattr(self, name)}")
        if not DEVICE_SPEC.fullmatch(self.device):
            raise ValueError(f"device must be cpu, auto, cuda or cuda:N, got {self.device!r}")
        if self.compile and self.model.dropout:
            raise ValueError("compile with dropout: a compiled graph draws its own random numbers, not the dropout "
                             "masks every mode and trainer draw alike from (seed, iteration, slice); use --dropout 0 "
                             "or leave out --compile")
        if self.keep_best and not self.eval_every:
            raise ValueError("keep_best keeps the best of the evaluations during training: it needs eval_every "
                             "(--eval-every N); without it the only evaluation is the last, whose model is kept anyway")
        check_liveness(self.liveness_s, self.timeout, name="liveness_s", timeout_name="timeout")
        rpc_lists(self.rpc_transports, self.rpc_channels)
        for name in ("cleanup_fraction", "holdout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.eval_protocol not in EVAL_PROTOCOLS:
            raise ValueError(f"eval_protocol must be one of {', '.join(EVAL_PROTOCOLS)}, got {self.eval_protocol!r}")
        if self.data_format not in ("", *DATA_FORMATS):
            raise ValueError(f"data_format must be one of {', '.join(DATA_FORMATS)} (or empty: detected), "
                             f"got {self.data_format!r}")
        if self.storage not in STORAGE_KINDS:
            raise ValueError(f"storage must be one of {', '.join(STORAGE_KINDS)}, got {self.storage!r}")
        if not (self.storage_budget_mb > 0 and math.isfinite(self.storage_budget_mb)):
            raise ValueError(f"storage_budget_mb must be a positive, finite number, got {self.storage_budget_mb}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not (self.checkpoint_every_s >= 0 and math.isfinite(self.checkpoint_every_s)):
            raise ValueError(f"checkpoint_every_s must be a finite number of seconds >= 0, "
                             f"got {self.checkpoint_every_s}")
        for name in ("trainers", "servers", "lookahead", "prefetch_depth", "slices", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.cache_rows < 0:
            raise ValueError(f"cache_rows must not be negative, got {self.cache_rows}")
        if self.parity < 0:
            raise ValueError(f"parity must not be negative, got {self.parity}")
        if self.parity and self.servers % (self.parity + 1):
            raise ValueError(f"--parity {self.parity}: servers form groups of {self.parity} data servers and one "
                             f"parity server, so --servers must be a multiple of {self.parity + 1}, got {self.servers}")
        if not 0 <= self.master_port < 65535:
            raise ValueError(f"master_port must be in [0, 65535), got {self.master_port}")
        if self.planner_processes not in (1, 2):
            raise ValueError(f"planner_processes must be 1 or 2, got {self.planner_processes}")
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {', '.join(CACHE_MODES)}, got {self.cache_mode!r}")
        mode = self.run_mode
        if mode.processes and self.partitioned:
            self._check_partitioned()
        if mode.cached and self.policy not in mode.policies:
            raise ValueError(f"--mode {self.mode}: policy must be one of {', '.join(mode.policies)}, "
                             f"got {self.policy!r}")
        if not mode.processes and self.batch_size % self.slices:
            raise ValueError(f"batch_size {self.batch_size} must be a multiple of slices ({self.slices}): "
                             "each slice is an equal part of the global batch")
        if mode.processes and self.batch_size % self.trainers:
            raise ValueError(f"batch_size {self.batch_size} must be a multiple of trainers ({self.trainers}): "
                             "each trainer takes an equal slice of the global batch")

    @property
    def partitioned(self) -> bool:
        """Whether its trainers' caches are partitioned (--cache-mode partitioned)."""
        return partitioned_cache(self.cache_mode)

    @property
    def run_mode(self) -> "Mode":
        """Its --mode (RUN_MODES): what the code asks of a mode, it asks of this."""
        return RUN_MODES[self.mode]

    def _check_partitioned(self) -> None:
        """What the partitioned cache does not do (yet): said before any role starts."""
        if not plans_ahead(self.policy):
            raise ValueError(f"--cache-mode partitioned plans each trainer's cache by lookahead only, not "
                             f"--policy {self.policy}")
        if self.planner_processes != 1:
            raise ValueError("--cache-mode partitioned plans in one process (--planner-processes 2 numbers the "
                             "replicated plan's batches only)")

    @property
    def checkpoints(self) -> bool:
        """Whether the run writes checkpoints during training."""
        return self.checkpoint_every > 0 or self.checkpoint_every_s > 0


def load_train_config(path: str | None, overrides: dict[str, Any]) -> TrainConfig:
    """Build a TrainConfig from an optional TOML file, then apply flag overrides (non-None values).

    The TOML file may hold the train fields at top level and the model fields under ``[model]``.
    """
    values, model_values = given_settings(path, overrides)
    values.setdefault("data", "")
    values.setdefault("run_dir", "")
    values, model_values = with_model_defaults(values, model_values)
    return TrainConfig(model=ModelConfig(**models.complete_model(model_values)), **values)


# A run's settings by section: a TOML file's tables ([cache], [job], ...; the model's are [model]), and what each
# mode reads (RUN_MODES): a setting changed from its default in a section its mode does not read is warned
# (preflight.ignored_settings). Every TrainConfig field but ``model`` is in exactly one (tests/unit/test_config.py).
SECTIONS: dict[str, tuple[str, ...]] = {
    "run": ("run_dir", "mode", "device", "compile", "iterations", "epochs", "batch_size", "seed", "warmup_iterations",
            "log_every"),
    "data": ("data", "data_format", "holdout", "vocab_min_count", "row_min_count", "row_retire_after", "row_budget",
             "shuffle", "shuffle_seed", "fresh_negatives"),
    "optimizer": ("optimizer", "lr"),
    "evaluation": ("eval_batch_size", "max_eval_rows", "eval_every", "eval_protocol", "keep_best"),
    "checkpoint": ("checkpoint_every", "checkpoint_every_s", "keep_checkpoints"),
    "reference": ("slices",),  # --mode reference's gradients as T trainers compute them
    "cache": ("cache_rows", "lookahead", "policy", "cleanup_fraction"),  # the trainers' (or --mode single's) cache
    "storage": ("storage", "storage_dir", "storage_budget_mb"),  # where the full tables live: servers, or host
    "job": ("trainers", "servers", "cache_mode", "keep_within", "prefetch_depth", "planner_processes", "master_port",
            "max_restarts"),  # --mode bagpipe's processes and plan
    "fault_tolerance": ("parity", "check_parity", "replace_trainers", "replace_oracle", "replace_data_servers",
                        "liveness_s"),
    "rpc": ("timeout", "rpc_transports", "rpc_channels"),
}
SECTION_OF = {name: section for section, names in SECTIONS.items() for name in names}


@dataclass(frozen=True)
class Mode:
    """A way to train (``--mode``): the sections of settings it reads, what it is, and what the code asks of it
    (no mode is named anywhere else: tests/unit/project/test_registries.py)."""

    name: str
    sections: frozenset[str]
    summary: str
    cached: bool = False  # trains from a cache of the rows (a plan's, or an online policy's): reads [cache]
    processes: bool = False  # a job of processes (oracle, servers, trainers) that the local launcher starts
    policies: tuple[str, ...] = ()  # the cache policies it takes (cached)

    def reads(self, setting: str) -> bool:
        return SECTION_OF[setting] in self.sections


_EVERY_MODE = {"run", "data", "optimizer", "evaluation", "checkpoint"}
RUN_MODES: dict[str, Mode] = {mode.name: mode for mode in (
    Mode("reference", frozenset(_EVERY_MODE | {"reference"}), "one process, every table in memory: the ground truth"),
    Mode("bagpipe", frozenset(_EVERY_MODE | {"cache", "storage", "job", "fault_tolerance", "rpc"}),
         "an oracle, embedding servers and trainers as processes, each trainer training from its planned cache",
         cached=True, processes=True, policies=POLICIES),
    Mode("single", frozenset(_EVERY_MODE | {"cache", "storage"}),
         "one process, the tables in host memory or on disk behind a planned cache", cached=True,
         policies=SINGLE_POLICIES),
)}
MODES = tuple(RUN_MODES)  # their names


def with_model_defaults(values: dict[str, Any], model_values: dict[str, Any]) -> tuple[dict, dict]:
    """The settings given, completed by the chosen model's own defaults (its card's ``defaults``) where not given."""
    values, model_values = dict(values), dict(model_values)
    model_names = {f.name for f in dataclasses.fields(ModelConfig)}
    card = models.CARDS.get(model_values.get("name", models.DEFAULT_MODEL))
    for name, value in (card.defaults if card is not None else {}).items():
        if name == "keep_best" and values.get("eval_every") == 0:
            continue  # --eval-every 0 given: only the final state is evaluated, and kept
        (model_values if name in model_names else values).setdefault(name, value)
    return values, model_values


def default_config(model: str = models.DEFAULT_MODEL) -> TrainConfig:
    """What `bagpipe train --model MODEL` runs with when given nothing else."""
    return load_train_config(None, {"name": model, "data": "-", "run_dir": "-"})


def given_settings(path: str | None, overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The train and model settings given explicitly (in the TOML file or as flags, flags winning),
    each checked for its type; a setting neither gives keeps its default."""
    values: dict[str, Any] = {}
    model_values: dict[str, Any] = {}
    model_names = {f.name for f in dataclasses.fields(ModelConfig)}
    train_names = {f.name for f in dataclasses.fields(TrainConfig)} - {"model"}
    if path:
        values, model_values = _read_toml(Path(path), train_names=train_names, model_names=model_names)
    for key, value in overrides.items():
        if value is None:
            continue
        (model_values if key in model_names else values)[key] = value
    unknown = sorted(set(values) - train_names) + sorted(set(model_values) - model_names)
    if unknown:
        where = f" in {path}" if path else ""
        raise ValueError(f"unknown setting(s){where}: {', '.join(unknown)}")
    return values, model_values


def config_from_dict(values: dict) -> TrainConfig:
    """A TrainConfig from ``config_to_dict``'s form (a run's config.json, a job's published config)."""
    values = dict(values)
    return TrainConfig(model=ModelConfig(**values.pop("model")), **values)


# Settings a resumed run may change: they shape how it runs and reports, not what it computes.
RESUMABLE_CHANGES = ("device", "compile", "iterations", "epochs", "log_every", "warmup_iterations", "timeout",
                     "liveness_s",
                     "planner_processes",
                     "rpc_transports", "rpc_channels", "checkpoint_every", "checkpoint_every_s", "keep_checkpoints",
                     "max_restarts", "max_eval_rows", "eval_batch_size", "eval_every", "eval_protocol", "master_port",
                     "replace_trainers", "replace_oracle", "replace_data_servers", "storage", "storage_dir",
                     "storage_budget_mb")

ARITHMETIC_CHANGES = ("device", "compile")  # resumable, but a step computes otherwise with another value


def resumed_config(run_dir: str, path: str | None, overrides: dict[str, Any]) -> TrainConfig:
    """The config of the run in ``run_dir`` (its config.json), for ``--resume``: settings given again
    (a TOML file, flags) must equal the saved ones, except those a resumed run may change. The run dir is
    ``run_dir``, whatever config.json says: a run dir copied or moved elsewhere resumes where it is now."""
    saved_path = Path(run_dir) / "config.json"
    if not saved_path.is_file():
        raise ValueError(f"--resume: {run_dir} holds no run to resume (no config.json)")
    saved = config_from_dict(json.loads(saved_path.read_text()))
    values, model_values = given_settings(path, overrides)
    values.pop("run_dir", None)
    changes = {}
    for name, value in [*values.items(), *(("model." + k, v) for k, v in model_values.items())]:
        have = getattr(saved.model, name[6:]) if name.startswith("model.") else getattr(saved, name)
        if name in RESUMABLE_CHANGES:
            changes[name] = value
        elif checked_value(type(saved.model) if name.startswith("model.") else TrainConfig,
                           name.removeprefix("model."), value) != have:
            raise ValueError(f"--resume: the run in {run_dir} was started with {name.removeprefix('model.')}="
                             f"{have!r}, not {value!r}; a resumed run keeps its settings (leave the flag out)")
    for name in ARITHMETIC_CHANGES:
        if name in changes and changes[name] != getattr(saved, name):
            logging.getLogger("bagpipe").warning(
                "--resume with %s=%r, where the run started with %r: the steps from here round otherwise, so the run "
                "will not end bit for bit as an uninterrupted one would", name, changes[name], getattr(saved, name))
    return dataclasses.replace(saved, run_dir=str(run_dir), **changes)


def _read_toml(path: Path, *, train_names: set[str], model_names: set[str]) -> tuple[dict, dict]:
    """The train and ``[model]`` settings of a TOML file, each of the type its field holds. The train settings are
    read from their sections' tables (``[optimizer]`` lr = ..., SECTIONS); settings at the top level (the form
    before sections) are read too, with a warning."""
    if not path.is_file():
        raise ValueError(f"--config: no such file {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not valid TOML: {err}") from None
    model = raw.pop("model", {})
    if not isinstance(model, dict):
        raise ValueError(f"{path}: model must be a table ([model]), got {model!r}")
    # (a section and a setting may share a name, data, optimizer, storage: a table is the section)
    flat = {key: value for key, value in raw.items() if not (key in SECTIONS and isinstance(value, dict))}
    if flat:
        log.warning("%s: settings outside their sections (%s): put each under its own, e.g. [%s] %s = ...; the flat "
                    "form is still read", path, ", ".join(flat), SECTION_OF.get(next(iter(flat)), "run"),
                    next(iter(flat)))
    values = dict(flat)
    for section in SECTIONS:
        table = raw.get(section, {})
        if not isinstance(table, dict):
            continue  # the setting of that name, given flat
        for key, value in table.items():
            if key in model_names and key not in train_names:
                raise ValueError(f"{path}: [{section}] {key}: a model setting, read from [model]")
            if key in train_names and SECTION_OF[key] != section:
                raise ValueError(f"{path}: [{section}] {key}: {key} is a setting of [{SECTION_OF[key]}]")
            if key in values:
                raise ValueError(f"{path}: {key} is given twice (at the top level and in [{section}])")
            values[key] = value
    checked = []
    for cls, table, names, prefix in ((TrainConfig, values, train_names, ""), (ModelConfig, model, model_names,
                                                                                "model.")):
        for key, value in table.items():
            if key in names:
                try:
                    table[key] = checked_value(cls, key, value)
                except ValueError as err:
                    raise ValueError(f"{path}: {prefix}{err}") from None
        checked.append(table)
    return checked[0], checked[1]


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def dump_toml(config: TrainConfig) -> str:
    """The config as TOML that ``load_train_config`` reads back to an equal config."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        return json.dumps(str(v))  # a TOML basic string: JSON's escapes are valid TOML

    values = config_to_dict(config)
    model = values.pop("model")
    lines = []
    for section, names in SECTIONS.items():
        lines += [f"[{section}]"] + [f"{name} = {value(values[name])}" for name in names] + [""]
    lines += ["[model]"] + [f"{k} = {value(v)}" for k, v in model.items()]
    return "\n".join(lines) + "\n"
