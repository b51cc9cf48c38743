"""The job's processes and how they meet: ranks, roles, the handshake and the RPC world.

Rank 0 is the oracle, ranks 1..T the trainers, ranks T+1..T+S the embedding servers (the
original system's ``worker_id`` numbering; ``world_size`` counts them all). Rank 0 hosts a
TCPStore on ``master_port``: every process first checks in there (so a world-size mismatch or an
unreachable master is a clear error within seconds, not a hang), then joins the RPC world over
TensorPipe, whose rendezvous uses the same store. Trainers build their gradient-sync gloo group on
it too, under their own prefix, so it never touches the default process group that a user script
may create itself. One port in all: under torchrun, the agent's store on MASTER_PORT.

RPC and c10d have no authentication and unpickle what arrives: the default address is loopback,
where the store, TensorPipe and gloo listen on 127.0.0.1 only; a job spanning machines belongs on
a trusted network. Each process listens (TensorPipe, gloo) on the address it reaches the master from:
the interface the kernel routes the master's address through (``reach``), so that a job whose machines
are joined by loopback-range addresses on links of their own (the hosts of ``bagpipe.hosts``) or by
a network whose host names resolve to 127.0.1.1 (Debian's default) still meets; GLOO_SOCKET_IFNAME and
TP_SOCKET_IFNAME, where set, choose instead.
"""

from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import json
import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bagpipe.config import check_liveness, rpc_lists
from bagpipe.faults import inject_fault, set_role
from bagpipe.runtime import transport
from bagpipe.runtime.names import (BEAT_PREFIX, EPOCH_KEY, HELLO_PREFIX, JOB_KEY, JOINING_PREFIX, REFUSED_KEY,
                                   REPLACE_PREFIX, ROUTE_PREFIX, SHAPE_KEY, STATUS_KEY, STOP_KEY)
from bagpipe.runtime.reduce import TrainerGroup
from bagpipe.runtime.transport import AgentAnswers, Endpoint
from bagpipe.threads import Background

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 18000  # the original system's
ROLES = ("oracle", "server", "trainer")
RPC_FLAGS = ("--rpc-transports", "--rpc-channels")
MAX_BEAT_S = 1.0  # heartbeats: once a second, or four times per liveness window where that is shorter
TAKEOVER_MARGIN_S = 10.0  # beyond the liveness window: how long a lost data server's parity server may take


@dataclass(frozen=True, kw_only=True)
class World:
    rank: int
    world_size: int
    num_trainers: int | None  # None: a server or trainer learns it from the oracle at check-in
    master_addr: str = LOOPBACK
    master_port: int = DEFAULT_PORT
    timeout: float = 60.0
    liveness: float = 0.0  # silence after which a peer counts as lost (--liveness-s; 0: from the timeout)
    parity: int = 0  # servers in groups of `parity` data shards and one parity server (the job's; 0: none)
    epoch: int = 0  # the RPC world this process joins: 0, or a later one for a replacement (Epochs)
    # TensorPipe's transports and channels (--rpc-transports, --rpc-channels); None: the job's (every role but the
    # oracle takes them from the job it joins: job_world)
    rpc_transports: str | None = None
    rpc_channels: str | None = None

    def __post_init__(self) -> None:
        check_liveness(self.liveness, self.timeout, name="--liveness-s", timeout_name="--timeout")
        rpc_lists(self.rpc_transports, self.rpc_channels, names=RPC_FLAGS)
        if not 0 < self.master_port < 65535:
            raise ValueError(f"--master-port must be in (0, 65535), got {self.master_port}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"--worker-id {self.rank} is outside [0, {self.world_size})")
        if self.num_trainers is None:
            return
        if self.num_trainers <= 0:
            raise ValueError(f"the job needs at least one trainer, got --world-size-trainers {self.num_trainers}")
        if self.world_size < self.num_trainers + 2:
            raise ValueError(f"--world-size {self.world_size} leaves no room for an oracle and a server besides "
                             f"{self.num_trainers} trainers (world size = 1 + servers + trainers)")

    @property
    def num_servers(self) -> int:
        return self.world_size - 1 - self.num_trainers

    @property
    def num_shards(self) -> int:
        """Servers holding a shard of the rows: all of them, or with parity those before the parity servers."""
        return self.num_servers - (self.num_servers // (self.parity + 1) if self.parity else 0)

    def parity_server(self, shard: int) -> int:
        """The index (among the servers) of the parity server of data shard ``shard``'s group."""
        return self.num_shards + shard // self.parity

    def parity_group(self, shard: int) -> list[int]:
        """The data shards of ``shard``'s parity group."""
        first = shard - shard % self.parity
        return list(range(first, first + self.parity))

    @property
    def role(self) -> tuple[str, int]:
        """(role, index within the role) of this rank."""
        return self.role_of(self.rank)

    def role_of(self, rank: int) -> tuple[str, int]:
        """(role, index within the role) of ``rank``."""
        if rank == 0:
            return "oracle", 0
        if rank <= self.num_trainers:
            return "trainer", rank - 1
        return "server", rank - 1 - self.num_trainers

    @staticmethod
    def server_name(index: int) -> str:
        return f"server{index}"

    @staticmethod
    def trainer_name(index: int) -> str:
        return f"trainer{index}"

    def trainer_rank(self, index: int) -> int:
        return 1 + index

    def server_rank(self, index: int) -> int:
        return 1 + self.num_trainers + index

    def label(self, rank: int) -> str:
        """``trainer 1``: the role and index of ``rank``, as messages name it."""
        role, index = self.role_of(rank)
        return role if role == "oracle" else f"{role} {index}"

    @property
    def liveness_s(self) -> float:
        """Silence after which a peer counts as lost: --liveness-s, else well inside the timeout of any wait on it
        (half of it, within 3-10 s)."""
        return liveness_window(self.timeout, self.liveness)

    @property
    def beat_s(self) -> float:
        """How often every process beats and reads its peers' beats: four times per liveness window, at most once a
        second (a window of 1 s, the shortest, is judged on beats 0.25 s apart)."""
        return min(MAX_BEAT_S, self.liveness_s / 4)

    @property
    def replacement_s(self) -> float:
        """How long the job waits for a lost oracle's replacement to re-form its RPC world: the liveness window (the
        loss told), then the timeout (a process started, its data opened, its planner replayed)."""
        return self.liveness_s + self.timeout

    @property
    def takeover_s(self) -> float:
        """How long after a data server's loss its parity server may take to stand in (--parity): the
        liveness window and a margin for the move."""
        return self.liveness_s + TAKEOVER_MARGIN_S

    @property
    def name(self) -> str:
        role, index = self.role
        return role if role == "oracle" else f"{role}{index}"

    @property
    def is_loopback(self) -> bool:
        try:
            return ipaddress.ip_address(socket.gethostbyname(self.master_addr)).is_loopback
        except OSError:
            return False

    @property
    def interface(self) -> str | None:
        """The network interface this process reaches the master through: where it listens for the other
        processes (None where it cannot tell: the libraries' own choice)."""
        return reach(self.master_addr)[1]


def reach(address: str) -> tuple[str | None, str | None]:
    """This machine's address towards ``address`` (the source address the kernel picks for it) and the network
    interface holding it; (None, None) where either cannot be told (no route, IPv6, a name that does not resolve)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(address), 9))  # a UDP connect sends nothing: it only routes
            own = probe.getsockname()[0]
    except OSError:
        return None, None
    for _, name in socket.if_nameindex():
        if _address_of(name) == own:
            return own, name
    return own, None


def _address_of(interface: str) -> str | None:
    """``interface``'s IPv4 address (its first), None if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), 0x8915, interface.encode()[:15].ljust(256, b"\0"))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


def world_from_env(*, rank: int | None, world_size: int | None, num_trainers: int | None,
                   master_addr: str | None, master_port: int | None, timeout: float, liveness: float = 0.0,
                   rpc_transports: str | None = None, rpc_channels: str | None = None,
                   trainers_from_oracle: bool = False) -> World:
    """Flags first, then the variables torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    ``trainers_from_oracle``: the trainer count may be left out (a server's or trainer's check-in learns it).
    """
    env = os.environ

    def pick(value, name, default=None, cast=int, optional=False):
        if value is not None:
            return value
        if name in env:
            return cast(env[name])
        if default is None and not optional:
            raise ValueError(f"{name.lower().replace('_', '-')} is not set: pass the flag or set ${name}")
        return default

    return World(rank=pick(rank, "RANK"), world_size=pick(world_size, "WORLD_SIZE"),
                 num_trainers=pick(num_trainers, "BAGPIPE_TRAINERS", optional=trainers_from_oracle),
                 master_addr=pick(master_addr, "MASTER_ADDR", LOOPBACK, str),
                 master_port=pick(master_port, "MASTER_PORT", DEFAULT_PORT), timeout=timeout, liveness=liveness,
                 rpc_transports=rpc_transports, rpc_channels=rpc_channels)


def liveness_window(timeout: float, liveness: float) -> float:
    """Silence after which a peer counts as lost: ``liveness`` (--liveness-s), else well inside the timeout of any
    wait on it (half of it, within 3-10 s)."""
    return liveness or max(3.0, min(10.0, timeout / 2))


def job_world(world: World, config) -> World:
    """``world`` as the job (``config``, the oracle's) has it: its parity, its liveness window (every process judges
    silence alike: a process cut off longer than the window ends by itself as the others take it for lost), and
    its RPC transports and channels, which every process of a job shares; a ValueError if this process was given
    other ones."""
    for name, flag in zip(("rpc_transports", "rpc_channels"), RPC_FLAGS):
        mine, theirs = getattr(world, name), getattr(config, name)
        if mine is not None and mine != theirs:
            raise ValueError(f"{flag} {mine!r}: the job runs with {theirs!r} (every process of a job takes the same; "
                             f"leave it out to take the job's)")
    window = liveness_window(config.timeout, config.liveness_s)
    if world.liveness and world.liveness != window:
        raise ValueError(f"--liveness-s {world.liveness:g}: the job runs with {window:g} s (every process of a job "
                         f"takes the same; leave it out to take the job's)")
    return dataclasses.replace(world, parity=config.parity, liveness=window, rpc_transports=config.rpc_transports,
                               rpc_channels=config.rpc_channels)


def free_port() -> int:
    """A port free on loopback right now, for a listener that binds it a moment later.

    Picked below the system's ephemeral range where it can: a port the OS hands out itself (bind to
    0, outgoing connections) may be given to another process before ours binds it.
    """
    low = _ephemeral_low()
    for _ in range(200):
        port = random.SystemRandom().randrange(10_000, low) if low > 11_000 else 0
        with socket.socket() as probe:
            try:
                probe.bind((LOOPBACK, port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


_LISTENERS: list[socket.socket] = []  # sockets the master store serves on, kept open for the process


def _host_store(world: World, wait: timedelta) -> dist.TCPStore:
    """Rank 0's store; on a loopback master it listens on 127.0.0.1 only (TCPStore alone binds all)."""
    store, listener = _serve(world, wait)
    if listener is not None:
        _LISTENERS.append(listener)
    return store


def _serve(world: World, wait: timedelta) -> tuple[dist.TCPStore, socket.socket | None]:
    """A TCPStore server on the world's master address, and the socket it listens on (a loopback-range address: that
    address only, 127.0.0.1 on one machine)."""
    if not world.is_loopback:
        return dist.TCPStore(world.master_addr, world.master_port, None, True, wait, wait_for_workers=False), None
    address = socket.gethostbyname(world.master_addr)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((address, world.master_port))
    except OSError as err:
        listener.close()
        raise ConnectionError(f"cannot listen on {address}:{world.master_port}: {err}") from None
    listener.listen(1024)
    return dist.TCPStore(address, world.master_port, None, True, wait, wait_for_workers=False,
                         master_listen_fd=listener.fileno()), listener


class JobStore:
    """The job's store served apart from the oracle (by the local launcher, or ``bagpipe store``), so that it
    outlives a lost oracle, whose replacement then meets the others there. The oracle learns so from
    ``STORE_SERVED``."""

    def __init__(self, world: World) -> None:
        self.store, listener = _serve(world, timedelta(seconds=world.timeout))
        if listener is not None:
            listener.detach()  # the store closes its socket when it is destroyed

    def close(self) -> None:
        """Stop serving (the store is destroyed with its last reference: this one, for users that hold the JobStore)."""
        self.store = None


def bounded(call, *, timeout: float, what: str):
    """``call()``, given up after ``timeout`` s with a TimeoutError saying ``what`` did not happen.

    For native calls that may block past their own timeout (a TCPStore client that reached a
    listener which never answers waits forever): the call runs in a helper thread, so the caller
    can give up, and Ctrl-C still reaches it.
    """
    helper = Background(call, name="bounded")
    try:
        return helper.result(timeout)
    except TimeoutError:
        if helper.done():  # the call's own TimeoutError
            raise
        raise TimeoutError(f"{what} within {timeout:.0f} s") from None


STORE_SERVED = "BAGPIPE_STORE_SERVED"  # "1": the job's store is served apart from the oracle (JobStore)


def uses_agent_store() -> bool:
    """Under torchrun the agent already serves a store on MASTER_PORT: every rank uses that one."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def store_served_apart() -> bool:
    """The local launcher or ``bagpipe store`` serves the job's store: the oracle joins it like any role, and it
    outlives the oracle."""
    return os.environ.get(STORE_SERVED) == "1"


def connect_store(world: World, *, timeout: float) -> dist.TCPStore:
    """A client of the job's store, or a clear error within ``timeout`` seconds.

    A plain connection first, retried until the store's host listens; then the store's handshake,
    bounded, since a TCPStore client that reached another program waits forever for its answer.
    """
    where = f"{world.master_addr}:{world.master_port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((world.master_addr, world.master_port), timeout=1.0).close()
            break
        except OSError as err:
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach the oracle's store at {where} within {timeout:.0f} s "
                                      f"(is the oracle started, and the address right?): {err}") from None
            time.sleep(0.2)
    wait = max(deadline - time.monotonic(), 5.0)
    return bounded(lambda: dist.TCPStore(world.master_addr, world.master_port, None, False, timedelta(seconds=wait)),
                   timeout=wait, what=f"the program listening at {where} did not answer as the job's store "
                                      f"(is another program using that port?)")


def host_store(world: World) -> tuple[dist.TCPStore, World]:
    """The oracle's side of the check-in: serve the job's store (or join torchrun's, or the local launcher's), state
    the world's shape. Returns the store and the world: a later epoch's if this process replaces a lost oracle (the
    launcher awaits one: its store outlived the oracle)."""
    set_role(world.name)
    if uses_agent_store() or store_served_apart():
        store = connect_store(world, timeout=world.timeout)
    else:
        store = _host_store(world, timedelta(seconds=world.timeout))
    epoch = _claim(world, store, wait_s=world.liveness_s + 5.0 if store_served_apart() else 0.0)
    if epoch:
        set_role(f"{world.name}/{epoch}")
        log.warning("the oracle joins the job as the replacement of its lost process (RPC world %d)", epoch)
        return store, dataclasses.replace(world, epoch=epoch)
    store.set(SHAPE_KEY, _shape(world))
    return store, world


def check_in(world: World, role: str, *, given: dict | None = None) -> tuple[dist.TCPStore, World]:
    """Meet at the master's store; refuse a world that does not add up, before anything else runs.

    Returns the store and the world, with the trainer count the oracle states if this role was not
    given one. ``given``: the settings this role was given, for the oracle to agree (runtime.agree).
    """
    set_role(world.name if world.num_trainers is not None else f"{role}")
    if world.num_trainers is not None:
        _check_role(world, role)
    deadline = time.monotonic() + world.timeout
    store = connect_store(world, timeout=world.timeout)
    where = f"{world.master_addr}:{world.master_port}"
    theirs = json.loads(bounded(lambda: store.get(SHAPE_KEY), timeout=max(deadline - time.monotonic(), 1.0),
                                what=f"the job's store at {where} gave no world shape"))
    if world.world_size != theirs["world_size"] or world.num_trainers not in (None, theirs["trainers"]):
        raise ValueError(f"world mismatch: this {role} has world_size={world.world_size}, "
                         f"trainers={world.num_trainers}, the oracle has world_size={theirs['world_size']}, "
                         f"trainers={theirs['trainers']}")
    world = dataclasses.replace(world, num_trainers=theirs["trainers"])
    _check_role(world, role)
    set_role(world.name)
    epoch = _claim(world, store, wait_s=world.takeover_s)  # (started again by hand, maybe at once)
    if epoch:  # a replacement: faults meant for it name it NAME/EPOCH (faults.py)
        set_role(f"{world.name}/{epoch}")
        inject_fault("joining")
        log.warning("%s joins the job as the replacement of its lost process (RPC world %d)", world.name, epoch)
        return store, dataclasses.replace(world, epoch=epoch)
    store.set(f"{HELLO_PREFIX}{world.rank}", json.dumps({"role": role, "given": given or {}}))
    return store, world


def _check_role(world: World, role: str) -> None:
    expected, _ = world.role
    if role != expected:
        raise ValueError(f"--worker-id {world.rank} is the {expected} in a world of {world.world_size} with "
                         f"{world.num_trainers} trainers (0: oracle, 1..{world.num_trainers}: trainers, then "
                         f"servers), but this process was started as the {role}")


def read_hellos(world: World, store: dist.Store) -> dict[int, dict]:
    """What every other rank said at check-in: its role and the settings it was given."""
    return {rank: json.loads(store.get(f"{HELLO_PREFIX}{rank}")) for rank in range(1, world.world_size)}




def _shape(world: World) -> str:
    return json.dumps({"world_size": world.world_size, "trainers": world.num_trainers})


def _claim(world: World, store: dist.Store, *, wait_s: float = 0.0) -> int:
    """Refuse a second process that checks in with a rank another one already holds, unless the oracle awaits
    a replacement for that rank's lost process: then the epoch of the RPC world the replacement joins. ``wait_s``:
    how long a process started again soon after a loss waits for the loss to be told (the oracle asks for a
    replacement once the lost one's heartbeat has been silent for the liveness window, and a server's once its
    parity server stands in; ``bagpipe store`` tells an oracle's): cut short, refused, while the holder still beats
    (two processes given one --worker-id)."""
    if store.add(f"bagpipe/claim/{world.rank}", 1) > 1:
        wanted = f"{REPLACE_PREFIX}{world.rank}"
        beats = f"{BEAT_PREFIX}{world.rank}"
        first_beat = store.add(beats, 0)
        deadline = time.monotonic() + wait_s
        while True:
            if store.check([wanted]) and not store.check([f"{JOINING_PREFIX}{world.rank}"]):
                return int(store.get(wanted))
            if time.monotonic() >= deadline or store.add(beats, 0) != first_beat:
                break
            time.sleep(0.2)
        raise ValueError(f"--worker-id {world.rank} ({world.label(world.rank)}) is already taken by another "
                         f"process of this job: give each process its own --worker-id")
    return 0


def wait_for_ranks(world: World, store: dist.Store) -> None:
    """The oracle's wait, up to the timeout, for every other rank to check in."""
    others = [f"{HELLO_PREFIX}{r}" for r in range(1, world.world_size)]
    deadline = time.monotonic() + world.timeout
    while not all(store.check([key]) for key in others):
        if time.monotonic() > deadline:
            missing = [world.label(r) + f" (rank {r})" for r in range(1, world.world_size)
                       if not store.check([f"{HELLO_PREFIX}{r}"])]
            raise TimeoutError(f"{', '.join(missing)} of a world of {world.world_size} did not check in at "
                               f"{world.master_addr}:{world.master_port} within {world.timeout:.0f} s: are all "
                               f"roles started, with the same --world-size?")
        time.sleep(0.05)


def publish_status(store: dist.Store, text: str) -> None:
    """What the oracle is doing before the job starts, for the roles waiting on it."""
    store.set(STATUS_KEY, text)


def refuse_job(store: dist.Store, reason: str) -> None:
    """The oracle's refusal of the job (e.g. roles that disagree), for the roles waiting on it to
    report; they read it within a moment, before the oracle (and its store) are gone."""
    store.set(REFUSED_KEY, reason)
    time.sleep(2.0)


def wait_for_job(world: World, store: dist.Store) -> str:
    """The job the oracle publishes once its data is ready and every role agrees (converting a large
    data set may take a while): waited for as long as the oracle is alive, which the heartbeats
    judge, not a timeout; a ValueError if the oracle refuses the job."""
    noted = time.monotonic()
    while not store.check([JOB_KEY]):
        if store.check([REFUSED_KEY]):
            raise ValueError(f"the oracle refused the job: {store.get(REFUSED_KEY).decode()}")
        if time.monotonic() - noted > 15.0:
            status = store.get(STATUS_KEY).decode() if store.check([STATUS_KEY]) else "starting"
            log.info("waiting for the oracle: %s", status)
            noted = time.monotonic()
        time.sleep(0.1)
    return store.get(JOB_KEY).decode()


def init_rpc(world: World, store: dist.Store, *, epoch: int = 0) -> None:
    """Join the RPC world of ``epoch`` as ``world``'s rank, through ``store`` (runtime/transport.py)."""
    transports, channels = rpc_lists(world.rpc_transports, world.rpc_channels, names=RPC_FLAGS)
    transport.init_rpc(world.name, rank=world.rank, world_size=world.world_size, store=store, timeout=world.timeout,
                       interface=world.interface, epoch=epoch, transports=transports, channels=channels)


def trainer_group(world: World, store: dist.Store, index: int, *, epoch: int = 0) -> TrainerGroup | None:
    """A gloo group of the trainers alone, apart from any default process group, with its sums' thread (None for one
    trainer); a later ``epoch``'s (re-formed around a lost trainer's replacement) rendezvouses under a store prefix
    of its own."""
    if world.num_trainers == 1:
        return None
    group = transport.gloo_group(store, "bagpipe/trainers" if not epoch else f"bagpipe/trainers/{epoch}", index,
                                 world.num_trainers, timeout=world.timeout, interface=world.interface)
    return TrainerGroup(group, timeout=world.timeout)


class Epochs:
    """The job's RPC world, by epoch. Torch RPC's world is static and a dead process's name cannot be taken, so
    when the oracle has a replacement for a lost process ready it announces a new epoch (``EPOCH_KEY``): every
    process then shuts its RPC agent down and joins the new world, the replacement in the lost one's rank,
    under a store prefix of the epoch's own (as torchft re-forms its groups). Requests in flight meanwhile fail;
    ``resend_after`` tells their senders to send them again (every request that may be sent twice is idempotent:
    fetches, versioned write-backs and deltas, plan pulls acknowledged by iteration).

    A watcher thread polls the key through a store client of its own."""

    POLL_S = 0.1
    GRACE_S = 1.0  # how long a failed request waits to learn that it failed to a re-formation

    def __init__(self, world: World, store: dist.Store) -> None:
        self.world, self.epoch = world, world.epoch
        # peer name -> how long a request whose connection to it broke waits for a re-formation instead of GRACE_S:
        # a lost oracle's replacement starts, replays its planner and re-forms the world (``await_peer``)
        self.patience: dict[str, float] = {}
        self._awaiting = 0  # requests waiting out a patience now
        self._rpc_store = store  # the client init_rpc rendezvouses through
        self._store = connect_store(world, timeout=world.timeout)
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self.reformed: list[dict] = []  # (epoch, seconds): each re-formation this process took part in
        self._answers = AgentAnswers()  # those of this process's handlers, handed to the current RPC agent
        self._thread = threading.Thread(target=self._watch, name="epochs", daemon=True)
        self._thread.start()

    def announced(self) -> int:
        try:
            return int(self._store.get(EPOCH_KEY)) if self._store.check([EPOCH_KEY]) else 0
        except (RuntimeError, OSError):  # the store's host is gone: the heartbeats tell
            return self.epoch

    def stop(self) -> None:
        """Stop following epochs (before this process leaves the RPC world for good): a re-formation announced
        by now is still taken part in, since the others cannot form the new world without this process."""
        self._stop.set()
        self._thread.join()
        epoch = self.announced()
        if epoch > self.epoch:
            self._reform(epoch)

    def _watch(self) -> None:
        while not self._stop.wait(self.POLL_S):
            epoch = self.announced()
            if epoch > self.epoch:
                self._reform(epoch)

    def answer(self, future: torch.futures.Future) -> torch.futures.Future:
        """What an ``async_execution`` handler returns for ``future`` (see AgentAnswers.answer)."""
        return self._answers.answer(future)

    def _reform(self, epoch: int) -> None:
        started = time.perf_counter()
        log.info("the job's RPC world is re-formed (epoch %d): leaving epoch %d", epoch, self.epoch)
        self._answers.leave(epoch)  # while the agent that waits on them is alive (their callers send them again)
        transport.shutdown_rpc()
        self._answers.reopen()
        init_rpc(self.world, self._rpc_store, epoch=epoch)
        seconds = time.perf_counter() - started
        log.info("in the RPC world of epoch %d after %.2f s", epoch, seconds)
        with self._changed:
            self.epoch = epoch
            self.reformed.append({"epoch": epoch, "seconds": round(seconds, 3)})
            self._changed.notify_all()

    def await_peer(self, name: str) -> None:
        """Requests to ``name`` whose connection breaks wait for a new world (up to ``world.replacement_s``): a lost
        ``name`` is replaced, and the request sent again to its replacement."""
        self.patience[name] = self.world.replacement_s

    @property
    def awaiting(self) -> bool:
        """Whether some request waits for a lost peer's replacement now (see ``await_peer``)."""
        return self._awaiting > 0

    def grace(self, to: str, err: BaseException) -> float:
        """How long a request to ``to`` that failed with ``err`` waits for a re-formation: ``GRACE_S``, or the peer's
        patience when its connection broke (an error its handler raised is its own, answered by a live peer)."""
        if to in self.patience and not transport.raised_by_handler(err):
            return self.patience[to]
        return self.GRACE_S

    def resend_after(self, sent_in: int, *, grace: float | None = None) -> bool:
        """A request sent in epoch ``sent_in`` failed: True, once this process is in a later world, if the
        failure was (or may have been) the re-formation's, so the request is to be sent again; False if no new
        epoch is announced within ``grace`` (default ``GRACE_S``; the failure is the request's own)."""
        patient = grace is not None and grace > self.GRACE_S
        if patient:
            with self._changed:
                self._awaiting += 1
        try:
            return self._resend_after(sent_in, self.GRACE_S if grace is None else grace)
        finally:
            if patient:
                with self._changed:
                    self._awaiting -= 1

    def _resend_after(self, sent_in: int, grace: float) -> bool:
        deadline = time.monotonic() + grace
        while True:
            if self.epoch > sent_in:
                return True
            announced = self.announced()
            if announced > sent_in:
                with self._changed:
                    if not self._changed.wait_for(lambda: self.epoch >= announced, timeout=self.world.timeout):
                        raise TimeoutError(f"the job's RPC world was not re-formed (epoch {announced}) within "
                                           f"{self.world.timeout:.0f} s")
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def call(self, to: str, endpoint: Endpoint, args: tuple = (), *, timeout: float | None = None):
        """``endpoint`` of ``to``'s answer, the request sent again after a re-formation."""
        while True:
            sent_in = self.epoch
            try:
                return endpoint.call(to, args, timeout=timeout or self.world.timeout)
            except RuntimeError as err:
                if not self.resend_after(sent_in, grace=self.grace(to, err)):
                    raise


def join_rpc_as_replacement(world: World, store) -> Epochs | None:
    """Say this replacement is ready, and join the RPC world the oracle then re-forms around it; None if
    training ends first (the oracle announces no new world then)."""
    if not await_reformation(world, store):
        return None
    init_rpc(world, store, epoch=world.epoch)
    return Epochs(world, store)


def await_reformation(world: World, store) -> bool:
    """Say this replacement is ready and wait for the oracle to announce the RPC world it joins (``world.epoch``);
    False if training ends first."""
    store.set(f"{JOINING_PREFIX}{world.rank}", str(world.epoch))
    log.info("ready: waiting for the job's RPC world to be re-formed around this process (epoch %d)", world.epoch)
    while not (store.check([EPOCH_KEY]) and int(store.get(EPOCH_KEY)) >= world.epoch):
        if store.check([STOP_KEY]):
            log.warning("training ended before the job's RPC world was re-formed around this replacement: "
                        "it is not needed")
            return False
        time.sleep(0.05)
    return True


class NoEpochs:
    """A process that does not follow epochs (a script's trainer): every failure is the request's own."""

    epoch = 0
    reformed: list = []
    awaiting = False

    @staticmethod
    def resend_after(sent_in: int, *, grace: float | None = None) -> bool:
        return False

    @staticmethod
    def call(to: str, endpoint: Endpoint, args: tuple = (), *, timeout: float | None = None):
        return endpoint.call(to, args, timeout=timeout)

    def stop(self) -> None:
        pass




class ShardMoved(RuntimeError):
    """Answered by a server for a shard it is handing on (a lost data server's stand-in, once the replacement
    takes the shard back): the request is to be sent again where the store's route says, once it moves."""


class Routes:
    """Which server holds each data shard: its own, until the oracle moves the shard of a lost server to its
    group's parity server (``--parity``), which then serves it until a replacement process takes it back
    (``bagpipe/route/SHARD`` in the store)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self._moved: dict[int, int] = {}
        self._store = None  # a client of its own, opened when first needed
        self._lock = threading.Lock()

    def server(self, shard: int) -> int:
        return self._moved.get(shard, shard)

    def name(self, shard: int) -> str:
        return World.server_name(self.server(shard))

    def move(self, store, shard: int, to: int) -> None:
        """The oracle's side: shard ``shard`` is served by server ``to`` from now on."""
        self._moved[shard] = to
        store.set(f"{ROUTE_PREFIX}{shard}", str(to))

    def load(self, store) -> None:
        """The routes as the store has them (a lost oracle's replacement takes them over)."""
        for shard in range(self.world.num_shards):
            key = f"{ROUTE_PREFIX}{shard}"
            if store.check([key]) and int(store.get(key)) != shard:
                self._moved[shard] = int(store.get(key))

    def failover(self, shard: int, sent_to: int, err: BaseException) -> None:
        """A request for ``shard`` to server ``sent_to`` failed with ``err``: return once the shard is served by
        another server (the oracle moves it within its liveness window of the loss), else raise ``err`` (no
        parity, or no move within the timeout: the failure was not a covered loss)."""
        if not self.world.parity:
            raise err
        if not self._await_move(shard, sent_to, err, wait_s=self.world.timeout):
            raise err

    def follow(self, shard: int, sent_to: int, err: ShardMoved, *, wait_s: float = 0.5) -> None:
        """Server ``sent_to`` answered that it hands ``shard`` on: wait (up to ``wait_s``) for the store to name
        the server that has it now. Returns either way: the caller sends again where the route says (a handover
        that failed leaves the shard where it was, served again)."""
        self._await_move(shard, sent_to, err, wait_s=wait_s)

    def _await_move(self, shard: int, sent_to: int, err: BaseException, *, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        key = f"{ROUTE_PREFIX}{shard}"
        with self._lock:
            if self.server(shard) != sent_to:
                return True
            if self._store is None:
                self._store = connect_store(self.world, timeout=self.world.timeout)
            while time.monotonic() < deadline:
                if self._store.check([key]):
                    moved = int(self._store.get(key))
                    if moved != sent_to:
                        self._moved[shard] = moved
                        log.warning("shard %d is served by server %d from now on (%s)", shard, moved,
                                    str(err).splitlines()[0])
                        return True
                time.sleep(0.05)
        return False
