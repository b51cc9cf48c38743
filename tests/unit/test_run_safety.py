"""No run is ever damaged by another: a run dir's identity and lock, working files swept, SIGTERM, resume targets
checked before anything starts, full and read-only disks named (issue 24). In one process where the property
allows; processes only where a kill, a signal or the kernel's release of a lock is what is shown."""


import dataclasses
import errno
import hashlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from bagpipe import faults
from bagpipe.config import resumed_config
from bagpipe.files import WriteFailed, human_bytes, writing
from bagpipe.rundir import export
from bagpipe.runlock import LOCK, lock_run_dir
from helpers.jobs import job_config, same_export
from helpers.run_safety import train, resume, MODES


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (the lock's holder record aside) by its content's hash."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != LOCK}


def strict_json(path: Path) -> dict:
    def refuse(constant):
        raise ValueError(f"{path} holds {constant}: not strict JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture
def fail_at(monkeypatch):
    """Have this process's reference loop raise at an iteration (as a run killed there leaves its run dir)."""
    def arm(iteration: int) -> None:
        monkeypatch.setattr(faults, "_FAULTS", {("reference", f"iteration {iteration}"): ("fail", 0.0)})
        monkeypatch.setattr(faults, "_ROLE", "reference")

    def disarm() -> None:
        monkeypatch.setattr(faults, "_FAULTS", {})
    arm.disarm = disarm
    return arm


@pytest.mark.parametrize("mode", MODES)
def test_a_copied_or_moved_run_dir_resumes_where_it_is_and_never_touches_the_original(small_binary, tmp_path,
                                                                                      fail_at, mode):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert train(small_binary, whole, *MODES[mode]) == 0
    fail_at(12)
    assert train(small_binary, broken, *MODES[mode]) == 1  # checkpoints at 5 and 10, no summary
    fail_at.disarm()
    copy, moved = tmp_path / "copy", tmp_path / "moved"
    shutil.copytree(broken, copy)
    before = tree(broken)
    assert resume(copy) == 0
    assert tree(broken) == before  # the original, byte for byte
    same_export(export(whole, tmp_path / "a.pt"), export(copy, tmp_path / "b.pt"))
    broken.rename(moved)
    assert resume(moved) == 0
    assert not broken.exists()  # no stray directory at the old path
    same_export(export(whole, tmp_path / "a.pt"), export(moved, tmp_path / "c.pt"))
    assert json.loads((moved / "config.json").read_text())["run_dir"] == str(moved)


def test_a_run_dir_held_by_a_run_is_refused_to_every_other_command(small_binary, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(small_binary, run_dir, "--iterations", "6") == 0
    (run_dir / "summary.json").unlink()  # as if still going
    with lock_run_dir(run_dir):  # the run's lock, as its process holds it
        capsys.readouterr()
        for attempt in (lambda: resume(run_dir), lambda: train(small_binary, run_dir, "--overwrite"),
                        lambda: train(small_binary, run_dir, "--mode", "bagpipe", "--overwrite", "--cache-rows", "800")):
            assert attempt() == 2
            err = capsys.readouterr().err
            assert f"--run-dir {run_dir} is in use by a run still going (pid {os.getpid()} on " in err, err
        assert (run_dir / "metrics.jsonl").exists() and (run_dir / "model").is_dir()  # nothing cleared
    assert resume(run_dir, "--iterations", "6") == 0  # let go: the run dir is free again


def test_a_run_refused_at_start_leaves_no_directory_behind(small_binary, tmp_path, capsys):
    assert train(small_binary, tmp_path / "new", "--mode", "single", "--cache-rows", "10") == 2
    assert "the smallest --cache-rows that every batch fits is" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("mode", MODES)
def test_resuming_at_the_last_iteration_writes_a_strict_summary(small_binary, tmp_path, fail_at, mode):
    run_dir = tmp_path / "run"
    fail_at(12)
    assert train(small_binary, run_dir, *MODES[mode]) == 1
    fail_at.disarm()
    assert resume(run_dir, "--iterations", "10") == 0  # the checkpoint at 10: nothing left to train
    summary = strict_json(run_dir / "summary.json")
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["final_train_loss"] == [r for r in logged if "train_loss" in r][-1]["train_loss"]
    assert summary["iterations"] == 10 and summary["eval_auc"] > 0.5
    if mode != "reference":
        assert summary["cache_hit_rate"] is None  # nothing looked up: no rate, not NaN


def test_bagpipe_resume_targets_are_checked_before_any_role_starts(small_binary, tmp_path, fail_at, monkeypatch):
    """Past --iterations, and no valid checkpoint at all (torn first write, damaged manifest): refused by the
    launcher in one line, without a process started."""
    from bagpipe.runtime import launch

    run_dir = tmp_path / "run"
    fail_at(12)
    assert train(small_binary, run_dir) == 1
    fail_at.disarm()
    config = dataclasses.replace(resumed_config(str(run_dir), None, {}), mode="bagpipe", trainers=2, servers=1,
                                 cache_rows=800)

    def started(*args, **kwargs):
        raise AssertionError("a role was started")
    monkeypatch.setattr(launch.subprocess, "Popen", started)
    began = time.monotonic()
    with pytest.raises(ValueError, match=r"step-00000010\) is at iteration 10, past --iterations 8: give "
                                         r"--iterations 10 or more"):
        launch.launch_local(dataclasses.replace(config, iterations=8), show_progress=False, resume=True)
    (run_dir / "checkpoints" / "step-00000010" / "manifest.json").write_text("{not json")
    shutil.rmtree(run_dir / "checkpoints" / "step-00000005")
    (run_dir / "checkpoints" / "step-00000015.tmp").mkdir()  # a first write torn by a kill
    with pytest.raises(ValueError, match=r"no valid checkpoint to resume from: step-00000010, step-00000015.tmp "
                                         r"are not whole"):
        launch.launch_local(config, show_progress=False, resume=True)
    assert time.monotonic() - began < 5


def test_the_storage_check_names_small_sizes_and_a_read_only_directory(small_binary, tmp_path, monkeypatch):
    from collections import namedtuple

    from bagpipe import preflight
    from bagpipe.data.binary import open_dataset

    dataset = open_dataset(small_binary)
    config = job_config(small_binary, tmp_path / "run", storage="disk", storage_dir=str(tmp_path / "tables"))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: usage(10**6, 0, 1000))
    with pytest.raises(ValueError, match=r"files need \d+\.\d KiB in .*, which has 1,000 B free"):
        preflight.check_disk(config, preflight.job_layout(config, dataset))
    assert human_bytes(512) == "512 B" and human_bytes(3 * 2**20) == "3.0 MiB"


def test_the_disk_checks_count_the_model_the_run_writes_at_its_end(small_binary, tmp_path, monkeypatch):
    """The model directory (every table's rows) is written after the whole run: a disk that holds the tables' files
    but not them and the model too is refused before the run starts, and so is a run directory's disk that cannot
    hold the model of an in-memory job."""
    from collections import namedtuple
    from dataclasses import replace

    from bagpipe import preflight
    from bagpipe.data.binary import open_dataset
    from bagpipe.optim import make_row_optimizer
    from bagpipe.storage.disk import record_bytes

    dataset = open_dataset(small_binary)
    on_disk = job_config(small_binary, tmp_path / "run", storage="disk", storage_dir=str(tmp_path / "tables"))
    layout = preflight.job_layout(on_disk, dataset)
    optimizer = make_row_optimizer(on_disk.optimizer, lr=on_disk.lr)
    files = sum(space.num_rows * record_bytes(space.dim, optimizer.state_width(space.dim)) for space in layout.spaces)
    model = preflight.model_bytes(layout)
    assert model == sum(space.num_rows * space.dim * 4 for space in layout.spaces) > 0
    usage = namedtuple("usage", "total used free")
    free = {"bytes": files + model // 2}
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: usage(10**12, 0, free["bytes"]))
    with pytest.raises(ValueError, match=r"tables' files need .* \(and the model the run writes at its end into "
                                         r".*, on the same disk: .* in all\), which has"):
        preflight.check_disk(on_disk, layout)
    free["bytes"] = files + model
    preflight.check_disk(on_disk, layout)  # room for both
    in_memory = replace(on_disk, storage="memory")
    free["bytes"] = model - 1
    with pytest.raises(ValueError, match=r"the model this run writes at its end \(model/: every table's rows\) "
                                         r"needs .* which has .* free; give --run-dir on a larger disk"):
        preflight.check_memory(in_memory, dataset)
    free["bytes"] = model
    preflight.check_memory(in_memory, dataset)


def test_writing_names_the_device_and_the_file(tmp_path):
    with pytest.raises(WriteFailed, match=rf"no space left on .* while writing {tmp_path / 'x'}$"):
        with writing(tmp_path / "x"):
            raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(WriteFailed, match=rf"cannot write {tmp_path / 'y'}: .* is a read-only file system"):
        with writing(tmp_path / "y"):
            raise OSError(errno.EROFS, "Read-only file system")
    with pytest.raises(PermissionError):  # other errors pass unchanged
        with writing(tmp_path / "z"):
            raise PermissionError(errno.EACCES, "Permission denied")


# -- processes: a lock held by a live run, released by the kernel at its death; signals ------------------------


def test_an_interrupt_while_waiting_for_background_work_is_not_taken_for_its_error():
    """Ctrl-C or SIGTERM met while the main thread waits for a checkpoint write is raised as itself (it was
    reported as "writing a checkpoint failed: " with exit 1); the work's own errors still say what failed."""
    from bagpipe.runtime.exit_status import Terminated
    from bagpipe.threads import Background

    def interrupt(signum, frame):
        raise Terminated()
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Terminated):
            Background(lambda: time.sleep(1.0), name="slow write").join(failed="writing a checkpoint failed")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

    def broken():
        raise OSError("disk gone")
    with pytest.raises(RuntimeError, match="writing a checkpoint failed: disk gone"):
        Background(broken, name="write").join(failed="writing a checkpoint failed")
