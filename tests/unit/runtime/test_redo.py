"""A lost trainer's shares of the gradient sums, computed again from what a surviving trainer kept (runtime/redo.py).

Two trainers are carried out in one process, as the runtime does (the plan's steps on one cache per space, each
trainer's slice from the oracle's messages); what trainer 1 sent is compared with what a fresh model computes
again from trainer 0's log, for the iteration under way and for the one before (after its step).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bagpipe.cache import BatchRows, BatchView, RowCache, StepTables, batch_view
from bagpipe.train.single import carry_out
from bagpipe.config import ModelConfig, TrainConfig
from bagpipe.data.batches import iterate_batches
from bagpipe.data.binary import open_dataset
from bagpipe.embeddings import valid_keys
from bagpipe.optim import make_row_optimizer
from bagpipe.planner import PlannerConfig, plan_spaces
from bagpipe.preflight import cache_rows_of, job_layout
from bagpipe.train.reference import build_model
from bagpipe.runtime.protocol import slice_messages
from bagpipe.runtime.redo import REDO_DEPTH, RedoLog, Shares, recompute, slice_shares
from bagpipe.storage import RowStore

TRAINERS, BATCH, ITERATIONS = 2, 64, 8


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def assert_same_shares(ours: Shares, theirs: Shares, what: str) -> None:
    assert same_bits(ours.early, theirs.early), f"{what}: early parameters' gradients differ"
    assert same_bits(ours.main, theirs.main), f"{what}: the blocking sum's operand differs"
    assert len(ours.later) == len(theirs.later)
    for space, (a, b) in enumerate(zip(ours.later, theirs.later)):
        assert same_bits(a, b), f"{what}: space {space}'s later rows' gradients differ"


def split_params(model):
    early = list(model.early_params())
    return early, [p for p in model.parameters() if all(p is not q for q in early)]


@pytest.mark.parametrize("model, optimizer, cache_rows", [
    (ModelConfig(emb_dim=8, arch_mlp_bot="13-16-8", arch_mlp_top="16-1"), "adagrad", 600),
    # two spaces (factors and first-order weights), and dropout keyed by the trainer
    (ModelConfig(name="deepfm", emb_dim=8, deep_mlp="16-16", dropout=0.3), "adam", 1100),
])
def test_a_lost_trainers_shares_computed_again_from_a_survivors_log_are_its_own_bit_for_bit(small_binary, model,
                                                                                             optimizer, cache_rows):
    config = TrainConfig(data=str(small_binary), run_dir="unused", model=model, optimizer=optimizer, lr=0.05, seed=3,
                         batch_size=BATCH, iterations=ITERATIONS, cache_rows=cache_rows, trainers=TRAINERS)
    dataset = open_dataset(small_binary)
    layout = job_layout(config, dataset)
    row_optimizer = make_row_optimizer(optimizer, lr=config.lr)
    torch.manual_seed(config.seed)
    survivor = build_model(config, dataset.schema)  # trainer 0 and 1 hold the same weights: one model for both
    scratch = build_model(config, dataset.schema)  # the replacement's, its own initial weights overwritten
    dense_optimizer = row_optimizer.dense_optimizer(survivor.parameters())
    early, late = split_params(survivor)
    scratch_early, scratch_late = split_params(scratch)
    log = RedoLog(list(survivor.parameters()))
    shares_of = cache_rows_of(config, layout)
    caches = [RowCache(capacity=share, dim=space.dim, optimizer=row_optimizer)
              for space, share in zip(layout.spaces, shares_of)]
    stores = [[RowStore(layout=layout, space=s, optimizer=row_optimizer, seed=config.seed)]
              for s in range(len(layout.spaces))]
    planners = [PlannerConfig(num_rows=space.num_rows, cache_rows=share, lookahead=10, num_trainers=TRAINERS)
                for space, share in zip(layout.spaces, shares_of)]
    batches = list(iterate_batches(dataset.train, batch_size=BATCH, iterations=ITERATIONS))
    before = None  # the previous iteration: (trainer 1's message, what it sent)
    checked = 0
    evicted = 0
    matrices = [layout.keys(b.ids.numpy()) for b in batches]
    for steps in plan_spaces(([valid_keys(k) for k in m] for m in matrices), planners, inverse=True):
        iteration = steps[0].iteration
        for s, step in enumerate(steps):
            carry_out(step, caches[s], stores[s], dim=layout.spaces[s].dim, row_optimizer=row_optimizer, timeout=5.0)
            evicted += len(step.evict_keys)
        if iteration == ITERATIONS:
            break
        views = [batch_view(step, keys) for step, keys in zip(steps, matrices[iteration])]
        messages = slice_messages(iteration, steps, views, batches[iteration], TRAINERS)
        sent = []
        for part, message in enumerate(messages):
            step_views = [BatchView(s.batch_keys.numpy(), s.batch_slots.numpy(), s.num_now, s.positions)
                          for s in message.spaces]
            embeddings, lookups = StepTables(caches, step_views, layout).lookup(message.ids)
            sent.append(slice_shares(survivor, message, embeddings, lookups, seed=config.seed, part=part,
                                     early=early, late=late))
            if part == 0:
                log.keep(iteration, lookups)
        # trainer 1 lost: its shares of this iteration, and of the one before (whose step is done by now)
        assert_same_shares(recompute(scratch, log.kept(iteration), messages[1], layout, seed=config.seed, part=1,
                                     early=scratch_early, late=scratch_late), sent[1], f"iteration {iteration}")
        if before is not None:
            assert_same_shares(recompute(scratch, log.kept(iteration - 1), before[0], layout, seed=config.seed,
                                         part=1, early=scratch_early, late=scratch_late), before[1],
                               f"iteration {iteration - 1}, after its step")
            checked += 1
        assert not same_bits(sent[0].main, sent[1].main)  # the slices differ: a wrong part would be seen
        # the sums over trainers, in trainer order, applied as the trainers do
        with torch.no_grad():
            main = (sent[0].main + sent[1].main) / TRAINERS
            dense = sum(p.numel() for p in late) + 1
            offset = 0
            for p in late:
                p.grad = main[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            early_mean = (sent[0].early + sent[1].early) / TRAINERS
            offset = 0
            for p in early:
                p.grad = early_mean[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            dense_optimizer.step()
            offset = dense
            for space, (cache, step) in enumerate(zip(caches, messages[0].spaces)):
                now, dim = step.num_now, layout.spaces[space].dim
                cache.apply(step.batch_slots[:now], main[offset:offset + now * dim].view(-1, dim))
                offset += now * dim
                cache.apply(step.batch_slots[now:], (sent[0].later[space] + sent[1].later[space]) / TRAINERS)
        before = (messages[1], sent[1])
    assert checked == ITERATIONS - 1 and evicted > 0  # rows moved through the cache meanwhile
    assert log.iterations() == list(range(ITERATIONS - REDO_DEPTH, ITERATIONS))
    with pytest.raises(KeyError, match="not kept"):
        log.kept(ITERATIONS - REDO_DEPTH - 1)


def test_the_log_copies_the_parameters_so_a_step_after_it_does_not_change_what_it_kept():
    model = torch.nn.Linear(3, 2)
    log = RedoLog(list(model.parameters()), depth=2)
    values = []
    for iteration in range(4):
        log.keep(iteration, [])
        values.append([p.detach().clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    for iteration in (2, 3):
        kept = log.kept(iteration)
        assert all(torch.equal(a, b) for a, b in zip(kept.params, values[iteration]))
    assert np.array_equal(log.iterations(), [2, 3])


def test_the_oracle_keeps_a_trainers_messages_from_before_its_last_step_and_tells_the_rows_written_by_all(
        small_binary):
    from bagpipe.runtime.protocol import StepMessage
    from bagpipe.runtime.world import World
    from helpers.feeds import feed_of

    config = TrainConfig(data=str(small_binary), run_dir="unused", batch_size=BATCH, iterations=40, trainers=2,
                         model=ModelConfig(emb_dim=8, arch_mlp_bot="13-16-8", arch_mlp_top="16-1"))
    oracle = feed_of(config, World(rank=0, world_size=4, num_trainers=2), open_dataset(small_binary))
    for iteration in range(12):
        for out in oracle.queues:
            out.put(StepMessage(iteration=iteration, final=False, dense_x=None, ids=None, target=None, spaces=[]))

    def iterations(pulled):
        return [m.iteration for m in pulled.messages]

    assert iterations(oracle.pull(0, -1, 8, -1, -1)) == list(range(8))
    assert iterations(oracle.pull(0, -1, 8, -1, -1)) == list(range(8))  # an answer lost: the same again
    assert iterations(oracle.pull(0, 7, 8, 5, 4)) == [8, 9, 10, 11]
    # trainer 0 stepped 5: a replacement for it may need iterations 5 - REDO_DEPTH + 1 on, and gets them
    first = 5 - REDO_DEPTH + 1
    assert iterations(oracle.pull(0, first - 1, 8, 5, 4)) == list(range(first, 12))
    with pytest.raises(RuntimeError, match=f"from iteration {first - 1} are no longer kept"):
        oracle.pull(0, first - 2, 8, 5, 4)
    # trainer 1 has not said how far its write-backs are acknowledged: none are, for all the oracle knows
    assert oracle.pull(0, 11, 8, 9, 8).written_by_all == -1
    assert oracle.pull(1, -1, 8, 2, 3).written_by_all == 3
    assert oracle.pull(1, 7, 8, 7, 6).written_by_all == 6
    assert oracle.pull(1, 7, 8, 3, 2).written_by_all == 6  # a late pull does not take it back


def test_written_back_is_the_version_every_write_back_is_acknowledged_to():
    from bagpipe.runtime.trainer.runtime import WrittenBack

    written = WrittenBack(start=0)
    assert written.through() == -1
    written.sending(3)
    written.sending(3)
    written.sending(4)
    written.boundary(4)
    assert written.through() == 2
    written.acknowledged(3)
    assert written.through() == 2  # one of version 3 is still in flight
    written.acknowledged(4)
    assert written.through() == 2
    written.acknowledged(3)
    assert written.through() == 4
    written.boundary(5)  # a boundary with nothing of this trainer's to write back
    assert written.through() == 5


def test_survivors_agree_on_the_union_of_their_unfinished_sums_in_start_order_and_the_furthest_gives():
    """Three trainers, trainer 2 lost: trainer 0 failed in iteration 7's main sum (its later sums of 6 still in flight),
    trainer 1 finished that one and failed in 8's main sum (one iteration on). Every unfinished sum of either is done
    again, in the order every trainer started them; trainer 1, further on, holds the inputs of 6, 7 and 8."""
    from bagpipe.runtime.redo import agree_on_sums

    entries = {0: {"sums": [["later", 6, 1], ["early", 7, None], ["main", 7, None], ["later", 7, 0]], "reached": 7},
               1: {"sums": [["later", 7, 0], ["early", 8, None], ["main", 8, None], ["later", 8, 1]], "reached": 8}}
    union, donor = agree_on_sums(entries)
    assert union == [("later", 6, 1), ("early", 7, None), ("main", 7, None), ("later", 7, 0), ("early", 8, None),
                     ("main", 8, None), ("later", 8, 1)]
    assert donor == 1 and entries[donor]["reached"] - REDO_DEPTH < min(what[1] for what in union)
    assert agree_on_sums({1: {"sums": [], "reached": 4}, 0: {"sums": [], "reached": 4}})[1] == 0  # a tie: the lowest
    assert agree_on_sums({0: entries[0]})[0] == [tuple(what) for what in entries[0]["sums"]]  # two trainers: its own


def test_the_feed_counts_its_planners_time_apart_from_its_reading_and_every_id_it_plans(small_binary):
    """The producer's CPU is split into the planner's steps and the reading of the batches they plan (the reading
    happens inside the planner's iteration: it is taken out), and the ids planned are those the messages carry."""
    import threading

    from bagpipe.runtime.world import World
    from helpers.feeds import feed_of

    config = TrainConfig(data=str(small_binary), run_dir="unused", batch_size=BATCH, iterations=12, trainers=2,
                         cache_rows=4000,
                         model=ModelConfig(emb_dim=8, arch_mlp_bot="13-16-8", arch_mlp_top="16-1"))
    feed = feed_of(config, World(rank=0, world_size=4, num_trainers=2), open_dataset(small_binary))
    producer = threading.Thread(target=feed.produce)
    producer.start()
    pulled = {0: [], 1: []}
    while not all(got and got[-1].final for got in pulled.values()):
        for trainer, got in pulled.items():
            if not (got and got[-1].final):
                got += feed.pull(trainer, got[-1].iteration if got else -1, 8).messages
    producer.join()
    figures = feed.figures
    assert figures.iterations == 13  # the 12 iterations and the final flush
    assert figures.ids == sum(message.lookups for message in pulled[0]) > 12 * BATCH
    assert figures.planner_cpu_s > 0 and figures.read_cpu_s > 0
    assert figures.thread_cpu_s >= figures.planner_cpu_s + figures.read_cpu_s
    figures.end()
    summary = figures.summary()
    assert summary["oracle_ms_per_iteration"]["planner"] == pytest.approx(1e3 * figures.planner_cpu_s / 13, abs=1e-3)
    assert summary["planned_ids_per_planner_s"] == round(figures.ids / figures.planner_cpu_s)


@pytest.mark.parametrize("trainers", [2, 3])
def test_messages_cut_from_the_planners_places_equal_those_searched(small_binary, trainers):
    """The oracle's messages place each trainer's ids by cutting its rows out of the whole batch's places (the
    planner's, ``plan_spaces(..., inverse=True)``): the places a search of each slice's ids finds (BatchRows)."""
    config = TrainConfig(data=str(small_binary), run_dir="unused", batch_size=BATCH * 3, iterations=ITERATIONS,
                         cache_rows=1600, trainers=trainers)
    dataset = open_dataset(small_binary)
    layout = job_layout(config, dataset)
    planners = [PlannerConfig(num_rows=space.num_rows, cache_rows=share, lookahead=4, num_trainers=trainers)
                for space, share in zip(layout.spaces, cache_rows_of(config, layout))]
    batches = list(iterate_batches(dataset.train, batch_size=BATCH * 3, iterations=ITERATIONS))
    matrices = [layout.keys(b.ids.numpy()) for b in batches]
    rows = [BatchRows() for _ in layout.spaces]
    compared = 0
    for steps in plan_spaces(([valid_keys(k) for k in m] for m in matrices), planners, inverse=True):
        iteration = steps[0].iteration
        batch = batches[iteration] if iteration < ITERATIONS else None
        views = [batch_view(step, None if batch is None else keys)
                 for step, keys in zip(steps, matrices[min(iteration, ITERATIONS - 1)])]
        for space_rows, view in zip(rows, views):
            space_rows.load(view)
        messages = slice_messages(iteration, steps, views, batch, trainers)
        for trainer, message in enumerate(messages):
            slice_keys = None if batch is None else layout.keys(batch.slices(trainers)[trainer].ids.numpy())
            for s, space in enumerate(message.spaces):
                assert torch.equal(space.batch_keys, torch.from_numpy(views[s].keys))
                assert (space.positions is None) == (batch is None)
                if batch is not None:
                    searched = rows[s].at(slice_keys[s]).positions
                    assert space.positions.dtype == torch.int32
                    assert torch.equal(space.positions, torch.from_numpy(searched))
                    compared += 1
    assert compared == ITERATIONS * trainers * len(layout.spaces)
