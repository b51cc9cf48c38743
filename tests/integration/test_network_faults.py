"""The network failing under a job across hosts (bagpipe.hosts, bagpipe.hostjobs): the shortest scenarios of
benchmarks/network_faults.py (``hostjobs.SHORTEST``), each ending bit for bit the one-process reference. Skipped
where network namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bagpipe import hosts as hosts_module
from bagpipe.config import config_from_dict
from bagpipe.hostjobs import EXACT, SHORTEST, run_scenario, scenario
from bagpipe.rundir import export
from helpers.cli_processes import in_host
from helpers.jobs import assert_same_parameters, reference_of

RESTARTS = {"trainer link down 1.5 s": 0, "trainer host lost": 1, "server host lost, parity": 1}


@pytest.fixture
def can_make_hosts():
    ok, why = hosts_module.available()
    if not ok:
        pytest.skip(why)


@pytest.mark.parametrize("name", SHORTEST)
def test_the_shortest_network_fault_scenarios_end_bit_for_bit(name, can_make_hosts, small_binary, tmp_path):
    def same_as(run_dir) -> bool:
        config = config_from_dict(json.loads((run_dir / "config.json").read_text()))
        reference = reference_of(dataclasses.replace(config, data=str(small_binary)), tmp_path / "reference")
        assert_same_parameters(export(run_dir, tmp_path / "export.pt"), reference)  # (says which tensors differ)
        return True

    outcome = run_scenario(scenario(name), data=small_binary, cwd=tmp_path / "job", same_as=same_as,
                           start=in_host)
    assert (outcome.outcome, outcome.passed) == (EXACT, True), outcome
    # a link down within the liveness window loses nobody; a host lost, its role (the command started again)
    assert outcome.restarts == RESTARTS[name]
    assert outcome.recovered_s is None if name == SHORTEST[0] else outcome.recovered_s > 0
