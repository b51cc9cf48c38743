"""The original trainer API: the example script, with separately started oracle and servers."""


import pytest


def test_compat_module_exports_init_cache():
    import bagpipe
    from BagPipe import init_cache

    assert init_cache is bagpipe.init_cache


def test_init_cache_refuses_a_world_that_does_not_add_up():
    from bagpipe import init_cache

    with pytest.raises(ValueError, match="worker_id 3 is the server 0"):
        init_cache(worker_id=3, world_size=5, training_worker_id=0, trainer_world_size=2)
    with pytest.raises(ValueError, match="worker_id 2 is the trainer 1 .* but training_worker_id is 0"):
        init_cache(worker_id=2, world_size=5, training_worker_id=0, trainer_world_size=2)
    with pytest.raises(ValueError, match="needs world_size"):
        init_cache(worker_id=3)
