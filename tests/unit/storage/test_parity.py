"""Erasure-coded shards (storage.parity): the parity is the XOR of its members' bits whatever order deltas arrive
in; a lost shard is rebuilt bit for bit, optimizer state included; training through a loss equals training
without one, bit for bit; a second loss in a group is refused."""


import numpy as np
import pytest
import torch

from bagpipe.train.single import gather_tables, train_cached
from bagpipe.config import ModelConfig, TrainConfig
from bagpipe.data.binary import open_dataset
from bagpipe.optim import make_row_optimizer
from bagpipe.train.reference import build_model
from bagpipe.storage import RowStore
from bagpipe.storage.bits import row_bits
from bagpipe.storage.parity import ParityGroups, ParityRows, StandIn, TwoLossesInAGroup, read_member, reconstruct
from helpers.layouts import PARITY_SIZES, layout_of, member_bits, members


def test_the_parity_is_the_xor_of_its_members_whatever_order_deltas_arrive_in():
    rng = np.random.default_rng(0)
    stores = members()
    parity = ParityRows.of(stores)
    deltas = []
    for index, store in enumerate(stores):
        store.parity_sink = lambda local, delta, before, version, index=index: deltas.append(
            (index, local, delta, before, version))
    for version in range(40):
        for index, store in enumerate(stores):
            local = rng.choice(store.num_rows, size=int(rng.integers(1, 12)), replace=False)
            keys = local * 3 + index
            store.write_back(keys, torch.from_numpy(rng.standard_normal((len(keys), 4)).astype(np.float32)),
                             torch.from_numpy(rng.standard_normal((len(keys), 9)).astype(np.float32)), version=version)
    order = rng.permutation(len(deltas))
    repeats = rng.choice(len(deltas), size=30)  # write-backs retried after they had arrived: no-ops
    for i in [*order[: len(order) // 2], *repeats, *order[len(order) // 2:]]:
        parity.apply(*deltas[i])
    assert parity.pending_rows() == 0
    expected = np.zeros_like(parity.bits)
    for index, store in enumerate(stores):
        bits, versions = member_bits(store)
        expected[:store.num_rows] ^= bits
        assert (parity.versions[:store.num_rows, index] == versions).all()
    assert (parity.bits == expected).all()
    for lost in range(3):  # every member rebuilt from the others, bit for bit
        positions = np.arange(stores[lost].num_rows)
        bits, versions, consistent = reconstruct(lost, parity.read(positions), {
            index: read_member(store, positions) for index, store in enumerate(stores) if index != lost})
        assert consistent.all() and (bits == member_bits(stores[lost])[0]).all()
        assert (versions == member_bits(stores[lost])[1]).all()


def test_a_survivor_read_ahead_of_its_delta_is_not_mixed_in():
    stores = members("adagrad")
    parity = ParityRows.of(stores)
    held = []
    stores[1].parity_sink = lambda *delta: held.append(delta)  # this delta is still on its way
    stores[1].write_back(np.array([4, 10]), torch.ones(2, 4), torch.ones(2, 4), version=5)  # positions 1 and 3
    positions = np.arange(4)
    _, _, consistent = reconstruct(0, parity.read(positions), {
        index: read_member(stores[index], positions) for index in (1, 2)})
    assert consistent.tolist() == [True, False, True, False]  # changed on shard 1: to be read again
    parity.apply(1, *held[0])
    bits, _, consistent = reconstruct(0, parity.read(positions), {
        index: read_member(stores[index], positions) for index in (1, 2)})
    assert consistent.all() and (bits == member_bits(stores[0])[0][:4]).all()


def test_a_delta_ahead_of_an_earlier_one_of_its_row_waits_for_it():
    stores = members("sgd")
    parity = ParityRows.of(stores)
    deltas = []
    stores[2].parity_sink = lambda *delta: deltas.append(delta)
    for version in (3, 8):
        stores[2].write_back(np.array([5]), torch.full((1, 4), float(version)), torch.zeros(1, 0), version=version)
    parity.apply(2, *deltas[1])
    assert parity.pending_rows() == 1 and parity.versions[1, 2] == -1
    parity.apply(2, *deltas[0])
    assert parity.pending_rows() == 0 and parity.versions[1, 2] == 8
    assert (parity.read(np.array([1]))[0] == ParityRows.of(stores).read(np.array([1]))[0]).all()


def test_a_delta_folded_in_part_way_frees_one_that_arrived_before_it():
    stores = members("sgd")
    parity = ParityRows.of(stores)
    deltas = []
    stores[0].parity_sink = lambda *delta: deltas.append(delta)
    write = [(np.array([3]), 4), (np.array([0, 3]), 6), (np.array([0]), 8)]  # keys 0 and 3: positions 0 and 1
    for keys, version in write:
        stores[0].write_back(keys, torch.full((len(keys), 4), float(version)), torch.zeros(len(keys), 0),
                             version=version)
    generation = parity.generation
    parity.apply(0, *deltas[2])  # position 0 at 8: waits for 6
    parity.apply(0, *deltas[1])  # position 0 at 6 folds in, and frees it; position 1 at 6 waits for 4
    assert parity.versions[0, 0] == 8 and parity.versions[1, 0] == -1 and parity.pending_rows() == 1
    assert parity.generation > generation
    parity.apply(0, *deltas[0])
    assert parity.pending_rows() == 0 and (parity.bits == ParityRows.of(stores).bits).all()


def test_a_stand_in_serves_its_rows_while_rebuilt_and_ends_bit_for_bit_the_lost_shard():
    rng = np.random.default_rng(1)
    make = members("adam")
    groups = ParityGroups(lambda shard: make[shard] if shard < 3 else None, num_shards=3, k=3)
    twin = members("adam")  # the same writes, never lost
    for version in range(10):
        for shard in range(3):
            keys = rng.choice(PARITY_SIZES[0], size=5, replace=False) * 3 + shard
            keys = keys[keys < sum(PARITY_SIZES)]
            rows, state = (torch.from_numpy(rng.standard_normal((len(keys), n)).astype(np.float32)) for n in (4, 9))
            groups.members[shard].write_back(keys, rows, state, version=version)
            twin[shard].write_back(keys, rows, state, version=version)
        if version == 4:
            groups.make_store = lambda shard: members("adam")[shard]  # a fresh shard: its initial rows only
            groups.lose(1)
            assert isinstance(groups.members[1], StandIn)
    stand_in = groups.members[1]
    keys = np.array([1, 4, 7])
    rows, state = stand_in.fetch(keys, np.full(3, -1), timeout=1.0)
    want_rows, want_state, _ = twin[1].read(keys // 3)
    assert torch.equal(rows, want_rows) and torch.equal(state, want_state)
    assert 0 < stand_in.rows_reconstructed < twin[1].num_rows  # rebuilt as asked for, not all at once
    while groups.rebuild(max_rows=7):
        pass
    assert groups.members[1] is stand_in.store
    assert (member_bits(stand_in.store)[0] == member_bits(twin[1])[0]).all()
    assert (member_bits(stand_in.store)[1] == member_bits(twin[1])[1]).all()
    assert (groups.parities[0].bits == ParityRows.of(twin).bits).all()  # and the parity still covers the group


def test_a_second_loss_in_a_group_before_the_rebuild_is_refused_but_one_in_another_group_is_not():
    layout = layout_of(PARITY_SIZES, 4)
    row_optimizer = make_row_optimizer("sgd", lr=0.1)
    groups = ParityGroups(lambda shard: RowStore(layout=layout, space=0, optimizer=row_optimizer, seed=3,
                                                 shard=shard, num_shards=6), num_shards=6, k=3)
    groups.lose(1)
    groups.lose(4)  # group 1: covered
    with pytest.raises(TwoLossesInAGroup, match=r"shard 2 lost while shard 1 of the same parity group \(shards 0..2\)"
                                                r".*resume from the newest checkpoint"):
        groups.lose(2)
    groups.rebuild(max_rows=1 << 20)
    groups.lose(2)  # shard 1 is whole again: one loss in the group
    assert isinstance(groups.members[2], StandIn)


def test_groups_must_divide_the_shards():
    with pytest.raises(ValueError, match="4 data shards do not form groups of 3"):
        ParityGroups(lambda shard: None, num_shards=4, k=3)


@pytest.mark.parametrize("optimizer, losses, rebuild_rows", [
    ("sgd", {5: [1]}, 10), ("adagrad", {5: [0], 40: [2]}, 25), ("adam", {0: [2], 30: [1]}, 0),
    ("adam", {12: [4]}, 5)])
def test_training_through_lost_shards_equals_training_without_losses_bit_for_bit(small_binary, optimizer, losses,
                                                                                 rebuild_rows):
    split = open_dataset(small_binary).train
    num_shards = 6 if any(4 in shards for shards in losses.values()) else 3
    config = TrainConfig(data="-", run_dir="-", optimizer=optimizer, lr=0.05, seed=7,
                         model=ModelConfig(emb_dim=8, arch_mlp_bot="13-16-8", arch_mlp_top="16-1"))
    row_optimizer = make_row_optimizer(optimizer, lr=config.lr)
    results = []
    for parity, lost in ((0, None), (3, losses)):
        model = build_model(config, split.schema)
        layout = layout_of_split(split, config)
        stores = train_cached(model, row_optimizer.dense_optimizer(model.parameters()), split, layout=layout,
                              row_optimizer=row_optimizer, seed=config.seed, batch_size=64, iterations=50,
                              cache_rows=600, lookahead=4, num_shards=num_shards, parity=parity, losses=lost,
                              rebuild_rows=rebuild_rows)
        states = [row_bits(*store.read(np.arange(store.num_rows))[:2]) for space in stores for store in space]
        results.append((model.state_dict(), gather_tables(stores, layout), states))
    (model_a, tables_a, states_a), (model_b, tables_b, states_b) = results
    for got, want in zip(tables_b, tables_a, strict=True):
        assert torch.equal(got, want)
    assert all((a == b).all() for a, b in zip(states_a, states_b, strict=True))  # optimizer state too
    for name, value in model_a.items():
        assert torch.equal(model_b[name], value), name


def layout_of_split(split, config):
    from bagpipe.train.reference import build_tables
    return build_tables(config, split.schema).layout


def test_initial_parity_made_from_the_seed_equals_the_parity_of_the_initialised_shards():
    layout = layout_of(PARITY_SIZES, 4)
    for optimizer in ("sgd", "adam"):
        width = make_row_optimizer(optimizer, lr=0.1).state_width(4)
        made = ParityRows.initial(layout, 0, shards=[3, 4, 5], num_shards=6, state_width=width, seed=3)
        stores = [RowStore(layout=layout, space=0, optimizer=make_row_optimizer(optimizer, lr=0.1), seed=3, shard=s,
                           num_shards=6) for s in (3, 4, 5)]
        of = ParityRows.of(stores)
        assert (made.bits == of.bits).all() and (made.versions == of.versions).all()


def test_row_bits_of_no_rows_and_of_no_state():
    """A write-back that brings nothing new (a repeat at a stand-in) and SGD's empty state have bits too."""
    from bagpipe.storage.bits import row_bits

    assert row_bits(np.zeros((0, 4), np.float32), np.zeros((0, 9), np.float32)).shape == (0, 13)
    assert row_bits(torch.ones(3, 4), torch.zeros(3, 0)).shape == (3, 4)
