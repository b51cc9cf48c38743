"""bagpipe.opcount: the operations a block dispatches, and the one steady iteration a training loop counts."""

from __future__ import annotations

import threading

import torch

from bagpipe.opcount import OpCounter, StepCount


def test_the_counter_counts_top_level_operations_and_host_reads():
    x = torch.ones(4)
    with OpCounter() as ops:
        y = (x * 2).sum()
        float(y)
    assert ops.counts["mul"] == 1 and ops.counts["sum"] == 1 and ops.host_reads == 1 and ops.total == 3


def test_a_step_count_counts_its_iteration_alone_on_its_own_thread():
    steps = StepCount(at=2)
    x = torch.ones(3)
    for n in range(5):
        steps.begin(n)
        for _ in range(n + 1):  # iteration n dispatches n + 1 additions
            x = x + 1
        if n == 2:  # another thread's work while counting is not this loop's
            worker = threading.Thread(target=lambda: [torch.ones(2) * 3 for _ in range(10)])
            worker.start()
            worker.join()
        steps.end(n)
    assert steps.summary() == {"ops_per_iteration": 3, "host_reads_per_iteration": 0}
    x = x + 1
    assert steps.counted.total == 3  # nothing counted after its iteration ended


def test_a_step_count_closed_early_leaves_no_mode_behind():
    steps = StepCount(at=0)
    steps.begin(0)
    torch.ones(2).add_(1)
    steps.close()  # (an error inside the iteration: the loop's cleanup closes it)
    torch.ones(2).add_(1)
    assert steps.summary()["ops_per_iteration"] == 2  # ones and add_, nothing after
    assert StepCount(at=5).summary() == {}


def test_on_a_cuda_device_a_step_count_counts_the_hosts_waits_by_line_and_passes_other_warnings_on():
    """torch's sync debug mode warns at each wait for a CUDA device; a stand-in for it here (no GPU) warns as it
    does, so the counting is what is tested: the waits of the counted iteration by line, the mode set for it
    alone and restored, any other warning left to its caller."""
    import warnings

    from bagpipe.opcount import SYNC_WARNING

    modes = [0]
    debug_mode = (lambda: modes[-1], modes.append)

    def wait() -> None:
        if modes[-1] == "warn":
            warnings.warn(f"called a {SYNC_WARNING}", UserWarning)

    steps = StepCount(at=1, device="cuda", debug_mode=debug_mode)
    with warnings.catch_warnings(record=True) as passed:
        warnings.simplefilter("always")
        for n in range(3):
            steps.begin(n)
            for _ in range(n + 1):
                wait()
            if n == 1:
                warnings.warn("something else", RuntimeWarning)
            steps.end(n)
    summary = steps.summary()
    assert summary["device_syncs_per_iteration"] == 2 and modes == [0, "warn", 0]
    (site, count), = summary["device_sync_sites"].items()
    assert site.endswith(f"test_opcount.py:{wait.__code__.co_firstlineno + 2}") and count == 2
    assert [str(w.message) for w in passed] == ["something else"]
    on_cpu = StepCount(at=0, device="cpu", debug_mode=debug_mode)
    on_cpu.begin(0)
    wait()
    on_cpu.end(0)
    assert "device_syncs_per_iteration" not in on_cpu.summary() and modes == [0, "warn", 0]
