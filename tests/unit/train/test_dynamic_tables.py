"""Tables that grow with the data (embeddings.dynamic): raw-id data trains with a row made for each key the run's
batches look up, the same rows in --mode reference and --mode single, bit for bit, and through a resume."""

import json

import numpy as np
import pytest
import torch

from bagpipe.data.binary import open_dataset
from bagpipe.data.batches import Batch, batch_rows
from bagpipe.embeddings.dynamic import DEFAULT_KEY, RowNumbering, init_keyed
from bagpipe.rundir import export
from bagpipe.train.reference import train_reference
from helpers.jobs import exports_equal, small_config
from helpers.raw_ids import arriving_raw_data, cut_and_resumed


def test_a_keys_initial_row_is_a_function_of_seed_table_and_key_alone():
    keys = np.array([5, 2**62 + 7, 11, DEFAULT_KEY], dtype=np.uint64)
    rows = init_keyed(keys, seed=1, table=3, dim=8, num_rows=100)
    assert torch.equal(init_keyed(keys[[2, 0]], seed=1, table=3, dim=8, num_rows=100), rows[[2, 0]])  # alone
    assert rows.dtype == torch.float32 and rows.abs().max() <= 0.1 and len(torch.unique(rows)) == rows.numel()
    for other in (dict(seed=2, table=3), dict(seed=1, table=4)):
        assert not torch.equal(init_keyed(keys, dim=8, num_rows=100, **other), rows)
    normal = init_keyed(np.arange(4000), seed=0, table=0, dim=16, num_rows=1, init="normal")
    assert abs(float(normal.std()) - 1 / 16) < 0.005 and abs(float(normal.mean())) < 0.002
    assert not init_keyed(keys, seed=1, table=3, dim=8, num_rows=100, init="zeros").any()
    many = np.arange(3 * 2**16 + 5, dtype=np.uint64)  # drawn in chunks: each row as if drawn alone
    assert torch.equal(init_keyed(many, seed=1, table=3, dim=2, num_rows=9)[[7, 2**16 + 1, -1]],
                       init_keyed(many[[7, 2**16 + 1, -1]], seed=1, table=3, dim=2, num_rows=9))


class FakeSplit:
    def __init__(self, ids):
        self.ids, self.rows = np.asarray(ids, dtype=np.int64), len(ids)


def test_rows_are_made_in_the_order_keys_are_first_looked_up_and_evaluations_see_those_made_so_far():
    split = FakeSplit([[90, 7], [40, 7], [90, 8], [60, 9], [40, 5], [10, 5]])
    numbering = RowNumbering.of_run(split, [slice(0, 2), slice(2, 4), np.array([4, 5])])
    assert numbering.rows_made == [4, 4] and numbering.table_rows == [5, 5]
    np.testing.assert_array_equal(numbering.numbered(split.ids), [[1, 1], [2, 1], [1, 2], [3, 3], [2, 4], [4, 4]])
    np.testing.assert_array_equal(numbering.row_keys(0), [DEFAULT_KEY, 90, 40, 60, 10])
    assert numbering.made_by(1) == [2, 1] and numbering.made_by(2) == [3, 3] and numbering.made_by(3) == [4, 4]
    # a key no batch looks up, and (as of iteration 1) a key whose row is made later: the default row
    np.testing.assert_array_equal(numbering.numbered([[60, 7], [33, 9]], as_of=1), [[0, 1], [0, 0]])
    np.testing.assert_array_equal(numbering.numbered([[60, 7], [33, 9]]), [[3, 1], [0, 3]])


def test_admission_makes_a_keys_row_at_the_batch_that_brings_its_look_ups_to_the_minimum_count():
    split = FakeSplit([[90], [40], [90], [40], [60], [40], [10], [10], [60], [90]])
    selectors = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8), slice(8, 10)]
    numbering = RowNumbering.of_run(split, selectors, min_count=2)
    # 90 and 40 reach two look-ups at iteration 1 (90 first in the batch), 10 at 3, 60 at 4
    assert numbering.rows_made == [4] and [list(m) for m in numbering.made_at] == [[1, 1, 3, 4]]
    np.testing.assert_array_equal(numbering.row_keys(0), [DEFAULT_KEY, 90, 40, 10, 60])
    # a model kept after iteration 3 holds the keys of the rows made before it (the others: -1, the default row's)
    np.testing.assert_array_equal(numbering.stored_row_keys(as_of=3)[0], [-1, 90, 40, -1, -1])
    batches = [Batch(dense_x=torch.zeros(2, 1), ids=torch.from_numpy(numbering.numbered(split.ids[rows])),
                     target=torch.zeros(2)) for rows in selectors]  # (as the numbered train split reads them)
    seen = [batch.ids[:, 0].tolist() for batch in numbering.as_made(batches, start=0)]
    assert seen == [[0, 0], [1, 2], [0, 2], [3, 3], [4, 1]]  # before its row: the default row
    assert numbering.default_lookups == 3  # (counted over the run's batches when it is numbered)
    assert RowNumbering.of_run(split, selectors, min_count=4).rows_made == [0]  # none looked up four times
    with pytest.raises(ValueError, match="row_min_count must be at least 1"):
        RowNumbering.of_run(split, selectors, min_count=0)


@pytest.fixture(scope="module")
def raw_data(tmp_path_factory):
    return arriving_raw_data(tmp_path_factory.mktemp("raw_ids"), rows=4_000, test_rows=800)


# (the tables on disk too: each space a file of records made from the rows' keys, a small DRAM budget; and rows
# retired, their numbers made again for new keys wherever the row then is: in the cache, or on the host)
@pytest.mark.parametrize("policy, optimizer, slices, min_count, storage, retire_after, budget", [
    ("lookahead", "adagrad", 1, 1, "memory", 0, 0), ("lru", "adam", 2, 1, "memory", 0, 0),
    ("lfu", "sgd", 1, 1, "memory", 0, 0), ("lru", "adagrad", 2, 3, "memory", 0, 0),
    ("lookahead", "adam", 1, 2, "disk", 0, 0),
    ("lookahead", "adam", 1, 1, "memory", 3, 0), ("lru", "adagrad", 2, 2, "disk", 5, 0),
    ("lookahead", "sgd", 1, 1, "memory", 0, 90)])
def test_single_mode_on_raw_ids_equals_the_reference_bit_for_bit(raw_data, tmp_path, policy, optimizer, slices,
                                                                 min_count, storage, retire_after, budget):
    runs = {}
    for mode in ("reference", "single"):
        config = small_config(raw_data, tmp_path / mode, mode=mode, iterations=30, batch_size=64, optimizer=optimizer,
                              policy=policy, cache_rows=1000, lookahead=8, slices=slices, eval_every=25, shuffle=True,
                              shuffle_seed=2, row_min_count=min_count, storage=storage, storage_budget_mb=0.05,
                              row_retire_after=retire_after, row_budget=budget)
        summary = train_reference(config, show_progress=False)
        metrics = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        runs[mode] = (summary, [m["eval_auc"] for m in metrics if "eval_auc" in m],
                      export(tmp_path / mode, tmp_path / f"{mode}.pt"))
    (reference, ref_evals, want), (single, single_evals, got) = runs["reference"], runs["single"]
    assert exports_equal(want, got)
    assert single_evals == ref_evals and len(ref_evals) == 2  # the evaluation during training too
    assert single["raw_ids"] == reference["raw_ids"]
    made = reference["raw_ids"]["rows_made_per_table"]
    held = reference["raw_ids"].get("rows_held_per_table", [rows + 1 for rows in made])  # (retired: numbers reused)
    assert single["total_rows"] == sum(held) and len(want["embeddings"][0]) == held[0]
    assert (reference["raw_ids"].get("rows_retired", 0) > 0) == (retire_after > 0 or budget > 0)
    assert not budget or max(held) == budget + 1  # (the tables of many keys: held to the budget)
    assert 0 < reference["raw_ids"]["test_lookups_on_the_default_row"] < 1  # the test period's new ids, at least
    assert single["cache"]["rows_written_back"] > 0  # rows made were evicted and fetched again
    if storage == "disk":  # (the file's DRAM cache was too small for its rows: they were read back from disk)
        assert single["storage"]["disk_rows_read"] > 0
    # admission: the keys looked up fewer than min_count times so far look the default row up, which trains
    assert (reference["raw_ids"]["training_lookups_on_the_default_row"] > 0) == (min_count > 1)
    scale = len(np.unique(np.asarray(open_dataset(raw_data).train.ids[:, 0]))) + 1  # (the data's: Feature.init_rows)
    initial = init_keyed(np.array([DEFAULT_KEY]), seed=0, table=0, dim=8, num_rows=scale)[0]
    assert torch.equal(want["embeddings"][0][0], initial) == (min_count == 1)  # trained only under admission


def test_a_run_on_raw_ids_resumes_from_its_checkpoint_as_if_never_stopped(raw_data, tmp_path, monkeypatch):
    common = dict(iterations=40, batch_size=64, optimizer="adam", shuffle=True, shuffle_seed=1, row_min_count=2)
    whole = train_reference(small_config(raw_data, tmp_path / "whole", **common), show_progress=False)
    resumed = cut_and_resumed(small_config(raw_data, tmp_path / "cut", checkpoint_every=5, **common), monkeypatch)
    assert resumed["resumed_at"] == 25 and resumed["raw_ids"] == whole["raw_ids"]
    assert exports_equal(export(tmp_path / "whole", tmp_path / "whole.pt"), export(tmp_path / "cut", tmp_path / "cut.pt"))


@pytest.mark.parametrize("before, after, retire_after", [(40, 60, 0), (60, 40, 4)])
def test_a_run_on_raw_ids_resumed_for_more_or_fewer_iterations_regrows_its_tables(raw_data, tmp_path, monkeypatch,
                                                                                   before, after, retire_after):
    """The rows a run makes are numbered in its batches' order, and batch i is the same whatever the run's length:
    a checkpoint's tables are the first rows of a longer (or shorter) run's, so a resume that changes --iterations
    regrows them and ends exactly as a run of the new length never stopped (in-process modes; a bagpipe job refuses
    it)."""
    from bagpipe.preflight import check_same_batches, prepare_data

    common = dict(batch_size=64, optimizer="adam", shuffle=True, shuffle_seed=1, row_min_count=2,
                  row_retire_after=retire_after)
    whole = train_reference(small_config(raw_data, tmp_path / "whole", iterations=after, **common), show_progress=False)
    cut = small_config(raw_data, tmp_path / "cut", iterations=before, checkpoint_every=5, **common)
    grown = small_config(raw_data, tmp_path / "cut", iterations=after, checkpoint_every=5, **common)
    resumed = cut_and_resumed(cut, monkeypatch, resumed=grown)
    assert resumed["resumed_at"] == 25 and resumed["raw_ids"] == whole["raw_ids"]
    assert exports_equal(export(tmp_path / "whole", tmp_path / "whole.pt"), export(tmp_path / "cut", tmp_path / "cut.pt"))
    job = small_config(raw_data, tmp_path / "cut", iterations=after + 5, mode="bagpipe", **common)
    with pytest.raises(ValueError, match="is not supported yet in --mode bagpipe"):
        check_same_batches(job, prepare_data(job))


def test_the_rows_made_follow_the_batches_and_the_memory_the_rows(raw_data, tmp_path):
    """Fewer iterations make fewer rows: the tables hold the rows the run makes, not a declared size."""
    dataset = open_dataset(raw_data)
    made = {}
    for iterations in (10, 60):
        summary = train_reference(small_config(raw_data, tmp_path / str(iterations), iterations=iterations,
                                               batch_size=64), show_progress=False)
        made[iterations] = summary["raw_ids"]["rows_made"]
        selectors = list(batch_rows(dataset.train, batch_size=64, iterations=iterations, shuffle=False,
                                    shuffle_seed=0))
        looked_up = np.concatenate([np.asarray(dataset.train.ids[rows]) for rows in selectors])
        assert made[iterations] == sum(len(np.unique(looked_up[:, t])) for t in range(26))
        exported = export(tmp_path / str(iterations), tmp_path / f"{iterations}.pt")
        tables = exported["embeddings"]
        assert [len(table) for table in tables] == [made_t + 1 for made_t in summary["raw_ids"]["rows_made_per_table"]]
        # the model holds each row's key (the default row's -1): the first key looked up has row 1, and so on
        keys = exported["row_keys"]
        assert [len(k) for k in keys] == [len(t) for t in tables] and all(int(k[0]) == -1 for k in keys)
        first_seen = list(dict.fromkeys(looked_up[:, 0].tolist()))
        assert keys[0][1:].tolist() == first_seen
    assert made[10] < made[60]


def test_a_wide_and_deep_model_of_raw_ids_keys_both_tables_of_a_feature(raw_data, tmp_path):
    from bagpipe.config import ModelConfig

    config = small_config(raw_data, tmp_path / "wd", iterations=5, batch_size=64, seed=2**45,  # (a large seed too)
                          model=ModelConfig(name="wide-deep", emb_dim=8, arch_mlp_bot="13-32-8", arch_mlp_top="32-1"))
    train_reference(config, show_progress=False)
    exported = export(tmp_path / "wd", tmp_path / "wd.pt")
    keys, tables = exported["row_keys"], exported["embeddings"]
    assert len(keys) == len(tables) == 52 and [len(k) for k in keys] == [len(t) for t in tables]
    assert torch.equal(keys[0], keys[26]) or torch.equal(keys[0], keys[1])  # a feature's two tables, one numbering


@pytest.mark.parametrize("num_shards", [1, 3])
def test_a_servers_shard_of_raw_id_tables_holds_the_references_rows_made_from_their_keys(raw_data, tmp_path,
                                                                                         num_shards):
    """What a bagpipe job's servers make (each shard's rows from the keys the oracle gives it: shard_keys), and the
    parity of their group, equal the reference's tables, row for row."""
    from bagpipe.optim import make_row_optimizer
    from bagpipe.preflight import job_layout, prepare_data
    from bagpipe.storage import RowStore
    from bagpipe.storage.parity import ParityRows
    from bagpipe.storage.rowstore import shard_keys
    from bagpipe.train.reference import keyed_weights

    config = small_config(raw_data, tmp_path / "run", iterations=30, batch_size=64, seed=3, mode="bagpipe")
    dataset = prepare_data(config)
    layout = job_layout(config, dataset)
    table_keys = dataset.numbering.model_table_keys(layout)
    optimizer = make_row_optimizer("adam", lr=0.1)
    for space, weights in enumerate(keyed_weights(config, layout, dataset.numbering)):
        def store(shard, space=space):
            return RowStore(layout=layout, space=space, optimizer=optimizer, seed=3, shard=shard,
                            num_shards=num_shards, keys=shard_keys(layout, table_keys, space, shard, num_shards))
        stores = [store(shard) for shard in range(num_shards)]
        for shard, each in enumerate(stores):
            assert torch.equal(each.all_weights(), weights[shard::num_shards])
        made = ParityRows.initial(layout, space, shards=list(range(num_shards)), num_shards=num_shards,
                                  state_width=optimizer.state_width(layout.spaces[space].dim), seed=3,
                                  keys_of=lambda shard, space=space: shard_keys(layout, table_keys, space, shard,
                                                                                 num_shards))
        assert np.array_equal(made.bits, ParityRows.of(stores).bits)


def test_a_hand_started_role_that_gives_table_sizes_for_raw_ids_is_refused_saying_so(raw_data, tmp_path):
    """Raw-id tables have the rows the run's batches make: a role's --emb-info-file cannot size them."""
    from bagpipe.preflight import prepare_data
    from bagpipe.runtime.oracle.main import settle
    from bagpipe.runtime.world import World

    config = small_config(raw_data, tmp_path / "run", iterations=10, mode="bagpipe")
    dataset = prepare_data(config)
    world = World(rank=0, world_size=4, num_trainers=2)
    hellos = {rank: {"given": {}} for rank in (1, 2, 3)}
    assert settle(config, dataset, world, {}, hellos)[1].schema == dataset.schema
    hellos[3] = {"given": {"table_sizes": [100] * 26}}
    with pytest.raises(ValueError, match=r"server 0 \(rank 3\) gives table sizes, but .* holds raw ids"):
        settle(config, dataset, world, {}, hellos)


def test_a_row_unused_for_n_iterations_is_retired_and_its_number_made_again_for_the_next_key():
    # iterations:        0        1        2        3        4
    split = FakeSplit([[10], [20], [30], [10], [40], [50], [20], [60], [10], [70]])
    batches = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8), slice(8, 10)]
    numbering = RowNumbering.of_run(split, batches, retire_after=1)
    # unused for one iteration, a row is retired at the start of the next: 20 (row 2, used at 0 alone) at 2, where
    # 40 takes its number and 50 a new one; 10 and 30 (rows 1 and 3, last used at 1) at 3, where 20 comes back as
    # a new key and takes the smallest free number (1), 60 the next (3); 40 and 50 at 4, taken by 10 and 70
    np.testing.assert_array_equal([numbering.training_ids(np.zeros((2, 1)), i)[:, 0] for i in range(5)],
                                  [[1, 2], [3, 1], [2, 4], [1, 3], [2, 4]])
    assert numbering.table_rows == [5] and numbering.rows_made == [9] and numbering.rows_retired == [5]
    assert [(rows.tolist(), keys.tolist()) for rows, keys in (numbering.resets(i)[0] for i in range(5))] == [
        ([], []), ([], []), ([2], [40]), ([1, 3], [20, 60]), ([2, 4], [10, 70])]  # numbers made again, for whom
    assert numbering.row_keys(0).tolist()[1:] == [10, 20, 30, 50]  # each number's first key (its initial row)
    assert numbering.stored_row_keys()[0].tolist() == [-1, 20, 10, 60, 70]  # alive at the end (5)
    # an evaluation as of 3 sees the rows alive then: 10 and 30 (retired at the start of 3), 40 and 50; 20 gone
    np.testing.assert_array_equal(numbering.numbered([[20], [30], [60], [10]], as_of=3)[:, 0], [0, 3, 0, 1])


@pytest.mark.parametrize("retire_after, min_count", [(1, 1), (3, 2), (2, 3)])
def test_retired_numbering_gives_each_look_up_the_row_its_key_has_then_and_no_two_live_keys_one_row(
        retire_after, min_count):
    generator = np.random.default_rng(retire_after)
    ids = np.stack([generator.zipf(1.3, 600) % 80, generator.integers(0, 15, 600)], axis=1)  # a tail, a few hot
    split = FakeSplit(ids)
    batches = [slice(i * 20, (i + 1) * 20) for i in range(30)]
    numbering = RowNumbering.of_run(split, batches, min_count=min_count, retire_after=retire_after)
    for i, rows in enumerate(batches):  # each look-up's row is the one its key has as of the end of its iteration
        np.testing.assert_array_equal(numbering.training_ids(ids[rows], i), numbering.numbered(ids[rows], as_of=i + 1))
    for as_of in range(31):  # one key a row at any time, and the numbers compact: the most alive at once
        for keys in numbering.stored_row_keys(as_of):
            alive = keys[keys >= 0]
            assert len(np.unique(alive)) == len(alive)
    alive_most = [max(int(np.count_nonzero(numbering.stored_row_keys(a)[t] >= 0)) for a in range(31))
                  for t in range(2)]
    assert numbering.table_rows == [most + 1 for most in alive_most]
    assert sum(numbering.rows_retired) > 0 and numbering.table_rows[0] - 1 < numbering.rows_made[0]
    # never retired within the run: the numbering without retirement
    kept = RowNumbering.of_run(split, batches, min_count=min_count, retire_after=30)
    plain = RowNumbering.of_run(split, batches, min_count=min_count)
    for i, rows in enumerate(batches):
        np.testing.assert_array_equal(kept.training_ids(ids[rows], i),
                                      plain.training_ids(plain.numbered(ids[rows]), i))
    assert kept.table_rows == plain.table_rows and kept.rows_retired == [0, 0]


def test_a_run_with_rows_retired_resumes_from_its_checkpoint_as_if_never_stopped(raw_data, tmp_path, monkeypatch):
    """Rows made again when their number is reused (new key, fresh optimizer state) go into the incremental
    checkpoints, so a resumed run ends as an uninterrupted one; the tables hold the rows alive at once."""
    common = dict(iterations=40, batch_size=64, optimizer="adam", shuffle=True, shuffle_seed=1, row_retire_after=4,
                  eval_every=20)
    whole = train_reference(small_config(raw_data, tmp_path / "whole", **common), show_progress=False)
    kept = train_reference(small_config(raw_data, tmp_path / "kept", **{**common, "row_retire_after": 0}),
                           show_progress=False)
    raw = whole["raw_ids"]
    assert raw["rows_retired"] > 0 and raw["rows_made"] > kept["raw_ids"]["rows_made"]  # (keys made again)
    assert sum(raw["rows_held_per_table"]) < sum(kept["raw_ids"]["rows_made_per_table"])  # memory: rows alive
    resumed = cut_and_resumed(small_config(raw_data, tmp_path / "cut", checkpoint_every=5, **common), monkeypatch)
    assert resumed["resumed_at"] == 25 and resumed["raw_ids"] == raw and resumed["eval_auc"] == whole["eval_auc"]
    exported = export(tmp_path / "whole", tmp_path / "whole.pt")
    assert exports_equal(exported, export(tmp_path / "cut", tmp_path / "cut.pt"))
    # the model keys the rows alive at the end, -1 the numbers free then
    assert [len(k) for k in exported["row_keys"]] == raw["rows_held_per_table"]


@pytest.mark.parametrize("retire_after, min_count", [(1, 1), (3, 2), (2, 3)])
def test_retirement_worked_out_an_iteration_at_a_time_equals_the_episodes_at_once(retire_after, min_count):
    from bagpipe.embeddings.dynamic import RetiringNumbering

    generator = np.random.default_rng(retire_after + 10)
    ids = np.stack([generator.zipf(1.3, 600) % 80, generator.integers(0, 15, 600)], axis=1)
    order, at = np.arange(600), np.repeat(np.arange(30), 20)
    at_once = RetiringNumbering.of_lookups(FakeSplit(ids), order, at, iterations=30, min_count=min_count,
                                           retire_after=retire_after)
    in_turn = RetiringNumbering.of_lookups_in_turn(FakeSplit(ids), order, at, iterations=30, min_count=min_count,
                                                   retire_after=retire_after)
    for a, b in zip(at_once.assigned, in_turn.assigned):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(at_once.tenures, in_turn.tenures):
        by_a, by_b = np.lexsort((a["keys"], a["start"])), np.lexsort((b["keys"], b["start"]))
        for field in ("keys", "rows", "start", "end"):
            np.testing.assert_array_equal(a[field][by_a], b[field][by_b])
    assert at_once.default_lookups == in_turn.default_lookups


@pytest.mark.parametrize("budget, retire_after", [(25, 0), (21, 4)])
def test_a_row_budget_retires_the_least_frequently_used_and_a_batch_past_it_is_refused(budget, retire_after):
    generator = np.random.default_rng(budget)
    ids = np.stack([generator.zipf(1.2, 600) % 200, generator.integers(0, 12, 600)], axis=1)
    split, batches = FakeSplit(ids), [slice(i * 20, (i + 1) * 20) for i in range(30)]
    numbering = RowNumbering.of_run(split, batches, budget=budget, retire_after=retire_after)
    assert numbering.table_rows[0] == budget + 1 and numbering.table_rows[1] <= 13  # (12 keys fit: none retired)
    assert numbering.rows_retired[1] == 0 and numbering.rows_retired[0] > 0
    for i, rows in enumerate(batches):  # each look-up's row is its key's live one; never more than the budget
        np.testing.assert_array_equal(numbering.training_ids(ids[rows], i), numbering.numbered(ids[rows], as_of=i + 1))
        assert all(np.count_nonzero(keys >= 0) <= budget for keys in numbering.stored_row_keys(i + 1))
    # the first retired for the budget was looked up no more than any row alive beside it then
    tenure = numbering.tenures[0]
    first = int(np.argmin(np.where(tenure["end"] >= 0, tenure["end"], 10**9)))
    end = int(tenure["end"][first])
    if not retire_after:
        looked = ids[:end * 20, 0]
        alive = numbering.stored_row_keys(end)[0]
        alive = alive[alive >= 0]
        uses = lambda key, made: int(np.count_nonzero(looked[made * 20:] == key))  # noqa: E731
        mine = uses(tenure["keys"][first], tenure["start"][first])
        assert all(mine <= uses(key, int(tenure["start"][(tenure["keys"] == key) & (tenure["start"] < end)].max()))
                   for key in alive if key not in ids[end * 20:(end + 1) * 20, 0])
    with pytest.raises(ValueError, match=r"batch looks up \d+ rows of table 0, more than its row budget of 5"):
        RowNumbering.of_run(split, batches, budget=5)


def test_a_reused_number_is_made_again_for_its_new_key_with_fresh_state_under_a_budget_alone(raw_data, tmp_path,
                                                                                            monkeypatch):
    """A budget alone retires rows too: the run makes each reused number again (new key's initial row, optimizer
    state zero) at the iteration it is reused, before the step."""
    from bagpipe.train import reference

    seen = []

    def remake_rows(tables, numbering, iteration, *, seed):
        made = reference.remade(numbering, tables.layout, iteration)
        before = [(tables.weights[s].clone(), tables.state[s].clone()) for s in range(len(made))]
        real(tables, numbering, iteration, seed=seed)
        for space, (flat, keys, owners) in enumerate(made):
            if len(flat):
                index = torch.from_numpy(flat)
                want = reference.remade_weights(tables.layout, owners, keys, seed=seed)
                assert torch.equal(tables.weights[space][index], want) and not tables.state[space][index].any()
                assert not torch.equal(before[space][0][index], want)  # (it held the retired key's trained row)
                seen.append(iteration)

    real = reference.remake_rows
    monkeypatch.setattr(reference, "remake_rows", remake_rows)
    summary = train_reference(small_config(raw_data, tmp_path / "run", iterations=30, batch_size=64, optimizer="adam",
                                           row_budget=70), show_progress=False)
    assert seen and summary["raw_ids"]["rows_retired"] > 0 and summary["raw_ids"]["retire_after"] == 0
