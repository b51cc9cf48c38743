"""The local launcher starts a job that lost a process parity does not cover again from its newest checkpoint.

Faults are injected deterministically (``BAGPIPE_FAULTS``; ``ROLE#1@...`` is meant for the first restart): a
role is SIGKILLed at an iteration the test chooses, the launcher restarts the job, and the export equals
the reference's (so the job's with no failure) bit for bit. What a restart cannot help (a role's own error,
which the deterministic job would meet again; the bound on restarts; no checkpoint yet) fails clearly.
"""


import pytest


def test_faults_are_meant_for_one_attempt_of_the_job():
    from bagpipe.faults import _parse

    spec = "trainer1@iteration 3:kill, trainer1#1@iteration 5:stop, oracle#2@data ready:pause=1.5"
    assert _parse(spec, 0) == {("trainer1", "iteration 3"): ("kill", 0.0)}
    assert _parse(spec, 1) == {("trainer1", "iteration 5"): ("stop", 0.0)}
    assert _parse(spec, 2) == {("oracle", "data ready"): ("pause", 1.5)}
    for bad in ("trainer1#x@iteration 3:kill", "trainer1@iteration 3:explode", "trainer1@iteration 3:pause"):
        with pytest.raises(ValueError, match="BAGPIPE_FAULTS"):
            _parse(bad, 0)
