"""Issue 24's adversarial list, re-run through the CLI as a user would meet it: a table of case -> outcome.

    .venv/bin/python benchmarks/adversarial_runs.py [--work-dir runs/adversarial] [--out FILE.json]
        [--only SUBSTRING]
    make adversarial

Every case runs `python -m bagpipe.cli ...` in subprocesses on tiny synthetic data (20,000 rows, tables of
at most 200 rows), in the mode the issue names (reference, single or bagpipe), and checks what a user
would see: the exit status, the one error line, the time to a refusal, files byte for byte untouched (hash
trees before and after), no process left (RUN_DIR/pids.json and the lock's holder), no working file left,
summary.json strict JSON. Faults come from BAGPIPE_FAULTS (bagpipe/faults.py); signals are sent by pid.
A full or read-only disk is a small tmpfs (mount needs root: a case that cannot mount is SKIPPED). Prints
`case | mode | expected | outcome | OK/FAIL` and the count, and exits 1 if any case FAILs; --out writes
the results, with each failed case's commands and the end of their stderr, as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

TRAIN = ("--batch-size", "128", "--emb-dim", "8", "--checkpoint-every", "10", "--iterations", "60", "--no-progress")
CACHED = ("--cache-rows", "2000")  # single and bagpipe: a cache of about half the 3,806 rows
FAULT_ROLE = {"reference": "reference", "single": "reference", "bagpipe": "trainer0"}  # who a fault names
REFUSAL_S = 5.0  # the time --mode single took to refuse a resume past --iterations (the issue): the bound
STOP_S = 5.0  # from a signal to the exit, when no checkpoint is being written
RUN_TIMEOUT_S = 300.0
LOCK = ".bagpipe-lock"


class Skipped(Exception):
    """The case cannot run here (no tmpfs mount): reported as SKIPPED with the reason."""


class FixtureFailed(Exception):
    """A run the case starts from could not be made."""


@dataclass
class Done:
    """A finished command: its exit status, output and wall time."""

    command: list[str]
    code: int
    out: str
    err: str
    seconds: float

    def errors(self) -> list[str]:
        """The ERROR lines of its log, without their time and role."""
        return [line.split(" ERROR ", 1)[1] for line in self.err.splitlines() if " ERROR " in line]

    def error(self) -> str:
        return (self.errors() or [""])[0]

    def evidence(self) -> dict:
        return {"command": " ".join(self.command), "exit": self.code, "seconds": round(self.seconds, 2),
                "stderr_tail": self.err.splitlines()[-12:]}


@dataclass
class Running:
    """A command started in the background; ``finish`` waits for it."""

    command: list[str]
    process: subprocess.Popen
    out_path: Path
    err_path: Path
    started: float

    @property
    def pid(self) -> int:
        return self.process.pid

    def finish(self, timeout: float = RUN_TIMEOUT_S) -> Done:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
        seconds = time.monotonic() - self.started
        return Done(self.command, code, self.out_path.read_text(errors="replace"),
                    self.err_path.read_text(errors="replace"), seconds)


@dataclass
class Case:
    """One case's directory, its checks and the commands it ran."""

    name: str
    directory: Path
    problems: list[str] = field(default_factory=list)
    commands: list[Done] = field(default_factory=list)

    def plain(self, text: str) -> str:
        """``text`` with this case's directory left out of its paths, for the table."""
        return short(text.replace(f"{self.directory}/", ""), 70)

    def check(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.problems.append(problem)
        return ok

    def start(self, *args: str, faults: str = "") -> Running:
        number = len(list(self.directory.glob("cmd*.err")))
        out, err = self.directory / f"cmd{number}.out", self.directory / f"cmd{number}.err"
        command = [sys.executable, "-m", "bagpipe.cli", *map(str, args)]
        env = dict(os.environ, BAGPIPE_FAULTS=faults) if faults else {k: v for k, v in os.environ.items()
                                                                      if k != "BAGPIPE_FAULTS"}
        with open(out, "w") as out_file, open(err, "w") as err_file:
            process = subprocess.Popen(command, stdout=out_file, stderr=err_file, env=env)
        return Running(command, process, out, err, time.monotonic())

    def run(self, *args: str, faults: str = "", timeout: float = RUN_TIMEOUT_S) -> Done:
        done = self.start(*args, faults=faults).finish(timeout)
        self.commands.append(done)
        return done

    def finish(self, running: Running, timeout: float = RUN_TIMEOUT_S) -> Done:
        done = running.finish(timeout)
        self.commands.append(done)
        return done


# -- what the checks look at ----------------------------------------------------------------------------------

def tree_hash(root: Path, *, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Every file under ``root`` (by relative path, ``skip`` names left out) and its SHA-256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name not in skip}


def changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


def strict_json(path: Path) -> dict:
    """``path`` read as strict JSON: NaN and Infinity are refused."""
    def refuse(constant: str):
        raise ValueError(f"{path} holds {constant}: not strict JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def run_pids(run_dir: Path) -> dict[str, int]:
    """The run's processes: its roles (pids.json) and the lock's holder."""
    pids = {}
    with contextlib.suppress(OSError, ValueError):
        pids.update(json.loads((run_dir / "pids.json").read_text()))
    with contextlib.suppress(OSError, ValueError, KeyError):
        pids["lock holder"] = json.loads((run_dir / LOCK).read_text())["pid"]
    return pids


def lock_held(run_dir: Path) -> bool:
    """Whether a process holds the run dir's lock (asked of the kernel, with a lock taken and let go at once)."""
    if not (run_dir / LOCK).exists():
        return False
    fd = os.open(run_dir / LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def wait_for(condition, *, timeout: float, running: Running | None = None) -> bool:
    """Poll ``condition`` until it holds; False at ``timeout`` or once ``running`` has ended without it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if running is not None and running.process.poll() is not None:
            return condition()
        time.sleep(0.1)
    return False


def leftovers(run_dir: Path, *, files: bool = True) -> list[str]:
    """What a run that has ended left behind: live processes, a held lock, and (``files``) working files
    (*.tmp, the tables')."""
    pids = run_pids(run_dir)
    wait_for(lambda: not any(alive(pid) for pid in pids.values()), timeout=10)
    found = [f"{name} (pid {pid}) still alive" for name, pid in pids.items() if alive(pid)]
    found += ["the run dir's lock is still held"] if lock_held(run_dir) else []
    if not files:
        return found
    found += [str(p) for p in (*run_dir.glob("*.tmp"), *(run_dir / "checkpoints").glob("*.tmp"))]
    storage = run_dir / "storage"
    found += [f"{storage}: {short(' '.join(sorted(p.name for p in storage.rglob('*'))))}"] if storage.exists() else []
    return found


def tables_in_tmp() -> set[str]:
    """The tables' files the issue found in the temporary directory (bagpipe-table-<random>.rows)."""
    return {p.name for p in Path(tempfile.gettempdir()).glob("bagpipe-table-*.rows")}


def flip_a_byte(path: Path) -> None:
    """One bit of ``path`` changed in place, its size and mtime kept (as a disk's fault leaves them)."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def newest_checkpoint(run_dir: Path) -> str:
    names = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*") if not p.name.endswith(".tmp"))
    return names[-1] if names else ""


def has_checkpoint(run_dir: Path, name: str) -> bool:
    return (run_dir / "checkpoints" / name / "manifest.json").is_file()


@contextlib.contextmanager
def tmpfs(where: Path, options: str):
    """A tmpfs mounted at ``where`` for the block (Skipped if it cannot be), unmounted after."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        raise Skipped(f"cannot mount a tmpfs ({mounted.stderr.strip() or mounted.returncode})")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def short(text: str, limit: int = 90) -> str:
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- the runs cases start from, each made once ------------------------------------------------------------------

class Fixtures:
    """The data and base runs, made through the CLI on first use and copied by the cases that change them."""

    def __init__(self, work: Path) -> None:
        self.work = work / "fixtures"
        self.made: dict[str, Path] = {}

    def _cli(self, name: str, *args: str, faults: str = "", expect: int = 0) -> Done:
        case = Case(name, self.work)
        self.work.mkdir(parents=True, exist_ok=True)
        done = case.run(*args, faults=faults)
        if done.code != expect:
            raise FixtureFailed(f"{name}: exit {done.code}, expected {expect}: {done.err.splitlines()[-3:]}")
        return done

    def text(self) -> Path:
        """Synthetic Criteo text splits (train.tsv, test.tsv, meta.json)."""
        if "text" not in self.made:
            out = self.work / "text"
            shutil.rmtree(out, ignore_errors=True)
            self._cli("synth", "synth", "--out", out, "--rows", "20000", "--test-rows", "2000", "--seed", "1",
                      "--max-rows-per-table", "200")
            self.made["text"] = out
        return self.made["text"]

    def binary(self) -> Path:
        """The text splits preprocessed into a directory of their own (no sources beside it)."""
        if "binary" not in self.made:
            out = self.work / "binary"
            shutil.rmtree(out, ignore_errors=True)
            self._cli("preprocess", "preprocess", "--input", self.text(), "--out", out)
            self.made["binary"] = out
        return self.made["binary"]

    def converted(self) -> Path:
        """A copy of the text splits that a run has converted (into DIR/preprocessed, its sources beside it)."""
        if "converted" not in self.made:
            out, run = self.work / "converted", self.work / "converted-run"
            for path in (out, run):
                shutil.rmtree(path, ignore_errors=True)
            shutil.copytree(self.text(), out)
            self._cli("convert", "train", "--data", out, "--run-dir", run, "--mode", "reference", *TRAIN[:-3],
                      "--iterations", "2", "--no-progress")
            self.made["converted"] = out
        return self.made["converted"]

    def run(self, mode: str, *, finished: bool) -> Path:
        """A run of 60 iterations (checkpoints every 10), finished, or failed at iteration 46 (its newest
        checkpoint at 40)."""
        name = f"{mode}-{'finished' if finished else 'unfinished'}"
        if name not in self.made:
            run_dir = self.work / name
            shutil.rmtree(run_dir, ignore_errors=True)
            faults = "" if finished else f"{FAULT_ROLE[mode]}@iteration 45:fail"
            self._cli(name, *train_args(self.binary(), run_dir, mode), faults=faults, expect=0 if finished else 1)
            if not finished and newest_checkpoint(run_dir) != "step-00000040":
                raise FixtureFailed(f"{name}: newest checkpoint {newest_checkpoint(run_dir)!r}, expected step-00000040")
            self.made[name] = run_dir
        return self.made[name]

    def copy(self, mode: str, *, finished: bool, to: Path) -> Path:
        shutil.copytree(self.run(mode, finished=finished), to, symlinks=True)
        return to


def train_args(data: Path, run_dir: Path, mode: str, *extra: str) -> list:
    return ["train", "--data", data, "--run-dir", run_dir, "--mode", mode, *TRAIN,
            *(CACHED if mode != "reference" else ()), *extra]


def resume_args(run_dir: Path, *extra: str) -> list:
    return ["train", "--run-dir", run_dir, "--resume", "--no-progress", *extra]


def expect_refusal(case: Case, done: Done, *, code: int = 2, says: tuple[str, ...] = (), within: float | None = None,
                   never: tuple[str, ...] = ("Traceback", "enforce fail")) -> str:
    """Check a refusal: its exit status, one error line saying each of ``says``, in time; the outcome text."""
    case.check(done.code == code, f"exit {done.code}, expected {code}")
    case.check(len(done.errors()) == 1, f"{len(done.errors())} error lines, expected one")
    for words in says:
        case.check(words in done.error(), f"the error line does not say {words!r}")
    for words in never:
        case.check(words not in done.err, f"stderr holds {words!r}")
    if within is not None:
        case.check(done.seconds < within, f"refused after {done.seconds:.1f} s, not under {within:.0f} s")
    return f"exit {done.code} in {done.seconds:.1f} s: {case.plain(done.error())}"


def expect_finished(case: Case, done: Done, run_dir: Path) -> dict:
    """Check a run that must finish: exit 0, summary.json strict JSON; the summary ({} if none)."""
    case.check(done.code == 0, f"exit {done.code}, expected 0 ({short(done.error())})")
    if not case.check((run_dir / "summary.json").is_file(), f"no summary.json in {run_dir}"):
        return {}
    try:
        return strict_json(run_dir / "summary.json")
    except ValueError as err:
        case.check(False, str(err))
        return {}


def expect_clean(case: Case, run_dir: Path, *, files: bool = True) -> None:
    for found in leftovers(run_dir, files=files):
        case.check(False, f"left: {found}")


def placed(fx: Fixtures, mode: str, to: Path, *, finished: bool = False) -> Path:
    """A copy of a base run at ``to`` whose config.json names ``to``, as if the run had been made there."""
    run_dir = fx.copy(mode, finished=finished, to=to)
    config = json.loads((run_dir / "config.json").read_text())
    config["run_dir"] = str(run_dir.absolute())
    (run_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return run_dir


def pause_at(mode: str, iteration: int, seconds: float) -> str:
    """A fault that holds the run at ``iteration`` (0-based, so ``iteration`` 12 follows the checkpoint at 10)."""
    return f"{FAULT_ROLE[mode]}@iteration {iteration}:pause={seconds:g}"


# -- 1. --resume runs where --run-dir says, not where config.json says --------------------------------------------

def resume_copy(case: Case, fx: Fixtures, mode: str) -> str:
    original = placed(fx, mode, case.directory / "original")
    copy = case.directory / "copy"
    shutil.copytree(original, copy, symlinks=True)
    before = tree_hash(original)
    done = case.run(*resume_args(copy))
    expect_finished(case, done, copy)
    touched = changed(before, tree_hash(original))
    case.check(not touched, f"the original changed: {short(' '.join(touched))}")
    expect_clean(case, copy)
    return (f"exit {done.code}; copy finished: {(copy / 'summary.json').is_file()}; "
            f"original files changed: {len(touched)}")


def resume_moved(case: Case, fx: Fixtures, mode: str) -> str:
    original = placed(fx, mode, case.directory / "original")
    moved = case.directory / "moved"
    original.rename(moved)
    done = case.run(*resume_args(moved))
    expect_finished(case, done, moved)
    case.check(not original.exists(), f"{original} was made again")
    case.check(mode != "bagpipe" or (moved / "logs" / "oracle0.log").is_file(), "no logs in the moved run dir")
    case.check("Traceback" not in done.err, "stderr holds a traceback")
    expect_clean(case, moved)
    return (f"exit {done.code}; moved run finished: {(moved / 'summary.json').is_file()}; "
            f"old path exists: {original.exists()}")


# -- 2. one run at a time in a run dir ------------------------------------------------------------------------

def while_running(case: Case, fx: Fixtures, mode: str, second: list) -> str:
    """Start a run held at iteration 12 (checkpoint 10 written); start ``second`` into its run dir meanwhile."""
    run_dir = case.directory / "run"
    first = case.start(*train_args(fx.binary(), run_dir, mode), faults=pause_at(mode, 12, 15))
    if not case.check(wait_for(lambda: has_checkpoint(run_dir, "step-00000010"), timeout=120, running=first),
                      "the first run never reached its checkpoint at 10"):
        case.finish(first)
        return "the first run did not get going"
    done = case.run(*second)
    outcome = expect_refusal(case, done, says=("is in use by a run still going", f"pid {first.pid}"))
    first_done = case.finish(first)
    expect_finished(case, first_done, run_dir)
    logged = [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "train_loss" in line]
    case.check(logged == sorted(set(logged)), f"metrics.jsonl logs iterations twice or out of order: {logged}")
    expect_clean(case, run_dir)
    return f"{outcome}; the first run: exit {first_done.code}"


def lock_resume(case: Case, fx: Fixtures, mode: str) -> str:
    return while_running(case, fx, mode, resume_args(case.directory / "run"))


def lock_overwrite(case: Case, fx: Fixtures, mode: str) -> str:
    return while_running(case, fx, mode, train_args(fx.binary(), case.directory / "run", mode, "--overwrite"))


# -- 3. model/ and preprocessed data are used only as they were written ------------------------------------------

def export_refused(case: Case, fx: Fixtures, damage, *, says: tuple[str, ...]) -> str:
    """Export a finished run after ``damage(run_dir)``: refused naming the file, nothing written at --out."""
    run_dir = fx.copy("reference", finished=True, to=case.directory / "run")
    damage(run_dir)
    out = case.directory / "model.pt"
    done = case.run("export", "--run-dir", run_dir, "--out", out)
    outcome = expect_refusal(case, done, says=tuple(s.format(run=run_dir) for s in says))
    case.check(not out.exists() and not out.with_name("model.pt.tmp").exists(), "export left a file at --out")
    return outcome


def model_flip_table(case: Case, fx: Fixtures, mode: str) -> str:
    return export_refused(case, fx, lambda run: flip_a_byte(run / "model" / "table_2_C3.safetensors"),
                          says=("{run}/model/table_2_C3.safetensors fails its checksum",))


def model_flip_dense(case: Case, fx: Fixtures, mode: str) -> str:
    return export_refused(case, fx, lambda run: flip_a_byte(run / "model" / "dense.safetensors"),
                          says=("{run}/model/dense.safetensors fails its checksum",))


def model_read_errors(case: Case, fx: Fixtures, mode: str) -> str:
    """Three damaged model dirs (a truncated table, a lost dense file, an invalid model.json): each error names
    its file."""
    def truncate(run: Path) -> None:
        table = run / "model" / "table_5_C6.safetensors"
        table.write_bytes(table.read_bytes()[:200])

    damages = {"truncated table": (truncate, "{run}/model/table_5_C6.safetensors"),
               "lost dense file": (lambda run: (run / "model" / "dense.safetensors").unlink(),
                                   "{run}/model/dense.safetensors"),
               "invalid model.json": (lambda run: (run / "model" / "model.json").write_text('{"format": 1,\n'),
                                      "{run}/model/model.json")}
    outcomes = []
    for name, (damage, file) in damages.items():
        sub = Case(name, case.directory / name.replace(" ", "-"))
        sub.directory.mkdir()
        export_refused(sub, fx, damage, says=(file,))
        case.commands += sub.commands
        case.problems += [f"{name}: {problem}" for problem in sub.problems]
        outcomes.append(f"{name}: exit {sub.commands[-1].code}")
    return "; ".join(outcomes) + " (each naming the file)" * (not case.problems)


def data_damaged(case: Case, fx: Fixtures, damage, *, sources: bool) -> str:
    """Train on preprocessed data ``damage``d in one file: with its sources beside it, one warning naming the
    file and the data converted again (the file as the conversion wrote it); without, refused naming it."""
    data = case.directory / "data"
    shutil.copytree(fx.converted() if sources else fx.binary(), data)
    split = data / "preprocessed" if sources else data
    before = tree_hash(split, skip=("header.json", "meta.json"))
    file = damage(split)
    args = ("train", "--data", data, "--run-dir", case.directory / "run", "--mode", "reference", *TRAIN[:-3],
            "--iterations", "2", "--no-progress")
    done = case.run(*args)
    if not sources:
        return expect_refusal(case, done, says=(str(file),))
    warned = [line for line in done.err.splitlines() if " WARNING " in line and str(file) in line]
    case.check(done.code == 0, f"exit {done.code}, expected 0 ({short(done.error())})")
    case.check(len(warned) == 1 and "converting it again" in warned[0], "no one warning naming the file")
    case.check(not changed(before, tree_hash(split, skip=("header.json", "meta.json"))),
               "the arrays converted again differ from the first conversion")
    try:
        json.loads((split / "train" / "header.json").read_text())
    except ValueError as err:
        case.check(False, f"header.json is still invalid after the run ({err})")
    return f"exit {done.code}: {case.plain(warned[0].split(' WARNING ', 1)[1]) if warned else 'no warning'}"


def flip_dense_f32(split: Path) -> Path:
    flip_a_byte(split / "train" / "dense.f32")
    return split / "train" / "dense.f32"


def invalid_header(split: Path) -> Path:
    header = split / "train" / "header.json"
    text = header.read_text()
    at = text.index('"', text.index(":")) + 1  # inside the first string value: JSON's "Invalid control character"
    header.write_text(text[:at] + "\x01" + text[at:])
    return header


def data_flip_converted(case: Case, fx: Fixtures, mode: str) -> str:
    return data_damaged(case, fx, flip_dense_f32, sources=True)


def data_flip_preprocessed(case: Case, fx: Fixtures, mode: str) -> str:
    return data_damaged(case, fx, flip_dense_f32, sources=False)


def data_header_converted(case: Case, fx: Fixtures, mode: str) -> str:
    return data_damaged(case, fx, invalid_header, sources=True)


def data_header_preprocessed(case: Case, fx: Fixtures, mode: str) -> str:
    return data_damaged(case, fx, invalid_header, sources=False)


# -- 4, 5. a resume that cannot go is refused before any role starts ----------------------------------------------

def refused_resume(case: Case, run_dir: Path, *extra: str, says: tuple[str, ...]) -> str:
    """``--resume`` refused in under 5 s, the run dir byte for byte as it was (its lock's record aside)."""
    before = tree_hash(run_dir, skip=(LOCK,))
    done = case.run(*resume_args(run_dir, *extra))
    outcome = expect_refusal(case, done, says=says, within=REFUSAL_S)
    touched = changed(before, tree_hash(run_dir, skip=(LOCK,)))
    case.check(not touched, f"the run dir changed: {short(' '.join(touched))}")
    expect_clean(case, run_dir, files=False)  # a refusal touches nothing: what a killed run left waits for a resume
    return outcome


def resume_below(case: Case, fx: Fixtures, mode: str) -> str:
    run_dir = placed(fx, mode, case.directory / "run")
    return refused_resume(case, run_dir, "--iterations", "20",
                          says=("step-00000040) is at iteration 40, past --iterations 20",))


def resume_manifests_invalid(case: Case, fx: Fixtures, mode: str) -> str:
    run_dir = placed(fx, mode, case.directory / "run")
    for manifest in (run_dir / "checkpoints").glob("step-*/manifest.json"):
        manifest.write_text(manifest.read_text()[:40])
    return refused_resume(case, run_dir, says=("has no valid checkpoint to resume from", "not whole"))


def resume_torn_first_checkpoint(case: Case, fx: Fixtures, mode: str) -> str:
    """The whole job SIGKILLed while its first checkpoint was being written, then resumed."""
    run_dir = case.directory / "run"
    faults = "oracle@committing 10:pause=60" if mode == "bagpipe" else "reference@checkpoint parts written:pause=60"
    first = case.start(*train_args(fx.binary(), run_dir, mode), faults=faults)
    staged = run_dir / "checkpoints" / "step-00000010.tmp"
    reached = wait_for(lambda: staged.is_dir() and (staged / "dense.pt").is_file(), timeout=120, running=first)
    time.sleep(1.0)  # every part written
    os.kill(first.pid, signal.SIGKILL)
    case.finish(first)
    if not case.check(reached, "the run never got to write its first checkpoint"):
        return "the first run did not get going"
    wait_for(lambda: not any(alive(pid) for pid in run_pids(run_dir).values()), timeout=10)
    return refused_resume(case, run_dir, says=("has no valid checkpoint to resume from",
                                               "step-00000010.tmp is not whole"))


# -- 6. a full disk and a read-only one --------------------------------------------------------------------------

def full_disk(case: Case, fx: Fixtures, mode: str) -> str:
    """The run dir on a 1 MiB tmpfs: config and metrics fit, a checkpoint (3.8 MB) does not."""
    with tmpfs(case.directory / "disk", "size=1m") as disk:
        done = case.run(*train_args(fx.binary(), disk / "run", mode))
        outcome = expect_refusal(case, done, code=1, says=(f"no space left on tmpfs (mounted at {disk.absolute()}) "
                                                           f"while writing {disk / 'run' / 'checkpoints'}",))
        expect_clean(case, disk / "run")
    return outcome


def storage_too_small(case: Case, fx: Fixtures, mode: str) -> str:
    """--storage disk with a --storage-dir of 64 KiB, less than the tables' files: refused in KiB, at once."""
    with tmpfs(case.directory / "disk", "size=64k") as disk:
        run_dir = case.directory / "run"
        done = case.run(*train_args(fx.binary(), run_dir, mode, "--storage", "disk", "--storage-dir", disk))
        outcome = expect_refusal(case, done, says=("KiB", "64.0 KiB free"), never=("Traceback", "0.0 GiB"))
        case.check(not run_dir.exists(), f"{run_dir} left behind (a later run would need --overwrite)")
        case.check(not any(disk.iterdir()), f"files left in {disk}")
    return outcome


def storage_read_only(case: Case, fx: Fixtures, mode: str) -> str:
    with tmpfs(case.directory / "disk", "ro,size=1m") as disk:
        run_dir = case.directory / "run"
        done = case.run(*train_args(fx.binary(), run_dir, mode, "--storage", "disk", "--storage-dir", disk))
        outcome = expect_refusal(case, done, says=("--storage-dir", "read-only file system"))
        case.check(not run_dir.exists(), f"{run_dir} left behind (a later run would need --overwrite)")
    return outcome


# -- 7. a resume with nothing left to train ----------------------------------------------------------------------

def resume_at_final(case: Case, fx: Fixtures, mode: str) -> str:
    run_dir = placed(fx, mode, case.directory / "run")
    done = case.run(*resume_args(run_dir, "--iterations", "40"))
    summary = expect_finished(case, done, run_dir)
    loss, hit_rate = summary.get("final_train_loss"), summary.get("cache_hit_rate", "absent")
    case.check(isinstance(loss, float) and math.isfinite(loss), f"final_train_loss is {loss!r}")
    case.check(hit_rate is None or isinstance(hit_rate, float), f"cache_hit_rate is {hit_rate!r}")
    expect_clean(case, run_dir)
    return f"exit {done.code}; strict JSON: {bool(summary)}; final_train_loss {loss!r}; cache_hit_rate {hit_rate!r}"


# -- 8. SIGTERM as Ctrl-C: one line, every process stopped, every working file removed -----------------------------

@dataclass
class Signal:
    """What a case sends and when: ``faults`` hold the run where ``ready`` says, then ``sig`` goes to it."""

    sig: signal.Signals
    faults: str
    ready: object  # run_dir -> bool
    within: float  # seconds from the signal to the exit


def signalled(case: Case, fx: Fixtures, mode: str, plan: Signal, *extra: str) -> str:
    run_dir = case.directory / "run"
    in_tmp = tables_in_tmp()
    first = case.start(*train_args(fx.binary(), run_dir, mode, *extra), faults=plan.faults)
    reached = wait_for(lambda: plan.ready(run_dir), timeout=120, running=first)
    os.kill(first.pid, plan.sig)
    sent = time.monotonic()
    done = case.finish(first)
    took = time.monotonic() - sent
    if not case.check(reached, f"the run never got where the signal was to be sent (exit {done.code})"):
        return "the run did not get going"
    code, line = (143, "terminated (SIGTERM)") if plan.sig == signal.SIGTERM else (130, "interrupted (Ctrl-C)")
    case.check(done.code == code, f"exit {done.code}, expected {code}")
    case.check(done.errors() == [line], f"error lines {done.errors()}, expected [{line!r}]")
    case.check("Traceback" not in done.err, "stderr holds a traceback")
    case.check(took < plan.within, f"exited {took:.1f} s after the signal, not under {plan.within:.0f} s")
    case.check(tables_in_tmp() <= in_tmp, f"new table files in {tempfile.gettempdir()}")
    expect_clean(case, run_dir)
    return (f"exit {done.code} {took:.1f} s after the signal: {short(done.error(), 30)}; "
            f"left: {len(leftovers(run_dir))} processes or files")


def checkpointed(name: str, *, storage: bool = False):
    """``run_dir`` has the checkpoint ``name`` (or, for a name ending .tmp, one being written), and with
    ``storage`` its tables' files."""
    def ready(run_dir: Path) -> bool:
        where = run_dir / "checkpoints" / name
        written = (where / "dense.pt").is_file() if name.endswith(".tmp") else (where / "manifest.json").is_file()
        return written and (not storage or any((run_dir / "storage").rglob("*.rows")))
    return ready


def sigterm_training(case: Case, fx: Fixtures, mode: str) -> str:
    return signalled(case, fx, mode, Signal(signal.SIGTERM, pause_at(mode, 12, 30), checkpointed("step-00000010"),
                                            STOP_S))


def sigterm_checkpoint_in_flight(case: Case, fx: Fixtures, mode: str) -> str:
    """SIGTERM while a checkpoint is half written (held there 5 s), the tables on disk."""
    faults = ("oracle@committing 10:pause=30" if mode == "bagpipe"
              else "reference@checkpoint parts written:pause=5")
    plan = Signal(signal.SIGTERM, faults, checkpointed("step-00000010.tmp", storage=True), 12.0)
    return signalled(case, fx, mode, plan, "--storage", "disk")


def ctrl_c(case: Case, fx: Fixtures, mode: str) -> str:
    plan = Signal(signal.SIGINT, pause_at(mode, 12, 30), checkpointed("step-00000010", storage=True), 12.0)
    return signalled(case, fx, mode, plan, "--storage", "disk")


def sigkill_then_resume(case: Case, fx: Fixtures, mode: str) -> str:
    """SIGKILL (which nothing can catch) leaves the tables' files; the resume that follows removes them."""
    run_dir = case.directory / "run"
    in_tmp = tables_in_tmp()
    first = case.start(*train_args(fx.binary(), run_dir, mode, "--storage", "disk"), faults=pause_at(mode, 25, 60))
    reached = wait_for(lambda: checkpointed("step-00000020", storage=True)(run_dir), timeout=120, running=first)
    os.kill(first.pid, signal.SIGKILL)
    case.finish(first)
    if not case.check(reached, "the run never reached its checkpoint at 20"):
        return "the run did not get going"
    left = sorted(p.name for p in (run_dir / "storage").rglob("*.rows"))
    case.check(bool(left), "the kill left no table files (nothing for the resume to remove)")
    done = case.run(*resume_args(run_dir))
    expect_finished(case, done, run_dir)
    case.check(tables_in_tmp() <= in_tmp, f"new table files in {tempfile.gettempdir()}")
    expect_clean(case, run_dir)
    return f"the kill left {len(left)} table files; resume: exit {done.code}, left: {len(leftovers(run_dir))}"


# -- 9. readers and export -------------------------------------------------------------------------------------

def bom_and_blank_last_line(case: Case, fx: Fixtures, mode: str) -> str:
    """Both splits with a UTF-8 BOM and a blank last line: converted, the arrays byte for byte those without."""
    data, out = case.directory / "text", case.directory / "binary"
    shutil.copytree(fx.text(), data)
    for split in ("train.tsv", "test.tsv"):
        (data / split).write_bytes(b"\xef\xbb\xbf" + (data / split).read_bytes() + b"\n")
    done = case.run("preprocess", "--input", data, "--out", out)
    case.check(done.code == 0, f"exit {done.code}, expected 0 ({short(done.error())})")
    differ = changed(tree_hash(fx.binary(), skip=("header.json", "meta.json")),
                     tree_hash(out, skip=("header.json", "meta.json"))) if out.is_dir() else ["all"]
    case.check(not differ, f"arrays differ from the clean file's: {differ}")
    return f"exit {done.code}; arrays differing from the clean file's: {len(differ)}"


def export_not_a_run(case: Case, fx: Fixtures, mode: str) -> str:
    elsewhere = case.directory / "notes"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("not a run\n")
    done = case.run("export", "--run-dir", elsewhere, "--out", case.directory / "model.pt")
    return expect_refusal(case, done, says=(f"--run-dir {elsewhere} is not a bagpipe run dir",),
                          never=("Traceback", "interrupted, failed or is still running"))


def export_out_directory(case: Case, fx: Fixtures, mode: str) -> str:
    run_dir = fx.copy("reference", finished=True, to=case.directory / "run")
    out = case.directory / "out"
    out.mkdir()
    done = case.run("export", "--run-dir", run_dir, "--out", out)
    outcome = expect_refusal(case, done, says=(f"--out {out} is a directory",))
    case.check(not any(out.iterdir()), f"files written into {out}")
    return outcome


def export_out_read_only(case: Case, fx: Fixtures, mode: str) -> str:
    run_dir = fx.copy("reference", finished=True, to=case.directory / "run")
    with tmpfs(case.directory / "ro", "ro,size=1m") as read_only:
        out = read_only / "model.pt"
        done = case.run("export", "--run-dir", run_dir, "--out", out)
        return expect_refusal(case, done, says=(f"cannot write --out {out}: read-only file system",))


# -- the list, and running it ------------------------------------------------------------------------------------

REFUSED = "exit 2, one line naming "
REFUSED_FAST = "exit 2 in < 5 s, one line naming "
CASES = [  # (issue item, case, mode, expected, function)
    (1, "resume-copy", "single", "exit 0; the copy finished; the original byte for byte untouched", resume_copy),
    (1, "resume-copy", "bagpipe", "exit 0; the copy finished; the original byte for byte untouched", resume_copy),
    (1, "resume-moved", "single", "exit 0; finished where moved; nothing at the old path", resume_moved),
    (1, "resume-moved", "bagpipe", "exit 0; finished where moved (logs there); nothing at the old path",
     resume_moved),
    (2, "lock-resume-while-running", "reference", REFUSED + "the holder's pid; the run finishes", lock_resume),
    (2, "lock-resume-while-running", "bagpipe", REFUSED + "the holder's pid; the run finishes", lock_resume),
    (2, "lock-overwrite-while-running", "single", REFUSED + "the holder's pid; the run finishes", lock_overwrite),
    (3, "model-flipped-byte-table", "export", "exit 2 naming table_2_C3.safetensors; no --out file",
     model_flip_table),
    (3, "model-flipped-byte-dense", "export", "exit 2 naming dense.safetensors; no --out file", model_flip_dense),
    (3, "data-flipped-byte-converted-copy", "reference", "one warning naming dense.f32; converted again; exit 0",
     data_flip_converted),
    (3, "data-flipped-byte-preprocessed-dir", "reference", "exit 2 naming train/dense.f32", data_flip_preprocessed),
    (3, "data-invalid-header-converted-copy", "reference", "one warning naming header.json; converted again; exit 0",
     data_header_converted),
    (3, "data-invalid-header-preprocessed-dir", "reference", "exit 2 naming train/header.json",
     data_header_preprocessed),
    (4, "resume-iterations-below-checkpoint", "single", REFUSED_FAST + "the checkpoint; run dir untouched",
     resume_below),
    (4, "resume-iterations-below-checkpoint", "bagpipe", REFUSED_FAST + "the checkpoint; no role started, run dir "
                                                                   "untouched", resume_below),
    (5, "resume-first-checkpoint-torn", "bagpipe", REFUSED_FAST + "step-00000010.tmp; no role started",
     resume_torn_first_checkpoint),
    (5, "resume-manifests-invalid", "bagpipe", REFUSED_FAST + "the broken checkpoints; no role started",
     resume_manifests_invalid),
    (6, "full-disk-checkpoint", "reference", "exit 1: 'no space left on tmpfs (mounted at ...) while writing ...'; "
                                             "no .tmp", full_disk),
    (6, "full-disk-checkpoint", "bagpipe", "exit 1: 'no space left on tmpfs (mounted at ...) while writing ...'; "
                                           "no .tmp, no process", full_disk),
    (6, "storage-dir-too-small", "single", REFUSED + "sizes in KiB; no run dir left", storage_too_small),
    (6, "storage-dir-too-small", "bagpipe", REFUSED + "sizes in KiB; no run dir left", storage_too_small),
    (6, "storage-dir-read-only", "single", REFUSED + "'read-only file system'; no run dir left", storage_read_only),
    (6, "storage-dir-read-only", "bagpipe", REFUSED + "'read-only file system'; no run dir left", storage_read_only),
    (7, "resume-at-final-iteration", "single", "exit 0; strict JSON, a final_train_loss, no NaN", resume_at_final),
    (7, "resume-at-final-iteration", "bagpipe", "exit 0; strict JSON, a final_train_loss, no NaN", resume_at_final),
    (8, "sigterm-while-training", "reference", "exit 143 in < 5 s, one line; no process, lock free",
     sigterm_training),
    (8, "sigterm-checkpoint-in-flight-disk", "single", "exit 143, one line; no storage/, no .tmp, nothing in /tmp",
     sigterm_checkpoint_in_flight),
    (8, "sigterm-checkpoint-in-flight-disk", "bagpipe", "exit 143, one line; no shard files, no .tmp, no process",
     sigterm_checkpoint_in_flight),
    (8, "ctrl-c-disk", "bagpipe", "exit 130, one line; no shard files, no process", ctrl_c),
    (8, "sigkill-then-resume-disk", "single", "the resume finishes and removes the tables' files",
     sigkill_then_resume),
    (9, "bom-and-blank-last-line", "preprocess", "exit 0; arrays byte for byte the clean file's",
     bom_and_blank_last_line),
    (9, "export-not-a-run-dir", "export", "exit 2: 'is not a bagpipe run dir'", export_not_a_run),
    (9, "export-out-a-directory", "export", "exit 2 naming --out as a directory; no torch line",
     export_out_directory),
    (9, "export-out-read-only", "export", "exit 2: 'cannot write --out ...: read-only file system'",
     export_out_read_only),
    (9, "model-read-errors-named", "export", "truncated table, lost dense file, bad model.json: exit 2 naming each",
     model_read_errors),
]


def run_case(item: int, name: str, mode: str, expected: str, function, fixtures: Fixtures, work: Path) -> dict:
    """Run one case in a directory of its own (removed again unless it failed); its row of the table."""
    directory = work / "cases" / f"{name}-{mode}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    case = Case(name, directory)
    started = time.monotonic()
    try:
        outcome = function(case, fixtures, mode)
        status = "FAIL" if case.problems else "OK"
    except Skipped as why:
        outcome, status = f"skipped: {why}", "SKIPPED"
    except Exception as err:  # noqa: BLE001 - a case that cannot be run is a failed case, and the table goes on
        outcome, status = f"{type(err).__name__}: {err}", "FAIL"
        case.problems.append(outcome)
    if status != "FAIL":
        shutil.rmtree(directory, ignore_errors=True)
    return {"item": item, "case": name, "mode": mode, "expected": expected, "outcome": outcome, "status": status,
            "seconds": round(time.monotonic() - started, 1), "problems": case.problems,
            "evidence": [done.evidence() for done in case.commands] if status == "FAIL" else []}


def table(results: list[dict]) -> str:
    lines = ["| # | case | mode | expected | outcome | result |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['item']} | {r['case']} | {r['mode']} | {r['expected']} | {short(r['outcome'], 120)} | "
              f"{r['status']} |" for r in results]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="runs/adversarial", help="where the data, runs and cases go")
    parser.add_argument("--out", default=None, help="a JSON file of the results")
    parser.add_argument("--only", default=None, help="run only the cases whose name or mode holds this")
    args = parser.parse_args()
    work = Path(args.work_dir).absolute()
    chosen = [c for c in CASES if args.only is None or args.only in f"{c[1]} {c[2]}"]
    fixtures = Fixtures(work)
    started = time.monotonic()
    results = []
    for item, name, mode, expected, function in chosen:
        results.append(run_case(item, name, mode, expected, function, fixtures, work))
        print(f"{results[-1]['status']:7} {name} ({mode}) {results[-1]['seconds']} s", file=sys.stderr, flush=True)
    counts = {status: sum(r["status"] == status for r in results) for status in ("OK", "FAIL", "SKIPPED")}
    print(table(results))
    print(f"\n{counts['OK']} OK, {counts['FAIL']} FAIL, {counts['SKIPPED']} SKIPPED of {len(results)} cases "
          f"in {time.monotonic() - started:.0f} s")
    for failed in (r for r in results if r["status"] == "FAIL"):
        print(f"\nFAIL {failed['case']} ({failed['mode']}):\n  " + "\n  ".join(failed["problems"]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "counts": counts,
                                              "seconds": round(time.monotonic() - started, 1),
                                              "cases": results}, indent=2) + "\n")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
