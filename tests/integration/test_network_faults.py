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


def _same_as_reference(small_binary, tmp_path):
    """``same_as(run_dir)`` for run_scenario: the run bit for bit the reference (assert_same_parameters says which
    tensors differ where not)."""
    def same_as(run_dir) -> bool:
        config = config_from_dict(json.loads((run_dir / "config.json").read_text()))
        reference = reference_of(dataclasses.replace(config, data=str(small_binary)), tmp_path / "reference")
        assert_same_parameters(export(run_dir, tmp_path / "export.pt"), reference)
        return True
    return same_as


@pytest.mark.parametrize("name", SHORTEST)
def test_the_shortest_network_fault_scenarios_end_bit_for_bit(name, can_make_hosts, small_binary, tmp_path):
    outcome = run_scenario(scenario(name), data=small_binary, cwd=tmp_path / "job",
                           same_as=_same_as_reference(small_binary, tmp_path), start=in_host)
    assert (outcome.outcome, outcome.passed) == (EXACT, True), outcome
    # a link down within the liveness window loses nobody; a host lost, its role (the command started again)
    assert outcome.restarts == RESTARTS[name]
    assert outcome.recovered_s is None if name == SHORTEST[0] else outcome.recovered_s > 0


def test_a_trainer_cut_off_past_the_liveness_window_ends_itself_and_its_command_started_again_replaces_it(
        can_make_hosts, small_binary, tmp_path):
    """The scenario that found two faults: the cut-off trainer judged silence by its own 10 s window (none given on
    its command line) and trained on beside its awaited replacement; and a survivor whose sum failed only once the
    world was re-formed (the loss crossed the link when it came back) waited for an epoch still to come."""
    outcome = run_scenario(scenario("trainer link down 10 s"), data=small_binary, cwd=tmp_path / "job",
                           same_as=_same_as_reference(small_binary, tmp_path), start=in_host)
    assert (outcome.outcome, outcome.passed, outcome.restarts) == (EXACT, True, 1), outcome
    log = (tmp_path / "job" / "logs" / "trainer1.log").read_text()
    assert "or the network to it is down" in log and "joins the job as the replacement" in log
