"""A run directory: config, metrics as JSON lines, summary.json, checkpoint and export."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

CHECKPOINT = "checkpoint.pt"


class RunDir:
    def __init__(self, path: str | Path, *, append: bool = False) -> None:
        """Open a run dir; a fresh one (``append`` False) starts an empty metrics log.

        Metrics are appended (O_APPEND), so several processes of one job may log to the same file.
        """
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        if not append:
            (self.path / "metrics.jsonl").write_text("")
        self._metrics = open(self.path / "metrics.jsonl", "a")

    def write_json(self, name: str, payload: dict) -> None:
        (self.path / name).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")

    def log_metrics(self, **record) -> None:
        record.setdefault("time", round(time.time(), 3))
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()

    def save_checkpoint(self, *, dense: dict, embeddings: list[torch.Tensor], extra: dict) -> None:
        payload = {"dense": dense, "embeddings": embeddings, **extra}
        tmp = self.path / (CHECKPOINT + ".tmp")
        torch.save(payload, tmp)
        tmp.replace(self.path / CHECKPOINT)

    def close(self) -> None:
        self._metrics.close()


def export(run_dir: str | Path, out: str | Path) -> dict:
    """Write ``{"dense": state_dict, "embeddings": [one tensor per table]}`` from a finished run."""
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise ValueError(f"{run_dir}: no {CHECKPOINT}; did the run finish?")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    exported = {"dense": checkpoint["dense"], "embeddings": checkpoint["embeddings"]}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(exported, out)
    return exported
