"""bagpipe.hosts and bagpipe.hostjobs without making any host: the recipe's reading, the roles' command lines,
tc's bucket. (Hosts themselves, as root: tests/integration/test_hosts.py and test_network_faults.py.)"""

from __future__ import annotations

import pytest

from bagpipe.hostjobs import ORACLE_HOST, SCENARIOS, SHORTEST, HostJob, JobShape
from bagpipe.hosts import Step, burst_bytes, machines, placed, read_recipe
from helpers.paths import REPO

RECIPE = """Some text.

<!-- recipe: hosts -->
```
# machine A (10.0.0.1): the oracle
bagpipe oracle --data data --worker-id 0 --world-size 3 \\
    --master-ip 10.0.0.1
# a comment that names no machine
# machine B (10.0.0.2): a trainer
bagpipe trainer --worker-id 1 --world-size 3 --master-ip 10.0.0.1
```
"""


class FakeHosts:
    def __init__(self, names):
        self.names = list(names)

    def address(self, name: str) -> str:
        return f"127.0.1.{self.names.index(name) + 1}"


def test_a_recipe_is_read_machine_by_machine_with_its_continued_lines():
    steps = read_recipe(RECIPE)
    assert steps == [Step("A", "10.0.0.1", ("bagpipe", "oracle", "--data", "data", "--worker-id", "0",
                                            "--world-size", "3", "--master-ip", "10.0.0.1")),
                     Step("B", "10.0.0.2", ("bagpipe", "trainer", "--worker-id", "1", "--world-size", "3",
                                            "--master-ip", "10.0.0.1"))]
    assert machines(steps) == ["A", "B"]
    # every machine's address becomes its host's, in every command
    assert placed(steps, FakeHosts(["A", "B"])) == [
        ("A", ["oracle", "--data", "data", "--worker-id", "0", "--world-size", "3", "--master-ip", "127.0.1.1"]),
        ("B", ["trainer", "--worker-id", "1", "--world-size", "3", "--master-ip", "127.0.1.1"])]


def test_a_recipe_without_its_mark_or_with_a_command_before_any_machine_is_refused():
    with pytest.raises(ValueError, match="no block marked"):
        read_recipe("```\nbagpipe oracle\n```")
    with pytest.raises(ValueError, match="a command before any"):
        read_recipe("<!-- recipe: hosts -->\n```\nbagpipe oracle\n```\n")
    with pytest.raises(ValueError, match="bagpipe's"):
        placed([Step("A", "10.0.0.1", ("python", "x.py"))], FakeHosts(["A"]))


def test_the_docs_recipe_puts_every_role_of_its_world_on_a_machine():
    steps = read_recipe((REPO / "docs" / "distributed.md").read_text())
    ranks = sorted(int(step.argv[step.argv.index("--worker-id") + 1]) for step in steps if "--worker-id" in step.argv)
    sizes = {step.argv[step.argv.index("--world-size") + 1] for step in steps}
    assert sizes == {str(len(ranks))} and ranks == list(range(len(ranks)))


def test_a_host_job_gives_each_role_its_rank_and_the_store_the_jobs_window(tmp_path):
    shape = JobShape(trainers=2, servers=2, parity=1, options=("--liveness-s", "3", "--timeout", "20"),
                     store_apart=True)
    assert shape.hosts() == ["store", ORACLE_HOST, "trainer0", "trainer1", "server0", "server1"]
    job = HostJob(FakeHosts(shape.hosts()), shape, data="d", cwd=tmp_path)
    args = {role.name: (role.host, role.args) for role in job.roles}
    assert args["store"] == ("store", ["store", "--world-size", "5", "--master-ip", "127.0.1.1", "--liveness-s", "3",
                                       "--timeout", "20"])
    host, oracle = args["oracle"]
    assert host == ORACLE_HOST and oracle[:3] == ["oracle", "--worker-id", "0"] and "--store-served" in oracle
    assert oracle[oracle.index("--parity") + 1] == "1"
    assert [args[f"trainer{t}"][1][2] for t in range(2)] == ["1", "2"]
    assert [args[f"server{s}"][1][2] for s in range(2)] == ["3", "4"]


def test_the_scenarios_are_named_once_and_the_tests_run_the_shortest():
    names = [s.name for s in SCENARIOS]
    assert len(names) == len(set(names)) >= 10
    assert set(SHORTEST) <= set(names)
    assert all(s.expect in ("exact", "failed, resumed exact") for s in SCENARIOS)


def test_tc_bucket_holds_at_least_512_kib_or_4_ms_of_the_rate():
    assert burst_bytes("100mbit") == 512 * 1024
    assert burst_bytes("10gbit") == 5_000_000
    with pytest.raises(ValueError, match="a rate as tc writes it"):
        burst_bytes("fast")
