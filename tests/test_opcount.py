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
