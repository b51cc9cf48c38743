"""Training in one process: the reference loop (reference.py), `--mode single`'s cached training (single.py),
evaluation (evaluation.py) and the checkpoint format every mode writes and reads (checkpoints.py)."""
