"""How the roles talk: torch RPC over TensorPipe, endpoints by name, and the trainers' gloo group.

This module alone touches torch's private state (the counters ``init_rpc`` resets so that a re-formed world
meets, gloo's device and timeout options), and checks at start-up that the torch installed is one whose private
state it knows (``SUPPORTED_TORCH``, pyproject's pin). It alone reads torch's error messages too: whether a
failure was a peer's process ending (``peer_gone``) or an error its handler raised (``raised_by_handler``).

Endpoints: a role serves an object of handlers under its service name (``serve("server", handlers)``); a caller
names what it asks for by an ``Endpoint`` (runtime/endpoints.py: ``SERVER.fetch``), never by importing the role
that answers, so the roles do not import each other. Torch RPC runs only module-level functions on the callee:
two here look the handler up in this process's table of services and call it, ``_answer`` for an answer it
returns and ``_answer_later`` for one it completes later (a future: torch's ``async_execution``). A request that
arrives before its service is served (a process is in the RPC world before its role is whole) waits for it.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

log = logging.getLogger(__name__)

SUPPORTED_TORCH = ((2, 11), (2, 13))  # the torch releases whose private RPC state init_rpc resets (pyproject's pin)
SERVED_WAIT_S = 60.0  # how long a request waits for its service to be served in this process


@dataclass(frozen=True)
class Endpoint:
    """What a service answers: its ``method`` called on the handlers the service's process serves. ``later``: the
    handler returns a future, answered when it completes."""

    service: str
    method: str
    later: bool = False

    def call(self, to: str, args: tuple = (), *, timeout: float) -> object:
        """The answer of ``to`` (a process's RPC name), waited for."""
        return rpc.rpc_sync(to, _answer_later if self.later else _answer, args=(self.service, self.method, *args),
                            timeout=timeout)

    def call_async(self, to: str, args: tuple = (), *, timeout: float) -> torch.futures.Future:
        """The answer of ``to``, as a future; one that cannot be sent (this process's RPC agent is shut down: the
        world is being re-formed) is a future failed with that error, as one that failed on its way is, never an
        exception here, so that every caller's re-sending covers both."""
        try:
            return rpc.rpc_async(to, _answer_later if self.later else _answer,
                                 args=(self.service, self.method, *args), timeout=timeout)
        except RuntimeError as err:
            failed: torch.futures.Future = torch.futures.Future()
            failed.set_exception(err)
            return failed


class _Services:
    """The handlers this process serves, by service name (one object per process: torch RPC's functions find
    them here)."""

    def __init__(self) -> None:
        self._handlers: dict[str, object] = {}
        self._changed = threading.Condition()

    def serve(self, service: str, handlers: object) -> None:
        with self._changed:
            self._handlers[service] = handlers
            self._changed.notify_all()

    def withdraw(self, service: str) -> None:
        with self._changed:
            self._handlers.pop(service, None)

    def handler(self, service: str, method: str):
        with self._changed:
            if not self._changed.wait_for(lambda: service in self._handlers, timeout=SERVED_WAIT_S):
                raise RuntimeError(f"this process serves no {service!r} (asked for {method!r})")
            return getattr(self._handlers[service], method)


_SERVICES = _Services()
serve, withdraw = _SERVICES.serve, _SERVICES.withdraw


def _answer(service: str, method: str, *args):
    return _SERVICES.handler(service, method)(*args)


@rpc.functions.async_execution
def _answer_later(service: str, method: str, *args) -> torch.futures.Future:
    return _SERVICES.handler(service, method)(*args)


# How gloo, TensorPipe and a TCPStore client say that the process at the other end has ended, and how torch RPC
# marks an error that the handler raised on the callee (re-raised at the caller with the callee named first).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "EOF: end of file",
             "Connection was likely closed")
RAISED_BY_HANDLER = "On WorkerInfo("


def peer_gone(err: BaseException) -> bool:
    """Whether ``err`` is a collective (gloo), an RPC or the job's store failing because a peer's process ended: a
    symptom of that peer's failure, not a failure of the process that saw it."""
    return isinstance(err, RuntimeError) and any(text in str(err) for text in PEER_GONE)


def raised_by_handler(err: BaseException) -> bool:
    """Whether an RPC's error was raised by the handler on a live callee (its own error), not by the connection."""
    return RAISED_BY_HANDLER in str(err)


def unwrap(answer):
    """An RPC's answer; raised if it is an error: a future an ``async_execution`` handler returned that failed
    reaches its caller as the exception object (seen with the answers failed at a re-formation)."""
    if isinstance(answer, BaseException):
        raise answer
    return answer


# ---- joining the RPC world ----

_RENDEZVOUS: dict[str, tuple] = {}


def _rendezvous(url: str, **kwargs):
    """RPC's rendezvous on the store every rank already checked in at (no second port), under its epoch's prefix."""
    store, rank, world_size, epoch = _RENDEZVOUS["store"]
    yield dist.PrefixStore(f"bagpipe/rpc/{epoch}", store), rank, world_size


dist.register_rendezvous_handler("bagpipe", _rendezvous)


def check_torch(version: str = torch.__version__) -> None:
    """Refuse a torch outside SUPPORTED_TORCH, naming the range: re-forming the RPC world resets state that
    torch keeps privately, which another release may name or keep otherwise."""
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_TORCH
    if not (low_major, low_minor) <= (major, minor) <= (high_major, high_minor):
        raise RuntimeError(f"bagpipe's runtime supports torch {low_major}.{low_minor} to {high_major}.{high_minor}, "
                           f"this is torch {version}: install torch>={low_major}.{low_minor},"
                           f"<{high_major}.{high_minor + 1}")


def init_rpc(name: str, *, rank: int, world_size: int, store: dist.Store, timeout: float, interface: str | None,
             epoch: int = 0, transports: tuple[str, ...] = ("uv",), channels: tuple[str, ...] = ()) -> None:
    """Join the RPC world (TensorPipe) of ``epoch`` as ``name`` through ``store``, listening on ``interface``'s
    address (None: TensorPipe's choice; TP_SOCKET_IFNAME, where set, wins). ``transports``, ``channels``:
    TensorPipe's, by name (``channels`` empty: its own choice)."""
    check_torch()
    if interface is not None:  # (GLOO_: the gloo group that torch's RPC makes at init takes its devices from it)
        os.environ.setdefault("TP_SOCKET_IFNAME", interface)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    _RENDEZVOUS["store"] = (store, rank, world_size, epoch)
    # torch prefixes each init_rpc of a process with how many it made before, and numbers the all-gathers it
    # makes (one in init_rpc) per process: a replacement's first init must meet the survivors' second, so the
    # epoch's prefix above does the first's job and both counts start again at 0 in every process of the world
    rpc._init_counter = 0
    rpc.api._all_gather_sequence_id.clear()
    rpc.api._all_gather_sequence_id_to_states.clear()
    # (TensorPipe's shared-memory transport busy-polls: on a few cores it takes CPU from compute, measured ~13% more
    # CPU per iteration over the whole job than "uv", which is TCP: the job's default, config.rpc_transports)
    extra = {"_transports": list(transports)}
    if channels:
        extra["_channels"] = list(channels)
    log.info("RPC over TensorPipe: transports %s, channels %s", ",".join(transports),
             ",".join(channels) or "TensorPipe's choice")
    options = rpc.TensorPipeRpcBackendOptions(init_method="bagpipe://job", num_worker_threads=16,
                                              rpc_timeout=timeout, **extra)
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)


def shutdown_rpc() -> None:
    """Leave the RPC world at once (waits for the handlers it runs)."""
    rpc.shutdown(graceful=False)


def gloo_group(store: dist.Store, prefix: str, rank: int, size: int, *, timeout: float,
               interface: str | None) -> dist.ProcessGroup:
    """A gloo group of ``size`` ranks meeting under ``prefix`` in ``store``, apart from any default process group,
    on ``interface`` (None: gloo's default device; GLOO_SOCKET_IFNAME, where set, wins)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout)
    chosen = ([name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
              or ([interface] if interface is not None else []))
    options._devices = ([dist.ProcessGroupGloo.create_device(interface=name) for name in chosen]
                        or [dist.ProcessGroupGloo.create_default_device()])
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)


class AgentAnswers:
    """The answers of a process's ``async_execution`` handlers, as its current RPC agent waits on them. A future an
    agent waits on must not outlive it (completing it later runs the dead agent's callback), so a re-formation fails
    them (``leave``) before the agent is shut down, and fails at once those of the requests the agent still takes
    until then; ``reopen`` once it is gone."""

    def __init__(self) -> None:
        self._pending: set = set()  # handed to the agent, not completed yet
        self._leaving: int | None = None  # the epoch being formed, from ``leave`` until ``reopen``
        self._lock = threading.Lock()

    def answer(self, future: torch.futures.Future) -> torch.futures.Future:
        """A future of the current agent's own, completed with ``future``'s result, or failed if the agent is shut
        down for a re-formation first."""
        proxy: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._leaving is not None:  # a request taken while the agent is shut down: sent again by its caller
                proxy.set_exception(self._reformed(self._leaving))
                return proxy
            self._pending.add(proxy)
        future.add_done_callback(functools.partial(self._pass_on, proxy))
        return proxy

    def _pass_on(self, proxy: torch.futures.Future, future: torch.futures.Future) -> None:
        with self._lock:
            if proxy not in self._pending:  # failed at a re-formation already
                return
            self._pending.discard(proxy)
            try:
                proxy.set_result(future.value())
            except BaseException as err:  # noqa: BLE001 - the caller's RPC gets it
                proxy.set_exception(err)

    def leave(self, epoch: int) -> None:
        """The agent is about to be shut down for the RPC world of ``epoch``: fail every answer it waits on, and
        every one asked for until ``reopen``."""
        with self._lock:
            pending, self._pending, self._leaving = self._pending, set(), epoch
            for proxy in pending:
                proxy.set_exception(self._reformed(epoch))

    def reopen(self) -> None:
        with self._lock:
            self._leaving = None

    @staticmethod
    def _reformed(epoch: int) -> RuntimeError:
        return RuntimeError(f"the job's RPC world is re-formed (epoch {epoch})")
