"""Shared fixtures: small synthetic data sets made once per session, and one fork server for every job and every
`python -m bagpipe.cli` process a test starts (helpers/cli_processes.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# Before torch loads libgomp: its idle OpenMP threads sleep instead of spinning. Two pytest workers and the jobs'
# processes share the cores, and spinning threads took them from each other (test_sequences + test_models, -n 2:
# 92 s by default, 48 s passive). `make test` sets it for every process; this covers a plain `pytest`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

from helpers import cli_processes  # noqa: E402
from bagpipe.runtime import launch
from bagpipe.runtime.forkserver import ForkServer

from bagpipe.data.prepare import ensure_preprocessed
from bagpipe.data.preprocess import preprocess
from bagpipe.synth import generate, resolve_table_sizes
from bagpipe.synth_sequences import generate_sequences


@pytest.fixture(scope="session")
def small_tsv(tmp_path_factory):
    """A learnable TSV data set: Criteo's 26 tables capped at 40 rows, 40k train rows."""
    out = tmp_path_factory.mktemp("small_tsv")
    sizes = resolve_table_sizes(tables=None, table_sizes=None, max_rows_per_table=40)
    generate(out, rows=40_000, test_rows=10_000, seed=3, table_sizes=sizes, show_progress=False)
    return out


@pytest.fixture(scope="session")
def small_binary(small_tsv, tmp_path_factory):
    out = tmp_path_factory.mktemp("small_bin")
    preprocess(small_tsv, out, show_progress=False)
    return out


@pytest.fixture(scope="session")
def wide_tsv(tmp_path_factory):
    """Criteo's 26 tables capped at 20k rows (~230k rows in all), 60k train rows: room for the default
    model, cache (5% of rows) and optimizer at a small batch."""
    out = tmp_path_factory.mktemp("wide_tsv")
    sizes = resolve_table_sizes(tables=None, table_sizes=None, max_rows_per_table=20_000)
    generate(out, rows=60_000, test_rows=6_000, seed=1, table_sizes=sizes, show_progress=False)
    return out


@pytest.fixture(scope="session")
def sequence_data(tmp_path_factory):
    """8000 users of 20 interactions over 300 items in 8 genres, preprocessed."""
    out = tmp_path_factory.mktemp("sequences")
    generate_sequences(out, users=8000, items=300, interactions=20, seed=1, genres=8, show_progress=False)
    return ensure_preprocessed(out, show_progress=False)


class _SessionForkServer(ForkServer):
    """One fork server for the whole session: every job a test launches in this process forks its roles from it,
    so torch and bagpipe are imported once, not once per job. A job's ``close`` leaves it running."""

    def close(self) -> None:
        pass

    def close_for_good(self) -> None:
        super().close()


class _LazyForkServer:
    """The session's fork server, started when a test first asks for a process (``make test-unit`` never does)."""

    def __init__(self) -> None:
        self.server: _SessionForkServer | None = None

    def __getattr__(self, name: str):
        if self.server is None:
            self.server = _SessionForkServer(env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
        return getattr(self.server, name)

    def close(self) -> None:
        """(A job refused before any role started closes a server it never used: that starts none.)"""

    def close_for_good(self) -> None:
        if self.server is not None:
            self.server.close_for_good()


@pytest.fixture(scope="session", autouse=True)
def session_fork_server():
    forks = _LazyForkServer()
    job_fork_server = launch.ForkServer
    launch.ForkServer = lambda env=None: forks
    cli_processes.use(forks)  # ... and every `python -m bagpipe.cli` a test starts itself
    try:
        yield forks
    finally:
        launch.ForkServer = job_fork_server
        forks.close_for_good()


# -- the test tiers: a test that starts a process (a job, a CLI command in a child, git) lives in tests/integration/,
# whose tests are all marked `processes`; tests/unit/ (`make test-unit`) holds the others. A test elsewhere that
# starts one fails, so the tier stays what it says. BAGPIPE_RECORD_PROCESS_TESTS=FILE lists such tests in FILE
# instead of failing them.

_INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if _INTEGRATION in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.processes)

_RECORD = os.environ.get("BAGPIPE_RECORD_PROCESS_TESTS")
# programs a library starts on its own, once per machine, whichever test first imports it: matplotlib lists the
# fonts (fc-list) to build its font cache (seen on a fresh GPU machine, in test_single's command-line test)
_NOT_OURS = frozenset({"fc-list"})


@pytest.fixture(autouse=True)
def _processes_tier(request, monkeypatch):
    started: list[str] = []
    real_popen_init, real_fork, real_start = subprocess.Popen.__init__, os.fork, ForkServer.start

    def popen_init(self, *args, **kwargs):
        command = args[0] if args else kwargs.get("args")
        if not (isinstance(command, (list, tuple)) and command and command[0] in _NOT_OURS):
            started.append(f"subprocess {command!r}")
        real_popen_init(self, *args, **kwargs)

    def fork():
        started.append("os.fork")
        return real_fork()

    def start(self, argv, **kwargs):
        started.append(f"a forked {' '.join(map(str, argv[:2]))}")
        return real_start(self, argv, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen_init)
    monkeypatch.setattr(os, "fork", fork)
    monkeypatch.setattr(ForkServer, "start", start)
    yield
    marked = request.node.get_closest_marker("processes") is not None
    if started and not marked:
        if _RECORD:
            with open(_RECORD, "a") as record:
                record.write(request.node.nodeid + "\n")
        else:
            pytest.fail(f"started processes outside tests/integration ({started[0]}, {len(started)} in all): move it "
                        f"there (make test-unit runs tests/unit, which start none)")


@pytest.fixture
def conversions(monkeypatch):
    """The directories ``preprocess`` converted, in order."""
    calls = []

    def spy(input_path, out_dir, **kwargs):
        calls.append(input_path)
        return real(input_path, out_dir, **kwargs)

    import bagpipe.data.prepare as prepare

    real = prepare.preprocess
    monkeypatch.setattr(prepare, "preprocess", spy)
    return calls
