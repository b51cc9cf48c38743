"""The fork server (runtime/forkserver.py): a forked child is the process a fresh interpreter would be, its exit
status comes back as subprocess reports it, and no child outlives the server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bagpipe.runtime.forkserver import ForkServer, ForkServerError
from helpers.paths import HELPERS


@pytest.fixture(scope="module")
def forks():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HELPERS), os.environ.get("PYTHONPATH")])))
    with ForkServer(env=env, preload=("torch", "bagpipe.faults", "forked_entry"), entry="forked_entry:main") as server:
        yield server


def _run(forks: ForkServer, tmp_path: Path, *argv: str, env: dict | None = None, **kwargs) -> tuple[int, str, str]:
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        child = forks.start(list(argv), env=env or dict(os.environ), stdout=stdout.fileno(), stderr=stderr.fileno(),
                            **kwargs)
    code = child.wait(timeout=60)
    return code, out.read_text(), err.read_text()


def test_a_child_gets_its_own_arguments_environment_directory_streams_threads_and_faults(forks, tmp_path):
    env = dict(os.environ, ONLY_HERE="yes", OMP_NUM_THREADS="3", BAGPIPE_FAULTS="trainer1@iteration 4:kill")
    code, out, err = _run(forks, tmp_path, "report", "--flag", env=env, cwd=str(tmp_path))
    report = json.loads(out)
    assert code == 0 and err == "to stderr\n"
    assert report["argv"] == report["sys_argv"] == ["report", "--flag"]
    assert report["cwd"] == str(tmp_path) and report["env"] == "yes" and report["threads"] == 3
    assert report["faults"] == [["trainer1", "iteration 4"]]
    # the next child sees its own request only, not the previous one's
    code, out, _ = _run(forks, tmp_path, "report", env=dict(os.environ, OMP_NUM_THREADS="1"))
    again = json.loads(out)
    assert (again["env"], again["threads"], again["faults"]) == (None, 1, []) and again["pid"] != report["pid"]


def test_a_script_runs_as_python_script_args_would_run_it(forks, tmp_path):
    """A Python file given instead of the entry point: run as __main__ with its own argv, its folder first on the
    path (a module beside it imports), its directory the one asked for, and its SystemExit as the exit status."""
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "beside.py").write_text("WHERE = 'beside'\n")
    (folder / "train.py").write_text(
        "import json, os, sys\nimport beside\n"
        "if __name__ == '__main__':\n"
        "    print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], 'cwd': os.getcwd(), 'beside': beside.WHERE}))\n"
        "    sys.exit(int(sys.argv[-1]))\n")
    code, out, err = _run(forks, tmp_path, "--epochs", "3", "4", script="scripts/train.py", cwd=str(tmp_path))
    assert code == 4, err
    assert json.loads(out) == {"argv": [str(folder / "train.py"), "--epochs", "3", "4"], "path0": str(folder),
                               "cwd": str(tmp_path), "beside": "beside"}
    # a thread the script leaves running (not a daemon) ends before the process does, as with `python SCRIPT`
    (folder / "writer.py").write_text(
        "import threading, time\n"
        "def write():\n    time.sleep(0.5)\n    print('written', flush=True)\n"
        "threading.Thread(target=write).start()\n")
    code, out, err = _run(forks, tmp_path, script="scripts/writer.py", cwd=str(tmp_path))
    assert (code, out) == (0, "written\n"), err


def test_exit_statuses_come_back_as_subprocess_reports_them(forks, tmp_path):
    assert _run(forks, tmp_path, "exit", "3")[0] == 3
    code, _, err = _run(forks, tmp_path, "raise")
    assert code == 1 and "RuntimeError: raised in the child" in err
    sleeper = forks.start(["sleep", "60"], env=dict(os.environ))
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.2)
    sleeper.send_signal(signal.SIGTERM)
    assert sleeper.wait(timeout=30) == -signal.SIGTERM and sleeper.returncode == -signal.SIGTERM
    sleeper.kill()  # (ended: nothing is sent to a pid that may be another process's by now)


def test_a_child_keeps_only_its_streams_and_the_descriptors_passed_to_it(forks, tmp_path):
    kept, other = tmp_path / "kept", tmp_path / "other"
    with open(kept, "w") as keep, open(other, "w"):
        code, out, _ = _run(forks, tmp_path, "fds", pass_fds=(keep.fileno(),))
    held = json.loads(out)
    assert code == 0 and str(kept) in held and str(other) not in held
    assert not any("socket" in name for name in held), held  # not the server's channels to other children


def test_children_do_not_outlive_the_server():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HELPERS), os.environ.get("PYTHONPATH")])))
    server = ForkServer(env=env, preload=("forked_entry",), entry="forked_entry:main")
    sleeper = server.start(["sleep", "120"], env=env)
    assert sleeper.poll() is None
    server.close()
    assert sleeper.wait(timeout=30) == -signal.SIGKILL  # (as the server saw it: gone, and its children with it)
    deadline = time.monotonic() + 30
    while _alive(sleeper.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(sleeper.pid)
    with pytest.raises(ForkServerError):
        server.start(["sleep", "1"], env=env)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_process_forked_from_a_fork_server_forks_its_own_server_from_itself(forks, tmp_path):
    """A process that holds every module a server would import (forked from one: a launcher the test suite starts as
    `bagpipe train`) forks its own server from itself instead of starting an interpreter that imports them again;
    that server serves as the other does, keeps none of the process's descriptors and dies with it."""
    (tmp_path / "launcher.py").write_text(
        "import json, os, sys, time\n"
        "from bagpipe.runtime.forkserver import ForkServer, _ServerFork\n"
        "other = open(sys.argv[1], 'w')\n"
        "started = time.perf_counter()\n"
        "server = ForkServer(env=dict(os.environ), preload=('torch', 'bagpipe.faults', 'forked_entry'),\n"
        "                    entry='forked_entry:main')\n"
        "with open(sys.argv[2], 'w') as out:\n"
        "    code = server.start(['fds'], env=dict(os.environ), stdout=out.fileno()).wait(timeout=60)\n"
        "first_child_s = time.perf_counter() - started\n"
        "server_fds = sorted(os.readlink(f'/proc/{server.pid}/fd/{fd}') for fd in os.listdir(f'/proc/{server.pid}/fd'))\n"
        "sleeper = server.start(['sleep', '120'], env=dict(os.environ))\n"
        "server.close()\n"
        "print(json.dumps({'forked': isinstance(server.process, _ServerFork), 'code': code, 'server_fds': server_fds,\n"
        "                  'sleeper': sleeper.wait(timeout=30), 'first_child_s': first_child_s,\n"
        "                  'server_code': server.process.returncode}))\n")
    other, held = tmp_path / "other", tmp_path / "held"
    code, out, err = _run(forks, tmp_path, str(other), str(held), script=str(tmp_path / "launcher.py"))
    assert code == 0, err
    report = json.loads(out)
    assert report["forked"] and report["code"] == 0 and report["first_child_s"] < 10
    assert str(other) not in json.loads(held.read_text()) and str(other) not in report["server_fds"]
    assert report["sleeper"] == -signal.SIGKILL and report["server_code"] == -signal.SIGKILL
    # and a process that has not imported them starts a fresh server, as before
    server = ForkServer(env=dict(os.environ), preload=("json", "bagpipe.not_a_module_here"))
    assert isinstance(server.process, subprocess.Popen)
    server.close()
