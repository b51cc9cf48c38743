"""The oracle role's process (``bagpipe oracle``): host the job's store, settle the job with every role (or take
over a lost oracle's), build the ``Oracle`` in the RPC world, feed the trainers to the end, write the run's
results.

The oracle reads the data in order, plans, and hands every trainer its slice and its plan (oracle/feed.py). When
every trainer has reported done, each server writes its shard to disk (no process ever holds every table); the
oracle evaluates the model from there, reading only each test batch's rows, and streams it table by table into
the run dir's ``model/`` (oracle/summary.py; ``--eval-every``: also from checkpoints during training, in the
background).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time

from bagpipe.train.checkpoints import discard_after, valid_checkpoints
from bagpipe.config import ModelConfig, TrainConfig, config_to_dict
from bagpipe.models import IMPLIED, complete_model
from bagpipe.data.batches import planned_iterations
from bagpipe.data.binary import BinaryDataset
from bagpipe.data.schema import original_table_sizes, with_table_sizes
from bagpipe.faults import inject_fault
from bagpipe.preflight import cache_rows_of, check_job, check_same_batches, claim, job_layout, prepare_data
from bagpipe.train.reference import deterministic
from bagpipe.rundir import RunDir
from bagpipe.runlock import lock_run_dir
from bagpipe.runtime import transport
from bagpipe.runtime.agree import Given, agree, agree_table_sizes
from bagpipe.runtime.endpoints import SERVER, TRAINER
from bagpipe.runtime.names import EPOCH_KEY, JOB_KEY, JOINING_PREFIX, LOST_AT_PREFIX, STOP_KEY, TRAINED
from bagpipe.runtime.liveness import Liveness
from bagpipe.runtime.oracle.feed import Sent
from bagpipe.runtime.oracle.service import Oracle
from bagpipe.runtime.oracle.summary import finish
from bagpipe.runtime.protocol import JobInfo, schema_dict
from bagpipe.runtime.redo import REDO_DEPTH
from bagpipe.runtime.succession import Failure, JobRecord, NotReplaceable, RecordKeeper, load_record, replayed_from
from bagpipe.runtime.world import (Epochs, World, host_store, init_rpc, job_world, publish_status, read_hellos,
                                   refuse_job, store_served_apart, wait_for_ranks)

log = logging.getLogger(__name__)

# what a lost server adds to the run's figures (its own were lost with it)
LOST_SERVER_DUMP = {"bytes_sent": 0, "fetches": 0, "fetches_waited": 0, "rows_written": 0, "storage": {},
                    "peak_rss_bytes": 0, "cpu_s": 0.0, "lost": True}
FINAL_ROWS = "final-rows.tmp"  # the servers' shards after the last iteration, until model/ holds them


def run_oracle(config: TrainConfig, world: World, *, overwrite: bool = False, prepared: bool = False,
               given: dict | None = None, resume: bool = False) -> dict:
    """Plan and feed the whole job; return the summary it writes to the run dir.

    ``prepared``: the local launcher has converted the data, checked the job and claimed the run dir.
    ``given``: the settings the oracle's command line gave (runtime.agree), agreed with every other
    role's at check-in; the job then runs with the agreed ones. A process started while the local launcher
    awaits a replacement for the job's lost oracle takes the job over instead (``take_over_job``).
    """
    started_at = time.time()
    deterministic()
    # The run dir is this job's while the oracle lives (a local launcher holds the lock for all its roles).
    with contextlib.nullcontext() if prepared else lock_run_dir(config.run_dir):
        # 1. the store first: the other roles check in, and wait while the data is converted and checked
        store, world = host_store(world)
        # 2. the job settled with every role, or taken over from a lost oracle; the Oracle in the RPC world
        if world.epoch:
            oracle = take_over_job(world, store)
        else:
            oracle = start_job(config, world, store, overwrite=overwrite, prepared=prepared, given=given,
                               resume=resume, started_at=started_at)
        # 3. answer the other roles (requests that came sooner waited for it), feed the job to its end
        transport.serve("oracle", oracle)
        return run_job(oracle)


def job_info(config: TrainConfig, world: World, dataset: BinaryDataset, *, resume: tuple[str, int] | None,
             scripts: bool) -> JobInfo:
    """The job every role runs: ``config`` over ``dataset`` with ``world``'s trainers, from checkpoint ``resume``
    (name, boundary) if given. ``scripts``: the trainers are scripts (``init_cache``), whose model is their own, so
    no share of it can be computed again (a lost trainer is not replaced)."""
    iterations = planned_iterations(config, dataset.train)
    if config.batch_size % world.num_trainers:
        raise ValueError(f"batch_size {config.batch_size} is not a multiple of the {world.num_trainers} trainers")
    layout = job_layout(config, dataset)
    if config.trainers != world.num_trainers:  # (a hand-started job's: its trainers are the world's)
        config = dataclasses.replace(config, trainers=world.num_trainers)
    partitioned = config.partitioned
    if partitioned and config.replace_trainers and world.num_trainers >= 2:
        log.info("--cache-mode partitioned: a lost trainer is not replaced while training goes on (the rows only it "
                 "held are lost with it): the job restarts from its newest checkpoint instead (--max-restarts)")
    return JobInfo(config=config, schema=schema_dict(dataset.schema), tables=[t.to_dict() for t in layout.tables],
                   iterations=iterations, cache_rows=cache_rows_of(config, layout),
                   slice_size=config.batch_size // world.num_trainers, resume=resume[0] if resume else None,
                   start=resume[1] if resume else 0,
                   replace_trainers=(config.replace_trainers and world.num_trainers >= 2 and not scripts
                                     and not partitioned),
                   replace_oracle=store_served_apart() and config.replace_oracle,
                   raw_ids=dataset.numbering is not None)


def start_job(config: TrainConfig, world: World, store, *, overwrite: bool, prepared: bool, given: dict | None,
              resume: bool, started_at: float) -> Oracle:
    """The job's first oracle: every role checked in, their settings agreed, the data checked and the job published;
    in the RPC world."""
    liveness = Liveness(world, watch=list(range(1, world.world_size)))
    publish_status(store, f"preparing the data in {config.data}")
    dataset = prepare_data(config)
    inject_fault("data ready")
    publish_status(store, "waiting for every role to check in")
    wait_for_ranks(world, store)
    hellos = read_hellos(world, store)
    checkpoint = None
    try:
        config, dataset = settle(config, dataset, world, given or {}, hellos)
        if resume:
            check_same_batches(config, dataset)
            checkpoint = resume_point(config, world)
            for warning in check_job(config, dataset):
                log.warning("%s", warning)
        elif not prepared:
            claim(config, dataset, overwrite=overwrite)
        world = job_world(world, config)
        job = job_info(config, world, dataset, resume=checkpoint,
                       scripts=any(hello["given"].get("kind") == "script" for hello in hellos.values()))
    except ValueError as err:
        refuse_job(store, str(err))
        raise
    run = RunDir(config.run_dir, append=resume)
    if resume:
        discard_after(config.run_dir, job.start)
        run.forget_metrics_after(job.start)
        log.info("resuming %s from its checkpoint at iteration %d", config.run_dir, job.start)
    run.write_json("config.json", config_to_dict(config))
    log.info("bagpipe job: %s, %d iterations of %d samples over %d trainers, %d servers; cache %d of %d rows, "
             "lookahead %d, policy %s", config.model.name, job.iterations, config.batch_size, world.num_trainers,
             world.num_servers, sum(job.cache_rows), job.layout.num_rows, config.lookahead, config.policy)
    keeper = RecordKeeper(JobRecord(started_at=started_at), store=store)
    keeper.save()
    store.set(JOB_KEY, job.to_json())
    init_rpc(world, store)
    oracle = Oracle(config, world, dataset, job, store=store, run=run, liveness=liveness, epochs=Epochs(world, store),
                    keeper=keeper)
    liveness.recover = functools.partial(oracle.replacements.lose_peer, store=store)
    return oracle


def take_over_job(world: World, store) -> Oracle:
    """A replacement for the job's lost oracle (the local launcher's store outlived it): read the job and its record,
    re-form the RPC world around this process, ask every trainer how far it is and take over the checkpoints the
    lost oracle had begun; the producer then plans again from the start (a pure function of the data and the
    configuration), sending each trainer only what it does not have. NotReplaceable if the job cannot be taken
    over (the launcher then restarts it from its newest checkpoint)."""
    epoch = world.epoch
    lost_at = float(store.get(f"{LOST_AT_PREFIX}0")) if store.check([f"{LOST_AT_PREFIX}0"]) else time.time()
    record = load_record(store) if store.check([JOB_KEY]) else None
    if record is None:
        raise NotReplaceable("the lost oracle had not started the job yet")
    why = record.why_not_replaceable(world) or ("training had ended" if store.check([STOP_KEY]) else None)
    if why:
        raise NotReplaceable(f"the lost oracle cannot be replaced: {why}")
    job = JobInfo.from_json(store.get(JOB_KEY).decode())
    config = job.config
    world = job_world(world, config)
    liveness = Liveness(world, watch=list(range(1, world.world_size)))
    dataset = prepare_data(config, show_progress=False)
    if dataset.schema != job.layout.schema:  # the table sizes the roles agreed on
        dataset = dataset.with_schema(job.layout.schema)
    record.failures.append(failure := Failure(role="oracle", rank=0, at=lost_at, epoch=epoch, replaced=True))
    reformed = list(record.reformed)
    started = time.perf_counter()
    store.set(f"{JOINING_PREFIX}0", str(epoch))
    store.set(EPOCH_KEY, str(epoch))  # every other process leaves its RPC world for this one
    init_rpc(world, store, epoch=epoch)
    reformed.append({"epoch": epoch, "seconds": round(time.perf_counter() - started, 3)})
    failure.joined_in_s = round(time.time() - lost_at, 3)
    epochs = Epochs(world, store)
    progress = [epochs.call(World.trainer_name(t), TRAINER.progress) for t in range(world.num_trainers)]
    sent = Sent(before=[p["after"] for p in progress], finished=[p["finished"] for p in progress],
                written=[p["written"] for p in progress],
                first=replayed_from(progress, start=job.start, redo_depth=REDO_DEPTH))
    failure.planned_iteration = max(sent.before)  # (at least: what the lost oracle had sent)
    failure.replayed_iterations = max(sent.before) + 1 - job.start
    oracle = Oracle(config, world, dataset, job, store=store, run=RunDir(config.run_dir, append=True),
                    liveness=liveness, epochs=epochs, keeper=RecordKeeper(record, store=store), takeover=failure,
                    sent=sent, reformed_before=reformed)
    oracle.save_record()
    liveness.recover = functools.partial(oracle.replacements.lose_peer, store=store)
    log.warning("the job's lost oracle is replaced (RPC world %d, %.2f s after the loss): trainers have plans up to "
                "iterations %s; planning again from iteration %d", epoch, failure.joined_in_s,
                ", ".join(map(str, sent.before)), job.start)
    return oracle


def run_job(oracle: Oracle) -> dict:
    """Feed the trainers to the end, gather the final rows (the servers write them) and write the run's results;
    the summary."""
    config, world, run, store = oracle.config, oracle.world, oracle.run, oracle.store
    epochs, liveness, replacements = oracle.epochs, oracle.liveness, oracle.replacements
    producer = threading.Thread(target=oracle.feed.produce, name="planner", daemon=True)
    producer.start()
    final_dir = run.path / FINAL_ROWS
    try:
        oracle.state.wait_for_trainers()
        producer.join(timeout=world.timeout)  # (it has sent every plan: the trainers pulled the final one)
        oracle.feed.figures.end()
        inject_fault("trainers reported")
        final_rows = oracle.checkpoints.write_final(oracle.iterations, final_dir)
        for failure in replacements.replacing.values():  # its rows are on its group's servers: not needed
            log.warning("training ended before %s's replacement was whole: the run goes without it", failure.role)
        latest = {f.server: f for f in replacements.failures if f.server is not None}  # a server's last loss
        lost = {server for server, f in latest.items() if not f.replaced}  # (and not back)
        if config.parity and config.check_parity:
            check_parity(world, epochs, skip=lost)
        shards = [LOST_SERVER_DUMP if s in lost else epochs.call(World.server_name(s), SERVER.dump)
                  for s in range(world.num_servers)]
    finally:
        oracle.state.stop.set()
        replacements.join_helpers(timeout=world.timeout)
    # Everything the run needs is here now: a role lost from here on costs nothing (the launcher reads STOP_KEY).
    run.log_metrics(event=TRAINED, iteration=oracle.iterations)
    liveness.fatal = False
    store.set(STOP_KEY, "1")
    others = list(range(1, world.world_size))
    staying = liveness.wait_until_gone(others, timeout=world.timeout)
    if staying:
        log.warning("%s still there %.0f s after the end", ", ".join(world.label(r) for r in staying), world.timeout)
    epochs.stop()
    liveness.stop()
    transport.shutdown_rpc()  # every role has left: no request is in flight
    return finish(oracle, run, shards, final_rows, final_dir)


def check_parity(world: World, epochs: Epochs, *, skip: set[int] = frozenset()) -> None:
    """Have every parity server (but those ``skip``ped: lost) compare its parity with its group's rows (every
    write-back has landed): a mismatch fails the run, naming the server and the rows."""
    for index in range(world.num_shards, world.num_servers):
        if index in skip:
            continue
        checked = epochs.call(World.server_name(index), SERVER.check_parity, timeout=4 * world.timeout)
        if any(checked["mismatched_rows"]):
            raise RuntimeError(f"the parity on server {index} differs from its group's rows at "
                               f"{sum(checked['mismatched_rows'])} of {sum(checked['rows'])} positions")
        log.info("parity on server %d matches its group's rows (%d positions)", index, sum(checked["rows"]))


def resume_point(config: TrainConfig, world: World) -> tuple[str, int]:
    """The newest valid checkpoint of the run (name, boundary); a ValueError if it cannot be continued."""
    found = valid_checkpoints(config.run_dir, newest_only=True)
    if not found:
        raise ValueError(f"--resume: {config.run_dir} has no valid checkpoint to resume from (a run checkpoints with "
                         f"--checkpoint-every N or --checkpoint-every-s S)")
    directory, chain = found[0]
    trainers = chain[-1]["extra"].get("trainers")
    if trainers != world.num_trainers:
        raise ValueError(f"--resume: the checkpoint {directory} was taken with {trainers} trainers, this job has "
                         f"{world.num_trainers}: the gradients' sums, and so the result, depend on it")
    return directory.name, chain[-1]["iteration"]


def settle(config: TrainConfig, dataset: BinaryDataset, world: World, given: dict,
           hellos: dict[int, dict]) -> tuple[TrainConfig, BinaryDataset]:
    """The job as every role's settings agree on it: ``config`` with the agreed values, and the data
    under the agreed table sizes."""
    givens = [Given("the oracle (rank 0)", given)]
    givens += [Given(f"{world.label(rank)} (rank {rank})", hello["given"]) for rank, hello in sorted(hellos.items())]
    agreed = agree(givens)
    if agreed.get("kind") == "script" and (config.checkpoints or config.eval_every):
        raise ValueError("checkpoints during training (and --eval-every, which evaluates them) need bagpipe's "
                         "trainers: these trainers are scripts (init_cache), which send no part of a checkpoint")
    if dataset.numbering is not None and "table_sizes" in agreed:
        raise ValueError(f"{next(g.label for g in givens if 'table_sizes' in g.settings)} gives table sizes, but "
                         f"{config.data} holds raw ids, whose tables have the rows the run's batches make: leave the "
                         f"table sizes out (--emb-info-file, ln_emb)")
    inferred = dataset.meta.get("made_from", {}).get("table_sizes_from") == "inferred"
    sizes = agree_table_sizes(agreed.get("table_sizes"), original_table_sizes(dataset.schema), inferred=inferred,
                              where=next(g.label for g in givens if "table_sizes" in g.settings)
                              if "table_sizes" in agreed else "the oracle")
    if sizes != original_table_sizes(dataset.schema):
        dataset = dataset.with_schema(with_table_sizes(dataset.schema, sizes))
    model = {name.removeprefix("model."): value for name, value in agreed.items() if name.startswith("model.")}
    if "emb_dim" in agreed:
        model["emb_dim"] = agreed["emb_dim"]
    model = {**{f.name: getattr(config.model, f.name) for f in dataclasses.fields(ModelConfig)
                if f.name not in IMPLIED}, **complete_model(model)}
    train = {name: agreed[name] for name in ("cache_rows", "lookahead", "optimizer", "lr") if name in agreed}
    return dataclasses.replace(config, model=ModelConfig(**model), **train), dataset

