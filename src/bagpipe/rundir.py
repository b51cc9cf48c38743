"""A run directory: config, metrics as JSON lines, the trained model (``model/``), and summary.json written last.

A run owns its directory. A new run refuses a directory that holds anything, unless asked to
replace a run there (``overwrite``), and it clears the old run only after every check has passed.
``summary.json`` is written last, atomically: a run dir with one holds a finished run; without
one, an unfinished run whose other files are not to be presented as results.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
from pathlib import Path

from bagpipe.files import save_torch, writing
from bagpipe.health import RunWarning
from bagpipe.runlock import LOCK  # (torch: imported where needed, so that a refused export answers at once)

log = logging.getLogger(__name__)

SUMMARY = "summary.json"
WARNING = "warning"  # the metrics log's event of a warning about the run's health (RunDir.warn)
MARKER = ".bagpipe-run"  # written first into every run dir: --overwrite deletes only directories holding it


def prepare_run_dir(path: str | Path, *, overwrite: bool) -> Path:
    """Make ``path`` an empty run dir: refuse one that holds anything, unless ``overwrite`` replaces a run."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--run-dir {path} is a file, not a directory")
    held = sorted(p.name for p in path.iterdir() if p.name != LOCK) if path.is_dir() else []
    if held:
        what = "a finished run" if (path / SUMMARY).is_file() else "an unfinished run" if (path / MARKER).exists() \
            else f"files that are not a bagpipe run ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''})"
        if not overwrite:
            raise ValueError(f"--run-dir {path} already holds {what}: pass --overwrite to replace it, "
                             f"or choose another --run-dir")
        if not (path / MARKER).exists():
            raise ValueError(f"--run-dir {path} holds {what}: --overwrite only replaces a bagpipe run; "
                             f"choose an empty or new directory")
        for child in (child for child in path.iterdir() if child.name != LOCK):  # the lock is this run's now
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text("")
    return path


def finite_or_null(value):
    """``value`` with every float that is not finite (NaN, inf) replaced by None, in dicts and lists too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def is_finished(path: str | Path) -> bool:
    return (Path(path) / SUMMARY).is_file()


def write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with writing(path):
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        with open(tmp) as handle:
            os.fsync(handle.fileno())
    tmp.replace(path)


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
        self._logging = threading.Lock()  # events are logged from RPC and background threads too

    def write_json(self, name: str, payload: dict) -> None:
        (self.path / name).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")

    def forget_metrics_after(self, iteration: int) -> None:
        """Drop the metrics logged past ``iteration`` (a resumed run logs those iterations again)."""
        self._metrics.close()
        forget_metrics_after(self.path, iteration)
        self._metrics = open(self.path / "metrics.jsonl", "a")

    def log_metrics(self, **record) -> None:
        record.setdefault("time", round(time.time(), 3))
        line = json.dumps(record) + "\n"
        with self._logging:
            self._metrics.write(line)
            self._metrics.flush()

    def warn(self, warning: RunWarning) -> None:
        """Say ``warning`` (health.py's) in the log, and record it in the metrics log (summary.json lists them)."""
        log.warning("%s", warning.message)
        self.log_metrics(event=WARNING, **warning.to_dict())

    def records(self) -> list[dict]:
        """Every whole record of the metrics log, in the order logged."""
        records = []
        for line in (self.path / "metrics.jsonl").read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records

    def warnings(self) -> list[dict]:
        """The warnings the run has recorded (``warn``): kind, iteration and message each, by iteration."""
        found = [{name: r[name] for name in ("kind", "iteration", "message")}
                 for r in self.records() if r.get("event") == WARNING]
        return sorted(found, key=lambda w: w["iteration"])

    def evaluated_iterations(self) -> set[int]:
        """The iterations the metrics log has an evaluation (``eval`` record) of."""
        return {record["iteration"] for record in self.records() if record.get("event") == "eval"}

    def last_train_loss(self) -> float | None:
        """The last training loss the metrics log holds (a resumed run with nothing left to train reports it)."""
        loss = None
        for line in (self.path / "metrics.jsonl").read_text().splitlines():
            try:
                loss = json.loads(line).get("train_loss", loss)
            except json.JSONDecodeError:
                continue
        return loss

    def finish(self, summary: dict) -> None:
        """Write summary.json, the mark of a finished run: the last file a run writes. It is strict JSON: a
        figure that does not exist (a hit rate with no lookups) is null, never NaN."""
        self._metrics.close()
        write_json_atomic(self.path / SUMMARY, finite_or_null(summary))

    def close(self) -> None:
        self._metrics.close()


def sweep_working_files(run_dir: str | Path, storage: Path) -> list[Path]:
    """Remove what a run keeps only while it runs, and return what was there: its tables' working files
    (``storage``: RUN_DIR/storage, or the run's directory in --storage-dir) and files and checkpoints it was
    writing (``*.tmp``). Called with the run dir locked: at the start of a run or a resume (what a killed run
    left: SIGKILL cannot be caught), and when a run ends or is interrupted."""
    from bagpipe.train.checkpoints import checkpoints_dir

    run_dir = Path(run_dir)
    found = [storage] if storage.exists() else []
    found += [*run_dir.glob("*.tmp"), *checkpoints_dir(run_dir).glob("*.tmp")]
    for path in found:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)
    return found


def forget_metrics_after(run_dir: str | Path, iteration: int) -> None:
    """Drop the lines of a run's metrics log past ``iteration``, and any torn line (atomically)."""
    path = Path(run_dir) / "metrics.jsonl"
    kept = [line for line in path.read_text().splitlines() if _logged_by(line, iteration)]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def _logged_by(line: str, iteration: int) -> bool:
    """Whether a metrics line is whole and about an iteration up to ``iteration`` (a kill may tear the last)."""
    try:
        return json.loads(line).get("iteration", 0) <= iteration
    except json.JSONDecodeError:
        return False


def export(run_dir: str | Path, out: str | Path) -> dict:
    """Write ``{"dense": state_dict, "embeddings": [one tensor per table]}`` of a finished run as one .pt,
    assembled from its model directory (every table read into memory: for models that fit in it), each file
    checked against its checksum. Written beside ``out`` and renamed: a failed export leaves no partial file
    at ``out``, nor harms one there."""
    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / MARKER).exists() and not (run_dir / "config.json").is_file():
        raise ValueError(f"--run-dir {run_dir} is not a bagpipe run dir (no {MARKER} or config.json)")
    if not is_finished(run_dir):
        raise ValueError(f"{run_dir}: not a finished run (no {SUMMARY}): it was interrupted, failed or is "
                         f"still running")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory: name the .pt file to write")
    from bagpipe.model_dir import MODEL_DIR, ModelDir  # (torch: loaded once the arguments are checked)

    model = ModelDir.open(run_dir / MODEL_DIR)

    def unwritable(err: OSError) -> ValueError:
        why = "part of its path is a file, not a directory" if isinstance(err, (NotADirectoryError, FileExistsError)) \
            else os.strerror(err.errno).lower() if err.errno else str(err)
        return ValueError(f"cannot write --out {out}: {why}")

    tmp = out.with_name(out.name + ".tmp")
    try:  # before the model is read (minutes for a large one): an --out that cannot be written fails at once
        out.parent.mkdir(parents=True, exist_ok=True)
        handle = open(tmp, "wb")
    except OSError as err:
        raise unwritable(err) from None
    try:
        exported = model.load()
        try:
            save_torch(exported, handle)
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
            tmp.replace(out)
        except OSError as err:
            raise unwritable(err) from None
    except BaseException:
        try:
            handle.close()
        except OSError:  # what it held could not be written either: the file goes
            pass
        tmp.unlink(missing_ok=True)
        raise
    return exported
