"""The original trainer API: the example script, with separately started oracle and servers."""


import os
import subprocess
import sys

import pytest

from bagpipe.data.binary import open_dataset
from bagpipe.rundir import export
from bagpipe.runtime.world import free_port
from helpers.jobs import BATCH, CACHE, assert_same_parameters, job_config, reference_of
from helpers.original import BagpipeLine, run_job, script_line
from helpers.paths import REPO as ROOT

ITERATIONS = 100


# With DDP the script creates its own default process group after init_cache; without it (one
# trainer, --no-ddp) there is none at all. The cache must work, and match the reference, either way.
@pytest.mark.parametrize("trainers, ddp", [(2, True), (1, False)])
def test_example_script_with_separate_roles_equals_reference(small_binary, tmp_path, trainers, ddp):
    sizes = open_dataset(small_binary).table_sizes
    emb_info = tmp_path / "emb_info.txt"
    emb_info.write_text("".join(f"{n}\n" for n in sizes))
    config = job_config(small_binary, tmp_path / "run", iterations=ITERATIONS, trainers=trainers)
    port, dist_port = str(free_port()), str(free_port())
    size = 3 + trainers
    world = ["--world-size", str(size), "--world-size-trainers", str(trainers), "--master-port", port,
             "--timeout", "60"]
    model = ["--arch-mlp-bot", config.model.arch_mlp_bot, "--arch-mlp-top", config.model.arch_mlp_top]
    commands = [
        BagpipeLine(["oracle", "--processed-csv", str(small_binary), "--run-dir", config.run_dir,
                     "--emb-info-file", str(emb_info), "--mini-batch-size", str(BATCH), "--cache-size", str(CACHE),
                     "--lookahead-value", "20", "--iterations", str(ITERATIONS), "--optimizer", "adagrad",
                     "--lr", str(config.lr), "--seed", str(config.seed), "--emb-size", "8",
                     "--max-eval-rows", "2000", "--worker-id", "0", *world, *model]),
        BagpipeLine(["server", "--worker-id", str(1 + trainers), *world]),
        BagpipeLine(["server", "--worker-id", str(2 + trainers), *world]),
    ]
    for trainer in range(trainers):
        commands.append(script_line(
            ROOT / "examples" / "dlrm_bagpipe.py", "--worker-id", str(1 + trainer), "--training-worker-id",
            str(trainer), "--world-size", str(size), "--world-size-trainers", str(trainers), "--master-port", port,
            "--dist-port", dist_port, "--emb-info-file", str(emb_info), "--emb-size", "8", "--cache-size", str(CACHE),
            "--lookahead-value", "20", "--optimizer", "adagrad", "--lr", str(config.lr), "--seed", str(config.seed),
            *model, *([] if ddp else ["--no-ddp"])))
    (tmp_path / "roles").mkdir()
    run_job(commands, cwd=tmp_path / "roles", timeout=180, env=dict(os.environ))
    ours = export(config.run_dir, tmp_path / "ours.pt")
    assert_same_parameters(ours, reference_of(config, tmp_path / "reference"))


def test_torchrun_starts_every_role_from_one_command_line(small_binary, tmp_path):
    """torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT and serves its own store; `bagpipe role` uses them."""
    config = job_config(small_binary, tmp_path / "run", iterations=40, trainers=1, servers=1)
    job = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "-m", "bagpipe.cli",
         "role", "--world-size-trainers", "1", "--data", str(small_binary), "--run-dir", config.run_dir,
         "--iterations", "40", "--mini-batch-size", str(BATCH), "--cache-size", str(CACHE), "--lookahead", "20",
         "--optimizer", "adagrad", "--lr", str(config.lr), "--seed", str(config.seed), "--emb-size", "8",
         "--arch-mlp-bot", config.model.arch_mlp_bot, "--arch-mlp-top", config.model.arch_mlp_top,
         "--max-eval-rows", "2000", "--timeout", "60"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    ours = export(config.run_dir, tmp_path / "ours.pt")
    assert_same_parameters(ours, reference_of(config, tmp_path / "reference"))
