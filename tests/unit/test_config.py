import dataclasses
from types import SimpleNamespace

import pytest

from bagpipe.config import (RUN_MODES, MODES, SECTION_OF, SECTIONS, ModelConfig, TrainConfig, default_config,
                            load_train_config)
from bagpipe.models import CARDS, MODEL_NAMES


def test_toml_then_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('data = "d"\nrun_dir = "r"\nlr = 0.5\noptimizer = "sgd"\n[model]\nemb_dim = 4\n'
                    'arch_mlp_bot = "13-4"\n')
    config = load_train_config(str(path), {"lr": 0.25, "optimizer": None, "arch_mlp_top": "7-1"})
    assert config.lr == 0.25 and config.optimizer == "sgd"
    assert config.model.emb_dim == 4 and config.model.sizes("arch_mlp_top") == (7, 1)


@pytest.mark.parametrize("overrides, message", [
    ({"optimizer": "rmsprop"}, "optimizer must be one of"),
    ({"batch_size": 0}, "batch_size must be positive"),
    ({"lr": -1.0}, "lr must be a positive, finite number"),
    ({"lr": float("inf")}, "lr must be a positive, finite number, got inf"),
    ({"lr": float("nan")}, "lr must be a positive, finite number, got nan"),
    ({"timeout": float("inf")}, "timeout must be a positive, finite number"),
    ({"liveness_s": 0.5}, r"liveness_s must be 0 \(from timeout\) or in \[1, timeout 60\) s, got 0.5"),
    ({"liveness_s": 20.0, "timeout": 20.0}, r"in \[1, timeout 20\) s, got 20.0"),
    ({"rpc_transports": "tcp"}, r"rpc_transports must be a comma-separated list of uv, shm, ibv, got 'tcp'"),
    ({"rpc_transports": ""}, r"rpc_transports must be a comma-separated list of uv, shm, ibv, got ''"),
    ({"rpc_channels": "basic,fast"}, r"rpc_channels must be .* \(or empty: TensorPipe chooses\), got 'basic,fast'"),
    ({"cleanup_fraction": 2.0}, r"cleanup_fraction must be in \[0, 1\), got 2.0"),
    ({"slices": 0}, "slices must be positive"),
    ({"iterations": -3}, "iterations must not be negative"),
    ({"max_restarts": -1}, "max_restarts must not be negative, got -1"),
    ({"arch_mlp_bot": "13-x-16"}, "arch_mlp_bot"),
    ({"arch_mlp_top": "64-2"}, "must end in 1"),
    ({"mode": "magic"}, "mode must be one of"),
    ({"cache_mode": "sharded"}, "cache_mode must be one of replicated, partitioned, got 'sharded'"),
    ({"mode": "bagpipe", "cache_mode": "partitioned", "policy": "lru"},
     "--cache-mode partitioned plans each trainer's cache by lookahead only, not --policy lru"),
    ({"planner_processes": 3}, "planner_processes must be 1 or 2, got 3"),
    ({"mode": "bagpipe", "cache_mode": "partitioned", "planner_processes": 2},
     r"--cache-mode partitioned plans in one process \(--planner-processes 2 numbers the replicated plan's"),
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


# Each line once went through unchecked: shuffle = "false" shuffled, iterations = true ran one
# iteration, the strings ended in tracebacks mid-run and 256.5 failed only after training started.
@pytest.mark.parametrize("line, message", [
    ('shuffle = "false"', "shuffle: expected true or false, got 'false' (a string)"),
    ("iterations = true", "iterations: expected an integer, got true (a boolean)"),
    ('iterations = "ten"', "iterations: expected an integer, got 'ten' (a string)"),
    ('lr = "0.1"', "lr: expected a number, got '0.1' (a string)"),
    ("batch_size = 256.5", "batch_size: expected an integer, got 256.5 (a number)"),
    ("mode = 1", "mode: expected a string, got 1 (an integer)"),
    ("model = 3", "model must be a table ([model])"),
    ("[model]\nemb_dim = 2.0", "model.emb_dim: expected an integer, got 2.0"),
    ("[model]\narch_mlp_top = [512, 1]", "model.arch_mlp_top: expected a string, got [512, 1] (an array)"),
])
def test_toml_values_of_the_wrong_type_are_refused_naming_file_and_key(tmp_path, line, message):
    path = tmp_path / "job.toml"
    path.write_text(f'data = "d"\nrun_dir = "r"\n{line}\n')
    with pytest.raises(ValueError) as refused:
        load_train_config(str(path), {})
    assert str(refused.value).startswith(f"{path}: {message}")


def test_types_are_checked_when_built_in_code_too():
    with pytest.raises(ValueError, match="iterations: expected an integer, got true"):
        TrainConfig(data="d", run_dir="r", iterations=True)
    with pytest.raises(ValueError, match="emb_dim: expected an integer"):
        ModelConfig(emb_dim="16")
    config = TrainConfig(data="d", run_dir="r", lr=1, timeout=5)
    assert isinstance(config.lr, float) and isinstance(config.timeout, float)  # an int is a fine float


def test_settings_the_mode_does_not_read_get_a_warning():
    from bagpipe.preflight import ignored_settings

    reference = TrainConfig(data="d", run_dir="r", trainers=4, lookahead=50, shuffle_seed=3)
    warnings = ignored_settings(reference)
    assert any(w.startswith("--trainers does nothing in --mode reference") and "--slices" in w for w in warnings)
    assert any(w.startswith("--lookahead does nothing in --mode reference") for w in warnings)
    assert any(w.startswith("--shuffle-seed does nothing without --shuffle") for w in warnings)
    assert ignored_settings(TrainConfig(data="d", run_dir="r", mode="bagpipe", slices=2))[0].startswith(
        "--slices does nothing in --mode bagpipe")
    assert ignored_settings(TrainConfig(data="d", run_dir="r", mode="bagpipe", trainers=4, lookahead=50)) == []
    assert ignored_settings(TrainConfig(data="d", run_dir="r")) == []
    # settings the hand-kept lists before the sections missed (issue 45)
    missed = TrainConfig(data="d", run_dir="r", planner_processes=2, cache_mode="partitioned", replace_trainers=False,
                         liveness_s=5.0, rpc_transports="shm,uv")
    assert {w.split()[0] for w in ignored_settings(missed)} == {
        "--planner-processes", "--cache-mode", "--replace-trainers", "--liveness-s", "--rpc-transports"}
    single = TrainConfig(data="d", run_dir="r", mode="single", lookahead=50, storage="disk", trainers=4, check_parity=True)
    assert {w.split()[0] for w in ignored_settings(single)} == {"--trainers", "--check-parity"}


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_every_model_setting_is_warned_with_exactly_the_models_that_do_not_read_it(model):
    """A model setting changed alone: warned as doing nothing with ``--model`` if and only if the model's card does
    not name it; every ModelConfig field past the name is a declared setting, at its declared default."""
    from bagpipe.models import SETTINGS
    from bagpipe.preflight import ignored_settings

    assert [f.name for f in dataclasses.fields(ModelConfig)] == ["name", *SETTINGS]
    assert all(getattr(ModelConfig(), name) == setting.default for name, setting in SETTINGS.items())
    defaults = default_config(model)
    for name in SETTINGS:
        config = SimpleNamespace(**{f.name: getattr(defaults, f.name) for f in dataclasses.fields(TrainConfig)})
        config.model = SimpleNamespace(**{**vars(defaults.model), name: object()}, card=defaults.model.card)
        warned = [w for w in ignored_settings(config) if w.startswith(f"--{name.replace('_', '-')} does nothing")]
        assert bool(warned) == (name not in CARDS[model].settings), (model, name, warned)


def test_a_model_setting_out_of_its_range_is_refused_naming_it():
    from bagpipe.models import SETTINGS

    bounded = [s for s in SETTINGS.values() if s.low is not None or s.choices or s.sizes]
    assert len(bounded) == len(SETTINGS)  # (every model setting has a range)
    for setting in bounded:
        wrong = ("13-x" if setting.sizes else "neither" if setting.choices
                 else type(setting.default)(setting.below if setting.below is not None else setting.low - 1))
        with pytest.raises(ValueError, match=f"^{setting.name}"):
            ModelConfig(**{setting.name: wrong})


@pytest.mark.parametrize("mode", MODES)
def test_every_setting_is_warned_in_exactly_the_modes_whose_sections_leave_it_out(mode):
    """Each setting changed alone: warned as doing nothing in ``mode`` if and only if its section (config.SECTIONS)
    is not one the mode reads; every setting is in exactly one section."""
    from bagpipe.preflight import ignored_settings

    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "model"]
    assert sorted(fields) == sorted(SECTION_OF) and sum(map(len, SECTIONS.values())) == len(SECTION_OF)
    defaults = default_config()
    for name in fields:
        if name in ("data", "run_dir", "mode"):
            continue
        config = SimpleNamespace(**{f: getattr(defaults, f) for f in fields}, model=defaults.model)
        config.mode = mode
        setattr(config, name, object())  # different from any default
        flag = "--" + name.replace("_", "-")
        warned = [w for w in ignored_settings(config) if w.startswith(f"{flag} does nothing in --mode {mode}")]
        assert bool(warned) == (not RUN_MODES[mode].reads(name)), (mode, name, warned)


def test_every_flag_has_a_help_line_with_its_default():
    import argparse

    from bagpipe.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = []
    for name, command in commands.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            flag = f"{name} {action.option_strings[0] if action.option_strings else action.dest}"
            takes_value = action.nargs != 0 and action.option_strings
            stated = "default" in (action.help or "") or "required" in (action.help or "")
            if not action.help or (takes_value and not action.required and not stated):
                missing.append(flag)
    assert not missing, f"flags without a help line that gives their default (or says they are required): {missing}"


def test_the_liveness_window_is_the_setting_or_follows_the_timeout():
    from bagpipe.runtime.world import World

    def world(**given) -> World:
        return World(rank=0, world_size=4, num_trainers=2, **given)
    assert [world(timeout=t).liveness_s for t in (4.0, 12.0, 60.0)] == [3.0, 6.0, 10.0]
    assert world(timeout=60.0, liveness=2.5).liveness_s == 2.5
    # heartbeats once a second, or four per window where that is shorter
    assert [world(timeout=60.0, liveness=w).beat_s for w in (0.0, 4.0, 2.0, 1.0)] == [1.0, 1.0, 0.5, 0.25]
    with pytest.raises(ValueError, match=r"--liveness-s must be 0 \(from --timeout\) or in \[1, --timeout 8\) s"):
        world(timeout=8.0, liveness=9.0)


def test_every_role_takes_the_jobs_rpc_transports_and_refuses_others():
    """A trainer or server (or a script's init_cache) given none runs on the job's; one given the job's own is
    fine; one given others is refused before it joins the RPC world, naming both."""
    from bagpipe.config import TrainConfig
    from bagpipe.runtime.world import World, job_world

    job = TrainConfig(data="d", run_dir="r", rpc_transports="uv,shm", rpc_channels="basic", parity=0)
    role = World(rank=1, world_size=4, num_trainers=2)
    joined = job_world(role, job)
    assert (joined.rpc_transports, joined.rpc_channels) == ("uv,shm", "basic")
    assert job_world(World(rank=1, world_size=4, num_trainers=2, rpc_transports="uv,shm"), job) == joined
    with pytest.raises(ValueError, match=r"--rpc-transports 'uv': the job runs with 'uv,shm'"):
        job_world(World(rank=1, world_size=4, num_trainers=2, rpc_transports="uv"), job)
    with pytest.raises(ValueError, match=r"--rpc-transports must be a comma-separated list"):
        World(rank=1, world_size=4, num_trainers=2, rpc_transports="tcp")


def test_openmp_waits_passively_only_beside_busy_processes_and_a_users_choice_stands():
    """Spinning workers are the fastest on an idle machine and collapse beside a busy process; passive waiting is the
    reverse (docs/performance.md): the command chooses by what the machine is running, before torch loads."""
    from bagpipe.openmp import BUSY_CORES, choose_wait_policy

    environ: dict[str, str] = {}
    assert choose_wait_policy(environ, measure=lambda: 0.1) is None and environ == {}  # idle: OpenMP's spin
    assert choose_wait_policy(environ, measure=lambda: None) is None and environ == {}  # cannot tell: the same
    assert choose_wait_policy(environ, measure=lambda: BUSY_CORES) == "PASSIVE"
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    mine = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert choose_wait_policy(mine, measure=lambda: 2.0) is None and mine == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_a_resume_that_changes_how_a_step_computes_says_it_will_not_end_bit_for_bit(tmp_path, caplog):
    """--compile and --device may change on --resume (a run moved to another machine), but the steps from there
    round otherwise: said, not left to be found in the last bits."""
    import json
    import logging

    from bagpipe.config import config_to_dict, resumed_config

    (tmp_path / "config.json").write_text(json.dumps(config_to_dict(TrainConfig(data="d", run_dir=str(tmp_path)))))
    caplog.set_level(logging.WARNING, logger="bagpipe")
    assert resumed_config(str(tmp_path), None, {"iterations": 30}).iterations == 30
    assert caplog.records == []  # (a change that computes alike says nothing)
    assert resumed_config(str(tmp_path), None, {"compile": True}).compile
    (warning,) = caplog.records
    assert "--resume with compile=True, where the run started with False" in warning.getMessage()
    assert "will not end bit for bit" in warning.getMessage()


def test_caser_keeps_its_best_evaluated_model_by_default_and_either_half_can_be_turned_off():
    """Caser's own defaults evaluate every 250 iterations and keep the best (its 20 passes overfit small data);
    --eval-every 0 leaves only the final evaluation (so nothing to choose from: the last is kept, not refused),
    --no-keep-best keeps the last while still evaluating."""
    from bagpipe.cli import build_parser
    from bagpipe.config import default_config

    caser, dlrm = default_config("caser"), default_config("dlrm")
    assert (caser.eval_every, caser.keep_best) == (250, True) and (dlrm.eval_every, dlrm.keep_best) == (0, False)
    assert not load_train_config(None, {"name": "caser", "data": "-", "run_dir": "-", "eval_every": 0}).keep_best
    args = build_parser().parse_args(["train", "--data", "-", "--run-dir", "-", "--model", "caser", "--no-keep-best"])
    assert args.keep_best is False
    assert build_parser().parse_args(["train", "--data", "-", "--run-dir", "-", "--keep-best"]).keep_best is True
    assert build_parser().parse_args(["train", "--data", "-", "--run-dir", "-"]).keep_best is None  # model's own


def test_a_toml_file_in_sections_equals_its_flat_form_which_is_still_read_with_a_warning(tmp_path, caplog):
    from bagpipe.config import dump_toml

    sectioned, flat = tmp_path / "sections.toml", tmp_path / "flat.toml"
    sectioned.write_text('[data]\ndata = "d"\nshuffle = true\n[run]\nrun_dir = "r"\nmode = "single"\n'
                         '[optimizer]\noptimizer = "sgd"\nlr = 0.5\n[cache]\nlookahead = 50\n[model]\nemb_dim = 4\n')
    flat.write_text('data = "d"\nshuffle = true\nrun_dir = "r"\nmode = "single"\noptimizer = "sgd"\nlr = 0.5\n'
                    'lookahead = 50\n[model]\nemb_dim = 4\n')
    with caplog.at_level("WARNING"):
        a = load_train_config(str(sectioned), {})
        assert not caplog.records
        b = load_train_config(str(flat), {})
    assert a == b and a.lookahead == 50 and a.optimizer == "sgd" and a.model.emb_dim == 4
    assert "settings outside their sections (data, shuffle, run_dir, mode, optimizer, lr, lookahead)" in caplog.text
    # a setting in another section's table, a model setting outside [model], one given twice: refused
    for text, message in (('[cache]\nlr = 0.5\n', r"\[cache\] lr: lr is a setting of \[optimizer\]"),
                          ('[run]\nemb_dim = 4\n', r"\[run\] emb_dim: a model setting"),
                          ('lr = 0.1\n[optimizer]\nlr = 0.5\n', "lr is given twice")):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_train_config(str(bad), {"data": "d", "run_dir": "r"})
    # what the launcher hands its roles: sections, read back equal
    written = tmp_path / "job.toml"
    written.write_text(dump_toml(a))
    with caplog.at_level("WARNING"):
        caplog.clear()
        assert load_train_config(str(written), {}) == a and not caplog.records
