"""A small run trained and resumed through the `bagpipe train` command line, in this process; the modes a run dir's
safety is checked in."""

from bagpipe.cli import main

SMALL = ["--iterations", "20", "--batch-size", "256", "--emb-dim", "8", "--arch-mlp-bot", "13-16-8",
         "--arch-mlp-top", "16-1", "--max-eval-rows", "1000", "--checkpoint-every", "5", "--log-every", "5",
         "--no-progress"]


def train(data, run_dir, *extra: str) -> int:
    return main(["train", "--data", str(data), "--run-dir", str(run_dir), *SMALL, *extra])


def resume(run_dir, *extra: str) -> int:
    return main(["train", "--run-dir", str(run_dir), "--resume", "--no-progress", *extra])


MODES = {"reference": [], "single-disk": ["--mode", "single", "--cache-rows", "800", "--storage", "disk",
                                          "--storage-budget-mb", "0.05"]}
