"""bagpipe.nn.CachedEmbeddingBag swapped into a plain PyTorch loop: its state dict resumes training bit for bit,
gradients accumulate, freezing, the default optimizer, nn.EmbeddingBag's keyword arguments and dtype changes."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

from bagpipe.nn import CachedEmbeddingBag, CachedEmbeddingBagCollection
from bagpipe.optim import RowWise, make_row_optimizer
from bagpipe.storage import StorageSpec
from bagpipe.synth import zipf_bags

NUM_ROWS, DIM, LR = 300, 5, 0.05
CACHE_ROWS = 60  # below two batches' distinct rows: every batch evicts rows the one before looked up


def zipf_batches(count: int, *, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return zipf_bags(count, num_rows=NUM_ROWS, dim=DIM, seed=seed, skew=1.1)


def squared_loss(embeddings: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((embeddings - target) ** 2).sum()


def _weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(NUM_ROWS, DIM, generator=torch.Generator().manual_seed(seed))


def _cached(optimizer: str, *, weight: torch.Tensor | None = None, **options) -> CachedEmbeddingBag:
    return CachedEmbeddingBag(NUM_ROWS, DIM, cache_rows=CACHE_ROWS, mode="sum", optimizer=optimizer, lr=LR,
                              _weight=None if weight is None else weight.clone(), **options)


def _train(module: nn.Module, batches) -> None:
    for ids, offsets, target in batches:
        squared_loss(module(ids, offsets), target).backward()


def _saved(module: nn.Module) -> dict:
    """The module's state dict through torch.save and torch.load, as a checkpoint file holds it."""
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer)


def _state(module: CachedEmbeddingBag) -> torch.Tensor:
    return module.rows.host.rows(0, NUM_ROWS)[1]


# -- 1. the optimizer state is in the state dict --------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_training_resumed_from_a_state_dict_equals_training_on(tmp_path, optimizer, storage):
    def spec():  # on disk: a DRAM cache of about 20 of Adam's records
        return StorageSpec("disk", tmp_path, 2000) if storage == "disk" else storage

    batches = zipf_batches(16)
    uninterrupted = _cached(optimizer, weight=_weight(), storage=spec())
    _train(uninterrupted, batches[:8])
    saved = _saved(uninterrupted)
    assert list(saved) == (["weight"] if optimizer == "sgd" else ["weight", "optimizer_state"])
    resumed = _cached(optimizer, weight=_weight(seed=1), storage=spec())  # other rows, an empty optimizer
    resumed.load_state_dict(saved)
    _train(uninterrupted, batches[8:])
    _train(resumed, batches[8:])
    assert torch.equal(uninterrupted.weight, resumed.weight)
    assert torch.equal(_state(uninterrupted), _state(resumed))


def test_a_weight_only_state_dict_loads_strictly_and_starts_a_fresh_optimizer():
    batches = zipf_batches(6)
    trained = _cached("adagrad", weight=_weight())
    _train(trained, batches)
    weight = trained.weight.clone()
    # an nn.EmbeddingBag state dict into a trained module: new rows, a fresh optimizer on them
    module = _cached("adagrad", weight=_weight(seed=1))
    _train(module, batches)
    assert _state(module).abs().sum() > 0
    module.load_state_dict(nn.EmbeddingBag(NUM_ROWS, DIM, mode="sum", _weight=weight).state_dict())
    assert torch.equal(module.weight, weight) and not _state(module).any()
    fresh = _cached("adagrad", weight=weight)
    _train(module, batches[:2])
    _train(fresh, batches[:2])
    assert torch.equal(module.weight, fresh.weight)
    # and the other way: nn.EmbeddingBag takes the weight, strict=False skipping the optimizer state
    plain = nn.EmbeddingBag(NUM_ROWS, DIM, mode="sum")
    with pytest.raises(RuntimeError, match='Unexpected key.*"optimizer_state"'):
        plain.load_state_dict(trained.state_dict())
    result = plain.load_state_dict(trained.state_dict(), strict=False)
    assert result.unexpected_keys == ["optimizer_state"] and torch.equal(plain.weight.detach(), trained.weight)


def test_strict_loading_names_what_does_not_fit():
    adam = _cached("adam")
    with pytest.raises(RuntimeError, match=r"size mismatch for optimizer_state: .*\(the adagrad optimizer's state\)"):
        _cached("adagrad").load_state_dict(adam.state_dict())
    with pytest.raises(RuntimeError, match='Unexpected key.*"optimizer_state"'):
        _cached("sgd").load_state_dict(adam.state_dict())
    with pytest.raises(RuntimeError, match='Missing key.*"weight"'):
        _cached("adam").load_state_dict({"optimizer_state": _state(adam)})
    before = _cached("adam", weight=_weight())
    state = _state(before).clone()
    before.load_state_dict({"other": torch.zeros(1)}, strict=False)  # nothing of ours given: nothing changes
    assert torch.equal(before.weight, _weight()) and torch.equal(_state(before), state)
    # under a parent module, the keys carry its prefix
    parent = nn.ModuleDict({"bag": _cached("adam", weight=_weight())})
    _train(parent["bag"], zipf_batches(3))
    other = nn.ModuleDict({"bag": _cached("adam")})
    other.load_state_dict(parent.state_dict())
    assert list(parent.state_dict()) == ["bag.weight", "bag.optimizer_state"]
    assert torch.equal(other["bag"].weight, parent["bag"].weight) and torch.equal(_state(other["bag"]),
                                                                                  _state(parent["bag"]))


# -- 2. the step inside backward: accumulation, eval(), no_grad, freezing ----------------------------------------

@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_accumulate_takes_one_step_on_the_summed_gradient(optimizer):
    micro_batches = zipf_batches(12)
    reference = nn.EmbeddingBag(NUM_ROWS, DIM, mode="sum", sparse=True, _weight=_weight())
    stepper = RowWise(reference.parameters(), make_row_optimizer(optimizer, lr=LR))
    cached, stepped_each = _cached(optimizer, weight=_weight()), _cached(optimizer, weight=_weight())
    for step in range(4):
        group = micro_batches[3 * step:3 * step + 3]
        stepper.zero_grad()
        _train(reference, group)
        before = reference.weight.detach().clone()
        stepper.step()
        with cached.accumulate():
            _train(cached, group)
            assert torch.equal(cached.weight, before)  # no step yet
        _train(stepped_each, group)
    assert cached.rows.stats["rows_written_back"] > 0, "meant to step some rows evicted since their lookup"
    assert torch.equal(cached.weight, reference.weight.detach())
    assert optimizer == "sgd" or torch.equal(_state(cached), stepper.state[reference.weight]["rows"])
    assert not torch.allclose(stepped_each.weight, reference.weight.detach())  # one step per backward differs


def test_accumulate_drops_the_gradients_of_a_block_that_raised_and_does_not_nest():
    cached = _cached("adagrad", weight=_weight())
    ids, offsets, target = zipf_batches(1)[0]
    with pytest.raises(KeyError):
        with cached.accumulate():
            squared_loss(cached(ids, offsets), target).backward()
            raise KeyError("a failed micro-batch")
    assert torch.equal(cached.weight, _weight()) and cached.rows.pending is None
    with cached.accumulate(), pytest.raises(ValueError, match="do not nest"):
        with cached.accumulate():
            pass
    squared_loss(cached(ids, offsets), target).backward()  # outside a block: stepped at once again
    assert not torch.equal(cached.weight, _weight())


def test_a_collection_accumulates_as_its_tables_would():
    shapes = [(5, 4), (80, 4), (30, 4)]  # one width: one space; the first's gradients outgrow its size
    weights = [torch.randn(*shape, generator=torch.Generator().manual_seed(t)) for t, shape in enumerate(shapes)]
    collection = CachedEmbeddingBagCollection(shapes, cache_rows=100, optimizer="adam", lr=LR, weights=weights)
    references = [nn.EmbeddingBag(*shape, mode="sum", sparse=True, _weight=w.clone()) for shape, w in zip(shapes, weights)]
    stepper = RowWise([p for r in references for p in r.parameters()], make_row_optimizer("adam", lr=LR))
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        micro_batches = [[(torch.randint(0, rows, (6, 3), generator=generator), torch.randn(6, dim, generator=generator))
                          for rows, dim in shapes] for _ in range(4)]
        with collection.accumulate():
            for batch in micro_batches:
                outputs = collection([ids for ids, _ in batch])
                sum(squared_loss(out, target) for out, (_, target) in zip(outputs, batch)).backward()
        stepper.zero_grad()
        for batch in micro_batches:
            sum(squared_loss(r(ids), target) for r, (ids, target) in zip(references, batch)).backward()
        stepper.step()
    assert all(torch.equal(collection.weight(t), r.weight.detach()) for t, r in enumerate(references))


def test_eval_still_trains_no_grad_does_not_and_requires_grad_false_freezes():
    ids, offsets, target = zipf_batches(1)[0]
    cached = _cached("sgd", weight=_weight())
    cached.eval()  # documented: eval() changes nothing here, a backward in eval mode steps the rows
    squared_loss(cached(ids, offsets), target).backward()
    assert not torch.equal(cached.weight, _weight())
    cached = _cached("sgd", weight=_weight())
    with torch.no_grad():
        assert not cached(ids, offsets).requires_grad
    assert cached.requires_grad_(False) is cached
    weights = torch.rand(ids.shape, requires_grad=True)
    squared_loss(cached(ids, offsets, weights), target).backward()
    assert weights.grad is not None and torch.equal(cached.weight, _weight())  # frozen: the rest still learns
    cached.requires_grad_(True)
    squared_loss(cached(ids, offsets), target).backward()
    assert not torch.equal(cached.weight, _weight())


# -- 3. the default optimizer is announced ------------------------------------------------------------------------

def test_no_optimizer_trains_with_sgd_and_warns_naming_it():
    with pytest.warns(UserWarning, match=r"optimizer='sgd', lr=0.001") as record:
        cached = CachedEmbeddingBag(NUM_ROWS, DIM, cache_rows=CACHE_ROWS, mode="sum", _weight=_weight())
    assert record[0].filename == __file__  # pointing at the caller's line
    assert cached.rows.optimizer.name == "sgd" and cached.rows.optimizer.lr == 1e-3
    with pytest.warns(UserWarning, match=r"optimizer='sgd', lr=0.001"):
        CachedEmbeddingBagCollection([(10, 2)], cache_rows=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _cached("sgd")
        CachedEmbeddingBagCollection([(10, 2)], cache_rows=4, optimizer="adagrad")


# -- 4. nn.EmbeddingBag's keyword arguments -----------------------------------------------------------------------

def test_embedding_bag_keyword_arguments_at_supported_values_are_accepted():
    cached = _cached("sgd", weight=_weight(), sparse=True, scale_grad_by_freq=False, padding_idx=None,
                     max_norm=None, norm_type=2.0, dtype=torch.float32)
    reference = nn.EmbeddingBag(NUM_ROWS, DIM, mode="sum", sparse=True, _weight=_weight())
    ids, offsets, _ = zipf_batches(1)[0]
    assert torch.equal(cached(ids, offsets), reference(ids, offsets))


@pytest.mark.parametrize("option, message", [
    ({"sparse": False}, "sparse=False is not supported: the table is no parameter"),
    ({"scale_grad_by_freq": True}, "scale_grad_by_freq=True is not supported: PyTorch has no sparse gradient"),
    ({"padding_idx": 0}, "padding_idx is not supported: leave the padding ids out"),
    ({"max_norm": 1.0}, "max_norm is not supported"),
    ({"dtype": torch.float64}, "dtype=torch.float64 is not supported: .* are float32"),
])
def test_unsupported_embedding_bag_arguments_are_refused_saying_why(option, message):
    with pytest.raises(ValueError, match=message):
        _cached("sgd", **option)


# -- 5. dtype conversions -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("convert, dtype", [
    (lambda m: m.double(), "torch.float64"), (lambda m: m.half(), "torch.float16"),
    (lambda m: m.to(torch.bfloat16), "torch.bfloat16"), (lambda m: m.to("cpu", torch.float64), "torch.float64"),
])
def test_a_dtype_conversion_is_refused_at_the_conversion(convert, dtype):
    cached = _cached("adagrad", weight=_weight())
    model = nn.Sequential(cached)
    with pytest.raises(ValueError, match=f"cached tables are float32 .* cannot be converted to {dtype}"):
        convert(model)
    assert cached.rows.cache_weight.dtype == torch.float32
    cached.float().to("cpu")  # no dtype change: fine
    ids, offsets, _ = zipf_batches(1)[0]
    assert torch.equal(cached(ids, offsets), nn.EmbeddingBag(NUM_ROWS, DIM, mode="sum", _weight=_weight())(ids, offsets))
