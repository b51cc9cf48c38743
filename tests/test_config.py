import pytest

from bagpipe.config import load_train_config


def test_toml_then_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('data = "d"\nrun_dir = "r"\nlr = 0.5\noptimizer = "sgd"\n[model]\nemb_dim = 4\n'
                    'arch_mlp_bot = "13-4"\n')
    config = load_train_config(str(path), {"lr": 0.25, "optimizer": None, "arch_mlp_top": "7-1"})
    assert config.lr == 0.25 and config.optimizer == "sgd"
    assert config.model.emb_dim == 4 and config.model.top_sizes == (7, 1)


@pytest.mark.parametrize("overrides, message", [
    ({"optimizer": "rmsprop"}, "optimizer must be one of"),
    ({"batch_size": 0}, "batch_size must be positive"),
    ({"lr": -1.0}, "lr must be positive"),
    ({"iterations": -3}, "iterations must not be negative"),
    ({"arch_mlp_bot": "13-x-16"}, "arch_mlp_bot"),
    ({"arch_mlp_top": "64-2"}, "must end in 1"),
    ({"mode": "magic"}, "mode must be one of"),
    ({"data": ""}, "data"),
])
def test_impossible_values_are_refused(overrides, message):
    values = {"data": "d", "run_dir": "r", **overrides}
    with pytest.raises(ValueError, match=message):
        load_train_config(None, values)


def test_unknown_keys_and_missing_files(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('data = "d"\nrun_dir = "r"\nlearning_rate = 1\n')
    with pytest.raises(ValueError, match="unknown setting.*learning_rate"):
        load_train_config(str(path), {})
    with pytest.raises(ValueError, match="no such file"):
        load_train_config(str(tmp_path / "missing.toml"), {})
    path.write_text("data = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_train_config(str(path), {})
