"""Hosts on one machine: network namespaces standing in for machines, so that a job runs across hosts the way it
runs across machines, and the network between them can fail on purpose (tests, benchmarks/network_faults.py,
benchmarks/bench_network.py --layout hosts).

Each host is a network namespace with a loopback of its own (127.0.0.1 alone) and one link, ``eth0``: a veth pair
whose other end is a port of a bridge in a namespace of its own, the switch. Hosts take addresses from the loopback
range on their links (127.0.1.1, 127.0.1.2, ... /24: such addresses cross between namespaces once
``route_localnet`` is set inside them), so no address of a real network is used, and there is no route out. The
hosts share this machine's file system (as machines share a network file system) and its processes' view; only the
network is theirs.

What can be done to a host's link, from outside the job:

- ``shape(host, rate)``: a rate in both directions (tc's token bucket, on the host's side and the switch's);
- ``link_down(host)`` / ``link_up(host)``: its cable pulled at the switch and plugged back (``ip link``);
- ``drop(host, p)``: each packet in or out lost with probability ``p`` (iptables' ``statistic`` match);
- ``isolate(host, others)``: no packet between it and ``others`` (a partition; iptables);
- ``lose(host)``: every process in it killed at once, as a machine that loses power.

Needs root and iproute2 (``ip``, ``tc``); ``drop`` and ``isolate`` need iptables. ``available()`` says whether
hosts can be made here, and why not. Everything made is removed by ``close`` (the context manager's exit), at
interpreter exit, and, where a process that made hosts died without removing them, by the next one to make any.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

SUBNET = "127.0.1"  # host i (from 1) is SUBNET.i/24 on its link
LINK = "eth0"
LATENCY = "100ms"  # tbf's: how long a packet may wait in the bucket's queue before it is dropped
_PREFIX = "bph"  # namespaces: bph<pid of the process that made them>-<token>-<name>
_OWNED = re.compile(rf"^{_PREFIX}(\d+)-")


class HostsUnavailable(RuntimeError):
    """Hosts cannot be made here (not root, no iproute2, no network namespaces)."""


def available() -> tuple[bool, str]:
    """(True, "") where hosts can be made here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "making network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not on PATH"
    probe = f"{_PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return False, f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def can_drop() -> bool:
    """Whether ``drop`` and ``isolate`` can work here (iptables on PATH)."""
    return shutil.which("iptables") is not None


@dataclass(frozen=True)
class Host:
    name: str
    index: int  # from 1: its address's last byte and the switch's port number
    namespace: str

    @property
    def address(self) -> str:
        return f"{SUBNET}.{self.index}"

    @property
    def port(self) -> str:
        """The switch's end of its link (in the switch's namespace)."""
        return f"port{self.index}"


class Hosts:
    """``names`` as hosts joined by one switch, each link unshaped unless ``rate`` (tc's notation: "1gbit").
    ``popen(host, argv)`` starts a process in a host. A context manager: every namespace and process made is gone
    after it."""

    def __init__(self, names: Sequence[str], *, rate: str | None = None) -> None:
        ok, why = available()
        if not ok:
            raise HostsUnavailable(why)
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"hosts need distinct names: {list(names)}")
        if len(names) > 250:
            raise ValueError("at most 250 hosts")
        sweep()
        self._owner = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self._owner}-switch"
        self.hosts = {name: Host(name, index, f"{self._owner}-{name}") for index, name in enumerate(names, start=1)}
        self._processes: list[subprocess.Popen] = []
        self._rates: dict[str, str | None] = {}
        self._relays: dict[str, tuple[str, subprocess.Popen]] = {}  # host -> (relay namespace, relay process)
        self._closed = False
        atexit.register(self.close)
        try:
            self._make(rate)
        except BaseException:
            self.close()
            raise

    # -- making and removing --------------------------------------------------------------------------------------
    def _make(self, rate: str | None) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "switch", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "switch", "up")
        for host in self.hosts.values():
            _ip("netns", "add", host.namespace)
            _ip("-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", LINK,
                "netns", host.namespace)
            _ip("-n", self.switch, "link", "set", host.port, "master", "switch")
            _ip("-n", self.switch, "link", "set", host.port, "up")
            # loopback holds 127.0.0.1 alone, so that the rest of 127/8 is routed, over the link
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("-n", host.namespace, "addr", "del", "127.0.0.1/8", "dev", "lo")
            _ip("-n", host.namespace, "addr", "add", "127.0.0.1/32", "dev", "lo")
            self.run(host.name, ["sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1",
                                 f"net.ipv4.conf.{LINK}.route_localnet=1"])
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", LINK)
            _ip("-n", host.namespace, "link", "set", LINK, "up")
            if rate is not None:
                self.shape(host.name, rate)

    def close(self) -> None:
        """Kill every process in the hosts, then remove the namespaces (again: nothing)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        namespaces = [host.namespace for host in self.hosts.values()] + [self.switch]
        _remove(namespaces + [namespace for namespace, _ in self._relays.values()])
        for process in self._processes:
            if process.poll() is None:
                process.kill()
            process.wait()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- processes ------------------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def address(self, name: str) -> str:
        return self.hosts[name].address

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run in host ``name``."""
        return ["ip", "netns", "exec", self.hosts[name].namespace, *argv]

    def popen(self, name: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """``argv`` started in host ``name`` (``subprocess.Popen``'s other arguments as given); killed at close."""
        process = subprocess.Popen(self.command(name, argv), **kwargs)
        self._processes.append(process)
        return process

    def run(self, name: str, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """``argv`` run in host ``name`` to its end; a RuntimeError with what it said if it fails."""
        done = subprocess.run(self.command(name, argv), capture_output=True, text=True, **kwargs)
        if done.returncode:
            raise RuntimeError(f"{' '.join(argv)} in host {name}: {(done.stderr or done.stdout).strip()}")
        return done

    def pids(self, name: str) -> list[int]:
        """The processes in host ``name`` now."""
        listed = _ip("netns", "pids", self.hosts[name].namespace).stdout.split()
        return [int(pid) for pid in listed]

    # -- faults ---------------------------------------------------------------------------------------------------
    def shape(self, name: str, rate: str | None) -> None:
        """Host ``name``'s link at ``rate`` in each direction (None: unshaped)."""
        host = self.hosts[name]
        self._rates[name] = rate
        for namespace, device in ((host.namespace, LINK), (self.switch, host.port)):
            if rate is None:
                subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root"],
                               capture_output=True)
                continue
            subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root", "tbf",
                            "rate", rate, "burst", str(burst_bytes(rate)), "latency", LATENCY],
                           check=True, capture_output=True)

    def link_down(self, name: str) -> None:
        """Host ``name``'s cable pulled at the switch: nothing crosses until ``link_up``."""
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "down")

    def link_up(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "up")

    def drop(self, name: str, probability: float) -> None:
        """Each packet into or out of host ``name`` lost with ``probability`` (0: none; replaces an earlier one)."""
        if not 0.0 <= probability < 1.0:
            raise ValueError(f"a drop probability is in [0, 1): {probability}")
        self._iptables(name, "bagpipe-drop", [] if probability == 0.0 else
                       [["-m", "statistic", "--mode", "random", "--probability", repr(probability), "-j", "DROP"]])

    def isolate(self, name: str, others: Sequence[str]) -> None:
        """No packet between host ``name`` and ``others`` (a partition; empty: healed)."""
        self._iptables(name, "bagpipe-isolate",
                       [["-s" if chain_in else "-d", self.hosts[other].address, "-j", "DROP"]
                        for other in others for chain_in in (True, False)])

    def _iptables(self, name: str, chain: str, rules: list[list[str]]) -> None:
        if not can_drop():
            raise HostsUnavailable("losing packets on a link needs iptables (apt-get install iptables)")
        table = ["iptables", "-w"]
        if subprocess.run(self.command(name, [*table, "-n", "-L", chain]), capture_output=True).returncode:
            self.run(name, [*table, "-N", chain])
            self.run(name, [*table, "-A", "INPUT", "-i", LINK, "-j", chain])  # the link's packets, not loopback's
            self.run(name, [*table, "-A", "OUTPUT", "-o", LINK, "-j", chain])
        self.run(name, [*table, "-F", chain])
        for rule in rules:
            self.run(name, [*table, "-A", chain, *rule])

    def delay(self, name: str, mean_ms: float, jitter_ms: float = 0.0, *, seed: int = 0) -> None:
        """Every frame into and out of host ``name`` held ``mean_ms`` +- ``jitter_ms`` (uniform), in order in each
        direction, by a relay of our own on its link (this kernel has no netem): the link's switch end moves into a
        namespace of the relay's, joined to the switch by a veth pair of its own. Once per host; the relay goes with
        the hosts. Checksum and segmentation offloads are turned off on every host's link (ethtool), so that the
        frames it copies are whole."""
        if name in self._relays:
            raise ValueError(f"host {name}'s link is delayed already")
        if shutil.which("ethtool") is None:
            raise HostsUnavailable("delaying a link needs ethtool (apt-get install ethtool)")
        host = self.hosts[name]
        relay = f"{self._owner}-relay-{name}"
        _ip("netns", "add", relay)
        self._relays[name] = (relay, None)
        _ip("-n", self.switch, "link", "set", host.port, "netns", relay)  # the host's cable, now into the relay
        _ip("-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", "uplink", "netns", relay)
        _ip("-n", self.switch, "link", "set", host.port, "master", "switch")
        _ip("-n", self.switch, "link", "set", host.port, "up")
        for device in (host.port, "uplink", "lo"):
            _ip("-n", relay, "link", "set", device, "up")
        # a relay copies frames as they are: every host computes its checksums itself (no offload to the device,
        # which a frame read off a veth would carry unfilled) and sends no frame longer than the wire takes
        links = [(other.namespace, LINK) for other in self.hosts.values()]
        for namespace, device in links + [(relay, host.port), (relay, "uplink")]:
            subprocess.run(["ip", "netns", "exec", namespace, "ethtool", "-K", device, "tx", "off", "tso", "off",
                            "gso", "off", "gro", "off"], capture_output=True)
        if self._rates.get(name):
            self.shape(name, self._rates[name])
        process = subprocess.Popen(["ip", "netns", "exec", relay, sys.executable, "-m", "bagpipe.hosts", "relay",
                                    host.port, "uplink", repr(mean_ms / 1e3), repr(jitter_ms / 1e3), str(seed)])
        self._relays[name] = (relay, process)
        self._processes.append(process)
        time.sleep(0.2)
        if process.poll() is not None:
            raise RuntimeError(f"the relay on host {name}'s link ended at once (exit code {process.returncode})")

    def lose(self, name: str) -> list[int]:
        """Every process in host ``name`` killed at once (SIGKILL), as a machine losing power; the pids killed."""
        lost = self.pids(name)
        for pid in lost:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return lost


# -- the multi-machine recipe (docs/distributed.md), run across hosts -------------------------------------------------

RECIPE_MARK = "<!-- recipe: hosts"
_MACHINE = re.compile(r"^# machine (\w+) \((\d+\.\d+\.\d+\.\d+)\)")


@dataclass(frozen=True)
class Step:
    """One command of a recipe: the machine it runs on, that machine's address as the recipe writes it, the
    command's words."""
    machine: str
    address: str
    argv: tuple[str, ...]


def read_recipe(markdown: str) -> list[Step]:
    """The commands of the code block after ``RECIPE_MARK`` in ``markdown``, in order, each under the latest
    ``# machine NAME (ADDRESS)`` line above it (a backslash at a line's end continues it)."""
    if RECIPE_MARK not in markdown:
        raise ValueError(f"no block marked {RECIPE_MARK!r}")
    after = markdown[markdown.index(RECIPE_MARK):]
    block = after[after.index("```") + 3:]
    block = block[block.index("\n") + 1:block.index("```")].replace("\\\n", " ")
    steps, machine = [], None
    for line in block.splitlines():
        line = line.strip()
        if not line:
            continue
        heading = _MACHINE.match(line)
        if heading:
            machine = heading.groups()
            continue
        if line.startswith("#"):
            continue
        if machine is None:
            raise ValueError(f"a command before any '# machine NAME (ADDRESS)' line: {line}")
        steps.append(Step(machine[0], machine[1], tuple(shlex.split(line))))
    return steps


def machines(steps: Sequence[Step]) -> list[str]:
    """The recipe's machines, in the order it first names them."""
    return list(dict.fromkeys(step.machine for step in steps))


def placed(steps: Sequence[Step], hosts: Hosts) -> list[tuple[str, list[str]]]:
    """Each step as (host, the arguments of its ``bagpipe`` command) on ``hosts`` (named after the recipe's
    machines), every machine's address in it replaced by its host's."""
    addresses = {step.address: hosts.address(step.machine) for step in steps}
    runs = []
    for step in steps:
        if step.argv[0] != "bagpipe":
            raise ValueError(f"a recipe's commands are bagpipe's: {' '.join(step.argv)}")
        runs.append((step.machine, [addresses.get(word, word) for word in step.argv[1:]]))
    return runs


def rate_bits(rate: str) -> float | None:
    """tc's rate ("100mbit", "1gbit", "500kbit") in bits/s; None for "none" (unshaped)."""
    if rate == "none":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit|bit)", rate.strip().lower())
    if match is None:
        raise ValueError(f"a rate as tc writes it (100mbit, 1gbit, 500kbit), or none: {rate!r}")
    return float(match.group(1)) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}[match.group(2)]


def burst_bytes(rate: str) -> int:
    """tbf's bucket for ``rate``: 512 KiB (as measured on this machine at 200 Mbit/s and 1 Gbit/s), or 4 ms at the
    rate where that is more (a bucket smaller than the rate over a timer tick caps the rate below the one asked
    for)."""
    bits = rate_bits(rate)
    if bits is None:
        raise ValueError("an unshaped link has no bucket")
    return max(512 * 1024, int(bits / 8 / 250))


def sweep() -> list[str]:
    """Remove the namespaces of hosts whose maker is gone (it was killed before it could); the names removed."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    stale = []
    for line in listed:
        name = line.split(" ")[0]
        owner = _OWNED.match(name)
        if owner and not _alive(int(owner.group(1))):
            stale.append(name)
    _remove(stale)
    return stale


def _remove(namespaces: list[str]) -> None:
    for namespace in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5.0
    for namespace in namespaces:
        while (subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.strip()
               and time.monotonic() < deadline):
            time.sleep(0.05)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ip(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def relay(first: str, second: str, mean_s: float, jitter_s: float, seed: int) -> None:
    """Forward every frame arriving on interface ``first`` out of ``second`` and back, each held ``mean_s`` +-
    ``jitter_s`` (uniform; a frame never overtakes the one before it in its direction). Runs until killed."""
    import heapq
    import random
    import select
    import socket

    everything = 0x0003  # ETH_P_ALL
    sockets = []
    for device in (first, second):
        raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(everything))
        raw.bind((device, 0))
        raw.setblocking(False)
        sockets.append(raw)
    onward = {sockets[0]: sockets[1], sockets[1]: sockets[0]}
    draw = random.Random(seed)
    due: list[tuple[float, int, socket.socket, bytes]] = []
    last = {raw: 0.0 for raw in sockets}
    count = 0
    while True:
        wait = max(0.0, due[0][0] - time.monotonic()) if due else None
        ready, _, _ = select.select(sockets, [], [], wait)
        now = time.monotonic()
        for raw in ready:
            while True:
                try:
                    frame, address = raw.recvfrom(65535)
                except BlockingIOError:
                    break
                if address[2] == socket.PACKET_OUTGOING:  # our own sends, seen on the way out
                    continue
                out = onward[raw]
                at = max(now + mean_s + draw.uniform(-jitter_s, jitter_s), last[out])
                last[out] = at
                count += 1
                heapq.heappush(due, (at, count, out, frame))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, out, frame = heapq.heappop(due)
            try:
                out.send(frame)
            except OSError:  # the link is down, or a frame the device will not take: lost, as on a wire
                pass


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "relay":
        relay(sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]))
    else:
        sys.exit("usage: python -m bagpipe.hosts relay FIRST SECOND MEAN_S JITTER_S SEED")
