"""The network failing under a job across hosts (bagpipe.hosts, bagpipe.hostjobs): the shortest scenarios of
benchmarks/network_faults.py, each ending bit for bit the one-process reference. Skipped where network namespaces
cannot be made (not root, no iproute2)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from bagpipe import hosts as hosts_module
from bagpipe.config import config_from_dict
from bagpipe.hostjobs import HostJob, JobShape
from bagpipe.hosts import Hosts
from bagpipe.rundir import export
from helpers.jobs import assert_same_parameters, reference_of

# 80 iterations of 256 samples on the small data (of 156 in an epoch); a cache short of its 861 rows, so rows move every iteration
OPTIONS = ("--mini-batch-size", "256", "--iterations", "80", "--cache-size", "800", "--liveness-s", "3", "--timeout", "20",
           "--log-every", "5")
FAULT_AT = 20  # the iteration after which the fault is injected


@pytest.fixture
def can_make_hosts():
    ok, why = hosts_module.available()
    if not ok:
        pytest.skip(why)


def _run(shape: JobShape, fault, small_binary, tmp_path) -> HostJob:
    """``shape`` across hosts, ``fault(hosts)`` injected at FAULT_AT, every lost trainer or server started again
    at once (as an operator would); the job must end by itself."""
    with Hosts(shape.hosts()) as hosts:
        job = HostJob(hosts, shape, data=small_binary, cwd=tmp_path)
        job.start_all()
        job.wait_for_iteration(FAULT_AT, timeout=120)
        fault(hosts)
        ended = job.supervise(replace=lambda role, code: role.name.startswith(("trainer", "server"))
                              and role.starts < 3, timeout=180)
        assert ended, {role.name: (role.exits, job.log(role.name)) for role in job.roles}
    config = config_from_dict(json.loads((job.run_dir / "config.json").read_text()))
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["iterations"] == 80 > FAULT_AT
    assert_same_parameters(export(job.run_dir, tmp_path / "export.pt"),
                           reference_of(dataclasses.replace(config, data=str(small_binary)), tmp_path / "reference"))
    return job


def test_a_trainers_link_down_shorter_than_the_liveness_window_costs_only_the_wait(can_make_hosts, small_binary,
                                                                                     tmp_path):
    def pull_and_plug(hosts):
        hosts.link_down("trainer1")
        time.sleep(1.5)  # the liveness window is 3 s
        hosts.link_up("trainer1")

    job = _run(JobShape(trainers=2, servers=1, options=OPTIONS), pull_and_plug, small_binary, tmp_path)
    assert all(role.starts == 1 for role in job.roles)  # nobody was lost


def test_a_trainers_host_lost_is_replaced_by_its_command_started_again(can_make_hosts, small_binary, tmp_path):
    job = _run(JobShape(trainers=2, servers=1, options=OPTIONS), lambda hosts: hosts.lose("trainer1"),
               small_binary, tmp_path)
    assert job.role("trainer1").exits == [-9, 0]  # killed with its host; its command, started again, ended the job
    assert "joins the job as the replacement" in job.log("trainer1")


def test_a_servers_host_lost_under_parity_is_served_by_its_parity_server_then_replaced(can_make_hosts, small_binary,
                                                                                       tmp_path):
    job = _run(JobShape(trainers=2, servers=2, parity=1, options=OPTIONS), lambda hosts: hosts.lose("server0"),
               small_binary, tmp_path)
    assert job.role("server0").exits == [-9, 0]
    assert all(job.role(name).starts == 1 for name in ("oracle", "trainer0", "trainer1", "server1"))
