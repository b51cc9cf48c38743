"""The command line of a checkpointed run that resumes exactly: its length, batches and checkpoints."""

ITERATIONS = 40


def train_args(data, run_dir, optimizer: str, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--run-dir", str(run_dir), "--iterations", str(ITERATIONS),
            "--batch-size", "256", "--optimizer", optimizer, "--lr", "0.05", "--emb-dim", "8",
            "--arch-mlp-bot", "13-16-8", "--arch-mlp-top", "16-1", "--max-eval-rows", "1000", "--no-progress",
            "--checkpoint-every", "6", "--keep-checkpoints", "2", "--shuffle", "--log-every", "5", *extra]
