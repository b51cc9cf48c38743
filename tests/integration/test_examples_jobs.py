"""The per-model example trainers (``examples/<model>_bagpipe.py``: the original API with one of our
models, DDP on the dense part) against separately started roles: each ends bit for bit where
``--mode reference --slices 2`` does, and the oracle evaluates trainer 0's model."""


import json
import os
from pathlib import Path

import pytest

from bagpipe.config import ModelConfig
from bagpipe.rundir import export
from bagpipe.runtime.world import free_port
from helpers.cli_processes import CliProcess
from helpers.jobs import BATCH, CACHE, assert_same_parameters, job_config, reference_of
from helpers.original import BagpipeLine, run_job, script_line
from helpers.paths import REPO as ROOT

ITERATIONS = 60

# (script, model, the script's shape flags, the oracle's data fixture and its settings)
CASES = {
    "deepfm": ("deepfm_bagpipe.py", ModelConfig(name="deepfm", emb_dim=8, deep_mlp="32-16", dropout=0.2),
               ["--deep-mlp", "32-16", "--emb-size", "8", "--dropout", "0.2"], "small_binary",
               dict(batch_size=BATCH, cache_rows=2 * CACHE, optimizer="adagrad", lr=0.05)),
    "caser": ("caser_bagpipe.py", ModelConfig(name="caser", emb_dim=16, vertical_filters=4, horizontal_filters=8),
              ["--emb-size", "16", "--horizontal-filters", "8"], "sequence_data",
              dict(batch_size=256, cache_rows=3000, optimizer="adam", lr=0.005)),
}


@pytest.mark.parametrize("name", CASES)
def test_an_example_trainer_equals_the_sliced_reference(name, request, tmp_path):
    script, model, flags, fixture, settings = CASES[name]
    data = request.getfixturevalue(fixture)
    config = job_config(data, tmp_path / "run", iterations=ITERATIONS, servers=1, model=model, **settings)
    world = ["--world-size", "4", "--world-size-trainers", "2"]
    common = ["--cache-size", str(config.cache_rows), "--optimizer", config.optimizer, "--lr", str(config.lr)]
    trainer = [*world, *common, *flags, "--lookahead-val", "20", "--dist-port", str(free_port()), "--device", "cpu"]
    run_job([
        BagpipeLine(["oracle", "--worker-id", "0", *world, "--processed-csv", str(data), "--run-dir", config.run_dir,
                     "--mini-batch-size", str(config.batch_size), "--iterations", str(ITERATIONS),
                     "--lookahead-value", "20", "--seed", str(config.seed), "--max-eval-rows", "2000", *common]),
        BagpipeLine(["server", "--worker-id", "3", *world[:2]]),
        script_line(ROOT / "examples" / script, *trainer, "--worker-id", "1"),
        script_line(ROOT / "examples" / script, *trainer, "--worker-id", "2"),
    ], cwd=tmp_path)
    summary = json.loads((Path(config.run_dir) / "summary.json").read_text())
    assert summary["model"] == name and ("eval_auc" in summary or "eval_hr10" in summary)  # trainer 0's, evaluated
    assert_same_parameters(export(config.run_dir, tmp_path / "ours.pt"), reference_of(config, tmp_path / "reference"))
    reference = json.loads((tmp_path / "reference" / "summary.json").read_text())
    metric = "eval_auc" if "eval_auc" in summary else "eval_hr10"
    assert summary[metric] == reference[metric]


def test_an_oracle_told_another_model_than_the_scripts_refuses_naming_both(small_binary, tmp_path):
    world = ["--world-size", "4", "--world-size-trainers", "2"]
    trainer = [*world, "--device", "cpu", "--dist-port", str(free_port())]
    script = ROOT / "examples" / "deepfm_bagpipe.py"
    env = dict(os.environ, MASTER_PORT=str(free_port()))
    processes = [
        CliProcess(["oracle", "--worker-id", "0", *world, "--processed-csv", str(small_binary),
                    "--run-dir", str(tmp_path / "run"), "--model", "dcn"], cwd=tmp_path, env=env),
        CliProcess(["server", "--worker-id", "3", *world[:2]], cwd=tmp_path, env=env),
        CliProcess([*trainer, "--worker-id", "1"], script=script, cwd=tmp_path, env=env),
        CliProcess([*trainer, "--worker-id", "2"], script=script, cwd=tmp_path, env=env),
    ]
    try:
        errors = [p.communicate(timeout=120)[1] for p in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert processes[0].returncode == 2, errors[0][-2000:]
    assert "the roles disagree on the model" in errors[0]
    assert "'dcn'" in errors[0] and "'deepfm'" in errors[0]
    assert all(p.returncode != 0 for p in processes[1:])
    assert not (tmp_path / "run" / "summary.json").exists()
