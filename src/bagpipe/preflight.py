"""Checks of a job against its data before anything starts: what cannot run is refused with a
ValueError naming the setting, what would do nothing gets a warning."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import numpy as np

from bagpipe.config import RUN_MODES, SECTION_OF, Mode, ModelConfig, TrainConfig, default_config
from bagpipe.data.batches import batches_per_epoch, epoch_rows, fresh_negatives, planned_iterations, read_batch
from bagpipe.data.binary import BinaryDataset, open_dataset
from bagpipe.data.prepare import ensure_preprocessed
from bagpipe.data.preprocess import physical_memory_bytes
from bagpipe.device import resolve_device
from bagpipe.embeddings import EmbeddingLayout, valid_keys
from bagpipe.files import check_writable, human_bytes, mount_point
from bagpipe.models import check_model, model_tables
from bagpipe.optim import make_row_optimizer
from bagpipe.planner.plan import (PARTITIONED_BYTES_PER_SEEN_ROW_PER_TRAINER, PLANNER_BYTES_PER_SEEN_ROW, plans_ahead,
                                  planner_window_bytes)
from bagpipe.progress import progress
from bagpipe.rundir import prepare_run_dir
from bagpipe.storage.tiers import storage_path, tier_class

log = logging.getLogger(__name__)

def default_cache_rows(table_sizes: list[int]) -> int:
    return max(1, int(0.05 * sum(table_sizes)))


def prepare_job(config: TrainConfig, *, overwrite: bool = False, show_progress: bool = False) -> BinaryDataset:
    """What comes before a run starts, in this order: the data (converted if its sources changed),
    every check of the job against it, and only then the run dir (an earlier run there is cleared
    only now, so a run refused at start loses nothing). A device the machine lacks is refused first."""
    resolve_device(config.device)
    dataset = prepare_data(config, show_progress=show_progress)
    claim(config, dataset, overwrite=overwrite, show_progress=show_progress)
    return dataset


def prepare_data(config: TrainConfig, *, show_progress: bool = False) -> BinaryDataset:
    """The job's data set, converted first if its sources changed."""
    dataset = open_dataset(ensure_preprocessed(config.data, show_progress=show_progress, fmt=config.data_format or None,
                                               holdout=config.holdout, vocab_min_count=config.vocab_min_count))
    if dataset.meta.get("raw_ids"):
        dataset = numbered_run_data(config, dataset)
    else:
        defaults = default_config()
        for name in ("row_min_count", "row_retire_after", "row_budget"):
            if getattr(config, name) != getattr(defaults, name):
                log.warning("--%s does nothing: %s holds no raw ids (bagpipe preprocess --raw-ids)",
                            name.replace("_", "-"), config.data)
    held = dataset.meta.get("held_out")
    if held:
        log.info("%s has no test split: its last %d rows (%.1f%%, --holdout %.4g) are held out for evaluation",
                 config.data, held["rows"], 100 * held["holdout"], held["holdout"])
    elif dataset.test is None:
        log.info("%s has no test split (--holdout 0): the run is not evaluated", config.data)
    return dataset


def numbered_run_data(config: TrainConfig, dataset: BinaryDataset) -> BinaryDataset:
    """Raw-id data as the run reads it: each table's keys that the run's batches look up given rows of their own
    (embeddings.dynamic), every other key the table's default row."""
    from bagpipe.data.batches import batch_rows
    from bagpipe.embeddings.dynamic import RowNumbering, numbered_dataset

    selectors = batch_rows(dataset.train, batch_size=config.batch_size, iterations=planned_iterations(
        config, dataset.train), shuffle=config.shuffle, shuffle_seed=config.shuffle_seed)
    numbering = RowNumbering.of_run(dataset.train, selectors, min_count=config.row_min_count,
                                    retire_after=config.row_retire_after, budget=config.row_budget)
    log.info("raw ids: %d rows made for the keys the run's batches look up, the tables holding %d rows (largest %d), "
             "a default row each for the others", sum(numbering.rows_made), sum(numbering.table_rows),
             max(numbering.table_rows))
    return dataclasses.replace(numbered_dataset(dataset, numbering), numbering=numbering)


def check_same_batches(config: TrainConfig, dataset: BinaryDataset) -> None:
    """A resumed job of processes on raw ids must plan the batches it started with: its tables' rows are those its
    batches make (embeddings.dynamic), and its servers restore their shards by the rows' places, so more or fewer
    iterations would number them otherwise. (The in-process modes regrow a checkpoint's tables instead:
    train.reference.numbered_before.)"""
    if dataset.numbering is None or not config.run_mode.processes:
        return
    saved = json.loads((Path(config.run_dir) / "config.json").read_text())
    for name in ("iterations", "epochs"):
        if saved.get(name) != getattr(config, name):
            raise ValueError(f"--resume: the run in {config.run_dir} trains raw ids, whose rows are the ones its "
                             f"batches make; it was started with {name}={saved.get(name)!r}, and resuming it with "
                             f"{getattr(config, name)!r} is not supported yet in --mode {config.mode} (leave the "
                             f"flag out; --mode reference and single resume it)")


def claim(config: TrainConfig, dataset: BinaryDataset, *, overwrite: bool, show_progress: bool = False) -> None:
    """Check the job against its data (warning about what does nothing), then claim the run dir."""
    for warning in check_job(config, dataset, show_progress=show_progress):
        log.warning("%s", warning)
    prepare_run_dir(config.run_dir, overwrite=overwrite)
    (Path(config.run_dir) / DATA_RECORD).write_text(json.dumps(data_identity(dataset), indent=2) + "\n")


DATA_RECORD = "data.json"  # in a run dir: what its data was (data_identity), checked when the run resumes


def data_identity(dataset: BinaryDataset) -> dict:
    """What a run's data is, whatever its path: each split's rows and its arrays' checksums (as their conversion
    recorded them; None in data converted before checksums were kept)."""
    return {name: {"rows": split.rows, "checksums": split.checksums} for name, split in dataset.splits().items()}


def check_same_data(run_dir: str | Path, dataset: BinaryDataset) -> None:
    """Refuse to resume the run in ``run_dir`` on data other than what it trained on (converted again since, from
    changed sources or by a bagpipe that converts otherwise): it would not continue the same run. A run dir from
    before runs recorded their data is not checked."""
    path = Path(run_dir) / DATA_RECORD
    if not path.is_file():
        return
    recorded, now = json.loads(path.read_text()), data_identity(dataset)
    if recorded != now:
        changed = sorted(name for name in recorded.keys() | now.keys() if recorded.get(name) != now.get(name))
        raise ValueError(f"--resume: the data in {dataset.directory} is not what the run in {run_dir} trained on "
                         f"(its {', '.join(changed)} split{'s' if len(changed) > 1 else ''} changed since: converted "
                         f"again from changed sources, or by a bagpipe that converts them otherwise); resuming would "
                         f"not continue the same run: start a new one (--overwrite), or give the data it trained on")


def check_job(config: TrainConfig, dataset: BinaryDataset, *, show_progress: bool = False) -> list[str]:
    """Refuse a job that cannot run on ``dataset``; return warnings about settings that do nothing."""
    check_data(config, dataset)
    check_memory(config, dataset)
    if (config.checkpoints or config.eval_every) and not config.model.card.built:
        raise ValueError("checkpoints during training (and --eval-every, which evaluates them) need bagpipe's "
                         "trainers: the trainers are scripts with a model of their own (init_cache), whose dense "
                         "state the job cannot save")
    if config.run_mode.cached:
        check_cache(config, dataset, show_progress=show_progress)
    return ignored_settings(config) + cache_warnings(config, dataset)


def check_data(config: TrainConfig, dataset: BinaryDataset) -> None:
    """The model can take the data's features, and the data holds at least one batch."""
    check_model(config.model, dataset.schema)
    if batches_per_epoch(dataset.train, config.batch_size) == 0:
        raise ValueError(f"batch_size {config.batch_size} exceeds the {dataset.train.rows} training rows "
                         f"of {dataset.directory}")


def job_layout(config: TrainConfig, dataset: BinaryDataset) -> EmbeddingLayout:
    return EmbeddingLayout(model_tables(config.model, dataset.schema), dataset.schema)


def table_bytes(config: TrainConfig, layout: EmbeddingLayout) -> int:
    """Every table's rows and their optimizer state, in float32."""
    optimizer = make_row_optimizer(config.optimizer, lr=config.lr)
    return sum(space.num_rows * (space.dim + optimizer.state_width(space.dim)) * 4 for space in layout.spaces)


def planner_bytes(layout: EmbeddingLayout, dataset: BinaryDataset, *, partitioned_trainers: int = 0,
                  lookahead: int = 0, batch_size: int = 0) -> int:
    """The most the oracle's planner can hold: its state grows with the distinct rows it sees, which are at most
    the tables' rows and at most the training split's ids (the same rows again in later epochs); the partitioned
    plan (``partitioned_trainers``: its trainers) holds more per row. Besides, its window: ``lookahead`` batches
    of ``batch_size`` samples ahead and the block of next uses being computed (``planner_window_bytes``)."""
    per_row = PLANNER_BYTES_PER_SEEN_ROW + partitioned_trainers * PARTITIONED_BYTES_PER_SEEN_ROW_PER_TRAINER
    window = planner_window_bytes(lookahead=lookahead, batch_ids=batch_size * int(np.prod(dataset.train.ids.shape[1:])),
                                  partitioned=partitioned_trainers > 0) if lookahead else 0
    return min(layout.num_rows, int(dataset.train.ids.size)) * per_row + window


def check_memory(config: TrainConfig, dataset: BinaryDataset) -> None:
    """Refuse a job whose tables cannot fit in this machine's memory at all.

    The reference holds every table once; a local bagpipe job holds them on its servers, besides the
    planner's state over the rows it sees (``planner_bytes``; no process gathers the tables: the end of a run
    reads the servers' snapshots).
    On disk (--storage disk: the servers', or --mode single's process's) only the DRAM budgets count.
    """
    layout = job_layout(config, dataset)
    on_disk = config.run_mode.cached and tier_class(config.storage).files
    if on_disk:  # the servers (or the one process) hold their budgets; the tables go to their files
        check_disk(config, layout)
        holders = config.servers if config.run_mode.processes else 1
        parts = {"the storage budgets": int(holders * config.storage_budget_mb * 2**20)}
    else:
        check_model_space(config, layout)
        parts = {"tables": table_bytes(config, layout)}
    if config.run_mode.processes or (config.run_mode.cached and plans_ahead(config.policy)):  # a planner runs
        parts["the planner"] = planner_bytes(
            layout, dataset, partitioned_trainers=config.trainers if config.partitioned else 0,
            lookahead=config.lookahead, batch_size=config.batch_size)
        if config.parity:  # in memory whatever the tier: 1/k of the tables, and a version per row
            parts["the parity"] = table_bytes(config, layout) // config.parity + layout.num_rows * 8
    need, have = sum(parts.values()), physical_memory_bytes()
    if need > have:
        detail = ", ".join(f"{name} {human_bytes(n)}" for name, n in parts.items())
        remedy = ("lower --storage-budget-mb" if on_disk else
                  "lower emb_dim or the table sizes" + (", or keep the tables on disk (--storage disk)"
                                                        if config.run_mode.cached else ""))
        raise ValueError(f"{dataset.directory}: the {config.model.name} tables ({layout.num_rows:,} rows) with "
                         f"{config.optimizer} need {human_bytes(need)} ({detail}), more than this machine's "
                         f"{human_bytes(have)}; "
                         f"{remedy}")


def model_bytes(layout: EmbeddingLayout) -> int:
    """What the model directory a run writes at its end (``model/``: every table's rows, float32) takes, at least."""
    return sum(space.num_rows * space.dim * 4 for space in layout.spaces)


def check_disk(config: TrainConfig, layout: EmbeddingLayout) -> None:
    """Refuse a disk-tier job whose tables' files cannot fit in the free space of --storage-dir (a local
    job's servers all write there; so does --mode single), counting the model directory the run writes at its end
    where the run directory is on the same disk (``check_model_space`` otherwise)."""
    optimizer = make_row_optimizer(config.optimizer, lr=config.lr)
    tier = tier_class(config.storage)
    files = sum(tier.stored_bytes(space.num_rows, space.dim, optimizer.state_width(space.dim))
                for space in layout.spaces)
    where = storage_path(config.storage_dir, config.run_dir).absolute()
    check_writable(where, what="--storage-dir")
    free = shutil.disk_usage(where if where.exists() else mount_point(where)).free
    shared = mount_point(where) == mount_point(config.run_dir)
    need = files + (model_bytes(layout) if shared else 0)
    if need > free:
        model = (f" (and the model the run writes at its end into {config.run_dir}, on the same disk: "
                 f"{human_bytes(need)} in all)" if shared else "")
        raise ValueError(f"--storage {config.storage}: the tables' files need {human_bytes(files)} in {where}{model}, "
                         f"which has {human_bytes(free)} free; give --storage-dir on a larger disk")
    if not shared:
        check_model_space(config, layout)


def check_model_space(config: TrainConfig, layout: EmbeddingLayout) -> None:
    """Refuse a job whose run directory's disk cannot hold the model directory the run writes at its end (every
    table's rows): found out after the whole run otherwise."""
    need = model_bytes(layout)
    free = shutil.disk_usage(mount_point(config.run_dir)).free
    if need > free:
        raise ValueError(f"the model this run writes at its end (model/: every table's rows) needs {human_bytes(need)} "
                         f"in {config.run_dir}, which has {human_bytes(free)} free; give --run-dir on a larger disk")


def cache_rows_of(config: TrainConfig, layout: EmbeddingLayout) -> list[int]:
    """Each space's share of the cache (``cache_rows`` of all rows, default 5%)."""
    return layout.split_cache(config.cache_rows or default_cache_rows([layout.num_rows]),
                              batch_size=cached_batch(config))


def cached_batch(config: TrainConfig) -> int:
    """The samples whose rows a cache must hold at once: the global batch, or with the partitioned cache a
    trainer's slice of it."""
    partitioned = config.run_mode.processes and config.partitioned
    return config.batch_size // config.trainers if partitioned else config.batch_size


def check_cache(config: TrainConfig, dataset: BinaryDataset, *, show_progress: bool = False) -> None:
    """Refuse a cache smaller than some batch's distinct rows (with the partitioned cache: some trainer's slice's),
    before the oracle's planner meets it.

    A batch touches at most its columns x batch_size rows of a space, so only a share smaller than
    that needs the batches scanned. A cache that some batch overflows is refused naming the first such batch and
    the smallest --cache-rows that every batch fits (the scan then goes on to the end, to find it).
    """
    split, layout = dataset.train, job_layout(config, dataset)
    shares, cached = cache_rows_of(config, layout), cached_batch(config)
    tight = [s for s, space in enumerate(layout.spaces) if shares[s] < cached * len(space.data_columns)]
    if not tight:
        return
    iterations = planned_iterations(config, split)
    stamps = {s: np.zeros(layout.spaces[s].num_rows, dtype=np.int64) for s in tight}
    need = dict.fromkeys(tight, 0)  # the most distinct rows of a space a batch (or slice) touches
    first: str | None = None  # the first batch that did not fit, said as the refusal says it
    bar = progress(total=iterations, desc="check cache", unit="batch", enabled=show_progress)
    rows = epoch_rows(split, batch_size=config.batch_size, iterations=iterations, shuffle=config.shuffle,
                      shuffle_seed=config.shuffle_seed)
    cardinalities, lowest = split.column_bounds()
    negatives = fresh_negatives(config, split)
    for iteration, (epoch, selector) in enumerate(rows):
        ids = np.array(split.ids[selector], dtype=np.int64)
        if negatives is not None:
            negatives.apply(ids, selector, epoch)
        if dataset.numbering is not None:  # (raw ids: a key not admitted yet looks the default row up)
            ids = dataset.numbering.training_ids(ids, iteration)
        if ((ids < lowest) | (ids >= cardinalities)).any():
            bar.close()
            read_batch(split, selector)  # refuses the batch, naming the row, the id and its table
        for part in range(len(ids) // cached):
            keys = layout.keys(ids[part * cached:(part + 1) * cached])
            for s in tight:
                flat = valid_keys(keys[s])
                positions = np.arange(len(flat), dtype=np.int64)
                # Each distinct key keeps exactly one of its positions in the stamps: count those.
                stamps[s][flat] = positions
                distinct = int(np.count_nonzero(stamps[s][flat] == positions))
                need[s] = max(need[s], distinct)
                if distinct > shares[s] and first is None:
                    where = "" if len(layout.spaces) == 1 else f" of the {layout.spaces[s].dim}-wide tables"
                    what = f"trainer {part}'s slice of batch" if cached < len(ids) else "batch"
                    first = (f"{what} {iteration} touches {distinct} distinct rows{where}, more than the cache's "
                             f"{shares[s]} for them (--cache-rows {config.cache_rows or 'default'})")
        bar.update(1)
    bar.close()
    if first is not None:
        smallest = smallest_cache_rows(config, layout, need)
        raise ValueError(f"{first}: the smallest --cache-rows that every batch fits is {smallest:,} (of "
                         f"{layout.num_rows:,} rows); or lower the batch size")


def smallest_cache_rows(config: TrainConfig, layout: EmbeddingLayout, need: dict[int, int]) -> int:
    """The smallest --cache-rows whose share of each space ``s`` holds ``need[s]`` rows (the shares grow with it)."""
    def fits(cache_rows: int) -> bool:
        shares = layout.split_cache(cache_rows, batch_size=cached_batch(config))
        return all(shares[s] >= rows for s, rows in need.items())

    low, high = 1, layout.num_rows  # (every row cached fits any batch)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle + 1, high)
    return low


def ignored_settings(config: TrainConfig) -> list[str]:
    """Warnings for settings changed from their defaults (the model's own: its card's defaults) that the
    chosen mode or model does not read."""
    defaults = default_config(config.model.name)
    changed = [f.name for f in dataclasses.fields(TrainConfig)
               if f.name != "model" and getattr(config, f.name) != getattr(defaults, f.name)]
    mode = RUN_MODES[config.mode]  # the sections of settings it reads (config.SECTIONS)
    warnings = [f"{_flag(name)} does nothing in --mode {config.mode} (a {SECTION_OF[name]} setting)"
                + _hint(name, mode) for name in changed if not mode.reads(name)]
    if "shuffle_seed" in changed and not config.shuffle:
        warnings.append("--shuffle-seed does nothing without --shuffle (batches are consecutive rows)")
    read = config.model.card.settings
    warnings += [f"{_flag(f.name)} does nothing with --model {config.model.name}"
                 for f in dataclasses.fields(ModelConfig)
                 if f.name not in ("name", *read) and getattr(config.model, f.name) != getattr(defaults.model, f.name)]
    return warnings


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _hint(name: str, mode: Mode) -> str:
    if mode.processes:
        return " (its trainers are the slices: --trainers)"
    if name == "trainers":
        return " (one process trains; --slices T computes the gradients as T trainers do)"
    return ""


def cache_warnings(config: TrainConfig, dataset: BinaryDataset) -> list[str]:
    total = job_layout(config, dataset).num_rows
    warnings = []
    if config.run_mode.cached and config.cache_rows >= total:
        warnings.append(f"--cache-rows {config.cache_rows} holds all {total} rows: every row stays cached after its "
                        f"first fetch, so the plan saves nothing over keeping the tables on the trainers")
    if config.run_mode.processes and config.partitioned and config.trainers > 1 and (
            not config.checkpoints or not config.max_restarts):
        warnings.append("--cache-mode partitioned does not replace a lost trainer (the rows only it held are lost "
                        "with it): without checkpoints and --max-restarts such a loss ends the job; "
                        "--checkpoint-every N lets it restart from the newest checkpoint")
    return warnings
