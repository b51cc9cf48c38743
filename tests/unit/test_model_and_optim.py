import numpy as np
import pytest
import torch

from bagpipe.data.schema import Schema
from bagpipe.embeddings import (INIT_BLOCK_ROWS, EmbeddingLayout, EmbeddingTables, TableConfig, init_block, init_rows,
                                init_table)
from bagpipe.models.dlrm import DLRM
from bagpipe.optim import make_row_optimizer
from helpers.layouts import layout_of


def test_dlrm_shapes_and_interaction_width():
    model = DLRM(num_tables=26, emb_dim=16, bottom_sizes=(13, 64, 16), top_sizes=(32, 1))
    assert model.top[0].in_features == 16 + 27 * 26 // 2
    logits = model(torch.randn(8, 13), torch.randn(8, 26, 16))
    assert logits.shape == (8,)
    with pytest.raises(ValueError, match=r"\[B, 26, 16\]"):
        model(torch.randn(8, 13), torch.randn(8, 25, 16))
    with pytest.raises(ValueError, match="embedding dimension"):
        DLRM(num_tables=2, emb_dim=16, bottom_sizes=(13, 8), top_sizes=(1,))


def test_dlrm_gradients_reach_every_embedding():
    model = DLRM(num_tables=3, emb_dim=4, bottom_sizes=(13, 4), top_sizes=(8, 1))
    embeddings = torch.randn(5, 3, 4, requires_grad=True)
    model(torch.randn(5, 13), embeddings).sum().backward()
    assert embeddings.grad is not None and (embeddings.grad.abs().sum(dim=(0, 2)) > 0).all()


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_row_optimizer_matches_torch_optim_on_the_rows_it_touches(name):
    torch.manual_seed(0)
    dim, num_rows = 4, 10
    row_optimizer = make_row_optimizer(name, lr=0.05)
    table = torch.randn(num_rows, dim)
    state = torch.zeros(num_rows, row_optimizer.state_width(dim))
    # torch.optim on each row as its own parameter: untouched rows get no step, as in our optimizer.
    params = [torch.nn.Parameter(table[i].clone()) for i in range(num_rows)]
    reference = [row_optimizer.dense_optimizer([p]) for p in params]
    for _ in range(6):
        touched = torch.unique(torch.randint(0, num_rows, (5,)))
        grads = torch.randn(len(touched), dim)
        rows, row_state = table[touched].clone(), state[touched].clone()
        row_optimizer.step(rows, row_state, grads)
        table[touched], state[touched] = rows, row_state
        for k, i in enumerate(touched.tolist()):
            params[i].grad = grads[k].clone()
            reference[i].step()
    torch.testing.assert_close(table, torch.stack([p.detach() for p in params]), rtol=1e-5, atol=1e-6)


def test_initial_rows_do_not_depend_on_how_a_table_is_split():
    num_rows = INIT_BLOCK_ROWS + 100
    whole = init_table(seed=1, table=2, num_rows=num_rows, dim=3)
    second = init_block(seed=1, table=2, block=1, num_rows=num_rows, dim=3)
    assert torch.equal(whole[INIT_BLOCK_ROWS:], second)
    assert whole.abs().max() <= num_rows ** -0.5
    assert not torch.equal(whole, init_table(seed=2, table=2, num_rows=num_rows, dim=3))
    table = TableConfig(name="t", num_rows=2 * INIT_BLOCK_ROWS + 7, dim=3, features=(0,))
    rows = init_rows(2, table, seed=1)
    for step in (2, 3, 5):  # a server's shard, made block by block
        for first in range(step):
            assert torch.equal(init_rows(2, table, seed=1, first=first, step=step), rows[first::step])


def test_tables_update_only_looked_up_rows():
    tables = EmbeddingTables(layout=layout_of([4, 6], 2), optimizer=make_row_optimizer("sgd", lr=1.0), seed=0)
    before = tables.weights[0].clone()
    embeddings, lookups = tables.lookup(torch.tensor([[1, 5], [1, 0]]))
    assert embeddings.stack().shape == (2, 2, 2) and embeddings[1].shape == (2, 2)
    embeddings.stack().sum().backward()
    tables.apply_gradients(lookups)
    changed = (tables.weights[0] != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [1, 4, 4 + 5]
    # Row 1 of table 0 appears twice: its gradient is the sum of both uses.
    torch.testing.assert_close(tables.weights[0][1], before[1] - 2.0)


def test_tables_of_several_widths_form_one_space_per_width():
    schema = Schema.one_hot([5, 7], num_dense=0)
    tables = [TableConfig(name="a", num_rows=5, dim=4, features=(0,)),
              TableConfig(name="a1", num_rows=5, dim=1, features=(0,), init="zeros"),
              TableConfig(name="b", num_rows=7, dim=4, features=(1,))]
    layout = EmbeddingLayout(tables, schema)
    assert [(s.dim, s.tables, s.num_rows) for s in layout.spaces] == [(4, (0, 2), 12), (1, (1,), 5)]
    assert layout.place(2) == (0, 5) and layout.place(1) == (1, 0)
    keys = layout.keys(np.array([[4, 6]]))
    assert keys[0].tolist() == [[4, 11]] and keys[1].tolist() == [[4]]
    memory = EmbeddingTables(layout=layout, optimizer=make_row_optimizer("sgd", lr=1.0), seed=0)
    embeddings, _ = memory.lookup(torch.tensor([[4, 6]]))
    assert [tuple(embeddings[i].shape) for i in range(3)] == [(1, 4), (1, 1), (1, 4)]
    assert torch.equal(embeddings[2], memory.table(2)[6:7]) and (memory.table(1) == 0).all()
    with pytest.raises(ValueError, match="fewer than feature"):
        EmbeddingLayout([TableConfig(name="small", num_rows=3, dim=2, features=(0,))], schema)

