"""Start processes from one that has imported torch and bagpipe once: a fork server.

A role started as ``python -m bagpipe.cli trainer ...`` spends 1.5-2 s of CPU importing torch and bagpipe
before it does anything, and a replacement started while the job goes on spends them while the job waits for it.
The local launcher (and the test suite) instead starts one fork server per job: a process that imports what
the roles need, then forks a child for each command it is sent. The child sets up what a fresh interpreter
would have (its argv, environment, working directory, stdout and stderr, signal dispositions, torch's thread
count, the faults meant for it) and runs the command's entry point, or a Python script given instead (the test
suite runs the example training scripts so); its exit status comes back to the process that asked for it.

Protocol (AF_UNIX SOCK_SEQPACKET, one message each): the client sends a JSON request with, as SCM_RIGHTS
descriptors, a fresh channel for the child, its stdin, stdout and stderr and the descriptors it keeps; the
server answers on the channel with the child's pid, and later with its exit code (``-N``: killed by signal N,
as subprocess reports it). The server is single-threaded and never runs torch ops (a fork after
the intra-op thread pool started is unsafe), and dies with the process that started it; its children die with
it (PR_SET_PDEATHSIG), so no role outlives its launcher.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import io
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback


# What a role imports: a child forked after these finds them in sys.modules. torch._inductor.config is what
# torch.use_deterministic_algorithms imports on its first call (with dynamo and sympy: ~1 s of CPU), which every
# trainer makes before its first iteration (reference.deterministic).
PRELOAD = ("torch", "torch.distributed.rpc", "torch._inductor.config", "numpy", "bagpipe.cli",
           "bagpipe.runtime.oracle.main", "bagpipe.runtime.server.main", "bagpipe.runtime.trainer.main",
           "bagpipe.runtime.launch", "bagpipe.models", "bagpipe.train.reference")
PRELOAD_IF_PRESENT = ("torch._inductor.config",)  # a speed-up only: a torch build without it still serves
ENTRY = "bagpipe.cli:main"
START_TIMEOUT_S = 120.0  # for the first answer, which waits for the server's imports
_MAX_MESSAGE = 1 << 20
_MAX_FDS = 64
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15
_CLONE_NEWNET = 0x40000000  # setns: the network namespace


class ForkServerError(RuntimeError):
    """The fork server is gone or did not answer."""


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG: this process is killed when its parent (thread) ends. Runs between fork and exec."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


class ForkServer:
    """A fork server started for this process (its child), and the client that asks it for processes.

    ``env``: the server's own environment (what libraries read as they are imported, such as OMP_NUM_THREADS,
    should match the children's); ``preload``: the modules it imports first. Thread-safe; ``close`` ends it
    and every process it started."""

    def __init__(self, *, env: dict[str, str] | None = None, preload: tuple[str, ...] = PRELOAD,
                 entry: str = ENTRY) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            if _holds(preload):  # this process is already what the server would import: fork it
                self.process: subprocess.Popen | _ServerFork = _ServerFork(theirs.fileno(), entry, preload)
            else:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "bagpipe.runtime.forkserver", str(theirs.fileno()), entry, *preload],
                    pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        self._control = ours
        self._lock = threading.Lock()
        self._started = False  # whether the server has answered once (its imports are done)

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self, argv: list[str], *, env: dict[str, str], stdout: int | None = None,
              stderr: int | None = None, stdin: int | None = None, cwd: str | None = None,
              pass_fds: tuple[int, ...] = (), name: str | None = None, script: str | None = None,
              netns: str | None = None) -> "ForkedProcess":
        """Run ``argv`` (the entry point's arguments) in a fresh child; ``stdout``/``stderr``/``stdin``:
        descriptors for it (None: /dev/null, stderr None: stdout's); ``pass_fds``: descriptors it keeps open
        (under numbers of their own); ``name``: what ps and top call it; ``script``: run this Python file with
        ``argv`` instead of the entry point, as ``python SCRIPT ARGV...`` would (a user's training script);
        ``netns``: in that named network namespace (``ip netns``: a host of bagpipe.hosts), as ``ip netns exec``."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        null = os.open(os.devnull, os.O_RDWR)
        try:
            fds = [theirs.fileno(), null if stdin is None else stdin, null if stdout is None else stdout]
            fds.append(fds[2] if stderr is None else stderr)
            fds += list(pass_fds)
            request = {"argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd(), "name": name, "netns": netns,
                       "script": None if script is None else os.path.abspath(os.path.join(cwd or os.getcwd(), script))}
            with self._lock:
                try:
                    socket.send_fds(self._control, [json.dumps(request).encode()], fds)
                except OSError as err:
                    raise ForkServerError(f"the fork server (pid {self.pid}) is gone: {err}") from None
        finally:
            theirs.close()
            os.close(null)
        timeout = 30.0 if self._started else START_TIMEOUT_S
        ready, _, _ = select.select([ours], [], [], timeout)
        answer = ours.recv(64) if ready else b""
        if not answer:
            ours.close()
            code = self.process.poll()
            why = (f"exited ({code})" if code is not None else f"did not answer within {timeout:.0f} s")
            raise ForkServerError(f"the fork server (pid {self.pid}) {why}")
        self._started = True
        return ForkedProcess(int(answer), ours, argv)

    def close(self) -> None:
        """End the server at once (its children, if any are left, die with it): killed before its control channel
        closes, since a server that saw the channel close first would end by itself, racing the kill (the way it
        ended, and what its children saw of it, then depended on which came first)."""
        self.process.kill()
        self.process.wait()
        self._control.close()

    def __enter__(self) -> "ForkServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _holds(preload: tuple[str, ...]) -> bool:
    """Whether this process may serve as the fork server's image as it is: it has imported every module of
    ``preload`` and runs one thread. That is a process forked from a fork server (a launcher the test suite
    starts as ``bagpipe train``, runtime/launch.py), before it has run any torch op; a launcher started as a fresh
    interpreter has not imported the roles' modules, and starts a fresh server instead."""
    return (hasattr(os, "fork") and threading.active_count() == 1
            and all(name in sys.modules for name in preload if name not in PRELOAD_IF_PRESENT))


class _ServerFork:
    """The fork server as a fork of this process (``_holds``): no interpreter to start and nothing to import again
    (5 s of CPU here). The fork keeps only its control channel of this process's descriptors, and none of its exit
    functions, log handlers or SIGTERM handler. Seen as the ``subprocess.Popen`` of the other way is."""

    def __init__(self, control_fd: int, entry: str, preload: tuple[str, ...]) -> None:
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid:
            return
        code = 1
        try:  # (never returns: the objects holding the closed descriptors are never collected)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.closerange(3, control_fd)
            os.closerange(control_fd + 1, os.sysconf("SC_OPEN_MAX"))
            atexit._clear()
            logging.getLogger().handlers.clear()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            serve(control_fd, entry, list(preload))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


class ForkedProcess:
    """A process the fork server started, seen as a ``subprocess.Popen`` is: ``pid``, ``returncode`` (negative:
    killed by that signal), ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, pid: int, channel: socket.socket, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self._channel = channel
        self._lock = threading.Lock()

    def _receive(self, timeout: float | None) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            ready, _, _ = select.select([self._channel], [], [], timeout)
            if not ready:
                return
            answer = self._channel.recv(64)
            # no answer: the server is gone, and its children were killed with it
            self.returncode = int(answer) if answer else -signal.SIGKILL
            self._channel.close()

    def poll(self) -> int | None:
        self._receive(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._receive(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ---- the server ----

def serve(control_fd: int, entry: str, preload: list[str]) -> None:
    """Import ``preload``, then fork a child running ``entry`` for each request, until the client hangs up."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's to handle
    control = socket.socket(fileno=control_fd)
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            if name not in PRELOAD_IF_PRESENT:
                raise
    import gc

    gc.freeze()  # what was imported stays out of the children's collections (fewer pages copied)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    channels: dict[int, socket.socket] = {}
    while True:
        try:
            readable, _, _ = select.select([control, wake_read], [], [])
        except InterruptedError:
            continue
        if wake_read in readable:
            while True:
                try:
                    if not os.read(wake_read, 512):
                        break
                except BlockingIOError:
                    break
            _reap(channels)
        if control in readable:
            try:
                data, fds, _, _ = socket.recv_fds(control, _MAX_MESSAGE, _MAX_FDS)
            except InterruptedError:
                continue
            if not data:
                break  # the client hung up: this server ends, and whatever it started with it
            request = json.loads(data)
            server_pid = os.getpid()
            pid = os.fork()
            if pid == 0:
                _run_child(request, fds, server_pid, entry, closing=[control.fileno(), wake_read, wake_write,
                                                                      *(c.fileno() for c in channels.values())])
            channel = socket.socket(fileno=fds[0])
            for fd in set(fds[1:]):
                os.close(fd)
            channels[pid] = channel
            try:
                channel.send(str(pid).encode())
            except OSError:
                pass
            _reap(channels)


def _reap(channels: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        channel = channels.pop(pid, None)
        if channel is not None:
            try:
                channel.send(str(os.waitstatus_to_exitcode(status)).encode())
            except OSError:
                pass
            channel.close()


def _run_child(request: dict, fds: list[int], server_pid: int, entry: str, *, closing: list[int]) -> None:
    """In the forked child: become the process a fresh interpreter running ``entry`` with the request's argv
    would be, run it, and exit with its status. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in closing:
            os.close(fd)
        channel, stdin, stdout, stderr, *_ = fds
        os.close(channel)
        for target, fd in ((0, stdin), (1, stdout), (2, stderr)):
            os.dup2(fd, target)
        for fd in set(fds[1:4]) - {0, 1, 2} - set(fds[4:]):
            os.close(fd)
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != server_pid:  # the server died before the line above
            os._exit(1)
        if request.get("name"):
            libc.prctl(_PR_SET_NAME, request["name"].encode()[:15])
        if request.get("netns"):
            namespace = os.open(f"/run/netns/{request['netns']}", os.O_RDONLY)
            if libc.setns(namespace, _CLONE_NEWNET):
                raise OSError(ctypes.get_errno(), f"cannot enter network namespace {request['netns']}")
            os.close(namespace)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own, open until it exits)
        sys.stdout = _text_stream(1, line_buffered=unbuffered)
        sys.stderr = _text_stream(2, line_buffered=True)
        if request.get("script"):  # as `python SCRIPT ARGV...`: its folder first on the path, run as __main__
            sys.argv = [request["script"], *request["argv"]]
            sys.path[0] = os.path.dirname(request["script"])
            _after_fork()
            runpy.run_path(request["script"], run_name="__main__")
            code = 0
            for thread in threading.enumerate():  # as an interpreter does at exit: a script's own threads end first
                if thread is not threading.main_thread() and not thread.daemon:
                    thread.join()
        else:
            module, _, function = entry.partition(":")
            sys.argv = [module, *request["argv"]]
            _after_fork()
            target = getattr(importlib.import_module(module), function)
            result = target(request["argv"])
            code = result if isinstance(result, int) else 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _text_stream(fd: int, *, line_buffered: bool) -> io.TextIOWrapper:
    return open(fd, "w", buffering=1 if line_buffered else -1, closefd=False,  # noqa: SIM115
                encoding="utf-8", errors="backslashreplace")


def _after_fork() -> None:
    """What a fresh interpreter would read from its environment as it imported, read again for this child."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    from bagpipe import faults

    faults.load()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
