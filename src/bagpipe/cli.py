"""The ``bagpipe`` command: synth, preprocess, train, export, plan-stats, and the job's roles."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from bagpipe.files import WriteFailed
from bagpipe.progress import setup_logging
from bagpipe.runtime.exit_status import ExitStatus, Terminated, record_exit
from bagpipe.runtime.succession import NOT_REPLACEABLE_EXIT_CODE, NotReplaceable

log = logging.getLogger("bagpipe")

DESCRIPTION = """\
Train recommendation models (DLRM, DCN, DeepFM, Wide & Deep, FGCNN, Caser) whose
embedding tables are larger than a trainer's memory: in one process, or as the
whole system (an oracle planning each trainer's cache, embedding servers,
trainers)."""
# README.md opens with the same lines (tests/unit/test_examples.py)
QUICK_START = """\
quick start (about a minute on 2 cores; README.md says more):
  bagpipe synth --out data --rows 50000 --max-rows-per-table 20000
  bagpipe train --data data --run-dir runs/dlrm --mode bagpipe
  bagpipe train --data data --run-dir runs/deepfm --mode bagpipe --model deepfm
  bagpipe train --data data --run-dir runs/reference --slices 2
  bagpipe report runs/dlrm runs/deepfm runs/reference
"""


def _default(name: str, *, models: bool = False) -> str:
    """" (default X)" for a train or model setting, from the config's own default; with ``models``, and the
    models whose own default differs (their cards' defaults, bagpipe.models.CARDS), "(default X; caser Y)"."""
    from bagpipe.models import CARDS

    defaults = _defaults()
    value = getattr(defaults.model, name) if hasattr(defaults.model, name) else getattr(defaults, name)
    own = [f"{model} {card.defaults[name]}" for model, card in CARDS.items()
           if models and name in card.defaults and card.defaults[name] != value]
    return f" (default {'; '.join([str(value), *own])})"


def _optimizers() -> str:
    """The row optimizers, as a help text lists them (config.OPTIMIZERS, optim.ROW_OPTIMIZERS)."""
    from bagpipe.config import OPTIMIZERS

    return ", ".join(OPTIMIZERS)


def _cache_modes() -> tuple[str, ...]:
    from bagpipe.config import CACHE_MODES

    return CACHE_MODES


def _policies() -> str:
    """The cache policies, as a help text lists them (planner.plan.POLICIES)."""
    from bagpipe.config import POLICIES

    return ", ".join(POLICIES)


@functools.cache
def _defaults():
    """The default config, made once: every flag's help names its default (validating one takes a few ms)."""
    from bagpipe.config import TrainConfig

    return TrainConfig(data="-", run_dir="-")


def _add_synth(sub) -> None:
    p = sub.add_parser("synth", help="write synthetic data with a known best metric: Criteo-format click logs "
                                     "(--kind ctr) or an interaction log of next-item sequences (--kind sequences)")
    p.add_argument("--out", required=True, help="output directory (train.tsv, test.tsv, meta.json; or ratings.csv)")
    p.add_argument("--kind", choices=("ctr", "sequences"), default="ctr", help="what to write (default ctr)")
    p.add_argument("--seed", type=int, default=0, help="the data's seed (default 0)")
    p.add_argument("--zipf", type=float, default=None, help="Zipf exponent of the ids or the items' popularity "
                   "(default 1.2 for ctr, 1.0 for sequences)")
    g = p.add_argument_group("--kind ctr")
    g.add_argument("--rows", type=int, default=None, help="training rows (required)")
    g.add_argument("--test-rows", type=int, default=None, help="test rows (default: rows / 10)")
    g.add_argument("--tables", default=None, help="a preset of table sizes (default criteo-kaggle)")
    g.add_argument("--table-sizes", default=None, help="comma-separated table sizes, instead of --tables "
                   "(default: the preset)")
    g.add_argument("--max-rows-per-table", type=int, default=0,
                   help="cap every table at this many rows (default 0: no cap)")
    g.add_argument("--raw-ids", action="store_true", help="63-bit ids that keep arriving: each period's ids a "
                   "window of the table's size that slides, a share --new-share of them new (preprocess them "
                   "with --raw-ids, or modulo the meta.json's table sizes)")
    g.add_argument("--periods", type=int, default=10, help="--raw-ids: periods of the train rows, in file order; "
                   "the test rows are the next one (default 10)")
    g.add_argument("--new-share", type=float, default=0.1, help="--raw-ids: the share of a period's ids that are "
                   "new (default 0.1)")
    g = p.add_argument_group("--kind sequences")
    g.add_argument("--users", type=int, default=8000, help="users (default 8000)")
    g.add_argument("--items", type=int, default=300, help="items (default 300)")
    g.add_argument("--interactions", type=int, default=20, help="interactions per user (default 20)")
    g.add_argument("--genres", type=int, default=8, help="item genres: the next item often shares the last one's "
                   "(default 8)")
    g.add_argument("--follow", type=float, default=0.7, help="how often it does (default 0.7)")
    _add_sequence_flags(g)


def _add_sequence_flags(g) -> None:
    g.add_argument("--history", type=int, default=None, help="items a sample sees, L (default 5)")
    g.add_argument("--targets", type=int, default=None, help="items predicted after them, T (default 3)")
    g.add_argument("--negatives", type=int, default=None, help="sampled negative items per sample (default 3)")


def _add_preprocess(sub) -> None:
    p = sub.add_parser("preprocess", help="convert Criteo TSV, Avazu CSV, JSON lines or an interaction log "
                                          "(MovieLens, RecBole .inter) (plain or gzip) to the binary format")
    p.add_argument("--input", required=True, help="a file, or a directory holding train.* and test.* "
                   "(.tsv, .txt, .csv, .jsonl, .json, each optionally .gz) or one interaction log (u.data, "
                   "ratings.dat, ratings.csv or NAME.inter)")
    p.add_argument("--format", choices=("criteo", "avazu", "jsonl", "movielens"), default=None,
                   help="the text format (default: from the first lines, whatever the file's name: a JSON object "
                        "(jsonl); a CSV header with a click column (avazu); user, item, rating and timestamp, "
                        "separated by a tab, :: or a comma, under a header line or none, or a RecBole header "
                        "such as user_id:token<TAB>item_id:token... (movielens); tab-separated (criteo); else "
                        "the suffix)")
    p.add_argument("--out", required=True, help="the directory to write (a conversion that fails leaves it as "
                   "it was)")
    p.add_argument("--vocab-min-count", type=int, default=0, help="criteo, avazu: number each column's values by "
                   "descending count in the train split, those seen fewer than N times (and values it never "
                   "shows) sharing id 0; writes OUT/vocab (default 0: no vocabulary, values hashed modulo "
                   "--table-sizes)")
    p.add_argument("--table-sizes", default=None, help="comma-separated table sizes (default: from --meta or "
                   "a meta.json beside the input; JSON lines only: the largest id + 1)")
    p.add_argument("--meta", default=None, help="a meta.json holding table_sizes, as `bagpipe synth` writes "
                   "(default: the one beside the input, if any)")
    p.add_argument("--raw-ids", action="store_true", help="criteo, avazu, jsonl: keep each categorical value as a "
                   "63-bit key of its own (a stable mix of table and value), in one pass: no vocabulary, no table "
                   "sizes, no two values of a table sharing a row (docs/data.md, 'Raw ids')")
    p.add_argument("--on-bad-row", choices=("error", "skip"), default="error",
                   help="stop at a malformed row naming its file and line, or skip and count it (default error)")
    _add_sequence_flags(p.add_argument_group("an interaction log's samples (default: its meta.json's, else these)"))


def _add_data_flags(p) -> None:
    """How text data is read (train and oracle): its format, the test split of data without one, ids."""
    p.add_argument("--format", dest="data_format", default=None,
                   help="criteo, avazu, jsonl or movielens (default: from the data's name or content)")
    p.add_argument("--holdout", type=float, default=None, help="data with no test split: the share of its end held "
                   "out for evaluation; 0: none, no evaluation" + _default("holdout"))
    _add_vocab_flag(p)


def _add_train(sub) -> None:
    from bagpipe.models import MODEL_NAMES

    p = sub.add_parser("train", help=f"train a model (--model: {', '.join(MODEL_NAMES)}) in one process, or with "
                                     "the whole system on this machine (--mode)")
    p.add_argument("--config", default=None, help="a TOML file of settings; flags override it (default: none)")
    p.add_argument("--data", default=None, help="a directory with train.* and test.* text splits (converted "
                   "once into DIR/preprocessed), a single data file (converted beside it), or a preprocessed "
                   "directory (required, here or in --config)")
    _add_data_flags(p)
    p.add_argument("--run-dir", default=None, help="where the run is written; must be new or empty "
                   "(required, here or in --config)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --run-dir (after every check has passed)")
    p.add_argument("--mode", default=None, help="reference (one process, all tables in memory), bagpipe "
                   "(oracle, servers and trainers started on this machine) or single (one process, the tables in "
                   "host memory behind a cache of --cache-rows rows, bagpipe.nn's)" + _default("mode"))
    p.add_argument("--device", default=None, help="cpu, auto, cuda or cuda:N: where --mode reference keeps its "
                   "model and tables, --mode single its model and cache (the full tables stay in host memory or on "
                   "disk), --mode bagpipe its trainers' models and caches (all on that device); a GPU where CUDA is "
                   "not available is refused, auto takes a GPU where there is one and the CPU elsewhere"
                   + _default("device"))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="run the dense model's forward and backward through torch.compile, in every mode and "
                   "trainer alike (compiled runs equal each other bit for bit, not an uncompiled one; the first "
                   "iteration compiles, seconds; not with --dropout)" + _default("compile"))
    p.add_argument("--iterations", type=int, default=None, help="global batches to train; 0: --epochs passes "
                   "over the training split" + _default("iterations"))
    p.add_argument("--epochs", type=int, default=None, help="passes over the training split when --iterations "
                   "is 0" + _default("epochs", models=True))
    p.add_argument("--batch-size", type=int, default=None, help="the global batch"
                   + _default("batch_size", models=True))
    p.add_argument("--eval-batch-size", type=int, default=None, help="samples per evaluation batch"
                   + _default("eval_batch_size"))
    p.add_argument("--optimizer", default=None, help=f"{_optimizers()}, for embeddings and dense weights"
                   + _default("optimizer", models=True))
    p.add_argument("--lr", type=float, default=None, help="learning rate" + _default("lr", models=True))
    p.add_argument("--seed", type=int, default=None, help="initialisation seed" + _default("seed"))
    p.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=None,
                   help="shuffle the rows each epoch (default: consecutive rows in file order; caser: shuffled)")
    p.add_argument("--shuffle-seed", type=int, default=None, help="seed of the shuffles" + _default("shuffle_seed"))
    p.add_argument("--fresh-negatives", action=argparse.BooleanOptionalAction, default=None,
                   help="next-item data: draw new negative items for each pass after the first (never an item the "
                   "user had in training), or keep the data's own (default: fresh)")
    p.add_argument("--warmup-iterations", type=int, default=None,
                   help="iterations left out of the steady-state samples/s" + _default("warmup_iterations"))
    p.add_argument("--log-every", type=int, default=None, help="iterations per metrics record" + _default("log_every"))
    p.add_argument("--max-eval-rows", type=int, default=None,
                   help="evaluate on at most this many test rows; 0: all" + _default("max_eval_rows"))
    p.add_argument("--eval-every", type=int, default=None, help="evaluate also every N iterations (as DLRM's "
                   "--test-freq; --mode bagpipe: from a checkpoint, in the background); 0: only at the end"
                   + _default("eval_every", models=True))
    p.add_argument("--eval-protocol", choices=("unseen", "history"), default=None,
                   help="next-item models: rank each test target among every item the user did not interact with "
                   "in training (unseen: the standard protocol) or among all items but the sample's history "
                   "(history: this project's before 2026-11)" + _default("eval_protocol"))
    p.add_argument("--keep-best", action="store_true", default=None, help="RUN_DIR/model holds the best evaluated "
                   "model (by AUC, or HR@10 for next-item models, on the validation split where the data has one, "
                   "as next-item data does, else on the test split; each written there when evaluated) instead of "
                   "the last, and summary.json its best_iteration and best_metrics; needs --eval-every (default: "
                   "the last; caser: the best)")
    p.add_argument("--no-keep-best", dest="keep_best", action="store_false", default=None,
                   help="RUN_DIR/model holds the last model, whatever a model's own default")
    p.add_argument("--slices", type=int, default=None,
                   help="--mode reference: compute each batch's gradient as this many trainers do, so that "
                        "--mode bagpipe with that many trainers gives the same result bit for bit"
                        + _default("slices"))
    _add_storage_flags(p)
    g = _add_checkpoint_flags(p)
    g.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its newest valid "
                   "checkpoint; its config.json supplies every setting (flags given again must agree)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per process (default 0: 1 per role in --mode bagpipe and with --slices, "
                        "else torch's default, whose idle workers wait passively when other processes keep the cores "
                        "busy as the run starts: OMP_WAIT_POLICY, docs/performance.md); bit-for-bit equality needs "
                        "the same on both sides")
    p.add_argument("--no-progress", action="store_true", help="no progress: neither the bar on a terminal nor, "
                   "elsewhere, the line logged every 10 s (iteration of total, samples/s, ETA)")
    _add_model_flags(p, emb_flags=("--emb-dim", "--emb-size"))
    _add_job_flags(p)


def _add_storage_flags(p) -> None:
    g = p.add_argument_group("the tables' storage (--mode bagpipe: the embedding servers'; --mode single: the "
                             "process's)")
    g.add_argument("--storage", default=None, help="where each server keeps its shard (--mode single: the process "
                   "its tables): memory, or disk (a file of fixed-size records, the hottest rows in a bounded DRAM "
                   "cache)" + _default("storage"))
    g.add_argument("--storage-dir", default=None, help="--storage disk: the directory of the tables' files, "
                   "local to each server's machine (default: RUN_DIR/storage)")
    g.add_argument("--storage-budget-mb", type=float, default=None, help="--storage disk: DRAM each server (--mode "
                   "single: the process) may hold of its rows besides the cache (MiB)" + _default("storage_budget_mb"))
    g.add_argument("--parity", type=int, default=None, help="erasure-coded servers: groups of K data servers and "
                   "one parity server holding the XOR of their rows and optimizer state, bit for bit (--servers a "
                   "multiple of K + 1); 0: none" + _default("parity"))
    g.add_argument("--check-parity", action="store_true", default=None, help="at the end, each parity server "
                   "checks its parity against its group's rows (reads every row once)")
    for flag, role, instead in (("trainers", "trainer", "the job restarts from its newest checkpoint"),
                                ("oracle", "oracle", "the job restarts from its newest checkpoint"),
                                ("data-servers", "data server", "with --parity, its parity server stands in to the "
                                                                "end")):
        g.add_argument(f"--no-replace-{flag}", dest=f"replace_{flag.replace('-', '_')}", action="store_false",
                       default=None, help=f"a lost {role} is not replaced while training goes on: {instead} "
                       f"(default: replaced)")


def _add_checkpoint_flags(p):
    g = p.add_argument_group("checkpoints (RUN_DIR/checkpoints)")
    g.add_argument("--checkpoint-every", type=int, default=None, help="write a checkpoint every N iterations; 0: "
                   "not by count" + _default("checkpoint_every"))
    g.add_argument("--checkpoint-every-s", type=float, default=None, help="write a checkpoint every S seconds; 0: "
                   "not by time" + _default("checkpoint_every_s"))
    g.add_argument("--keep-checkpoints", type=int, default=None, help="checkpoints kept (the newest; and the "
                   "bases they restore from)" + _default("keep_checkpoints"))
    g.add_argument("--max-restarts", type=int, default=None, help="--mode bagpipe, local launcher: a job that loses "
                   "a process (killed, hung) that parity does not cover is started again from its newest checkpoint, "
                   "at most N times; 0: never" + _default("max_restarts"))
    return g


RAW_ID_FLAGS = {
    "row_min_count": "raw-id data (preprocess --raw-ids): look-ups a key needs before it gets a row of its own; until "
                     "then it uses its table's default row (admission)",
    "row_retire_after": "raw-id data: retire a row unused for N iterations, its number reused by the next row made "
                        "(the key, if it comes back, gets a new row); 0: never",
    "row_budget": "raw-id data: the rows each table holds at most; past it the least frequently used row a batch "
                  "does not look up is retired (its number reused); 0: no bound"}


def _add_vocab_flag(p) -> None:
    p.add_argument("--vocab-min-count", type=int, default=None, help="criteo, avazu text: ids by a vocabulary of "
                   "the train split's values seen N times or more (the rest share id 0); 0: values hashed modulo "
                   "the table sizes, and Avazu with none gets min count 1" + _default("vocab_min_count"))
    for name, what in RAW_ID_FLAGS.items():  # (embeddings.dynamic: the rows a raw-id table makes and retires)
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=what + _default(name))


def _add_model_flags(p, *, emb_flags: tuple[str, ...]) -> None:
    """A flag per model setting (bagpipe.models.SETTINGS), its help naming the models that read it."""
    from bagpipe.models import MODEL_NAMES, SETTINGS, readers

    g = p.add_argument_group("the model (each reads its own settings)")
    g.add_argument("--model", dest="name", default=None, help=f"{', '.join(MODEL_NAMES)}" + _default("name"))
    for name, setting in SETTINGS.items():
        flags = emb_flags if name == "emb_dim" else ("--" + name.replace("_", "-"),)
        kind = type(setting.default)
        models = readers(name)
        about = "" if len(models) == len(MODEL_NAMES) else f"{', '.join(models)}: "
        g.add_argument(*flags, dest=name, type=kind, default=None,
                       help=about + setting.help + _default(name, models=True))
    g.add_argument("--filter-range", dest="conv_channels", type=_filter_range, default=None,
                   help="fgcnn, as the original system takes it: A-B picks channels 10, 12, ..., 26 from index A "
                        "to B (2-5: 14-16-18-20) (default: --conv-channels)")


ORIGINAL_CHANNELS = tuple(range(10, 28, 2))  # the original FGCNN trainer's channel list, indexed by --filter-range


def _filter_range(text: str) -> str:
    try:
        first, last = (int(part) for part in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A-B, such as 2-5, got {text!r}") from None
    if not 0 <= first <= last < len(ORIGINAL_CHANNELS):
        raise argparse.ArgumentTypeError(f"A-B must lie in 0-{len(ORIGINAL_CHANNELS) - 1}, got {text!r}")
    return "-".join(str(c) for c in ORIGINAL_CHANNELS[first:last + 1])


def _add_job_flags(p) -> None:
    g = p.add_argument_group("--mode bagpipe (--cache-rows, --lookahead and --policy: --mode single too)")
    g.add_argument("--trainers", type=int, default=None, help="trainer processes" + _default("trainers"))
    g.add_argument("--servers", type=int, default=None, help="embedding server processes" + _default("servers"))
    g.add_argument("--cache-rows", "--cache-size", dest="cache_rows", type=int, default=None,
                   help="rows each trainer (--mode single: the process) caches (default 0: 5%% of all rows)")
    g.add_argument("--lookahead", "--lookahead-value", dest="lookahead", type=int, default=None,
                   help="batches the oracle plans ahead" + _default("lookahead"))
    g.add_argument("--policy", default=None, help=f"{_policies()} (none: no cache; not in --mode single)"
                   + _default("policy"))
    g.add_argument("--cache-mode", default=None, choices=_cache_modes(), help="replicated: every "
                   "trainer caches every row the plan keeps, gradients summed over all trainers; partitioned: each "
                   "trainer caches only the rows its slices use, a row's gradient summed among its users only "
                   "(lookahead policy; a lost trainer restarts the job from its newest checkpoint)"
                   + _default("cache_mode"))
    g.add_argument("--keep-within", type=int, default=None, help="--cache-mode partitioned: a trainer keeps a row "
                   "another trainer updates, receiving the update, when its own next use is at most N iterations "
                   "away (0: it lets the row go and fetches it again)" + _default("keep_within"))
    g.add_argument("--cleanup-fraction", "--cleanup-batch-proportion", dest="cleanup_fraction", type=float,
                   default=None, help="when evicting, also free this share of the cache, in [0, 1)"
                   + _default("cleanup_fraction") + "; --mode single frees 0.05 at least")
    g.add_argument("--prefetch-depth", type=int, default=None,
                   help="iterations whose fetches a trainer has in flight" + _default("prefetch_depth"))
    g.add_argument("--planner-processes", type=int, choices=(1, 2), default=None, help="the oracle's planning in "
                   "1 process, or 2: each embedding space's batches numbered in a process of its own (the same "
                   "plan; a core more, for when the planner cannot keep up with the trainers)"
                   + _default("planner_processes"))
    g.add_argument("--timeout", type=float, default=None,
                   help="seconds any remote wait may take" + _default("timeout"))
    g.add_argument("--liveness-s", type=float, default=None, help="seconds of silence after which a process of "
                   "the job counts as lost (stopped, hung or gone); 0: half of --timeout, within 3-10"
                   + _default("liveness_s"))
    g.add_argument("--master-port", type=int, default=None, help="the local job's one port (default 0: a free one)")
    g.add_argument("--rpc-transports", default=None, help="TensorPipe transports for the job's RPC, comma-separated "
                   "(uv: TCP; shm: shared memory, busy-polls; ibv: InfiniBand)" + _default("rpc_transports"))
    g.add_argument("--rpc-channels", default=None, help="TensorPipe channels, comma-separated (default: "
                   "TensorPipe's choice)")


def _add_world_flags(p) -> None:
    g = p.add_argument_group("the job's world (flags, else the variables torchrun sets)")
    g.add_argument("--worker-id", dest="rank", type=int, default=None,
                   help="rank among all processes: 0 oracle, 1..T trainers, then the servers (default $RANK)")
    g.add_argument("--world-size", type=int, default=None,
                   help="oracle + servers + trainers (default $WORLD_SIZE)")
    g.add_argument("--world-size-trainers", dest="num_trainers", type=int, default=None,
                   help="trainers in the job (default $BAGPIPE_TRAINERS; servers and trainers: else the oracle's)")
    g.add_argument("--master-ip", dest="master_addr", default=None, help="the oracle's address (default "
                   "$MASTER_ADDR, else 127.0.0.1; RPC is unauthenticated: use a trusted network)")
    g.add_argument("--master-port", dest="world_port", type=int, default=None,
                   help="the oracle's store port, the job's only fixed port (default $MASTER_PORT, else 18000, "
                        "the original system's)")
    g.add_argument("--timeout", dest="world_timeout", type=float, default=None,
                   help="seconds any remote wait may take (default 60)")
    g.add_argument("--liveness-s", dest="world_liveness", type=float, default=None,
                   help="seconds of silence after which a process of the job counts as lost (default 0: half of "
                        "--timeout, within 3-10)")
    g.add_argument("--rpc-transports", dest="world_rpc_transports", default=None,
                   help="TensorPipe transports for the job's RPC, comma-separated: the oracle's setting, which every "
                        "other role takes (default uv: TCP; shm: shared memory, busy-polls; ibv: InfiniBand)")
    g.add_argument("--rpc-channels", dest="world_rpc_channels", default=None,
                   help="TensorPipe channels, comma-separated: the oracle's setting, which every other role takes "
                        "(default: TensorPipe's choice)")


def _add_roles(sub) -> None:
    for name, text in (("oracle", "the job's oracle: reads the data, plans, feeds the trainers (rank 0)"),
                       ("role", "the role this rank plays (0: oracle, 1..T: trainers, then servers): one "
                                "command line for every process, as torchrun launches them")):
        _add_oracle_flags(sub.add_parser(name, help=text, allow_abbrev=False))
    p = sub.add_parser("store", help="the job's store as a process of its own, so that it outlives the oracle: "
                       "a lost oracle (started with --store-served) is replaced by starting its command again",
                       allow_abbrev=False)
    p.set_defaults(rank=None, num_trainers=None)
    p.add_argument("--world-size", type=int, default=None, help="oracle + servers + trainers (default $WORLD_SIZE)")
    p.add_argument("--master-ip", dest="master_addr", default=None, help="the address to serve the store on "
                   "(default $MASTER_ADDR, else 127.0.0.1; unauthenticated: use a trusted network)")
    p.add_argument("--master-port", dest="world_port", type=int, default=None,
                   help="the job's store port (default $MASTER_PORT, else 18000)")
    p.add_argument("--timeout", dest="world_timeout", type=float, default=None,
                   help="the job's --timeout: how long a lost oracle's replacement is awaited follows it (default 60)")
    p.add_argument("--liveness-s", dest="world_liveness", type=float, default=None,
                   help="the job's --liveness-s (default 0: from --timeout)")
    p = sub.add_parser("server", help="an embedding server: one shard of every table (the last ranks)",
                       allow_abbrev=False)
    _add_world_flags(p)
    p.add_argument("--emb-size", "--emb-dim", dest="emb_dim", type=int, default=None,
                   help="the embedding width, agreed with the other roles' (default: theirs)")
    p.add_argument("--emb-info-file", default=None, help="one table size per line, agreed with the other roles' "
                   "and the data's (default: theirs)")
    _add_ignored_flags(p, "--logging-prefix")
    p = sub.add_parser("trainer", help="a trainer of the job's model (ranks 1..T): the --mode bagpipe loop",
                       allow_abbrev=False)
    _add_world_flags(p)
    _add_model_flags(p, emb_flags=("--emb-size", "--emb-dim"))
    p.add_argument("--emb-info-file", default=None, help="one table size per line, agreed with the other roles' "
                   "and the data's (default: theirs)")
    p.add_argument("--cache-size", "--cache-rows", dest="cache_rows", type=int, default=None,
                   help="rows each trainer caches, agreed with the oracle's (default: the oracle's)")
    p.add_argument("--lookahead-val", "--lookahead-value", dest="lookahead", type=int, default=None,
                   help="batches planned ahead, agreed with the oracle's (default: the oracle's)")
    p.add_argument("--dist-worker-id", type=int, default=None,
                   help="this trainer's index among the trainers; must be --worker-id - 1 (default: that)")
    p.add_argument("--dist-backend", choices=("gloo", "nccl"), default="gloo",
                   help="the trainers' gradient-sync backend (default gloo; nccl is refused: the sums run in "
                        "host memory over gloo, whatever --device)")
    p.add_argument("--device", default=None, help="cpu, auto, cuda or cuda:N: where the trainer's cache and model "
                   "live; as in the original's command lines, a GPU falls back to the CPU, with a warning, when there "
                   "is none (default: the job's --device, cpu unless the oracle's --config says otherwise)")
    _add_ignored_flags(p, "--dist-master-ip", "--master-port-ccom", "--logging-prefix", "--cleanup-batch-proportion")
    p.add_argument("--writeback-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests only


IGNORED_HELP = {
    "--prefetch": "accepted for the original's command lines: the oracle always prefetches",
    "--cache": "accepted for the original's command lines: the trainers always cache",
    "--dataset-multiprocessing": "accepted for the original's command lines: the data is converted once",
    "--ragged": "accepted for the original's command lines: multi-valued features are read as they come",
    "--logging-prefix": "accepted for the original's command lines: logs go to stderr (the local launcher: "
                        "RUN_DIR/logs)",
    "--dist-master-ip": "accepted for the original's command lines: the trainers' group meets at the oracle's "
                        "store, so trainer 0's own address is not needed",
    "--master-port-ccom": "accepted for the original's command lines: the trainers' group needs no port of its own",
    "--cleanup-batch-proportion": "accepted for the original's command lines: the oracle's plan decides evictions",
}


def _add_ignored_flags(p, *flags: str) -> None:
    g = p.add_argument_group("the original system's flags that mean nothing here (accepted, ignored)")
    for flag in flags:
        takes_value = flag in ("--logging-prefix", "--dist-master-ip", "--master-port-ccom",
                               "--cleanup-batch-proportion")
        g.add_argument(flag, dest=f"ignored_{flag.strip('-').replace('-', '_')}", default=None,
                       action=None if takes_value else "store_true", help=IGNORED_HELP[flag] + " (default: none)")


def _add_oracle_flags(p) -> None:
    p.add_argument("--config", default=None, help="a TOML file of train settings; flags override it (default: none)")
    p.add_argument("--data", "--processed-csv", dest="data", default=None,
                   help="the data: a directory, or a single file (JSON lines, Criteo TSV or an interaction log, "
                        "told by its content; see --format and --holdout) (required, here or in --config)")
    _add_data_flags(p)
    p.add_argument("--run-dir", default=None, help="where the run is written; must be new or empty "
                   "(default: a new runs/oracle-DATE-TIME, printed at start)")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --run-dir")
    _add_storage_flags(p)
    _add_checkpoint_flags(p).add_argument("--resume", action="store_true", help="continue the run in --run-dir "
                                          "from its newest valid checkpoint (the other roles learn it from the oracle)")
    p.add_argument("--prepared", action="store_true", help=argparse.SUPPRESS)  # the local launcher's
    p.add_argument("--store-served", action="store_true", help="the job's store is served by `bagpipe store` at "
                   "--master-ip:--master-port: join it; a lost oracle is then replaced by starting the same command "
                   "again, while the other roles wait (default: the oracle serves the store itself)")
    p.add_argument("--mini-batch-size", dest="batch_size", type=int, default=None,
                   help="the global batch, split evenly among the trainers" + _default("batch_size"))
    p.add_argument("--emb-info-file", default=None, help="one table size per line, agreed with the other roles' "
                   "and the data's (default: the data's)")
    for name, text in (("iterations", "global batches; 0: one pass"), ("seed", "initialisation seed"),
                       ("log-every", "iterations per metrics record"),
                       ("warmup-iterations", "iterations left out of the steady-state samples/s"),
                       ("max-eval-rows", "test rows evaluated; 0: all"), ("eval-batch-size", "samples per eval batch"),
                       ("eval-every", "evaluate also every N iterations (from a checkpoint); 0: only at the end")):
        p.add_argument(f"--{name}", type=int, default=None, help=text + _default(name.replace("-", "_")))
    p.add_argument("--keep-best", action="store_true", default=None, help="RUN_DIR/model holds the best evaluated "
                   "model instead of the last (needs --eval-every; default: the last; caser: the best)")
    p.add_argument("--no-keep-best", dest="keep_best", action="store_false", default=None,
                   help="RUN_DIR/model holds the last model, whatever a model's own default")
    p.add_argument("--optimizer", default=None, help=f"{_optimizers()}, agreed with the trainers'"
                   + _default("optimizer"))
    p.add_argument("--lr", type=float, default=None, help="learning rate, agreed with the trainers'" + _default("lr"))
    _add_model_flags(p, emb_flags=("--emb-size", "--emb-dim"))
    g = p.add_argument_group("the plan")
    g.add_argument("--cache-size", "--cache-rows", dest="cache_rows", type=int, default=None,
                   help="rows each trainer caches (default 0: 5%% of all rows)")
    g.add_argument("--lookahead-value", "--lookahead", dest="lookahead", type=int, default=None,
                   help="batches planned ahead" + _default("lookahead"))
    g.add_argument("--policy", default=None, help=_policies() + _default("policy"))
    g.add_argument("--cache-mode", default=None, choices=_cache_modes(), help="replicated: every trainer caches "
                   "every row the plan keeps; partitioned: each trainer only the rows its slices use (see bagpipe "
                   "train --help)" + _default("cache_mode"))
    g.add_argument("--keep-within", type=int, default=None, help="--cache-mode partitioned: a trainer keeps a row "
                   "another updates when its own next use is at most N iterations away" + _default("keep_within"))
    g.add_argument("--cleanup-batch-proportion", "--cleanup-fraction", dest="cleanup_fraction", type=float,
                   default=None, help="when evicting, also free this share of the cache" + _default("cleanup_fraction"))
    g.add_argument("--prefetch-depth", type=int, default=None,
                   help="iterations whose fetches a trainer has in flight" + _default("prefetch_depth"))
    g.add_argument("--planner-processes", type=int, choices=(1, 2), default=None, help="the oracle's planning in "
                   "1 process, or 2: each embedding space's batches numbered in a process of its own (the same "
                   "plan; a core more, for when the planner cannot keep up with the trainers)"
                   + _default("planner_processes"))
    _add_world_flags(p)
    _add_ignored_flags(p, "--prefetch", "--cache", "--dataset-multiprocessing", "--ragged", "--logging-prefix")
    p.add_argument("--writeback-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests only


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a finished run's parameters to one .pt file")
    p.add_argument("--run-dir", required=True, help="a finished run")
    p.add_argument("--out", required=True, help="the .pt file to write")


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="print a summary of runs and write PNG plots")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="one or more run dirs, drawn in the same plots")
    p.add_argument("--out", default=None, help="where the PNGs go (default: FIRST_RUN_DIR/report)")
    p.add_argument("--labels", default=None, help="comma-separated legend labels, one per run dir "
                   "(default: each run dir's name and mode)")


def _add_plan_stats(sub) -> None:
    p = sub.add_parser("plan-stats", help="plan a cache policy over a data set and print what it moves")
    p.add_argument("--data", required=True, help="a preprocessed data set (its train split is planned)")
    p.add_argument("--batch-size", type=int, required=True, help="the global batch")
    p.add_argument("--cache-rows", type=int, required=True, help="rows the cache holds")
    p.add_argument("--lookahead", type=int, default=200, help="batches planned ahead (default 200)")
    p.add_argument("--policy", default="lookahead", help=f"{_policies()} or belady (default lookahead)")
    p.add_argument("--iterations", type=int, default=0, help="batches planned (default 0: one pass over the split)")
    p.add_argument("--trainers", type=int, default=1, help="trainers sharing the write-backs (default 1); with 2 or "
                   "more, also what each trainer moves per iteration with a replicated and with a partitioned cache "
                   "of --cache-rows rows each (\"traffic\")")
    p.add_argument("--emb-dim", type=int, default=16, help="the rows' width, for the traffic's bytes (default 16)")
    p.add_argument("--optimizer", default="sgd", help=f"{_optimizers()}: the optimizer state a fetched or written "
                   "row carries, for the traffic's bytes (default sgd)")
    p.add_argument("--cleanup-fraction", type=float, default=0.0,
                   help="when evicting, also free this share of the cache (fewer, larger eviction rounds; default 0)")
    p.add_argument("--keep-within", type=int, default=0, help="the partitioned cache's traffic: a trainer keeps a row "
                   "another trainer updates when its own next use is at most N iterations away (default 0)")
    p.add_argument("--planner-processes", type=int, choices=(1, 2), default=1,
                   help="2: batches sorted and numbered in a process of their own, ahead of the decisions (the same "
                        "plan; worth it on large tables with a core to spare); default 1")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bagpipe", description=DESCRIPTION, epilog=QUICK_START,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_synth, _add_preprocess, _add_train, _add_export, _add_report, _add_plan_stats,
                _add_roles):
        add(sub)
    return parser


def run_synth(args) -> None:
    from bagpipe.synth import DEFAULT_ZIPF, generate, resolve_table_sizes

    if args.kind == "sequences":
        from bagpipe.synth_sequences import generate_sequences

        meta = generate_sequences(args.out, users=args.users, items=args.items, interactions=args.interactions,
                                  seed=args.seed, zipf=args.zipf if args.zipf is not None else 1.0,
                                  follow=args.follow, genres=args.genres, settings=_sequence_settings(args))
        log.info("wrote %d users' %d interactions to %s (best achievable HR@10 %.4f, NDCG@10 %.4f)", meta["users"],
                 meta["interactions"], args.out, meta["best_hr10"], meta["best_ndcg10"])
        return
    if args.rows is None:
        raise ValueError("--rows is required with --kind ctr")
    sizes = resolve_table_sizes(tables=args.tables, table_sizes=args.table_sizes,
                                max_rows_per_table=args.max_rows_per_table)
    test_rows = args.test_rows if args.test_rows is not None else max(args.rows // 10, 1)
    meta = generate(args.out, rows=args.rows, test_rows=test_rows, seed=args.seed, table_sizes=sizes,
                    zipf=args.zipf if args.zipf is not None else DEFAULT_ZIPF, raw_ids=args.raw_ids,
                    periods=args.periods, new_share=args.new_share)
    log.info("wrote %d train and %d test rows to %s (best achievable AUC %.4f)", meta["train_rows"],
             meta["test_rows"], args.out, meta.get("best_auc", math.nan))


def _sequence_settings(args):
    from bagpipe.data.sequences import SequenceSettings

    given = {name: getattr(args, name) for name in ("history", "targets", "negatives") if getattr(args, name)}
    return SequenceSettings(**given)


def run_preprocess(args) -> None:
    from bagpipe.data.preprocess import preprocess

    given = any(getattr(args, name) for name in ("history", "targets", "negatives"))
    meta = preprocess(args.input, args.out, fmt=args.format, table_sizes=args.table_sizes,
                      meta_file=args.meta, on_bad_row=args.on_bad_row, vocab_min_count=args.vocab_min_count,
                      sequence=_sequence_settings(args) if given else None, raw_ids=args.raw_ids)
    print(json.dumps({k: meta[k] for k in ("rows", "table_sizes", "skipped_rows", "skipped_by_reason")}))


def run_train(args) -> None:
    # The settings are checked before torch is imported (seconds on a busy machine): a mistyped flag, model, mode
    # or path is refused at once.
    from bagpipe.config import ModelConfig, TrainConfig, load_train_config, resumed_config

    if args.threads < 0:
        raise ValueError(f"--threads must not be negative, got {args.threads}")
    names = {f for f in TrainConfig.__dataclass_fields__ if f != "model"} | set(ModelConfig.__dataclass_fields__)
    overrides = {name: getattr(args, name) for name in names if hasattr(args, name)}
    if args.resume:
        if args.overwrite:
            raise ValueError("--resume continues the run in --run-dir, --overwrite replaces it: give one of them")
        if not args.run_dir:
            raise ValueError("--resume needs --run-dir: the run to continue")
        from bagpipe.rundir import is_finished

        if is_finished(args.run_dir):
            raise ValueError(f"--resume: the run in {args.run_dir} has finished (it has a summary.json)")
        config = resumed_config(args.run_dir, args.config, overrides)
    else:
        config = load_train_config(args.config, overrides)
        if not Path(config.data).exists():  # (as data.prepare refuses it, before anything is loaded)
            raise ValueError(f"--data: no such file or directory {config.data}")
    # A role runs one thread unless told otherwise, and a reference that computes as trainers do
    # (--slices) runs as many as each of them: some kernels' sums depend on the thread count.
    threads = args.threads or (SLICED_THREADS if config.run_mode.processes or config.slices > 1 else 0)
    if threads != 1 and "torch" not in sys.modules:  # (OpenMP's workers: how they wait, read as torch loads)
        from bagpipe.openmp import choose_wait_policy

        if choose_wait_policy():
            log.info("other processes are keeping this machine's cores busy: torch's threads wait passively "
                     "(OMP_WAIT_POLICY=PASSIVE; set it yourself to choose)")
    import torch

    from bagpipe.faults import set_role
    from bagpipe.train.reference import train_reference

    if config.run_mode.processes:
        from bagpipe.runtime.launch import launch_local

        summary = launch_local(config, show_progress=not args.no_progress, threads=threads, overwrite=args.overwrite,
                               resume=args.resume)
    else:
        if threads:
            torch.set_num_threads(threads)
        set_role("reference")
        summary = train_reference(config, show_progress=not args.no_progress, overwrite=args.overwrite,
                                  resume=args.resume)
    print(human_summary(summary))


def human_summary(summary: dict) -> str:
    from bagpipe.report import figure, health_lines, summary_mode

    lines = [
        f"mode {summary['mode']} ({summary.get('model', 'dlrm')}): {summary['iterations']} iterations, "
        f"{summary['samples']} samples"
        + (f", resumed at iteration {summary['resumed_at']}" if summary.get("resumed_at") is not None else ""),
        f"  throughput  {figure(summary['samples_per_s'], ',.0f')} samples/s (steady state; "
        f"wall {summary['wall_s']:.1f} s)",
        f"  train loss  {figure(summary['final_train_loss'], '.4f')}",
    ]
    # with --keep-best the model delivered may be an earlier one: its figures follow (report.health_lines)
    last = (" (the last state; model/ holds an earlier one)" if summary.get("keep_best")
            and summary.get("best_iteration") not in (None, summary["iterations"]) else "")
    for prefix, split in (("valid_", "valid"), ("eval_", "eval")):  # the validation split's, if any, then the test's
        if prefix + "auc" in summary:
            lines.append(f"  {split} AUC{' ' * (8 - len(split))}{figure(summary[prefix + 'auc'], '.4f')}   "
                         f"log-loss {figure(summary[prefix + 'logloss'], '.4f')}{last}")
        if prefix + "hr10" in summary:
            lines.append(f"  {split} HR@10{' ' * (6 - len(split))}{figure(summary[prefix + 'hr10'], '.4f')}   "
                         f"NDCG@10 {figure(summary[prefix + 'ndcg10'], '.4f')}{last}")
    if "eval_hr10" in summary:
        lines += [f"  {name:<11} {figure(summary[prefix + 'hr10'], '.4f')}   NDCG@10 "
                  f"{figure(summary[prefix + 'ndcg10'], '.4f')}" for name, prefix in
                  (("popular", "eval_popular_"), ("co-occur.", "eval_cooccurrence_")) if prefix + "hr10" in summary]
    if summary_mode(summary).cached:
        stall = (f", stall {100 * summary['embedding_stall_fraction']:.1f}% of trainer time"
                 if "embedding_stall_fraction" in summary else "")
        lines.append(f"  cache       {summary['cache_rows']:,} of {summary['total_rows']:,} rows, hit rate "
                     f"{figure(summary['cache_hit_rate'], '.3f')}, "
                     f"{figure(summary['rows_moved_per_iteration'], '.0f')} rows moved per iteration{stall}")
    for metric, name in (("auc", "AUC"), ("hr10", "HR@10")):
        if summary.get(f"best_{metric}") is not None and figure(summary.get(f"eval_{metric}"), "") != "n/a":
            gap = summary[f"best_{metric}"] - summary[f"eval_{metric}"]
            lines.append(f"  best {name:<7}{summary[f'best_{metric}']:.4f} (planted model; gap {gap:+.4f})")
    return "\n".join(lines + health_lines(summary))


def run_export(args) -> None:
    from bagpipe.rundir import export

    exported = export(args.run_dir, args.out)
    log.info("wrote %s: %d dense tensors, %d tables", args.out, len(exported["dense"]), len(exported["embeddings"]))


def run_report(args) -> None:
    from bagpipe.report import report

    labels = args.labels.split(",") if args.labels else None
    text, files = report(args.run_dirs, out=args.out, labels=labels)
    print(text)
    print(f"\nplots: {', '.join(str(f) for f in files)}")


def run_plan_stats(args) -> None:
    from bagpipe.data.binary import open_dataset
    from bagpipe.optim import make_row_optimizer
    from bagpipe.planner.stats import plan_stats, traffic

    if args.emb_dim <= 0:
        raise ValueError(f"--emb-dim must be positive, got {args.emb_dim}")
    dataset = open_dataset(args.data)
    if dataset.meta.get("raw_ids"):
        raise ValueError(f"{args.data} holds raw ids (bagpipe preprocess --raw-ids): plan-stats reads ids as rows of "
                         f"fixed tables, and raw ids get theirs only in a run (bagpipe train); not supported yet")
    split = dataset.train
    stats = plan_stats(split, batch_size=args.batch_size, cache_rows=args.cache_rows, lookahead=args.lookahead,
                       policy=args.policy, iterations=args.iterations, num_trainers=args.trainers,
                       cleanup_fraction=args.cleanup_fraction, processes=args.planner_processes)
    if args.trainers > 1 and args.batch_size % args.trainers:
        log.warning("--batch-size %d is not a multiple of the %d trainers: no slices, so no traffic figures",
                    args.batch_size, args.trainers)
    elif args.trainers > 1:
        state_width = make_row_optimizer(args.optimizer, lr=0.01).state_width(args.emb_dim)
        stats["traffic"] = traffic(split, batch_size=args.batch_size, cache_rows=args.cache_rows,
                                   lookahead=args.lookahead, trainers=args.trainers, iterations=args.iterations,
                                   cleanup_fraction=args.cleanup_fraction, dim=args.emb_dim, state_width=state_width,
                                   keep_within=args.keep_within)
    print(json.dumps(stats))


def _world(args, *, trainers_from_oracle: bool = False):
    from bagpipe.runtime.world import world_from_env

    return world_from_env(rank=args.rank, world_size=args.world_size, num_trainers=args.num_trainers,
                          master_addr=args.master_addr, master_port=args.world_port,
                          timeout=args.world_timeout or 60.0, liveness=args.world_liveness or 0.0,
                          rpc_transports=args.world_rpc_transports, rpc_channels=args.world_rpc_channels,
                          trainers_from_oracle=trainers_from_oracle)


def _given(args) -> tuple[dict, dict]:
    """The train and model settings this role's command line (and --config) gave explicitly."""
    from bagpipe.config import ModelConfig, TrainConfig, given_settings

    names = {f for f in TrainConfig.__dataclass_fields__ if f != "model"} | set(ModelConfig.__dataclass_fields__)
    return given_settings(getattr(args, "config", None),
                          {name: getattr(args, name) for name in names if hasattr(args, name)})


def run_oracle(args) -> None:
    import dataclasses
    import time

    from bagpipe.config import load_train_config
    from bagpipe.runtime.agree import stated
    from bagpipe.runtime.oracle.main import run_oracle as oracle_main

    setup_logging(role="oracle", rank=0)
    if args.store_served:  # a process-wide switch, read where the oracle joins the store and states the job
        from bagpipe.runtime.world import STORE_SERVED

        os.environ[STORE_SERVED] = "1"
    world = _world(args)
    train, model = _given(args)
    sizes = read_emb_info(args.emb_info_file) if args.emb_info_file else None
    given = stated(train, model, table_sizes=sizes)
    overrides = {**train, **model, "mode": "bagpipe", "trainers": world.num_trainers, "servers": world.num_servers,
                 "timeout": args.world_timeout, "liveness_s": args.world_liveness,
                 "rpc_transports": args.world_rpc_transports, "rpc_channels": args.world_rpc_channels}
    if not train.get("run_dir"):
        overrides["run_dir"] = f"runs/oracle-{time.strftime('%Y%m%d-%H%M%S')}"
        log.info("the run goes to %s (--run-dir)", overrides["run_dir"])
    config = load_train_config(args.config, overrides)
    world = dataclasses.replace(world, timeout=config.timeout, liveness=config.liveness_s)
    summary = oracle_main(config, world, overwrite=args.overwrite, prepared=args.prepared, given=given,
                          resume=args.resume)
    print(human_summary(summary))


def read_emb_info(path: str) -> list[int]:
    """--emb-info-file: one table size per line (agreed with the other roles' and the data's)."""
    try:
        return [int(line) for line in open(path).read().split()]
    except (OSError, ValueError) as err:
        raise ValueError(f"--emb-info-file {path}: expected one table size per line ({err})") from None


def run_server(args) -> None:
    from bagpipe.runtime.server.main import run_server as server_main

    world = _world(args, trainers_from_oracle=True)
    setup_logging(role="server", rank=world.rank)
    given = {}
    if getattr(args, "emb_dim", None) is not None:
        given["emb_dim"] = args.emb_dim
    if getattr(args, "emb_info_file", None):
        given["table_sizes"] = read_emb_info(args.emb_info_file)
    server_main(world, given=given)


# Why --dist-backend nccl is refused (issue 28): the trainers sum on the host over gloo whatever their device; an
# NCCL group needs every trainer on a GPU of its own (NCCL refuses two ranks on one device), and the only GPU machine
# this project is checked on has one, so an NCCL path could not run there, let alone be shown equal to the reference.
NCCL_REFUSED = ("--dist-backend nccl: the trainers' gradient sums run over gloo, in host memory, whatever their "
                "--device (NCCL needs a GPU per trainer, which no machine this project is checked on has); "
                "use --dist-backend gloo: it trains the same model, bit for bit")


def run_trainer(args) -> None:
    from bagpipe.models import complete_model
    from bagpipe.runtime.agree import stated
    from bagpipe.runtime.trainer.main import run_trainer as trainer_main

    if getattr(args, "dist_backend", "gloo") != "gloo":  # refused before joining the job: nothing to undo
        raise ValueError(NCCL_REFUSED)
    world = _world(args, trainers_from_oracle=True)
    setup_logging(role="trainer", rank=world.rank)
    if getattr(args, "dist_worker_id", None) is not None and args.dist_worker_id != world.rank - 1:
        raise ValueError(f"--dist-worker-id {args.dist_worker_id} is not trainer {world.rank - 1}, which "
                         f"--worker-id {world.rank} is (trainers are ranks 1..T)")
    train, model = _given(args)
    device = train.pop("device", None)  # this process's, not the job's: trainers may differ (cuda:0, cuda:1)
    sizes = read_emb_info(args.emb_info_file) if getattr(args, "emb_info_file", None) else None
    given = stated(train, complete_model(model), table_sizes=sizes, kind="model")
    trainer_main(world, given=given, device=device, writeback_delay=args.writeback_delay)


def run_store(args) -> None:
    from bagpipe.runtime.store import serve_store
    from bagpipe.runtime.world import world_from_env

    setup_logging(role="store", rank="-")
    serve_store(world_from_env(rank=0, world_size=args.world_size, num_trainers=args.num_trainers,
                               master_addr=args.master_addr, master_port=args.world_port,
                               timeout=args.world_timeout or 60.0, liveness=args.world_liveness or 0.0,
                               trainers_from_oracle=True))


def run_role(args) -> None:
    role, _ = _world(args).role
    {"oracle": run_oracle, "server": run_server, "trainer": run_trainer, "role": run_role}[role](args)


COMMANDS = {"synth": run_synth, "preprocess": run_preprocess, "train": run_train, "export": run_export,
            "report": run_report, "plan-stats": run_plan_stats, "oracle": run_oracle, "server": run_server,
            "trainer": run_trainer, "role": run_role, "store": run_store}


ROLES = ("oracle", "server", "trainer", "role", "store")
SLICED_THREADS = 1  # threads of each role of a local job, and of a reference that computes as its trainers do
_WAKEUP: list = []  # the socket pair Ctrl-C's wakeup byte travels through, kept for the process


def _say_unlocked(message: str) -> None:
    """One ERROR line as the log handlers write it, straight to stderr, taking no lock."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
    handler = next((h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler)), None)
    os.write(2, ((handler.format(record) if handler else message) + "\n").encode())


def _exit_on_interrupt() -> None:
    """Ctrl-C ends a role at once, with one line, even while its main thread waits in native code
    (Python raises KeyboardInterrupt only once such a wait returns): the signal's wakeup byte
    reaches a thread that is not blocked."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    _WAKEUP.extend((reader, writer))

    def watch() -> None:
        while signal.SIGINT not in reader.recv(64):
            pass
        _say_unlocked("interrupted (Ctrl-C)")  # logging's locks may be held by a thread that never lets go
        record_exit(ExitStatus(cause="interrupted", message="interrupted (Ctrl-C)"))
        os._exit(130)

    threading.Thread(target=watch, name="interrupt", daemon=True).start()


def _terminate(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the clean-up short
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(role=args.command)
    if args.command in ROLES:
        _exit_on_interrupt()
        previous_sigterm = None
    elif threading.current_thread() is threading.main_thread():  # (signal handlers are the main thread's)
        previous_sigterm = signal.signal(signal.SIGTERM, _terminate)
    else:
        previous_sigterm = None
    try:
        code = _run_command(args)
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
    return code


def _met_a_full_disk(err: BaseException | None) -> bool:
    """Whether ``err`` is, or was raised from, a write that met a full disk (a background write's error comes
    wrapped: threads.Background.join)."""
    while err is not None:
        if isinstance(err, WriteFailed) and err.full:
            return True
        err = err.__cause__
    return False


def _run_command(args) -> int:
    """Run ``args``' command; its exit status (a failed role leaves at once, with it)."""
    code, failure, cause = 0, "", None
    profile_dir = os.environ.get("BAGPIPE_PROFILE_DIR") if args.command in ROLES else None
    try:
        if profile_dir:  # a cProfile of this role, for finding where its time goes
            import cProfile

            Path(profile_dir).mkdir(parents=True, exist_ok=True)
            name = f"{args.command}{args.rank if args.rank is not None else os.environ.get('RANK', '')}"
            cProfile.runctx("COMMANDS[args.command](args)", globals(), {"args": args},
                            str(Path(profile_dir) / f"{name}.prof"))
        else:
            COMMANDS[args.command](args)
    except KeyboardInterrupt:
        code, failure = 130, "interrupted (Ctrl-C)"
        log.error("%s", failure)
    except Terminated:
        code, failure = 143, "terminated (SIGTERM)"
        log.error("%s", failure)
    except ValueError as err:
        code, failure = 2, str(err)
        log.error("%s", failure)
    except NotReplaceable as err:  # a lost oracle's replacement that cannot take over: the launcher restarts the job
        code, failure = NOT_REPLACEABLE_EXIT_CODE, str(err)
        log.error("%s", failure)
    # (WriteFailed: a full or read-only disk, named, the user's to fix: no traceback)
    except (WriteFailed, RuntimeError, TimeoutError, ConnectionError) as err:
        code, failure = 1, str(err)
        if _met_a_full_disk(err):
            cause = "no_space"
            if args.command == "train" and getattr(args, "run_dir", None):
                from bagpipe.train.checkpoints import after_a_full_disk

                failure += f"; {after_a_full_disk(args.run_dir)}"
        log.error("%s", failure)
    except Exception as err:
        code, failure = 1, f"{type(err).__name__}: {err}"
        log.exception("%s", failure)
    if code and args.command in ROLES:
        record_exit(ExitStatus(cause=cause or ("interrupted" if code in (130, 143) else "error"), message=failure))
        # A failed role leaves at once: tearing down RPC with peers gone can hang or abort.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
