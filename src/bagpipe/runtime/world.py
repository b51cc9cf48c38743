"""The job's processes and how they meet: ranks, roles, the handshake and the RPC world.

Rank 0 is the oracle, ranks 1..S the embedding servers, ranks S+1..S+T the trainers (the
original system's ``worker_id`` numbering; ``world_size`` counts them all). Rank 0 hosts a
TCPStore on ``master_port``: every process first checks in there (so a world-size mismatch or an
unreachable master is a clear error within seconds, not a hang), then joins the RPC world over
TensorPipe, whose rendezvous uses the same store. Trainers build their gradient-sync gloo group on
it too, under their own prefix, so it never touches the default process group that a user script
may create itself. One port in all: under torchrun, the agent's store on MASTER_PORT.

RPC and c10d have no authentication and unpickle what arrives: the default address is loopback,
where the store, TensorPipe and gloo listen on 127.0.0.1 only; a job spanning machines belongs on
a trusted network.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.rpc as rpc

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 29500
ROLES = ("oracle", "server", "trainer")


@dataclass(frozen=True, kw_only=True)
class World:
    rank: int
    world_size: int
    num_trainers: int
    master_addr: str = LOOPBACK
    master_port: int = DEFAULT_PORT
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.num_trainers <= 0:
            raise ValueError(f"the job needs at least one trainer, got --world-size-trainers {self.num_trainers}")
        if self.world_size < self.num_trainers + 2:
            raise ValueError(f"--world-size {self.world_size} leaves no room for an oracle and a server besides "
                             f"{self.num_trainers} trainers (world size = 1 + servers + trainers)")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"--worker-id {self.rank} is outside [0, {self.world_size})")
        if not 0 < self.master_port < 65535:
            raise ValueError(f"--master-port must be in (0, 65535), got {self.master_port}")

    @property
    def num_servers(self) -> int:
        return self.world_size - 1 - self.num_trainers

    @property
    def role(self) -> tuple[str, int]:
        """(role, index within the role) of this rank."""
        if self.rank == 0:
            return "oracle", 0
        if self.rank <= self.num_servers:
            return "server", self.rank - 1
        return "trainer", self.rank - 1 - self.num_servers

    @staticmethod
    def server_name(index: int) -> str:
        return f"server{index}"

    @staticmethod
    def trainer_name(index: int) -> str:
        return f"trainer{index}"

    def trainer_rank(self, index: int) -> int:
        return 1 + self.num_servers + index

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


def world_from_env(*, rank: int | None, world_size: int | None, num_trainers: int | None,
                   master_addr: str | None, master_port: int | None, timeout: float) -> World:
    """Flags first, then the variables torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    env = os.environ

    def pick(value, name, default=None, cast=int):
        if value is not None:
            return value
        if name in env:
            return cast(env[name])
        if default is None:
            raise ValueError(f"{name.lower().replace('_', '-')} is not set: pass the flag or set ${name}")
        return default

    return World(rank=pick(rank, "RANK"), world_size=pick(world_size, "WORLD_SIZE"),
                 num_trainers=pick(num_trainers, "BAGPIPE_TRAINERS"),
                 master_addr=pick(master_addr, "MASTER_ADDR", LOOPBACK, str),
                 master_port=pick(master_port, "MASTER_PORT", DEFAULT_PORT), timeout=timeout)


def free_port() -> int:
    """A port free on loopback right now."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


_LISTENERS: list[socket.socket] = []  # sockets the master store serves on, kept open for the process


def _host_store(world: World, wait: timedelta) -> dist.TCPStore:
    """Rank 0's store; on a loopback master it listens on 127.0.0.1 only (TCPStore alone binds all)."""
    if not world.is_loopback:
        return dist.TCPStore(world.master_addr, world.master_port, None, True, wait, wait_for_workers=False)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((LOOPBACK, world.master_port))
    except OSError as err:
        listener.close()
        raise ConnectionError(f"cannot listen on {LOOPBACK}:{world.master_port}: {err}") from None
    listener.listen(1024)
    _LISTENERS.append(listener)
    return dist.TCPStore(LOOPBACK, world.master_port, None, True, wait, wait_for_workers=False,
                         master_listen_fd=listener.fileno())


def check_in(world: World, role: str) -> dist.TCPStore:
    """Meet at the master's store; refuse a world that does not add up, before anything else runs."""
    expected, _ = world.role
    if role != expected:
        raise ValueError(f"--worker-id {world.rank} is the {expected} in a world of {world.world_size} with "
                         f"{world.num_trainers} trainers, but this process was started as the {role}")
    shape = json.dumps({"world_size": world.world_size, "trainers": world.num_trainers})
    wait = timedelta(seconds=world.timeout)
    where = f"{world.master_addr}:{world.master_port}"
    # Under torchrun the agent already serves a store on MASTER_PORT: use it rather than host one.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if world.rank == 0:
        if agent_store:
            store = dist.TCPStore(world.master_addr, world.master_port, None, False, wait)
        else:
            store = _host_store(world, wait)
        store.set("bagpipe/shape", shape)
        others = [f"bagpipe/hello/{r}" for r in range(1, world.world_size)]
        deadline = time.monotonic() + world.timeout
        while not all(store.check([key]) for key in others):
            if time.monotonic() > deadline:
                missing = [r for r in range(1, world.world_size) if not store.check([f"bagpipe/hello/{r}"])]
                raise TimeoutError(f"ranks {missing} of a world of {world.world_size} did not check in at {where} "
                                   f"within {world.timeout:.0f} s: are all roles started, with the same --world-size?")
            time.sleep(0.02)
        return store
    try:
        store = dist.TCPStore(world.master_addr, world.master_port, None, False, wait)
    except (RuntimeError, OSError) as err:
        raise ConnectionError(f"cannot reach the oracle's store at {where} within {world.timeout:.0f} s "
                              f"(is the oracle started, and the address right?): {err}") from None
    theirs = json.loads(store.get("bagpipe/shape"))
    mine = json.loads(shape)
    if theirs != mine:
        raise ValueError(f"world mismatch: this {role} has world_size={mine['world_size']}, "
                         f"trainers={mine['trainers']}, the oracle has world_size={theirs['world_size']}, "
                         f"trainers={theirs['trainers']}")
    store.set(f"bagpipe/hello/{world.rank}", role)
    return store


_RENDEZVOUS: dict[str, tuple] = {}


def _rendezvous(url: str, **kwargs):
    """RPC's rendezvous on the store every rank already checked in at (no second port)."""
    store, rank, world_size = _RENDEZVOUS["store"]
    yield dist.PrefixStore("bagpipe/rpc", store), rank, world_size


dist.register_rendezvous_handler("bagpipe", _rendezvous)


def init_rpc(world: World, store: dist.Store) -> None:
    """Join the RPC world (TensorPipe) through ``store``; loopback only when the master is."""
    if world.is_loopback:
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    _RENDEZVOUS["store"] = (store, world.rank, world.world_size)
    # TensorPipe's shared-memory transport busy-polls: on a few cores it takes CPU from compute
    # (measured: ~13% more CPU per iteration over the whole job than "uv", which is TCP). The
    # environment can choose other transports and channels (comma-separated TensorPipe names).
    extra = {"_transports": os.environ.get("BAGPIPE_TP_TRANSPORTS", "uv").split(",")}
    if os.environ.get("BAGPIPE_TP_CHANNELS"):
        extra["_channels"] = os.environ["BAGPIPE_TP_CHANNELS"].split(",")
    options = rpc.TensorPipeRpcBackendOptions(init_method="bagpipe://job", num_worker_threads=16,
                                              rpc_timeout=world.timeout, **extra)
    rpc.init_rpc(world.name, rank=world.rank, world_size=world.world_size, rpc_backend_options=options)


def trainer_group(world: World, store: dist.Store, index: int) -> dist.ProcessGroup | None:
    """A gloo group of the trainers alone, apart from any default process group (None for one trainer)."""
    if world.num_trainers == 1:
        return None
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=world.timeout)
    if world.is_loopback:
        options._devices = [dist.ProcessGroupGloo.create_device(interface="lo")]
    else:
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    prefixed = dist.PrefixStore("bagpipe/trainers", store)
    return dist.ProcessGroupGloo(prefixed, index, world.num_trainers, options)
