"""Jobs across hosts (bagpipe.hosts: network namespaces joined by a bridge, as root), and the multi-machine recipe of
docs/distributed.md run as written across them. Skipped where namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from bagpipe import hosts as hosts_module
from bagpipe.config import config_from_dict
from bagpipe.hosts import Hosts, machines, placed, read_recipe
from bagpipe.rundir import export
from helpers.cli_processes import in_host
from helpers.jobs import assert_same_parameters, reference_of
from helpers.paths import REPO


@pytest.fixture
def can_make_hosts():
    ok, why = hosts_module.available()
    if not ok:
        pytest.skip(why)


def _connects(hosts: Hosts, source: str, target: str, port: int, timeout: float = 1.5) -> bool:
    probe = (f"import socket\ntry:\n socket.create_connection(({hosts.address(target)!r}, {port}), timeout={timeout})"
             f"\nexcept OSError:\n raise SystemExit(1)")
    return subprocess.run(hosts.command(source, [sys.executable, "-c", probe]), capture_output=True).returncode == 0


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
    return {line.split(" ")[0] for line in listed if line}


def test_hosts_reach_each_other_over_their_links_which_fail_on_demand_and_are_removed(can_make_hosts):
    with Hosts(["a", "b"]) as hosts:
        made = {hosts.switch, hosts["a"].namespace, hosts["b"].namespace}
        assert made <= _namespaces()  # two hosts and the switch (other tests may be making their own meanwhile)
        listener = hosts.popen("a", [sys.executable, "-c",
                                     f"import socket, time\ns = socket.socket()\ns.bind(({hosts.address('a')!r}, 9000))"
                                     f"\ns.listen()\nwhile True: s.accept()"])
        deadline = time.monotonic() + 20
        while not _connects(hosts, "b", "a", 9000) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _connects(hosts, "b", "a", 9000)
        # the listener is on a's link address, not on b's loopback: b's own 127.0.0.1 is not a
        assert hosts.run("b", [sys.executable, "-c", "from bagpipe.runtime.world import reach; "
                                                     f"print(*reach({hosts.address('a')!r}))"]).stdout.split() == [
            hosts.address("b"), hosts_module.LINK]
        hosts.link_down("b")
        assert not _connects(hosts, "b", "a", 9000)
        hosts.link_up("b")
        assert _connects(hosts, "b", "a", 9000, timeout=5.0)
        assert hosts.pids("a") == [listener.pid]
        assert hosts.lose("a") == [listener.pid]
        assert listener.wait(timeout=10) == -9
    assert not made & _namespaces()


def test_namespaces_of_a_maker_that_died_are_swept(can_make_hosts):
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"bph{gone.pid}-0000-x"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in hosts_module.sweep()
    assert stale not in _namespaces()


def test_the_multi_machine_recipe_runs_as_written_across_hosts(can_make_hosts, small_binary, tmp_path):
    steps = read_recipe((REPO / "docs" / "distributed.md").read_text())
    assert [step.argv[1] for step in steps] == ["store", "oracle", "server", "trainer", "trainer"]
    assert len(machines(steps)) == 4  # the oracle's, a server's, one per trainer
    (tmp_path / "data").symlink_to(small_binary)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with Hosts(machines(steps)) as hosts:
        roles = []
        for host, args in placed(steps, hosts):
            with open(tmp_path / f"{args[0]}-{host}.log", "w") as log:
                roles.append(in_host(hosts, host, args, cwd=tmp_path, env=env, output=log))
        codes = [role.wait(timeout=240) for role in roles]
    logs = {path.name: path.read_text()[-2000:] for path in tmp_path.glob("*.log")}
    assert codes == [0] * len(roles), logs
    run_dir = tmp_path / "runs" / "job"
    config = config_from_dict(json.loads((run_dir / "config.json").read_text()))
    assert (config.trainers, config.servers, config.epochs) == (2, 1, 1)
    assert json.loads((run_dir / "summary.json").read_text())["iterations"] > 10
    config = dataclasses.replace(config, data=str(small_binary))  # the recipe's is relative to the roles' directory
    assert_same_parameters(export(run_dir, tmp_path / "export.pt"), reference_of(config, tmp_path / "reference"))


def test_a_hosts_link_can_be_cut_from_some_hosts_and_delayed(can_make_hosts):
    if not hosts_module.can_drop() or shutil.which("ethtool") is None:
        pytest.skip("partitions need iptables and delay ethtool (apt-get install iptables ethtool)")
    with Hosts(["a", "b", "c"]) as hosts:
        for host in ("a", "c"):
            hosts.popen(host, [sys.executable, "-c", f"import socket\ns = socket.socket()\n"
                                                     f"s.bind(({hosts.address(host)!r}, 9000))\ns.listen()\n"
                                                     f"while True: s.accept()[0].close()"])
        deadline = time.monotonic() + 20
        while not (_connects(hosts, "b", "a", 9000) and _connects(hosts, "b", "c", 9000)):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        hosts.isolate("b", ["a"])  # a partition between b and a alone
        assert not _connects(hosts, "b", "a", 9000) and _connects(hosts, "b", "c", 9000)
        hosts.isolate("b", [])
        assert _connects(hosts, "b", "a", 9000, timeout=5.0)
        timing = ("import socket, time\nstarted = time.perf_counter()\n"
                  f"socket.create_connection(({hosts.address('a')!r}, 9000), timeout=5)\n"
                  "print(time.perf_counter() - started)")
        before = float(hosts.run("b", [sys.executable, "-c", timing]).stdout)
        hosts.delay("b", 50.0)  # each way: a connection's handshake crosses b's link twice
        after = sorted(float(hosts.run("b", [sys.executable, "-c", timing]).stdout) for _ in range(3))
        assert before < 0.05 and 0.09 < after[1] < 0.5, (before, after)
